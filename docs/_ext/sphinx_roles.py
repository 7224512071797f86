"""A griffe extension: Sphinx roles in docstrings read as code in the API reference.

The package's docstrings name other objects with Sphinx roles (``:class:`~a.B```,
``:func:`f```), which Markdown would show as ``:class:`` followed by the name. mkdocstrings
renders Markdown, so each role becomes a code span of the name (``~a.B`` shows ``B``, as in
Sphinx). The docstrings themselves stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every loaded docstring as Markdown code spans."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring in place, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
