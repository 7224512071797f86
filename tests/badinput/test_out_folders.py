"""No file in ``--out`` that waterwave-hpo did not write is moved, changed or deleted.

For every file name the demo, the bench and the doctor write: a foreign file of that name is
refused before anything is written, the refusal names its path, and its bytes stay as they were.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from badinput._helpers import file_hashes
from waterwave_hpo._owned_files import MANIFEST_NAME
from waterwave_hpo.bench import BenchConfig
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import bench_file_names
from waterwave_hpo.bench._folders import claim_results_folder
from waterwave_hpo.bench._folders import default_folder
from waterwave_hpo.cli import main
from waterwave_hpo.demo import DEMO_FILES

# A user's file: one line without its newline, the shape a journal repair would have cut.
FOREIGN = b"the user's own notes, not written by waterwave-hpo"
DEMO_ARGS = ("--device", "cpu", "--trials", "0", "--epochs", "1", "--no-progress")
BENCH_ARGS = ("--device", "cpu", "--workloads", "digits", "--trials", "1", "--steps", "2")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


def _assert_refused(code: int, err: str, foreign: Path, before: dict[str, str], out: Path) -> None:
    assert code == 2, err
    assert str(foreign) in err and ("--out" in err or "--json" in err), err
    assert any(why in err for why in ("not written by", "changed since", "not a report")), err
    assert "Traceback" not in err
    assert foreign.read_bytes() == FOREIGN
    assert file_hashes(out) == before  # nothing else written, moved or removed


@pytest.mark.parametrize("name", [*DEMO_FILES, MANIFEST_NAME])
def test_demo_refuses_a_foreign_file_of_each_name_it_writes(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / name
    foreign.write_bytes(FOREIGN)
    before = file_hashes(tmp_path)
    code, err = _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)
    _assert_refused(code, err, foreign, before, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_demo_refuses_an_output_the_user_changed_between_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)[0] == 0
    assert _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)[0] == 0  # its own: resumed
    edited = tmp_path / "trials.csv"
    edited.write_bytes(FOREIGN)
    before = file_hashes(tmp_path)
    code, err = _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)
    _assert_refused(code, err, edited, before, tmp_path)
    assert "was changed since waterwave-hpo wrote it" in err


def test_demo_resumes_a_run_directory_written_before_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)[0] == 0
    (tmp_path / MANIFEST_NAME).unlink()  # as an earlier version left it
    code, err = _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)
    assert code == 0, err
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["kind"] == "demo" and "trials.csv" in manifest["files"]


def test_demo_refuses_a_table_annotated_in_a_run_directory_written_before_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)[0] == 0
    (tmp_path / MANIFEST_NAME).unlink()  # as an earlier version left it
    annotated = tmp_path / "trials.csv"
    annotated.write_bytes(annotated.read_bytes() + b"# trial 0 looked odd: rerun it\n")
    kept = annotated.read_bytes()
    before = file_hashes(tmp_path)
    code, err = _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)
    assert code == 2, err
    assert str(annotated) in err and "--out" in err and "Traceback" not in err
    assert "earlier version" in err and "edited since?" in err and "out of the way" in err
    assert annotated.read_bytes() == kept  # the note is not lost
    assert file_hashes(tmp_path) == before  # and no manifest adopting it was written


def test_demo_out_beside_foreign_files_of_other_names_leaves_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_bytes(FOREIGN)
    backup = tmp_path / "study.log.lock.bak"  # a name the lock's cleanup must not take
    backup.write_bytes(FOREIGN)
    assert _run(["demo", "--out", str(tmp_path), *DEMO_ARGS], capsys)[0] == 0
    assert mine.read_bytes() == FOREIGN and backup.read_bytes() == FOREIGN


def _bench_names() -> list[str]:
    config = BenchConfig(device="cpu", workloads=(Workload.DIGITS,), trials=1, steps=2)
    return [*bench_file_names(config), MANIFEST_NAME]


@pytest.mark.parametrize("name", _bench_names())
def test_bench_refuses_a_foreign_file_of_each_name_it_writes(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / name
    foreign.write_bytes(FOREIGN)
    before = file_hashes(tmp_path)
    code, err = _run(["bench", "--out", str(tmp_path), *BENCH_ARGS], capsys)
    _assert_refused(code, err, foreign, before, tmp_path)


def test_bench_out_dot_in_a_project_folder_keeps_its_readme(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = tmp_path / "README.md"
    readme.write_bytes(FOREIGN)
    (tmp_path / "results.csv").write_bytes(FOREIGN)
    monkeypatch.chdir(tmp_path)
    before = file_hashes(tmp_path)
    code, err = _run(["bench", "--out", ".", *BENCH_ARGS], capsys)
    _assert_refused(code, err, readme, before, tmp_path)


def test_a_second_bench_run_the_same_day_gets_a_new_default_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = BenchConfig(device="cpu")
    started = datetime.datetime(2026, 11, 27, tzinfo=datetime.timezone.utc)
    names = bench_file_names(config)
    first = claim_results_folder(None, default_folder(started, "cpu"), "bench", names)
    first.write_text("README.md", "first run\n")
    second = claim_results_folder(None, default_folder(started, "cpu"), "bench", names)
    assert first.path.name == "2026-11-27-cpu" and second.path.name == "2026-11-27-cpu-2"
    assert (first.path / "README.md").read_text() == "first run\n"


@pytest.mark.parametrize("flag", ["demo", "bench"])
def test_an_empty_out_is_refused(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = _run([flag, "--out", "", "--device", "cpu"], capsys)
    assert code == 2 and "--out '': is empty" in err and "pass a directory" in err
    assert list(tmp_path.iterdir()) == []


def test_doctor_refuses_a_json_path_holding_a_foreign_file_before_its_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / "waterwave-doctor.json"
    foreign.write_bytes(FOREIGN)
    before = file_hashes(tmp_path)
    code, err = _run(["doctor", "--device", "cpu", "--json", str(foreign)], capsys)
    assert code == 2 and f"--json {foreign}" in err and "not a report" in err, err
    assert "device:" not in capsys.readouterr().out  # refused before any check ran
    assert file_hashes(tmp_path) == before
