"""GPU tests of the pool under PyTorch and CuPy (marked ``gpu``; skipped without CUDA).

Each test runs its script in a fresh Python process: ``use_pool`` must come before CUDA's first
allocation, once per process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRAIN = """
import json, sys, torch
import waterwave_hpo.memory as wm

def train(steps, stream=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 64, generator=g).cuda()
    y = torch.randint(0, 10, (256,), generator=g).cuda()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
"""


def run_script(tmp_path: Path, body: str) -> dict:
    script = tmp_path / "script.py"
    script.write_text(TRAIN + textwrap.dedent(body))
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_training_with_the_pool_gives_the_stock_allocator_losses(tmp_path: Path) -> None:
    stock = run_script(tmp_path, "print(json.dumps({'losses': train(20)}))")
    pooled = run_script(
        tmp_path,
        """
        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
        print(json.dumps({'losses': train(20), 'allocs': pool.stats().num_allocs}))
        """,
    )
    assert pooled["allocs"] > 0
    assert pooled["losses"] == pytest.approx(stock["losses"], rel=1e-5, abs=1e-6)


def test_k_trainings_on_k_streams_share_the_pool(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        import threading
        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
        K = 4
        streams = [torch.cuda.Stream() for _ in range(K)]
        accounts = [pool.open_account(f"t{i}", streams=(streams[i],)) for i in range(K)]
        results = [None] * K
        def run(i):
            with torch.cuda.stream(streams[i]):
                results[i] = train(30, seed=i)
            streams[i].synchronize()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(K)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        torch.cuda.synchronize()
        peaks = [a.stats().peak_allocated_bytes for a in accounts]
        s = pool.stats()
        print(json.dumps({'results': results, 'peaks': peaks,
                          'cross': s.completed_event + s.stream_wait}))
        """,
    )
    assert all(r is not None and r[-1] < r[0] for r in out["results"])
    assert all(p > 0 for p in out["peaks"])


@pytest.mark.parametrize("side_stream", [False, True])
def test_stats_return_to_zero_after_del(tmp_path: Path, side_stream: bool) -> None:
    out = run_script(
        tmp_path,
        f"""
        import gc
        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
        s = torch.cuda.Stream() if {side_stream} else torch.cuda.current_stream()
        with torch.cuda.stream(s):
            # Elementwise only: cuBLAS would keep a workspace allocated on the stream.
            x = torch.randn(1024, 1024, device="cuda")
            y = x * 2 + 1
            during = pool.stats().allocated_bytes
            del x, y
            gc.collect()
        torch.cuda.synchronize()
        print(json.dumps({{'during': during, 'after': pool.stats().allocated_bytes,
                          'stream': pool.stream_stats(s).allocated_bytes}}))
        """,
    )
    assert out["during"] >= 2 * 1024 * 1024 * 4
    assert out["after"] == 0 and out["stream"] == 0


def test_oom_in_a_trial_is_torch_out_of_memory_error(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        pool = wm.StreamAwarePool(64 << 20, backend="cuda")
        wm.use_pool(pool)
        small = torch.ones(1024, device="cuda")
        kind = None
        try:
            with wm.translate_oom():
                torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            kind = "OutOfMemoryError"
        again = torch.ones(1024, device="cuda")
        print(json.dumps({'kind': kind, 'ooms': pool.stats().ooms,
                          'ok': float((small + again).sum().item())}))
        """,
    )
    assert out == {"kind": "OutOfMemoryError", "ooms": 1, "ok": 2048.0}


def test_use_pool_after_cuda_allocation_is_a_clear_error(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        x = torch.ones(4, device="cuda")
        try:
            wm.use_pool(wm.StreamAwarePool(backend="cuda"))
            msg = None
        except RuntimeError as exc:
            msg = str(exc)
        print(json.dumps({'msg': msg}))
        """,
    )
    assert out["msg"] is not None and "before CUDA's first allocation" in out["msg"]


def test_cupy_and_torch_share_the_pool_in_one_trial(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    out = run_script(
        tmp_path,
        """
        import gc, cupy
        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
        cupy.cuda.set_allocator(pool.cupy_allocator())
        t = torch.ones(1 << 20, device="cuda")
        c = cupy.ones(1 << 20, dtype=cupy.float32)
        both = pool.stats().allocated_bytes
        total = float(c.sum()) + float(t.sum().item())
        del t, c
        gc.collect()
        torch.cuda.synchronize()
        print(json.dumps({'both': both, 'after': pool.stats().allocated_bytes, 'total': total}))
        """,
    )
    assert out["both"] >= 2 * (4 << 20)
    assert out["after"] == 0
    assert out["total"] == 2.0 * (1 << 20)


def test_cupy_backend_draws_segments_from_cupy(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    out = run_script(
        tmp_path,
        """
        import cupy
        pool = wm.StreamAwarePool(backend="cupy")
        before = cupy.get_default_memory_pool().used_bytes()
        p = pool.allocate(3 << 20, 0)
        used = cupy.get_default_memory_pool().used_bytes() - before
        pool.free(p)
        torch.cuda.synchronize()
        print(json.dumps({'used': used, 'reserved': pool.stats().reserved_bytes}))
        """,
    )
    assert out["used"] == out["reserved"] > 0


def test_pool_oom_is_torch_out_of_memory_error_without_translation(tmp_path: Path) -> None:
    # Through the torch shim the pool throws c10::OutOfMemoryError itself.
    out = run_script(
        tmp_path,
        """
        pool = wm.StreamAwarePool(64 << 20, backend="cuda")
        wm.use_pool(pool)
        kind = None
        try:
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            kind = ["OutOfMemoryError", wm.OOM_MARKER in str(exc)]
        info = wm.allocator_info()
        print(json.dumps({'kind': kind, 'typed': info.typed_oom, 'err': info.shim_error}))
        """,
    )
    assert out == {"kind": ["OutOfMemoryError", True], "typed": True, "err": ""}


def test_a_new_capacity_bounds_the_pool_installed_as_pytorchs_allocator(tmp_path: Path) -> None:
    # What the GPU benchmark caps its pool rows with: the installed pool, capped afresh.
    out = run_script(
        tmp_path,
        """
        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
        train(2)
        torch.cuda.empty_cache()
        held = pool.stats().reserved_bytes
        pool.set_capacity(held + (64 << 20))
        kinds = []
        for nbytes in (32 << 20, 128 << 20):
            try:
                x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                kinds.append("ok")
                del x
            except torch.OutOfMemoryError:
                kinds.append("OutOfMemoryError")
        pool.set_capacity(None)
        x = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps({'kinds': kinds, 'after': int(x.numel())}))
        """,
    )
    assert out == {"kinds": ["ok", "OutOfMemoryError"], "after": 128 << 20}


def test_tensor_record_stream_reaches_the_pool(tmp_path: Path) -> None:
    # A block a busy stream still reads is not handed to a third stream while that read is
    # pending; if it were, without a stream wait, the third stream's write would show in the
    # reader's result.
    out = run_script(
        tmp_path,
        """
        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
        s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        n = 1 << 20
        with torch.cuda.stream(s1):
            x = torch.ones(n, device="cuda")
        p = x.untyped_storage().data_ptr()
        s2.wait_stream(s1)
        with torch.cuda.stream(s2):
            torch.cuda._sleep(2_000_000_000)  # about a second: s2 reads x long after the free
            y = x * 2
        x.record_stream(s2)
        del x
        pending = [b.event_pending for b in pool.snapshot() if b.ptr == p and not b.allocated]
        with torch.cuda.stream(s3):
            z = torch.empty(n, device="cuda")
            z.fill_(7.0)  # writes the block it was handed
        reused = z.untyped_storage().data_ptr() == p
        busy = not s2.query()  # s2 still spun when s3 was handed its block
        torch.cuda.synchronize()
        print(json.dumps({'registered': wm.allocator_info().record_stream,
                          'pending': pending, 'reused_while_busy': reused and busy,
                          'busy': busy, 'y': [float(y.min().item()), float(y.max().item())]}))
        """,
    )
    assert out["busy"], "s2 finished its spin before s3 allocated: the test proves nothing"
    assert out == {
        "registered": True,
        "pending": [True],
        "reused_while_busy": False,
        "busy": True,
        "y": [2.0, 2.0],
    }


def test_a_steady_training_step_costs_the_pool_no_segment_and_no_synchronisation(
    tmp_path: Path,
) -> None:
    # What tests/memory/test_cuda_fake.py pins with the fake driver, on the real one.
    out = run_script(
        tmp_path,
        """
        import dataclasses
        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
        train(5)
        before = pool.driver_stats()
        train(20)
        cost = pool.driver_stats() - before
        print(json.dumps(dataclasses.asdict(cost)))
        """,
    )
    steps = 20
    assert out["segment_allocs"] <= 3 and out["segment_frees"] == 0  # train() re-makes its model
    assert out["stream_syncs"] == 0
    assert out["event_records"] <= out["frees"] // 32 + steps


def test_a_co_hosted_study_after_cuda_started_completes_on_pytorchs_allocator(
    tmp_path: Path,
) -> None:
    # CUDA initialised first (a tensor on the GPU): the late path. K=4 co-hosted trials train on
    # PyTorch's own caching allocator, each on its stream; the process must not abort when the
    # first trial ends while its neighbours run, and the run says what it loses, once.
    out = run_script(
        tmp_path,
        """
        import warnings
        import optuna
        import waterwave_hpo as ww

        first = torch.ones(4, device="cuda")  # the user's script touched CUDA first
        torch.backends.cudnn.benchmark = True

        def objective(trial):
            return train(10, seed=trial.number)[-1]

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ww.WaterwaveExecutor("cuda:0", 4).optimize(study, objective, n_trials=8)
        late = [str(w.message) for w in caught if "PyTorch's own CUDA allocator" in str(w.message)]
        print(json.dumps({
            'states': [t.state.name for t in study.trials],
            'late': len(late),
            'pool': ww.memory.installed_pool(0) is not None,
            'benchmark': torch.backends.cudnn.benchmark,
            'stats': torch.cuda.memory_stats()['allocated_bytes.all.current'] > 0,
        }))
        """,
    )
    assert out["states"] == ["COMPLETE"] * 8
    assert out["late"] == 1 and out["pool"] is False
    assert out["benchmark"] is True and out["stats"] is True
