"""Without the frameworks extra its modules fail on import, naming the extra; the package and
its other integrations import without it."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "missing"),
    [("transformers", "transformers"), ("transformers", "accelerate"), ("lightning", "lightning")],
)
def test_a_missing_framework_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, missing: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # "import <missing>" raises ImportError
    monkeypatch.delitem(sys.modules, f"waterwave_hpo.integrations.{module}", raising=False)
    import waterwave_hpo.integrations as integrations

    monkeypatch.delitem(vars(integrations), module, raising=False)  # bound by an earlier import
    with pytest.raises(ImportError, match=r'pip install "waterwave-hpo\[frameworks\]"'):
        getattr(integrations, module)


def test_importing_waterwave_hpo_imports_no_framework() -> None:
    code = (
        "import sys, waterwave_hpo\n"
        "print([m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.strip() == "[]"


def test_an_unknown_integration_is_an_attribute_error() -> None:
    import waterwave_hpo.integrations as integrations

    with pytest.raises(AttributeError, match="has no attribute 'keras'"):
        integrations.keras  # noqa: B018
