"""experiments/gpu_benchmark.py: the one-command GPU benchmark runs at toy scale on the CPU.

The script is what a person with a GPU runs; these tests keep it from rotting where no GPU is:
its plan has every configuration the GPU run must measure, a failing row and a row past its time
share are recorded while the run goes on, its results folder is never someone else's, and the
whole script runs end to end on the CPU from an empty folder (``--device cpu --toy``).
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu_benchmark.py"


@pytest.fixture(scope="module")
def gb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_benchmark"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _plan(gb: ModuleType, rows: list[Any], group_end: float) -> dict[str, Any]:
    wls = gb.workloads(True)
    return {
        "device": "cpu",
        "toy": True,
        "trials": 2,
        "steps": 2,
        "seed": 0,
        "workloads": [gb.dataclasses.asdict(w) for w in wls],
        "capacity_bytes": {w.name: 1 << 30 for w in wls},
        "high_factor": 2.5,
        "workload_weight": {w.name: 1.0 for w in wls},
        "rows": [gb.dataclasses.asdict(r) for r in rows],
        "group_end": {"torch": group_end},
        "anchors_path": None,
    }


def test_the_gpu_plan_has_every_configuration_at_both_demands(gb: ModuleType) -> None:
    rows = gb.plan_rows("cuda", [4, 8], ["light", "high"], toy=False)
    names = {r.key for r in rows}
    for workload in ("small-cnn", "resnet"):
        for setting in ("light", "high"):
            for name in (
                "temporal",
                "optuna-nj K=4",
                "optuna-nj K=8",
                "ww-pool K=4",
                "ww-pool+gates K=8",
                "ww-torch K=8",
                "ww-torch+gates K=4",
                "ww-async K=4",
                "fused K=8",
                "processes K=4",
            ):
                assert f"{workload}/{setting}/{name}" in names
        # cuDNN's heuristic mode B alone, and the late path: each in a process of its own.
        assert f"{workload}/light/ww-torch+modeB K=4" in names
        assert f"{workload}/light/ww-late K=4" in names
    assert all(r.status == "pending" for r in rows)
    assert {r.group for r in rows if r.label == "ww-async"} == {"async"}
    assert {r.group for r in rows if r.label == "ww-pool"} == {"pool"}
    assert {r.group for r in rows if r.mode_b} == {"modeb"}
    assert {r.group for r in rows if r.label == "ww-late"} == {"late"}
    assert gb.GROUP_ENV["modeb"] == {"TORCH_CUDNN_USE_HEURISTIC_MODE_B": "1"}


def test_on_the_cpu_the_pool_rows_run_on_a_stand_in_and_cuda_only_rows_say_why(
    gb: ModuleType,
) -> None:
    rows = gb.plan_rows("cpu", [2], ["light", "high"], toy=True)
    skipped = [r for r in rows if r.group in ("async", "modeb", "late")]
    assert {r.group for r in skipped} == {"async", "modeb", "late"}
    assert all(r.status == "skipped" and "CUDA only" in r.note for r in skipped)
    pool = [r for r in rows if r.group == "pool"]
    assert pool and all(r.status == "pending" and "simulated device" in r.stand_in for r in pool)


def test_a_failing_row_records_its_error_and_the_next_row_runs(
    gb: ModuleType, tmp_path: Path
) -> None:
    broken = gb.Row("small-cnn/light/bogus", "torch", "small-cnn", "light", "bogus", 1)
    fine = gb.Row("small-cnn/light/temporal", "torch", "small-cnn", "light", "temporal", 1)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(_plan(gb, [broken, fine], time.time() + 120)))
    out = tmp_path / "rows.jsonl"
    assert gb.group_main(str(plan_path), "torch", str(out)) == 0
    got = {r["key"]: r for r in map(json.loads, out.read_text().splitlines()) if "key" in r}
    assert got["small-cnn/light/bogus"]["status"] == "error"
    assert "row.label='bogus': not a configuration" in got["small-cnn/light/bogus"]["note"]
    assert got["small-cnn/light/temporal"]["status"] == "ok"
    assert got["small-cnn/light/temporal"]["completed"] == 2


def test_a_row_past_its_share_is_cut_and_says_so(gb: ModuleType, tmp_path: Path) -> None:
    row = gb.Row("small-cnn/light/optuna-nj K=2", "torch", "small-cnn", "light", "optuna-nj", 2)
    plan = {**_plan(gb, [row], time.time() + 60), "steps": 1_000_000}
    # The same row run to its end first (2 trials of 2 steps): the imports and torch's first
    # steps, which alone took a fixed 2 s share when this test ran first in its process, are
    # then behind it. The share is 3 times what that took (at least 2 s), so that its trials
    # start and make steps before it ends on a machine as busy as it is now (beside two busy
    # loops, no trial had started within 2 s).
    warm = gb.Row("small-cnn/light/optuna-nj K=2", "torch", "small-cnn", "light", "optuna-nj", 2)
    started = time.monotonic()
    gb.run_row(warm, _plan(gb, [warm], time.time() + 600), deadline=time.time() + 600)
    assert warm.completed == 2, warm.note
    share_s = max(2.0, 3 * (time.monotonic() - started))
    gb.run_row(row, plan, deadline=time.time() + share_s)  # trials start, then the share ends
    assert row.status == "cut"
    assert "cut at its share" in row.note
    assert row.completed == 0 and row.failed >= 1
    assert row.steps_per_s is not None and row.steps_per_s > 0  # the cut trials' steps count


def test_a_group_out_of_time_records_its_rows_as_cut(gb: ModuleType, tmp_path: Path) -> None:
    row = gb.Row("small-cnn/light/temporal", "torch", "small-cnn", "light", "temporal", 1)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(_plan(gb, [row], time.time() - 1.0)))
    out = tmp_path / "rows.jsonl"
    gb.group_main(str(plan_path), "torch", str(out))
    (got,) = [json.loads(line) for line in out.read_text().splitlines() if "key" in line]
    assert got["status"] == "cut" and "time budget was spent" in got["note"]


def test_it_refuses_a_results_folder_it_did_not_make(gb: ModuleType, tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match=r"--out=.*was not made by this script"):
        gb._prepare_out(theirs)
    assert (theirs / "notes.txt").read_text() == "keep me"
    ours = tmp_path / "ours"
    gb._prepare_out(ours)
    (ours / "results.json").write_text("{}")
    gb._prepare_out(ours)  # its own folder: reused


@pytest.mark.slow  # one process per group, each importing torch: ~35-130 s on a busy 2-core VM
def test_the_toy_run_prints_one_table_and_writes_its_folder(tmp_path: Path) -> None:
    empty = tmp_path / "cwd"
    empty.mkdir()  # run from an empty folder, as on the GPU machine: nothing from tests/
    out = tmp_path / "results"
    # A long budget, a backstop: the rows end when they are done. At 400 s a row's share was
    # 4 s, and beside the suite's other workers (load 13) a pool row was cut with 0 of 4 done.
    args = ["--device", "cpu", "--toy", "--budget-s", "1200", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=empty,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (out / "table.md").read_text()
    assert table in proc.stdout
    assert "| small-cnn | light | temporal | cpu | 1.00x | 4/4 | 0 | 0 |" in table
    assert "| resnet | high | optuna-nj K=2 |" in table
    assert "anchors: matmul" in table
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert results["anchors"]["matmul_tflops"] > 0
    assert set(results["capacity_bytes"]) == {"small-cnn", "resnet"}
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    by_label = {r["key"]: r for r in rows}
    for key, r in by_label.items():
        assert r["status"] in ("ok", "cut", "skipped"), (key, r["note"])
        if r["status"] == "ok":
            assert r["x_temporal"] is not None and r["x_temporal"] > 0, key
        if r["status"] in ("ok", "cut"):  # every row that ran says what its trials held
            assert r["peak_bytes"] is not None and r["peak_bytes"] >= 0, key
            assert r["peak_source"], key
        # At high demand every method of a workload is capped at the same bytes, run or not.
        want = results["capacity_bytes"][r["workload"]] if r["setting"] == "high" else None
        assert r["cap_bytes"] == want, key
    assert all(v > 0 for v in results["capacity_bytes"].values())
    for key in ("small-cnn/light/temporal", "resnet/high/temporal"):
        assert by_label[key]["status"] == "ok" and by_label[key]["completed"] == 4
    assert by_label["small-cnn/light/processes K=2"]["status"] in ("ok", "cut")
    # The pool group's rows ran, on the simulated device standing in for the GPU, capped.
    pool_rows = [r for r in rows if r["group"] == "pool"]
    assert len(pool_rows) == 8
    for r in pool_rows:
        assert r["status"] == "ok" and r["completed"] == 4, (r["key"], r["note"])
        assert "simulated device" in r["stand_in"], r["key"]
        assert r["pool"]["num_allocs"] > 0 and r["driver"]["allocs"] > 0, r["key"]
        if r["setting"] == "high":
            assert f"pool.set_capacity({r['held_bytes'] + r['cap_bytes']})" in r["bound"]
            assert r["peak_bytes"] <= r["cap_bytes"], r["key"]
    assert "skipped" in results["torch_shim"]  # no CUDA: no shim to build
    for name in ("torch", "pool", "processes"):
        assert (out / f"group-{name}.log").exists()


def test_a_group_past_its_window_is_killed_and_says_so(gb: ModuleType, tmp_path: Path) -> None:
    row = gb.Row("small-cnn/light/temporal", "torch", "small-cnn", "light", "temporal", 1)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(_plan(gb, [row], time.time() + 600)))
    args = ["--_group", "torch", "--_plan", str(plan_path), "--_result", str(tmp_path / "r")]
    why = gb._child(args, {}, 0.5, tmp_path / "group.log")
    assert "ran past its window of 0 s and was killed" in why
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # the executor's first run in this process: ~5-10 s on a busy 2-core VM
def test_the_pool_rows_run_their_cuda_paths_and_read_the_pools_counters(
    gb: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fakes import cuda_topology

    # A fake CUDA device; a simulated pool as the allocator (the row installs it, as the
    # pool group's warm-up would).
    topology = cuda_topology.install(monkeypatch)
    try:
        plan = {**_plan(gb, [], time.time() + 600), "device": "cuda:0"}
        rows = [
            gb.Row("small-cnn/light/ww-pool+gates K=2", "pool", "small-cnn", "light", "ww-pool", 2),
            gb.Row("resnet/high/ww-pool K=2", "pool", "resnet", "high", "ww-pool", 2),
        ]
        rows[0].gates = True
        for row in rows:
            gb.run_row(row, plan, deadline=time.time() + 300)
            assert row.status == "ok" and row.completed == 2, row.note
            assert row.allocator == "waterwave-pool"
            for counter in ("num_allocs", "new_segment", "num_segments", "stream_waits_issued"):
                assert counter in row.pool
        # At high demand the installed pool itself is capped, above what it held.
        high = rows[1]
        assert high.cap_bytes == 1 << 30 and high.held_bytes is not None
        assert high.bound.startswith(f"pool.set_capacity({high.held_bytes + (1 << 30)}): ")
        assert topology.pools[0].capacity_bytes == high.held_bytes + (1 << 30)
        assert rows[0].cap_bytes is None and "set_capacity" not in rows[0].bound
        for row in rows:  # (the fake's tensors stay in host memory: the pool's peak is small)
            assert row.peak_bytes is not None and row.peak_bytes >= 0
            assert row.peak_source == "the pool's peak_reserved_bytes"
            assert "allocs" in row.driver and "segment_allocs" in row.driver
    finally:
        cuda_topology.uninstall()


def test_the_table_gives_ratios_and_the_pools_counters(gb: ModuleType) -> None:
    temporal = gb.Row("resnet/high/temporal", "torch", "resnet", "high", "temporal", 1)
    temporal.status, temporal.allocator, temporal.completed, temporal.wall_s = "ok", "a", 16, 8.0
    temporal.x_temporal = 1.0
    pool = gb.Row("resnet/high/ww-pool K=4", "pool", "resnet", "high", "ww-pool", 4)
    pool.status, pool.allocator, pool.completed, pool.oom, pool.failed = "ok", "p", 16, 2, 2
    pool.x_temporal = 1.5
    pool.pool = {"num_allocs": 120, "new_segment": 3, "stream_waits_issued": 7}
    pool.peak_bytes, pool.cap_bytes = 3 << 20, 5 << 20
    temporal.cap_bytes = 5 << 20
    anchors = {"matmul_tflops": 700.0, "matmul": "m", "h2d_gb_per_s": 50.0}
    table = gb.format_table([temporal, pool], 16, anchors, "GPU")
    assert "| resnet | high | temporal | a | 1.00x | 16/16 | 0 | 0 | - / 5.0 | - | ok |" in table
    assert (
        "| resnet | high | ww-pool K=4 | p | 1.50x | 16/16 | 2 | 2 | 3.0 / 5.0 | 120 / 3 / 7 | ok |"
        in table
    )
    assert "one at a time, wall: resnet high 8.00 s" in table
    assert "matmul 700 TFLOP/s" in table and "copy 50 GB/s" in table


def test_the_script_builds_the_bench_models_without_pandas(tmp_path: Path) -> None:
    # The GPU machine has torch, Optuna and the package but not pandas: the script's ResNet is
    # the bench's (one model, one definition), imported without pandas.
    check = (
        "import importlib.util, sys\n"
        "sys.modules['pandas'] = None\n"
        f"spec = importlib.util.spec_from_file_location('gpu_benchmark', {str(SCRIPT)!r})\n"
        "gb = importlib.util.module_from_spec(spec)\n"
        "sys.modules['gpu_benchmark'] = gb\n"
        "spec.loader.exec_module(gb)\n"
        "import torch\n"
        "from waterwave_hpo.bench import BasicBlock\n"
        "for wl in gb.workloads(True):\n"
        "    model = gb.build_model(wl)\n"
        "    x = torch.randn(2, 3, wl.image_size, wl.image_size)\n"
        "    blocks = sum(isinstance(m, BasicBlock) for m in model.modules())\n"
        "    print(wl.name, tuple(model(x).shape), blocks)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "small-cnn (2, 10) 0" in proc.stdout
    assert "resnet (2, 10) 2" in proc.stdout  # one block per stage, two stages (toy)


def test_the_stand_in_device_serves_each_tensor_and_runs_out_as_torch_does(
    gb: ModuleType,
) -> None:
    from waterwave_hpo.memory import StreamAwarePool

    pool = StreamAwarePool(4 << 20, backend="sim")
    with gb.SimDeviceMemory(pool, 1):
        x = torch.ones(1 << 18)  # 1 MiB
        y = x * 2  # another
        view = y[: 1 << 10]  # a view: no new storage
        assert pool.stats().allocated_bytes == 2 << 20
        with pytest.raises(torch.OutOfMemoryError, match="simulated device"):
            torch.empty(3 << 20, dtype=torch.uint8)  # 2 + 3 MiB > 4 MiB
    del x, y, view
    assert pool.stats().allocated_bytes == 0  # freed with the tensors, in their stream's order
    assert pool.stats().ooms == 1


def test_a_pool_row_capped_below_one_trial_runs_out_of_memory_on_the_stand_in(
    gb: ModuleType,
) -> None:
    from waterwave_hpo.memory import StreamAwarePool

    wl = gb.workloads(True)[0]
    cap = 64 << 10  # a toy trial holds some 400 KiB at once: not one fits
    plan = {**_plan(gb, [], time.time() + 600), "trials": 2}
    plan["capacity_bytes"] = {w.name: cap for w in gb.workloads(True)}
    gb._STAND_IN[0] = StreamAwarePool(gb.SIM_DEVICE_BYTES, backend="sim")
    try:
        row = gb.Row(f"{wl.name}/high/ww-pool K=2", "pool", wl.name, "high", "ww-pool", 2)
        gb.run_row(row, plan, deadline=time.time() + 300)
    finally:
        gb._STAND_IN[0] = None
    assert row.status == "ok" and row.completed == 0 and row.oom >= 2, row.note
    assert row.cap_bytes == cap
    assert row.peak_bytes is not None and row.peak_bytes <= row.cap_bytes
    assert row.pool["ooms"] >= 2 and row.driver["allocs"] > 0


def test_a_late_row_records_what_the_executor_did(gb: ModuleType) -> None:
    plan = {**_plan(gb, [], time.time() + 600), "trials": 2}
    row = gb.Row("small-cnn/light/ww-late K=2", "late", "small-cnn", "light", "ww-late", 2)
    gb.run_row(row, plan, deadline=time.time() + 300)
    assert row.status == "ok" and row.completed == 2, row.note
    assert row.note.startswith("CUDA not touched; the trials ran on cpu")
    assert row.peak_bytes is not None and row.cap_bytes is None


def test_a_group_killed_by_a_signal_is_named(
    gb: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A native abort (a C++ exception in a destructor is std::terminate) ends the group's
    # process with SIGABRT: its rows must say so, and the run go on.
    aborts = tmp_path / "aborts.py"
    aborts.write_text("import os\nprint('terminate called', flush=True)\nos.abort()\n")
    monkeypatch.setattr(gb, "__file__", str(aborts))
    why = gb._child([], {}, 60.0, tmp_path / "group.log")
    assert why.startswith("the group process was killed by SIGABRT: terminate called"), why
