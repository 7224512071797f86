"""experiments/laysa_ray_tune.py's worker, without Ray: batches go to the model's device.

With ``--use-gpu`` the model is on a GPU; the script fed it CPU batches and called ``.numpy()``
on GPU predictions. There is no GPU here, so the worker runs on the CPU in a one-process gloo
group while ``Tensor.to`` / ``Tensor.cpu`` / ``Tensor.numpy`` are watched: every tensor the
model receives must come out of a ``.to(device)`` call, and NumPy may read only what came out
of ``.cpu()``.
"""

from __future__ import annotations

from collections.abc import Iterator
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

pytest.importorskip("sklearn")
pytestmark = pytest.mark.slow  # sklearn's digits and a training epoch

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "laysa_ray_tune.py"


@pytest.fixture
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("laysa_ray_tune", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_every_batch_reaches_the_model_through_to_device_and_numpy_reads_host_copies(
    script: ModuleType, one_process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = torch.device("cpu")
    moved: set[int] = set()
    on_host: set[int] = set()
    to, cpu, numpy = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.numpy

    def spy_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = to(self, *args, **kwargs)
        if (args and args[0] == device) or kwargs.get("device") == device:
            moved.add(out.data_ptr())
        return out

    def spy_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = cpu(self, *args, **kwargs)
        on_host.add(out.data_ptr())
        return out

    def spy_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.data_ptr() not in on_host:
            raise AssertionError("numpy() on a tensor that did not come back with .cpu()")
        return numpy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    monkeypatch.setattr(torch.Tensor, "cpu", spy_cpu)
    monkeypatch.setattr(torch.Tensor, "numpy", spy_numpy)
    inputs_seen: list[bool] = []

    def prepare(net: torch.nn.Module) -> DistributedDataParallel:
        net.register_forward_pre_hook(
            lambda _m, args: inputs_seen.append(all(a.data_ptr() in moved for a in args))
        )
        return DistributedDataParallel(net.to(device))

    reports: list[dict[str, Any]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one process: LaySA runs dense
        script.train_worker(
            {"lr": 0.05, "density": 0.05, "epochs": 1},
            rank=0,
            world_size=1,
            device=device,
            prepare_model=prepare,
            report=reports.append,
        )
    assert len(inputs_seen) > 40 and all(inputs_seen)  # every training batch and the test set
    assert len(reports) == 1 and 0.5 < reports[0]["accuracy"] <= 1.0
