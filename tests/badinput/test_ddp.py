"""DDP's communication hooks (LaySA and the baselines): DDP's refusals name ``ddp_model``.

One-process gloo group in the test process (no spawn), as tests/distributed/test_laysa_inputs.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from waterwave_hpo.distributed import Baseline
from waterwave_hpo.distributed import attach_baseline
from waterwave_hpo.distributed import laysa


@pytest.fixture(scope="module", autouse=True)
def one_process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    rendezvous = Path(tmp_path_factory.mktemp("pg")) / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("second", ["laysa", *[b.name for b in Baseline]])
def test_a_second_hook_on_one_ddp_model_names_ddp_model_and_the_fix(second: str) -> None:
    model, optimizer = _ddp()
    laysa(model, density=0.5, optimizer=optimizer)
    with pytest.raises(
        ValueError, match=r"ddp_model=.*refused the .* hook.*new DistributedDataParallel"
    ) as e:
        if second == "laysa":
            laysa(model, density=0.5, optimizer=optimizer)
        else:
            attach_baseline(model, Baseline[second])
    assert isinstance(e.value.__cause__, RuntimeError)  # DDP's own error, kept


def test_attach_baseline_to_a_plain_module_says_to_wrap_it() -> None:
    with pytest.raises(TypeError, match=r"ddp_model=Linear.*wrap the model"):
        attach_baseline(torch.nn.Linear(4, 2), Baseline.DENSE)  # type: ignore[arg-type]
