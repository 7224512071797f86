"""Kill -9 the demo at random moments (also holding the lock, also mid-append) and
resume it; nothing is waited on forever and no trial is lost."""

from __future__ import annotations

import importlib.util
from pathlib import Path
import sys
from types import ModuleType

import pytest


def _harness() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "experiments" / "demo_kill_resume.py"
    spec = importlib.util.spec_from_file_location("demo_kill_resume", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_loses_nothing(tmp_path: Path) -> None:
    harness = _harness()
    trials = 16
    # The first 6 of the 21 rounds in experiments/results/2026-11-23-demo-kill-resume/ (same
    # seed): the modes take turns, 2 rounds of each. Each round starts the demo afresh (a
    # process importing torch), about 5 s on CI's 2 cores.
    report = harness.run_kills(tmp_path / "run", kills=6, trials=trials, rng_seed=17)
    modes = [r.mode for r in report.rounds]
    assert len(modes) == 6 and all(modes.count(mode) == 2 for mode in harness.KillMode)
    # Each resume opened the journal in bounded time (run_kills raises otherwise) ...
    assert max(r.ready_s for r in report.rounds) < 120
    # ... including after kills that cut the journal's last line (the harness cuts it itself).
    # How many "holding-lock" kills land inside the lock's few milliseconds depends on the
    # machine's load (14 of 21 rounds on a loaded VM, 2 on a quieter one), so it is reported,
    # not asserted: tests/demo/test_lock.py proves a dead holder's lock is released at once.
    assert sum(r.cut_bytes > 0 for r in report.rounds) == 2  # the two mid-append rounds
    assert report.final_returncode == 0, report.final_stderr_tail
    assert report.running_left == 0 and report.waiting_left == 0
    assert report.counted_finished == trials
    assert report.interrupted >= 1  # some kills did land while trials ran
    assert report.trials_lost == 0
