"""The ``cuda`` backend's plumbing without a GPU, against a fake CUDA driver.

``allocator_ext/tests/fake_cuda.cpp`` is compiled into a ``libcuda.so.1`` that the pool dlopens
(through ``LD_LIBRARY_PATH``, in a subprocess). It checks that the backend finds every driver
symbol it needs, makes the primary context current for each call that needs one (from any
thread), asks for timing-less events, issues stream waits, and releases what it took. Whether the
real driver behaves like the fake is verified only by the GPU tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import shutil
import subprocess
import sys
from typing import Any

import pytest

from waterwave_hpo.memory import OOM_MARKER

FAKE = Path(__file__).resolve().parents[2] / "allocator_ext" / "tests" / "fake_cuda.cpp"

SCRIPT = r"""
import ctypes, json, threading
import waterwave_hpo.memory as wm
from waterwave_hpo.memory._lib import load_library

fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_mem_used.restype = ctypes.c_uint64
MiB = 1 << 20
out = {}

def run():
    pool = wm.StreamAwarePool(backend="cuda")
    p, s1 = pool.allocate_with_source(10 * MiB, 1)
    pool.free(p, 1)
    q, s2 = pool.allocate_with_source(10 * MiB, 2)  # event not ready yet: a GPU-side wait
    pool.free(q, 2)
    pool.snapshot()  # the fake's event is ready from the second query on
    r, s3 = pool.allocate_with_source(10 * MiB, 3)
    pool.free(r, 3)
    try:
        pool.allocate(1 << 30, 1)
        reason = None
    except wm.PoolOutOfMemoryError as exc:
        reason = exc.reason.name
    lib = load_library()
    lib.ww_torch_set_pool(0, pool._handle())
    malloc = lib.waterwave_torch_malloc
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.waterwave_torch_free
    free.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    t = malloc(4096, 0, 5)
    torch_live = pool.stream_stats(5).allocated_bytes
    free(t, 4096, 0, 5)
    lib.ww_torch_set_pool(0, None)
    used_before_release = fake.fake_cuda_mem_used()
    released = pool.release_cached() + pool.release_cached()
    out.update(
        sources=[s1.name, s2.name, s3.name],
        same=(p == q == r),
        oom=reason,
        torch_live=torch_live,
        waits=fake.fake_cuda_stream_waits(),
        used_before_release=used_before_release,
        released=released,
        used_after=fake.fake_cuda_mem_used(),
        no_context_calls=fake.fake_cuda_calls_without_context(),
        stats=pool.stats().allocated_bytes,
    )
    pool.close()

def guarded():
    try:
        run()
    except Exception as exc:
        out["error"] = repr(exc)

t = threading.Thread(target=guarded)  # a fresh thread: no CUDA context is current in it
t.start(); t.join()
print(json.dumps(out))
"""


_FAKE_DIRS: dict[str, Path] = {}


def _fake_driver_dir(tmp_path: Path) -> Path:
    """A directory holding the fake libcuda.so.1, compiled once per test session."""
    if "dir" not in _FAKE_DIRS:
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            pytest.skip("no C++ compiler to build the fake CUDA driver")
        out = tmp_path / "fake_driver"
        out.mkdir()
        subprocess.run(
            [
                cxx,
                "-std=c++17",
                "-O1",
                "-shared",
                "-fPIC",
                "-o",
                str(out / "libcuda.so.1"),
                str(FAKE),
            ],
            check=True,
        )
        _FAKE_DIRS["dir"] = out
    return _FAKE_DIRS["dir"]


def run_against_fake_driver(tmp_path: Path, script: str) -> dict[str, Any]:
    """Runs ``script`` in a subprocess that loads the fake libcuda.so.1; returns its last stdout
    line as JSON."""
    fake_dir = _fake_driver_dir(tmp_path)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{fake_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in out, out["error"]
    return out


def test_cuda_backend_against_a_fake_driver(tmp_path: Path) -> None:
    out = run_against_fake_driver(tmp_path, SCRIPT)
    assert out["sources"] == ["NEW_SEGMENT", "STREAM_WAIT", "COMPLETED_EVENT"]
    assert out["same"] is True
    assert out["oom"] == "UPSTREAM"
    assert out["torch_live"] == 4096
    assert out["waits"] == 1
    assert out["used_before_release"] == out["released"] > 0
    assert out["used_after"] == 0
    assert out["no_context_calls"] == 0
    assert out["stats"] == 0


FAULT_SCRIPT = r"""
import ctypes, json
import waterwave_hpo.memory as wm
from waterwave_hpo.memory._lib import load_library, last_error

fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_set_fault.argtypes = [ctypes.c_int, ctypes.c_int]
lib = load_library()
try_malloc = lib.waterwave_torch_try_malloc
try_malloc.restype = ctypes.c_int
VP = ctypes.c_void_p
try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, VP, ctypes.POINTER(VP)]
MiB = 1 << 20
out = {}

def outcome(fn):
    try:
        fn()
        return ["ok", ""]
    except wm.PoolOutOfMemoryError as exc:
        return ["oom", str(exc)]
    except wm.PoolBackendError as exc:
        return ["backend", str(exc)]

pool = wm.StreamAwarePool(backend="cuda")
lib.ww_torch_set_pool(0, pool._handle())
fake.fake_cuda_set_fault(1, 700)  # cuMemAlloc: CUDA_ERROR_ILLEGAL_ADDRESS
out["alloc_illegal"] = outcome(lambda: pool.allocate(12 * MiB, 1))
ptr = ctypes.c_void_p()
out["torch_alloc_illegal"] = [try_malloc(12 * MiB, 0, 1, ctypes.byref(ptr)), last_error()]
fake.fake_cuda_set_fault(1, 2)  # cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY
out["alloc_oom"] = outcome(lambda: pool.allocate(12 * MiB, 1))
out["torch_alloc_oom"] = [try_malloc(12 * MiB, 0, 1, ctypes.byref(ptr)), last_error()]
fake.fake_cuda_set_fault(1, 0)
p = pool.allocate(12 * MiB, 1)
pool.free(p, 1)  # the fake's event is pending until its first query
fake.fake_cuda_set_fault(2, 700)  # cuEventQuery: the context is poisoned
out["after_bad_query"] = outcome(lambda: pool.allocate(12 * MiB, 2))
out["same_stream_after"] = outcome(lambda: pool.allocate(12 * MiB, 1))
out["no_pool"] = [try_malloc(4096, 1, 0, ctypes.byref(ptr)), last_error()]
lib.ww_torch_set_unavailable(1, b"cuInit failed on device 1: fake")
out["no_pool_reason"] = [try_malloc(4096, 1, 0, ctypes.byref(ptr)), last_error()]
lib.ww_torch_set_pool(0, None)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_against_fake_driver(tmp_path_factory.mktemp("fault"), FAULT_SCRIPT)


@pytest.mark.slow
def test_only_cuda_out_of_memory_is_an_oom_other_driver_errors_are_backend_errors(
    fault_run: dict[str, Any],
) -> None:
    out = fault_run
    kind, message = out["alloc_illegal"]
    assert kind == "backend"
    assert "illegal memory access" in message and "(700)" in message
    status, message = out["torch_alloc_illegal"]
    assert status == 5  # WW_BACKEND_ERROR
    assert "illegal memory access" in message and OOM_MARKER not in message
    # What PyTorch raises with that message is not an OOM for the executor either.
    from waterwave_hpo.host._oom import is_out_of_memory

    assert not is_out_of_memory(RuntimeError(message))
    assert not is_out_of_memory(RuntimeError(out["alloc_illegal"][1]))
    assert out["alloc_oom"][0] == "oom"
    status, message = out["torch_alloc_oom"]
    assert status == 3 and message.startswith(OOM_MARKER)
    # An event query that fails with an illegal address poisons the pool: nothing is served,
    # not even a cached block of the same stream, and it never looks like an OOM.
    for key in ("after_bad_query", "same_stream_after"):
        kind, message = out[key]
        assert kind == "backend", out[key]
        assert "cuEventQuery" in message and "illegal memory access" in message


@pytest.mark.slow
def test_a_device_without_a_pool_is_its_own_error_never_an_oom(fault_run: dict[str, Any]) -> None:
    out = fault_run
    status, message = out["no_pool"]
    assert status == 6  # WW_NO_POOL
    assert "no waterwave pool is installed for CUDA device 1" in message
    assert OOM_MARKER not in message and "out of memory" not in message
    status, message = out["no_pool_reason"]
    assert status == 6 and "cuInit failed on device 1: fake" in message


SWAP_SCRIPT = r"""
import ctypes, json, logging
import torch
import waterwave_hpo.memory as wm
from waterwave_hpo.memory._lib import load_library, last_error
from waterwave_hpo.host._memory import MemoryPoolMode, _device_pool

made = []
class FakePluggable:
    def __init__(self, path, alloc, free):
        made.append([path, alloc, free])
torch.cuda.is_initialized = lambda: False
torch.cuda.device_count = lambda: 3  # the fake driver has 2: device 2 cannot get a pool
torch.cuda.memory.CUDAPluggableAllocator = FakePluggable
torch.cuda.memory.change_current_allocator = lambda a: None
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger().addHandler(Keep())

lib = load_library()
try_malloc = lib.waterwave_torch_try_malloc
try_malloc.restype = ctypes.c_int
VP = ctypes.c_void_p
try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, VP, ctypes.POINTER(VP)]
free = lib.waterwave_torch_free
free.argtypes = [VP, ctypes.c_size_t, ctypes.c_int, VP]
out = {}
wm.use_pool(wm.StreamAwarePool(backend="cuda", device=0))
info = wm.allocator_info()
out["made"] = made
unavailable = {str(k): v for k, v in info.unavailable_devices.items()}
out["info"] = [info.swapped, info.typed_oom, list(info.pool_devices),
               list(info.passthrough_devices), unavailable]
ptr = VP()
out["device1"] = try_malloc(4096, 1, 0, ctypes.byref(ptr))
free(ptr, 4096, 1, None)
out["device2"] = [try_malloc(4096, 2, 0, ctypes.byref(ptr)), last_error()]
try:
    _device_pool(torch.device("cuda", 2), MemoryPoolMode.AUTO)
    out["exec2"] = "no error"
except RuntimeError as exc:
    out["exec2"] = str(exc)
pool1 = _device_pool(torch.device("cuda", 1), MemoryPoolMode.AUTO)
out["exec1_replaced"] = wm.installed_pool(1) is pool1 and wm.device_pool(1) is pool1
out["logs"] = records
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_visible_device_gets_a_pool_or_a_clear_no_pool_error_at_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    monkeypatch.setenv("WATERWAVE_HPO_CACHE", str(tmp_path / "cache"))
    out = run_against_fake_driver(tmp_path, SWAP_SCRIPT)
    [[path, alloc, free]] = out["made"]
    assert path.endswith("libwaterwave_torch_shim.so")  # typed OOM through the shim
    assert (alloc, free) == ("waterwave_shim_malloc", "waterwave_shim_free")
    swapped, typed_oom, pools, passthrough, unavailable = out["info"]
    assert swapped and typed_oom
    assert pools == [0] and passthrough == [1]
    assert list(unavailable) == ["2"] and "could not be created" in unavailable["2"]
    assert out["device1"] == 0  # the pass-through pool serves device 1
    status, message = out["device2"]
    assert status == 6 and "no waterwave pool is installed for CUDA device 2" in message
    assert "could not be created" in message and OOM_MARKER not in message
    assert "cannot use PyTorch's allocator" in out["exec2"]
    assert out["exec1_replaced"] is True
    assert not any("PyTorch's own CUDA allocator" in m for m in out["logs"]), out["logs"]


LAZY_CONTEXT_SCRIPT = r"""
import ctypes, json
import torch
import waterwave_hpo.memory as wm
from waterwave_hpo.memory._lib import load_library, last_error

fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_retains.restype = ctypes.c_long
class FakePluggable:
    def __init__(self, path, alloc, free):
        pass
torch.cuda.is_initialized = lambda: False
torch.cuda.device_count = lambda: 3
torch.cuda.memory.CUDAPluggableAllocator = FakePluggable
torch.cuda.memory.change_current_allocator = lambda a: None
lib = load_library()
try_malloc = lib.waterwave_torch_try_malloc
try_malloc.restype = ctypes.c_int
VP = ctypes.c_void_p
try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, VP, ctypes.POINTER(VP)]
free = lib.waterwave_torch_free
free.argtypes = [VP, ctypes.c_size_t, ctypes.c_int, VP]
retains = lambda: [fake.fake_cuda_retains(d) for d in range(3)]
out = {}
pool0 = wm.StreamAwarePool(backend="cuda", device=0)
out["after_pool0"] = retains()
wm.use_pool(pool0)
info = wm.allocator_info()
out["passthrough"] = list(info.passthrough_devices)
out["unavailable"] = sorted(info.unavailable_devices)
out["after_swap"] = retains()
ptr = VP()
out["alloc0"] = try_malloc(4096, 0, 0, ctypes.byref(ptr))
free(ptr, 4096, 0, None)
out["after_use0"] = retains()
out["alloc1"] = try_malloc(4096, 1, 0, ctypes.byref(ptr))
free(ptr, 4096, 1, None)
out["after_use1"] = retains()
out["alloc2"] = [try_malloc(4096, 2, 0, ctypes.byref(ptr)), last_error()]
print(json.dumps(out))
"""


SHIM_FAILS_SCRIPT = r"""
import json, sys, warnings
import torch
import waterwave_hpo.memory as wm
from waterwave_hpo.host._memory import MemoryPoolMode, _device_pool

made = []
class FakePluggable:
    def __init__(self, path, alloc, free):
        made.append([path, alloc, free])
torch.cuda.is_initialized = lambda: False
torch.cuda.device_count = lambda: 1
torch.cuda.memory.CUDAPluggableAllocator = FakePluggable
torch.cuda.memory.change_current_allocator = lambda a: None
out = {}
try:
    _device_pool(torch.device("cuda", 0), MemoryPoolMode(sys.argv[1]))
    out["raised"] = None
except RuntimeError as exc:
    out["raised"] = str(exc)
out["made"] = made
out["swapped"] = wm.allocator_swapped()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_device_keeps_no_cuda_context_until_the_study_allocates_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass-through pool retains its device's primary context (0.3-0.5 GiB
    of device memory) only at that device's first allocation; an exclusive-process GPU held by
    another process fails only if the study allocates on it, and then not as an OOM."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "3")
    monkeypatch.setenv("FAKE_CUDA_EXCLUSIVE_BUSY", "2")
    monkeypatch.setenv("WATERWAVE_HPO_CACHE", str(tmp_path / "cache"))
    out = run_against_fake_driver(tmp_path, LAZY_CONTEXT_SCRIPT)
    assert out["after_pool0"] == [0, 0, 0]  # making a pool touches no context
    assert out["passthrough"] == [1, 2] and out["unavailable"] == []
    assert out["after_swap"] == [0, 0, 0]  # nor does the swap, on any device
    assert out["alloc0"] == 0 and out["after_use0"] == [1, 0, 0]
    assert out["alloc1"] == 0 and out["after_use1"] == [1, 1, 0]
    status, message = out["alloc2"]
    assert status == 5  # WW_BACKEND_ERROR: never an OOM, retrying beside fewer trials cannot help
    assert "cannot retain the primary context of CUDA device 2" in message
    assert "busy or unavailable" in message and OOM_MARKER not in message


EVENTS_SCRIPT = r"""
import ctypes, json
import waterwave_hpo.memory as wm

fake = ctypes.CDLL("libcuda.so.1")
pool = wm.StreamAwarePool(backend="cuda")
for _ in range(1000):  # a trial's step: its stream reuses its own blocks
    p = pool.allocate(4096, 1)
    pool.free(p, 1)
out = {"records": fake.fake_cuda_event_records()}
p = pool.allocate(4096, 1)
pool.free(p, 1)
q, source = pool.allocate_with_source(4096, 2)  # another stream takes it: one more event
out.update(
    records_after_steal=fake.fake_cuda_event_records(),
    source=source.name,
    waits=fake.fake_cuda_stream_waits(),
)
pool.free(q, 2)
pool.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_frees_record_one_cuda_event_per_epoch_not_one_per_free(tmp_path: Path) -> None:
    """Through the CUDA backend: 1000 frees of one stream call
    cuEventRecord at most once per 64 frees; a block another stream takes is covered by an
    event recorded after its free, completed or waited for on the GPU."""
    out = run_against_fake_driver(tmp_path, EVENTS_SCRIPT)
    assert out["records"] <= 1000 // 64
    # The search closed stream 1's open epoch (one event for its last frees) and took a block
    # whose event completed, or waited for it on the GPU: never a block with no event.
    assert out["records_after_steal"] == out["records"] + 1
    assert (out["source"], out["waits"]) in (("COMPLETED_EVENT", 0), ("STREAM_WAIT", 1))


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_memory_pool_on_refuses_and_auto_warns_when_the_shim_cannot_be_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    message = "fake-c++: error: 'std::bit_width' is not a member of 'std'"
    cxx = tmp_path / "fake-c++"
    cxx.write_text(f'#!/bin/sh\necho "{message}" >&2\nexit 1\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("WATERWAVE_HPO_CACHE", str(tmp_path / "cache"))
    fake_dir = _fake_driver_dir(tmp_path)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{fake_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", SHIM_FAILS_SCRIPT, mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if mode == "on":
        assert out["raised"] is not None and message in out["raised"]
        assert "memory_pool='on'" in out["raised"]
        assert out["made"] == [] and out["swapped"] is False  # refused before the swap
    else:
        assert out["raised"] is None and out["swapped"] is True
        [[path, alloc, _]] = out["made"]
        assert path.endswith("libwaterwave_pool.so") and alloc == "waterwave_torch_malloc"
        assert done.stderr.count("ShimBuildWarning") == 1 and message in done.stderr


STEP_SCRIPT = r"""
import dataclasses, json
import waterwave_hpo.memory as wm
from waterwave_hpo.memory.testing import run_training_steps

K = 4
pool = wm.StreamAwarePool(backend="cuda")
cost = run_training_steps(pool, [0x100 + i for i in range(K)], 20, warmup=30)
print(json.dumps({**dataclasses.asdict(cost), "step_trials": 20 * K}))
"""


def test_a_steady_state_training_step_costs_the_pool_no_segment_and_no_synchronisation(
    tmp_path: Path,
) -> None:
    # Four co-hosted trials on four streams, their allocations interleaved op by op; what twenty
    # steady-state steps of each cost the pool on the cuda backend (each count a driver call).
    out = run_against_fake_driver(tmp_path, STEP_SCRIPT)
    steps = out["step_trials"]
    assert out["allocs"] == out["frees"] == 28 * steps  # the workload's 28 of each per step
    # No cuMemAlloc / cuMemFree (which synchronises the device), no CPU-side wait, no new event.
    assert out["segment_allocs"] == out["segment_frees"] == 0
    assert out["stream_syncs"] == 0
    assert out["event_creates"] == out["event_destroys"] == 0
    # One mutex acquisition per allocation or free, and nothing else takes it.
    assert out["lock_acquisitions"] == out["allocs"] + out["frees"]
    # The frees of a stream share one event per 64 (28 frees a step: under half an event), plus
    # the epochs other streams' searches close; at most one record and two queries a step.
    assert out["event_records"] <= steps
    assert out["event_queries"] <= 2 * steps
    # A stream serves its step from its own blocks: searching its neighbours' blocks and walking
    # every block to merge (which records an event on every stream) are rare. Before a stream's
    # completed and pending free neighbours were merged, about 0.9 and 0.2 a step.
    assert out["cross_stream_searches"] <= steps // 10
    assert out["coalesce_scans"] <= steps // 40
