"""Every flag of ``waterwave-hpo demo|bench|doctor`` with bad values (table-driven).

Each case: exit code 2 (argparse's or ours), the flag and the value on stderr, a fix or
argparse's usage line, no traceback, and no file of the user's created, moved or changed.
One case runs the real console script, to see what a shell sees.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
import shutil
import subprocess
import sys

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
import pytest

from badinput._helpers import file_hashes
from badinput._helpers import immutable
from waterwave_hpo.cli import main
from waterwave_hpo.cli._main import _parser


@dataclass(frozen=True)
class Flag:
    """A command line, and what stderr must show: the flag, the value, a fix."""

    id: str
    argv: tuple[str, ...]
    flag: str
    value: str
    fix: str  # a word of the fix, or "usage:" for argparse's own refusals
    klass: str


# Placeholders replaced per test: OUT (a fresh run directory), FILE (an existing user file).
FLAGS = [
    Flag("demo-trials-word", ("demo", "--trials", "x"), "--trials", "'x'", "usage:", "type"),
    Flag("demo-trials-negative", ("demo", "--trials", "-1"), "--trials", "-1", "pass", "range"),
    Flag(
        "demo-concurrency-zero",
        ("demo", "--concurrency", "0"),
        "--concurrency",
        "0",
        "pass",
        "range",
    ),
    Flag(
        "demo-concurrency-absurd",
        ("demo", "--concurrency", "5000", "--device", "cpu"),
        "--concurrency",
        "5000",
        "pass",
        "absurd",
    ),
    Flag("demo-epochs-zero", ("demo", "--epochs", "0"), "--epochs", "0", "pass", "range"),
    Flag("demo-epochs-float", ("demo", "--epochs", "1.5"), "--epochs", "'1.5'", "usage:", "type"),
    Flag("demo-seed-word", ("demo", "--seed", "abc"), "--seed", "'abc'", "usage:", "type"),
    Flag("demo-fuse-zero", ("demo", "--fuse", "0"), "--fuse", "0", "pass", "range"),
    Flag("demo-fuse-word", ("demo", "--fuse", "k"), "--fuse", "'k'", "usage:", "type"),
    Flag("demo-device-tpu", ("demo", "--device", "tpu"), "--device", "tpu", "pass", "range"),
    Flag("demo-device-cuda", ("demo", "--device", "cuda"), "--device", "cuda", "pass", "range"),
    Flag(
        "demo-device-index", ("demo", "--device", "cuda:7"), "--device", "cuda:7", "pass", "range"
    ),
    Flag("demo-device-negative", ("demo", "--device", "-1"), "--device", "-1", "pass", "range"),
    Flag("demo-out-file", ("demo", "--out", "FILE"), "--out", "FILE", "pass", "path"),
    Flag("demo-unknown-flag", ("demo", "--trails", "3"), "--trails", "3", "usage:", "type"),
    Flag("bench-k-zero", ("bench", "--k", "0"), "--k", "0", "pass", "range"),
    Flag("bench-trials-zero", ("bench", "--trials", "0"), "--trials", "0", "pass", "range"),
    Flag(
        "bench-budget-negative", ("bench", "--budget-s", "-1"), "--budget-s", "-1", "pass", "range"
    ),
    Flag(
        "bench-budget-word",
        ("bench", "--budget-s", "long"),
        "--budget-s",
        "'long'",
        "usage:",
        "type",
    ),
    Flag("bench-steps-zero", ("bench", "--steps", "0"), "--steps", "0", "pass", "range"),
    Flag(
        "bench-capacity-zero",
        ("bench", "--capacity-bytes", "0"),
        "--capacity-bytes",
        "0",
        "pass",
        "range",
    ),
    Flag("bench-device-tpu", ("bench", "--device", "tpu"), "--device", "tpu", "pass", "range"),
    Flag(
        "bench-workload-unknown",
        ("bench", "--workloads", "bert"),
        "--workloads",
        "'bert'",
        "usage:",
        "range",
    ),
    Flag(
        "bench-method-unknown", ("bench", "--methods", "mps"), "--methods", "mps", "pass", "range"
    ),
    Flag(
        "bench-method-not-a-search-method",
        ("bench", "--search", "--methods", "spatial"),
        "--methods",
        "spatial",
        "pass",
        "range",
    ),
    Flag("bench-search-value", ("bench", "--search=1"), "--search", "1", "usage:", "type"),
    Flag(
        "bench-seeds-zero", ("bench", "--search", "--seeds", "0"), "--seeds", "0", "pass", "range"
    ),
    Flag(
        "bench-seeds-without-search", ("bench", "--seeds", "2"), "--seeds", "2", "--search", "mode"
    ),
    Flag(
        "bench-epochs-zero",
        ("bench", "--search", "--epochs", "0"),
        "--epochs",
        "0",
        "pass",
        "range",
    ),
    Flag(
        "bench-target-fraction-above-one",
        ("bench", "--search", "--target-fraction", "1.5"),
        "--target-fraction",
        "1.5",
        "pass",
        "range",
    ),
    Flag(
        "bench-target-fraction-zero",
        ("bench", "--search", "--target-fraction", "0"),
        "--target-fraction",
        "0",
        "pass",
        "range",
    ),
    Flag(
        "bench-workloads-with-search",
        ("bench", "--search", "--workloads", "gpt", "digits"),
        "--workloads",
        "gpt digits",
        "leave it out",
        "mode",
    ),
    Flag(
        "bench-no-sim-with-search",
        ("bench", "--search", "--no-sim"),
        "--no-sim",
        "--no-sim",
        "leave it out",
        "mode",
    ),
    Flag(
        "bench-setting-unknown",
        ("bench", "--settings", "max"),
        "--settings",
        "'max'",
        "usage:",
        "range",
    ),
    Flag("bench-out-file", ("bench", "--out", "FILE"), "--out", "FILE", "pass", "path"),
    Flag("doctor-device-tpu", ("doctor", "--device", "tpu"), "--device", "tpu", "pass", "range"),
    Flag(
        "doctor-device-missing",
        ("doctor", "--device", "cuda:5"),
        "--device",
        "cuda:5",
        "use",
        "range",
    ),
    Flag("doctor-json-dir", ("doctor", "--json", "OUT"), "--json", "OUT", "pass", "path"),
    Flag("demo-seed-negative", ("demo", "--seed", "-1"), "--seed", "-1", "pass", "range"),
    Flag(
        "demo-seed-beyond-numpy",
        ("demo", "--seed", "4294967296"),
        "--seed",
        "4294967296",
        "pass",
        "range",
    ),
    Flag("demo-out-empty", ("demo", "--out", ""), "--out", "''", "pass", "path"),
    Flag(
        "demo-isolation-unknown",
        ("demo", "--isolation", "docker"),
        "--isolation",
        "'docker'",
        "usage:",
        "range",
    ),
    Flag("bench-k-word", ("bench", "--k", "four"), "--k", "'four'", "usage:", "type"),
    Flag("bench-seed-negative", ("bench", "--seed", "-5"), "--seed", "-5", "pass", "range"),
    Flag("bench-budget-inf", ("bench", "--budget-s", "inf"), "--budget-s", "inf", "pass", "range"),
    Flag("bench-budget-nan", ("bench", "--budget-s", "nan"), "--budget-s", "nan", "pass", "range"),
    Flag("bench-steps-word", ("bench", "--steps", "many"), "--steps", "'many'", "usage:", "type"),
    Flag(
        "bench-capacity-negative",
        ("bench", "--capacity-bytes", "-1"),
        "--capacity-bytes",
        "-1",
        "pass",
        "range",
    ),
    Flag("bench-out-empty", ("bench", "--out", ""), "--out", "''", "pass", "path"),
    Flag("bench-no-sim-value", ("bench", "--no-sim=1"), "--no-sim", "1", "usage:", "type"),
    Flag(
        "demo-no-progress-value",
        ("demo", "--no-progress=1"),
        "--no-progress",
        "1",
        "usage:",
        "type",
    ),
    Flag("demo-verbose-value", ("demo", "--verbose=1"), "--verbose", "1", "usage:", "type"),
    Flag("doctor-json-empty", ("doctor", "--json", ""), "--json", "''", "pass", "path"),
    Flag("doctor-json-foreign", ("doctor", "--json", "FILE"), "--json", "FILE", "pass", "path"),
    Flag("no-command", (), "COMMAND", "required", "usage:", "order"),
    Flag("unknown-command", ("train",), "train", "invalid choice", "usage:", "order"),
]


def _options(command: str) -> set[str]:
    """The long options of ``waterwave-hpo <command>``, read from its parser."""
    parser = _parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        max(action.option_strings, key=len)
        for action in subparsers.choices[command]._actions
        if action.option_strings and action.dest != "help"
    }


@pytest.mark.parametrize("command", ["demo", "bench", "doctor"])
def test_every_option_has_a_bad_input_case(command: str) -> None:
    covered = {f.flag for f in FLAGS if f.argv[:1] == (command,)}
    assert _options(command) - covered == set()


def _run(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own refusals
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flag", [pytest.param(f, id=f"{f.klass}-{f.id}") for f in FLAGS])
def test_cli_refuses(flag: Flag, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    user_file = tmp_path / "notes.txt"
    user_file.write_text("the user's own file\n")
    out = tmp_path / "out"
    out.mkdir()
    placeholders = {"FILE": str(user_file), "OUT": str(out)}
    argv = tuple(placeholders.get(a, a) for a in flag.argv)
    if flag.argv[:1] == ("demo",) and "--out" not in argv:
        argv = (*argv, "--out", str(out / "run"))
    if flag.argv[:1] == ("bench",) and "--out" not in argv:
        argv = (*argv, "--out", str(out / "bench"))
    before = file_hashes(tmp_path)
    code, err = _run(argv, capsys)
    assert code == 2, err
    value = placeholders.get(flag.value, flag.value)
    assert flag.flag in err and value in err, err
    assert flag.fix in err, err
    assert "Traceback" not in err
    assert file_hashes(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "out"]
    assert list(out.iterdir()) == []


def test_demo_into_a_directory_nobody_may_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    with immutable(locked):
        code, err = _run(("demo", "--out", str(locked / "run"), "--device", "cpu"), capsys)
    assert code == 2
    assert f"--out {locked / 'run'}:" in err and "Pass a directory you can write to" in err
    assert "Traceback" not in err
    assert list(locked.iterdir()) == []


def test_demo_with_an_immutable_journal_names_out_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("demo", "--out", str(tmp_path), "--trials", "0", "--epochs", "1", "--no-progress")
    assert _run((*args, "--device", "cpu"), capsys)[0] == 0
    journal = tmp_path / "study.log"
    before = file_hashes(journal)
    with immutable(journal):
        code, err = _run((*args, "--trials", "1"), capsys)
    assert code in (1, 2), err
    assert f"--out {tmp_path}" in err and "Traceback" not in err
    assert file_hashes(journal) == before
    study = optuna.load_study(
        study_name="waterwave-demo", storage=JournalStorage(JournalFileBackend(str(journal)))
    )
    assert [t.state for t in study.trials if t.state.name == "RUNNING"] == []


def test_demo_refuses_a_damaged_journal_without_touching_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("demo", "--out", str(tmp_path), "--trials", "0", "--epochs", "1", "--no-progress")
    assert _run((*args, "--device", "cpu"), capsys)[0] == 0  # the demo's own run directory
    journal = tmp_path / "study.log"
    journal.write_bytes(b"not json\n" + journal.read_bytes())
    before = file_hashes(tmp_path)
    code, err = _run(("demo", "--out", str(tmp_path), "--device", "cpu"), capsys)
    assert code == 2 and "line 1" in err and "Fix:" in err and "Traceback" not in err
    assert file_hashes(tmp_path) == before


def test_console_script_prints_no_traceback(tmp_path: Path) -> None:
    script = shutil.which("waterwave-hpo", path=str(Path(sys.executable).parent))
    assert script is not None
    done = subprocess.run(
        [script, "demo", "--device", "cuda:3", "--out", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("waterwave-hpo demo: error: --device cuda:3: ")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "d").exists()
