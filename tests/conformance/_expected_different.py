"""Optuna tests that assert Optuna's internals, so they are expected to differ under the executor.

Each entry is a pytest node id (without parameters: it covers every parametrization) of Optuna's
own tests, with why the executor legitimately differs. Any other failure is a bug in the
executor. Keep this list short and every reason specific.
"""

from __future__ import annotations

# Both K=1 and K=4.
_ALWAYS: dict[str, str] = {}

# Only with several trials at once (K > 1): Optuna's sequential order assumptions.
_CONCURRENT: dict[str, str] = {}


def expected_different(k: int) -> dict[str, str]:
    """The node ids expected to differ with ``trials_per_device=k``, with the reason of each."""
    return {**_ALWAYS, **(_CONCURRENT if k > 1 else {})}
