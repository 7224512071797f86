"""run_bench and ``waterwave-hpo bench``: the results folder has every field, and says CPU."""

from __future__ import annotations

from dataclasses import fields
import json
from pathlib import Path

import pandas as pd
import pytest

from waterwave_hpo.bench import CPU_NOTICE
from waterwave_hpo.bench import UNITS
from waterwave_hpo.bench import BenchConfig
from waterwave_hpo.bench import Method
from waterwave_hpo.bench import MethodResult
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import run_bench
from waterwave_hpo.cli._main import main


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bench")
    config = BenchConfig(
        out=out,
        device="cpu",
        k=2,
        trials=2,
        workloads=(Workload.DIGITS,),
        steps=2,
        command=("test",),
    )
    return run_bench(config, log=lambda line: None)


def test_every_method_has_a_row_per_setting(bench) -> None:
    table = bench.table
    assert set(table["method"]) == {m.value for m in Method}
    assert set(table["setting"]) == {"light", "high"}
    assert len(table) == 2 * len(Method)
    ran = table[table["available"]]
    assert (ran["completed_trials"] + ran["failed_trials"] == 2).all()
    temporal = ran[ran["method"] == "temporal"]
    assert (temporal["ratio_to_temporal"] == 1.0).all()
    assert (ran["allocator"] == "cpu").all()  # which allocator each method ran on
    assert (ran["samples_per_s"] > 0).all()
    simulated = ran[ran["method"] != "fused"]  # the simulator does not model fusion
    assert simulated["sim_makespan_s"].notna().all() and simulated["sim_error_pct"].notna().all()
    assert ran[ran["method"] == "fused"]["sim_makespan_s"].isna().all()
    async_rows = table[table["method"] == "cuda-malloc-async"]
    assert not async_rows["available"].any()
    assert async_rows["note"].str.contains("not available on this device").all()


def test_plans_are_compared_on_the_simulated_device(bench) -> None:
    assert {(c.setting, c.sharing) for c in bench.plan_comparison} == {
        (setting, sharing)
        for setting in ("light", "high")
        for sharing in ("stock", "stock+plans", "ledger", "ledger+plans")
    }
    assert all(c.failed_trials >= 0 and c.makespan_s > 0 for c in bench.plan_comparison)
    assert (bench.out / "plans.csv").exists()
    assert "## Co-hosting with and without memory plans" in (bench.out / "README.md").read_text()


def test_high_setting_is_high_demand(bench) -> None:
    for setting, over in (("light", False), ("high", True)):
        row = bench.table[bench.table["setting"] == setting].iloc[0]
        assert bool(row["solo_peaks_top_k_bytes"] > row["capacity_bytes"]) == over


def test_files_have_every_field(bench) -> None:
    out: Path = bench.out
    names = [f.name for f in fields(MethodResult)]
    csv = pd.read_csv(out / "results.csv")
    assert list(csv.columns) == names
    data = json.loads((out / "results.json").read_text())
    assert data["cpu_only"] is True and data["notice"] == CPU_NOTICE
    assert data["command"] == ["test"]
    assert data["machine"]["device"] == "cpu" and data["machine"]["cpu_count"]
    assert {"torch", "optuna", "python", "waterwave_hpo"} <= set(data["versions"])
    assert all(set(r) == set(names) for r in data["results"])
    numeric = [n for n in names if n.endswith(("_s", "_bytes", "_pct", "_per_s"))]
    assert set(numeric) <= set(data["units"]) == set(UNITS)
    assert data["trials"] and {"index", "start_s", "end_s", "complete", "method"} <= set(
        data["trials"][0]
    )
    readme = (out / "README.md").read_text()
    assert "CPU-only run" in readme and "| digits | high | waterwave |" in readme
    for png in ("throughput.png", "gantt-digits-light.png", "memory-digits-high.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_cli_runs_and_rejects_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--k",
            "2",
            "--trials",
            "2",
            "--workloads",
            "digits",
            "--settings",
            "light",
            "--methods",
            "temporal",
            "waterwave",
            "--steps",
            "1",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "CPU-only run" in printed and "waterwave" in printed
    table = pd.read_csv(tmp_path / "results.csv")
    assert list(table["method"]) == ["temporal", "waterwave"]
    assert main(["bench", "--device", "cpu", "--k", "0"]) == 2
    assert "--k 0: must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--device", "cuda:7"]) == 2
    assert "does not exist here" in capsys.readouterr().err


def test_config_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="trials=0"):
        BenchConfig(trials=0)
    with pytest.raises(ValueError, match="budget_s=0"):
        BenchConfig(budget_s=0)
    with pytest.raises(ValueError, match="workloads, settings and methods"):
        BenchConfig(methods=())
