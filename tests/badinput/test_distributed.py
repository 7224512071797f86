"""LaySA and its baselines without their prerequisite: the project's error names the step.

Per public entry point of :mod:`waterwave_hpo.distributed` that takes a process group
(``LaySAState``, ``NaiveTopKState``, ``laysa``, ``attach_baseline`` with each baseline):

- ``process_group="gloo"`` (a backend name, not a group): ``TypeError`` naming
  ``process_group``, the value and the fix (``init_process_group``, ``new_group``);
- no default group (never initialised, or destroyed): ``RuntimeError`` naming
  ``init_process_group``, never an ``AssertionError`` (which ``python -O`` removes);
- a destroyed sub-group: ``RuntimeError`` naming ``new_group``.

Nothing is registered on the DDP model before the refusal: a second, correct call works.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from waterwave_hpo.distributed import Baseline
from waterwave_hpo.distributed import LaySAState
from waterwave_hpo.distributed import NaiveTopKState
from waterwave_hpo.distributed import attach_baseline
from waterwave_hpo.distributed import laysa

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def ddp_model(tmp_path: Path) -> Iterator[DistributedDataParallel]:
    """A DDP model over a one-process gloo group (destroyed after the test, if still alive)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield DistributedDataParallel(torch.nn.Linear(4, 2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _entry_points(model: DistributedDataParallel) -> dict[str, Callable[[object], object]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: dict[str, Callable[[object], object]] = {
        "LaySAState": lambda group: LaySAState(group, 0.5),  # type: ignore[arg-type]
        "NaiveTopKState": lambda group: NaiveTopKState(group, 0.5),  # type: ignore[arg-type]
        "laysa": lambda group: laysa(model, 0.5, optimizer=optimizer, process_group=group),  # type: ignore[arg-type]
    }
    for baseline in Baseline:
        calls[f"attach_baseline-{baseline.name}"] = lambda group, b=baseline: attach_baseline(
            model,
            b,
            process_group=group,  # type: ignore[arg-type]
        )
    return calls


ENTRY_POINTS = [
    "LaySAState",
    "NaiveTopKState",
    "laysa",
    *[f"attach_baseline-{b.name}" for b in Baseline],
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_backend_name_for_process_group_is_refused_before_anything_is_attached(
    entry: str, ddp_model: DistributedDataParallel
) -> None:
    call = _entry_points(ddp_model)[entry]
    with pytest.raises(TypeError, match=r"process_group='gloo': must be a torch\.distributed\.Pro"):
        call("gloo")
    call(None)  # nothing was registered by the refused call


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_no_default_group_names_init_process_group(
    entry: str, ddp_model: DistributedDataParallel
) -> None:
    call = _entry_points(ddp_model)[entry]
    world = dist.group.WORLD
    dist.destroy_process_group()
    for group in (None, world):
        with pytest.raises(RuntimeError, match=r"process_group=.*init_process_group\('gloo'\)"):
            call(group)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_destroyed_group_names_new_group(entry: str, ddp_model: DistributedDataParallel) -> None:
    group = dist.new_group([0])
    dist.destroy_process_group(group)
    with pytest.raises(RuntimeError, match=r"is not a live group.*new_group"):
        _entry_points(ddp_model)[entry](group)


def test_the_refusal_survives_python_minus_o(tmp_path: Path) -> None:
    code = (
        "from waterwave_hpo.distributed import LaySAState\n"
        "try:\n"
        "    LaySAState(None, 0.5)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", code],
        cwd=tmp_path,  # `-c` puts the working directory first on sys.path: not the checkout
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "init_process_group" in done.stdout, done.stderr
