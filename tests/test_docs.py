"""The manual's examples run, and the manual's install page matches the README.

A ``python`` code block of ``README.md`` or of a page under ``docs/`` that follows a
``<!-- test -->`` line is executed; every ``pycon`` block is run through :mod:`doctest`. The
runnable blocks of one page run in order in one namespace (a later block may use an earlier
one's names), in a temporary working directory, on the CPU. A sketch (``...`` standing for the
user's own code) stays unmarked and is not run.
"""

from __future__ import annotations

from dataclasses import dataclass
import doctest
from pathlib import Path
import re

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- test -->"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, first line of code (1-based) and text."""

    lang: str
    line: int
    code: str
    marked: bool


def blocks_of(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, each with whether ``MARKER`` precedes it."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None or not opening["lang"]:
            i += 1
            continue
        indent = len(opening["indent"])
        previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        found.append(Block(opening["lang"], i + 2, code, previous == MARKER))
        i = end + 1
    return found


def _pages() -> list[Path]:
    docs = sorted((REPO_ROOT / "docs").rglob("*.md"))
    return [REPO_ROOT / "README.md", *docs]


def _runnable(page: Path) -> list[Block]:
    return [
        b
        for b in blocks_of(page.read_text())
        if b.lang == "pycon" or (b.lang == "python" and b.marked)
    ]


PAGES = [page for page in _pages() if _runnable(page)]


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO_ROOT))


def test_the_block_parser_finds_marked_blocks_and_only_those() -> None:
    text = (
        "intro\n\n<!-- test -->\n```python\nx = 1\n```\n\n```python\ny = ...\n```\n\n"
        "- item\n\n  ```pycon\n  >>> 1 + 1\n  2\n  ```\n"
    )
    python_marked, python_sketch, pycon = blocks_of(text)
    assert (python_marked.lang, python_marked.marked) == ("python", True)
    assert python_marked.code == "x = 1\n"
    assert (python_sketch.marked, python_sketch.line) == (False, 9)
    assert (pycon.lang, pycon.code) == ("pycon", ">>> 1 + 1\n2\n")


def test_the_manual_has_runnable_examples_where_a_newcomer_starts() -> None:
    # A lost marker would silently turn an example into an untested sketch.
    names = {_page_id(page) for page in PAGES}
    for expected in (
        "README.md",
        "docs/install.md",
        "docs/guide/memory.md",
        "docs/guide/fusion.md",
        "docs/guide/memory-planning.md",
        "docs/guide/reproducibility.md",
        "docs/guide/bad-input.md",
    ):
        assert expected in names, expected


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_pages_examples_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    where = _page_id(page)
    for block in _runnable(page):
        if block.lang == "python":
            exec(compile(block.code, f"{where}:{block.line}", "exec"), namespace)
            continue
        test = parser.get_doctest(block.code, namespace, where, str(page), block.line - 1)
        report: list[str] = []
        result = runner.run(test, out=report.append, clear_globs=False)
        assert result.failed == 0, "".join(report)
        namespace.update(test.globs)


def _bash_commands(page: Path) -> list[str]:
    return [
        line
        for b in blocks_of(page.read_text())
        if b.lang == "bash"
        for line in b.code.splitlines()
        if line.startswith("python3 -m venv")
    ]


def test_the_install_page_gives_the_readmes_two_commands_word_for_word() -> None:
    readme = _bash_commands(REPO_ROOT / "README.md")
    assert len(readme) == 2, readme
    assert _bash_commands(REPO_ROOT / "docs" / "install.md") == readme


def test_every_page_is_in_the_sites_nav() -> None:
    config = (REPO_ROOT / "mkdocs.yml").read_text()
    docs = REPO_ROOT / "docs"
    for page in docs.rglob("*.md"):
        assert f": {page.relative_to(docs).as_posix()}\n" in config, page


def test_the_built_manual_is_ignored_by_git() -> None:
    # `mkdocs build` writes site/ (its default site_dir) into the checkout.
    import shutil
    import subprocess

    assert "site_dir" not in (REPO_ROOT / "mkdocs.yml").read_text()  # so the default, site/
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(
        ["git", "check-ignore", "--quiet", "site/index.html"], cwd=REPO_ROOT, check=False
    )
    assert result.returncode == 0, "site/ is not in .gitignore"


def test_the_readme_says_what_the_demo_install_takes_on_disk() -> None:
    # torch's CUDA wheel pulls gigabytes of NVIDIA libraries: a newcomer should know first.
    readme = (REPO_ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start") : readme.index("## Headline figures")]
    assert re.search(r"the demo command's `\.venv` takes \d+(\.\d)? GB", quick_start)
