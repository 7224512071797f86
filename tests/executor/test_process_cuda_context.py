"""What a worker process holds on the GPU outside any pool, measured on the GPU at hand.

Process isolation leaves :data:`~waterwave_hpo.workers._lease_service.CONTEXT_RESERVE_BYTES`
per worker out of the device's default budget, and under MPS bounds each worker by its lease
plus that reserve (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``). This measures the real size instead of
assuming it: a fresh process creates its CUDA context, a cuBLAS handle (a matmul) and cuDNN's
(a convolution), frees its tensors and empties PyTorch's cache; the device's free memory before
and after, as this process sees it, is what that process holds.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from waterwave_hpo.workers._lease_service import CONTEXT_RESERVE_BYTES

_CHILD = """
import sys, torch
device = torch.device("cuda", 0)
x = torch.randn(512, 512, device=device)
(x @ x).sum().item()
conv = torch.nn.Conv2d(3, 8, 3).to(device)
conv(torch.randn(2, 3, 32, 32, device=device)).sum().item()
del x, conv
torch.cuda.synchronize(device)
torch.cuda.empty_cache()
print(torch.cuda.memory_reserved(device), flush=True)
sys.stdin.read()  # holds its context until the test has measured
"""


@pytest.mark.gpu
def test_a_workers_cuda_context_fits_the_reserve_left_for_it() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.init()  # type: ignore[no-untyped-call]
    free_before, total = torch.cuda.mem_get_info(device)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        reserved = int(child.stdout.readline())
        free_after, _ = torch.cuda.mem_get_info(device)
    finally:
        child.communicate(timeout=60)
    held = free_before - free_after - reserved
    mib = held / 2**20
    print(f"a worker's CUDA context and library handles: {mib:.0f} MiB of {total / 2**30:.0f} GiB")
    assert 0 < held <= CONTEXT_RESERVE_BYTES, (
        f"a process holds {mib:.0f} MiB outside PyTorch's cache (context, cuBLAS, cuDNN), more "
        f"than the {CONTEXT_RESERVE_BYTES / 2**20:.0f} MiB reserved per worker"
    )


@pytest.mark.gpu
def test_the_zygote_never_loads_cuda_and_its_workers_use_it() -> None:
    import optuna
    import psutil

    import waterwave_hpo as ww
    from waterwave_hpo.workers._zygote import ZYGOTE_MARK

    def objective(trial: optuna.trial.Trial) -> float:
        return float(torch.ones(1 << 10, device=ww.current().device).sum())

    study = optuna.create_study()
    with ww.WaterwaveExecutor("cuda:0", 2, isolation="process") as executor:
        executor.optimize(study, objective, n_trials=4)
        zygotes = [
            p for p in psutil.Process().children(recursive=True) if ZYGOTE_MARK in p.cmdline()
        ]
        assert zygotes  # the template and the executor's zygote
        for zygote in zygotes:
            with open(f"/proc/{zygote.pid}/maps") as maps:
                assert not any("/libcuda.so" in line for line in maps), zygote.pid
    assert [t.value for t in study.trials] == [1024.0] * 4
