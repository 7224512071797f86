"""experiments/late_path_flow.py: the late path's memory flow, measured at toy scale on the CPU.

The script replays one recorded trial's allocations over K slots through the stream-aware pool, a
model of PyTorch's caching allocator, and that model with routed private pools. These tests keep
its figures honest: a recorded trial frees all it allocated, every trial is accounted for and no
allocator holds more than its capacity, the model follows PyTorch's failure path (release every
cached segment, then retry) and routing switches it off, and only the pool moves memory between
trials that are both running.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
import sys
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "late_path_flow.py"
MIB = 1 << 20


@pytest.fixture(scope="module")
def lpf() -> ModuleType:
    spec = importlib.util.spec_from_file_location("late_path_flow", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["late_path_flow"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trace(lpf: ModuleType) -> Any:
    return lpf.record_trace(lpf.gb.WorkloadDef("small-cnn", 32, 32, 16), steps=3)


@pytest.fixture(scope="module")
def solo_peak(lpf: ModuleType, trace: Any) -> int:
    row = lpf.replay(trace, "torch", capacity_bytes=1 << 30, trials=1, k=1)
    return int(row["peak_reserved_bytes"])


def test_a_recorded_trial_frees_every_storage_it_allocated(trace: Any) -> None:
    allocated: set[int] = set()
    freed: set[int] = set()
    for ev in trace.events:
        if ev.nbytes:
            assert ev.tid not in allocated
            allocated.add(ev.tid)
        else:
            assert ev.tid in allocated and ev.tid not in freed
            freed.add(ev.tid)
    assert allocated == freed and len(allocated) == trace.allocations
    # The model's parameters (16 and 32 channels, 3x3, a linear head), moved to the device, are
    # live all along: the peak is above them.
    params = 4 * (16 * 3 * 9 + 16 + 32 * 16 * 9 + 32 + 10 * 32 * 8 * 8 + 10)
    assert trace.peak_allocated_bytes > params
    assert 0 < trace.step_events < len(trace.events)


@pytest.mark.parametrize("allocator", ["pool", "torch", "routed", "routed-slot"])
@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_every_trial_is_accounted_for_and_no_allocator_passes_its_capacity(
    lpf: ModuleType, trace: Any, solo_peak: int, allocator: str, factor: float
) -> None:
    capacity = int(factor * solo_peak)
    row = lpf.replay(trace, allocator, capacity_bytes=capacity, trials=6, k=2)
    assert row["completed"] + row["failed"] == 6
    assert row["attempts"] == row["completed"] + row["oom_attempts"]
    assert row["failed"] <= row["oom_attempts"]
    assert 0 < row["peak_reserved_bytes"] <= capacity
    assert 0 <= row["flow_live_bytes"] <= row["flow_bytes"] <= row["handed_bytes"]
    assert row["flow_cross_slot_bytes"] <= row["flow_bytes"]


def test_at_light_demand_neither_the_pool_nor_pytorch_runs_out_of_memory(
    lpf: ModuleType, trace: Any, solo_peak: int
) -> None:
    for allocator in ("pool", "torch"):
        row = lpf.replay(trace, allocator, capacity_bytes=3 * solo_peak, trials=6, k=2)
        assert (row["completed"], row["oom_attempts"]) == (6, 0), allocator


def test_only_the_pool_hands_one_running_trials_freed_memory_to_another(
    lpf: ModuleType, trace: Any, solo_peak: int
) -> None:
    live = {
        allocator: lpf.replay(trace, allocator, capacity_bytes=3 * solo_peak, trials=6, k=2)[
            "flow_live_bytes"
        ]
        for allocator in ("pool", "torch", "routed", "routed-slot")
    }
    assert live["pool"] > 0
    # PyTorch moves memory between streams only through a failed cudaMalloc (none at light
    # demand); a private pool never gives a running trial's blocks to anyone.
    assert live["torch"] == live["routed"] == live["routed-slot"] == 0


def _attempt(lpf: ModuleType, aid: int, slot: int) -> Any:
    return lpf.Attempt(aid=aid, trial=aid, number=0, slot=slot)


@pytest.mark.parametrize("routing", ["none", "trial"])
def test_pytorchs_failure_path_releases_a_neighbours_cached_segment_unless_a_route_is_open(
    lpf: ModuleType, routing: str
) -> None:
    ledger = lpf.FlowLedger({0: 0, 1: 1})
    model = lpf.CachingModel(routing, 40 * MIB, ledger, gpu_lag=8)
    a, b = _attempt(lpf, 0, 0), _attempt(lpf, 1, 1)
    model.begin(a)
    model.begin(b)
    assert model.malloc(a, 1, 30 * MIB)
    model.free(a, 1)  # cached on a's stream (or in a's private pool): 30 MiB of 40 held
    ok = model.malloc(b, 2, 30 * MIB)
    if routing == "none":
        # cudaMalloc past the fraction fails; release_cached_blocks gives a's segment back
        # (one device-wide synchronisation) and the retry succeeds with the same bytes.
        assert ok
        assert (model.sync_calls, model.release_passes, model.segment_frees) == (1, 1, 1)
        assert ledger.flow_live_bytes == 30 * MIB
    else:
        # captures_underway is not empty: no release, out of memory.
        assert not ok
        assert (model.sync_calls, model.ooms) == (0, 1)
    model.close()


def test_pytorchs_sizes_follow_its_source(lpf: ModuleType) -> None:
    assert lpf.torch_round_size(1) == 512
    assert lpf.torch_round_size(513) == 1024
    assert lpf.torch_allocation_size(MIB) == 2 * MIB  # small requests share 2 MiB segments
    assert lpf.torch_allocation_size(MIB + 512) == 20 * MIB  # 1-10 MiB share 20 MiB ones
    assert lpf.torch_allocation_size(10 * MIB) == 10 * MIB
    assert lpf.torch_allocation_size(10 * MIB + 512) == 12 * MIB  # rounded up to 2 MiB


def test_the_least_capacity_without_an_oom_is_the_edge_between_oom_and_none(
    lpf: ModuleType, trace: Any, solo_peak: int
) -> None:
    least = lpf.smallest_capacity(
        trace, "torch", solo_peak, k=2, trials=4, phases=1, resolution=0.5
    )
    assert least is not None

    def ooms(factor: float) -> int:
        capacity = int(factor * solo_peak)
        return int(
            lpf.replay(trace, "torch", capacity_bytes=capacity, trials=4, k=2)["oom_attempts"]
        )

    assert ooms(least) == 0
    assert ooms(least - 0.5) > 0


def test_the_script_writes_its_results_and_readme(lpf: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "flow"
    argv = ["--toy", "--factors", "2.5", "light", "--phases", "2", "--resolution", "1"]
    assert lpf.main([*argv, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert {(r["capacity"], r["allocator"]) for r in rows} == {
        (c, a) for c in ("2.5", "light (3)") for a in ("pool", "torch", "routed", "routed-slot")
    }
    assert all(r["trials"] == 12 and len(r["completed_by_phase"]) == 2 for r in rows)
    assert set(results["workloads"]["small-cnn"]["smallest_capacity"]["K=2"]) == {
        "pool",
        "torch",
        "routed",
        "routed-slot",
    }
    assert results["meta"]["torch"] and results["meta"]["load_start"]
    readme = (out / "README.md").read_text()
    assert "| K | capacity" in readme and "Least capacity" in readme


def test_a_capacity_that_is_not_a_factor_is_refused_naming_the_fix(lpf: ModuleType) -> None:
    assert lpf.capacity_factor("0.75K", 8) == ("0.75K (6)", 6.0)
    assert lpf.capacity_factor("light", 4) == ("light (5)", 5.0)
    with pytest.raises(ValueError, match=r"'half' is neither 'light'.*0.75K"):
        lpf.capacity_factor("half", 4)
