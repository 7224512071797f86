"""The ``waterwave-hpo`` command line."""

from waterwave_hpo.cli._main import main

__all__ = ["main"]
