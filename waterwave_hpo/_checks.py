"""Argument checks shared by every package: one message format, one exception per mistake.

Every message reads ``"name=value: what is wrong; the fix"``. A value of the wrong type raises
:class:`TypeError`, a value of the right type that is out of range or not one of the allowed
choices raises :class:`ValueError`. Byte counts print both readable and exact,
e.g. ``3.2 GiB (3435973837 bytes)``.

This module is private to the package: other packages of ``waterwave_hpo`` may import it, users
should not.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
import enum
import inspect
from typing import Any
from typing import TypeVar

_E = TypeVar("_E", bound=enum.Enum)

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: int) -> str:
    """A byte count both readable and exact, e.g. ``3.2 GiB (3435973837 bytes)``.

    Args:
        nbytes: The count, in bytes (may be negative, e.g. a difference).

    Returns:
        ``"<value> <binary unit> (<exact> bytes)"``, or ``"<n> bytes"`` below 1 KiB.

    >>> format_bytes(3435973837)
    '3.2 GiB (3435973837 bytes)'
    >>> format_bytes(512)
    '512 bytes'
    """
    size = abs(nbytes)
    if size < 1024:
        return f"{nbytes} bytes"
    value = float(size) / 1024.0
    index = 0
    while value >= 1024.0 and index < len(_UNITS) - 1:
        value /= 1024.0
        index += 1
    unit = _UNITS[index]
    sign = "-" if nbytes < 0 else ""
    return f"{sign}{value:.1f} {unit} ({nbytes} bytes)"


def message(name: str, value: object, problem: str, fix: str) -> str:
    """The one message format: ``"name=value: what is wrong; the fix"``.

    Args:
        name: The argument's name as the caller spells it.
        value: The value passed (shown with ``repr``).
        problem: What is wrong, without a trailing period.
        fix: What to pass instead, without a trailing period.

    Returns:
        The message.

    >>> message("n", -1, "must be >= 0", "pass a count of trials")
    'n=-1: must be >= 0; pass a count of trials.'
    """
    return f"{name}={value!r}: {problem}; {fix}."


def type_error(name: str, value: object, expected: str, fix: str) -> TypeError:
    """A :class:`TypeError` in the one format, naming the type that was passed.

    Args:
        name: The argument's name.
        value: The value passed.
        expected: The type wanted, e.g. ``"an int"``.
        fix: What to pass instead.

    Returns:
        The error, for the caller to raise.
    """
    return TypeError(message(name, value, f"must be {expected}, not {type(value).__name__}", fix))


def value_error(name: str, value: object, problem: str, fix: str) -> ValueError:
    """A :class:`ValueError` in the one format.

    Args:
        name: The argument's name.
        value: The value passed.
        problem: What is wrong.
        fix: What to pass instead.

    Returns:
        The error, for the caller to raise.
    """
    return ValueError(message(name, value, problem, fix))


def check_int(name: str, value: object, *, minimum: int, fix: str | None = None) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``.

    Args:
        name: The argument's name.
        value: The value passed.
        minimum: The smallest allowed value.
        fix: What to pass instead; defaults to ``"pass an int >= minimum"``.

    Returns:
        ``value``.

    Raises:
        TypeError: ``value`` is not an int, or is a bool.
        ValueError: ``value < minimum``.

    >>> check_int("n_trials", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: n_trials=0: must be >= 1; pass an int >= 1.
    """
    advice = fix or f"pass an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, value, f"an int >= {minimum}", advice)
    if value < minimum:
        raise value_error(name, value, f"must be >= {minimum}", advice)
    return value


def check_optional_int(name: str, value: object, *, minimum: int, fix: str) -> int | None:
    """``value`` if it is ``None`` or an int ``>= minimum`` (see :func:`check_int`).

    Args:
        name: The argument's name.
        value: The value passed.
        minimum: The smallest allowed int.
        fix: What to pass instead (say what ``None`` means).

    Returns:
        ``value``.

    Raises:
        TypeError: ``value`` is neither ``None`` nor an int.
        ValueError: ``value < minimum``.
    """
    if value is None:
        return None
    return check_int(name, value, minimum=minimum, fix=fix)


def check_number(
    name: str, value: object, *, allow_zero: bool = False, fix: str | None = None
) -> float:
    """``value`` as a float if it is a number (not a bool) ``> 0``, or ``>= 0`` with ``allow_zero``.

    Args:
        name: The argument's name.
        value: The value passed.
        allow_zero: Whether 0 is allowed.
        fix: What to pass instead; defaults to ``"pass a number > 0"`` (or ``>= 0``).

    Returns:
        ``float(value)``.

    Raises:
        TypeError: ``value`` is not an int or float, or is a bool.
        ValueError: ``value`` is negative, zero without ``allow_zero``, or NaN.
    """
    bound = ">= 0" if allow_zero else "> 0"
    advice = fix or f"pass a number {bound}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(name, value, f"a number {bound}", advice)
    ok = value >= 0 if allow_zero else value > 0
    if not ok:  # also catches NaN
        raise value_error(name, value, f"must be {bound}", advice)
    return float(value)


def check_choice(name: str, value: object, choices: type[_E], fix: str | None = None) -> _E:
    """``value`` as a member of the enum ``choices`` (by value or as a member).

    Args:
        name: The argument's name.
        value: The value passed.
        choices: The enum class whose values are allowed.
        fix: What to pass instead; defaults to listing the allowed values.

    Returns:
        The member.

    Raises:
        ValueError: ``value`` is not a value of ``choices``.
    """
    try:
        return choices(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in choices)
        raise value_error(
            name, value, f"is not one of {allowed}", fix or f"pass one of {allowed}"
        ) from None


SEED_MAX = 2**32 - 1
"""The largest seed NumPy's ``RandomState`` (Optuna's samplers) accepts."""


def check_seed(name: str, value: object) -> int:
    """``value`` if it is an int in ``[0, 2**32 - 1]``, the seeds NumPy and Optuna's samplers take.

    Args:
        name: The argument's name.
        value: The value passed.

    Returns:
        ``value``.

    Raises:
        TypeError: ``value`` is not an int, or is a bool.
        ValueError: ``value`` is outside ``[0, 2**32 - 1]``.

    >>> check_seed("seed", -1)
    Traceback (most recent call last):
    ...
    ValueError: seed=-1: must be >= 0; pass a seed from 0 to 4294967295.
    """
    fix = f"pass a seed from 0 to {SEED_MAX}"
    check_int(name, value, minimum=0, fix=fix)
    return check_at_most(name, value, SEED_MAX, "NumPy's seed range", fix)  # type: ignore[arg-type]


def check_finite_number(name: str, value: object, *, fix: str | None = None) -> float:
    """``value`` as a float if it is a finite number ``> 0`` (see :func:`check_number`).

    Raises:
        TypeError: ``value`` is not an int or float, or is a bool.
        ValueError: ``value`` is not > 0, is NaN, or is infinite.
    """
    number = check_number(name, value, fix=fix)
    if number == float("inf"):
        raise value_error(name, value, "must be finite", fix or "pass a number > 0")
    return number


def check_callables(name: str, value: object, what: str) -> list[Any]:
    """``value`` as a list if it is an iterable (not itself callable) of callables.

    Args:
        name: The argument's name.
        value: The value passed.
        what: What each callable takes, e.g. ``"(study, frozen_trial)"``.

    Returns:
        The callables, in order.

    Raises:
        TypeError: ``value`` is not an iterable, is callable itself, or holds a non-callable.
    """
    if not isinstance(value, Iterable) or callable(value) or isinstance(value, (str, bytes)):
        raise type_error(
            name, value, f"a list of callables taking {what}", "wrap a single callable in a list"
        )
    result = list(value)
    for index, item in enumerate(result):
        if not callable(item):
            raise type_error(
                f"{name}[{index}]", item, f"a callable taking {what}", "pass functions or methods"
            )
    return result


def check_at_most(name: str, value: int, maximum: int, why: str, fix: str) -> int:
    """``value`` if it is ``<= maximum`` (an absurd value is refused before it allocates anything).

    Args:
        name: The argument's name.
        value: The value passed (already checked to be an int).
        maximum: The largest allowed value.
        why: Why there is a limit.
        fix: What to pass instead.

    Returns:
        ``value``.

    Raises:
        ValueError: ``value > maximum``.

    >>> check_at_most("k", 5000, 1024, "each is a thread", "pass k <= 1024")
    Traceback (most recent call last):
    ...
    ValueError: k=5000: must be <= 1024 (each is a thread); pass k <= 1024.
    """
    if value > maximum:
        raise value_error(name, value, f"must be <= {maximum} ({why})", fix)
    return value


def check_takes_one_argument(name: str, func: Callable[..., Any], what: str, fix: str) -> None:
    """Refuse a callable that cannot be called with one positional argument.

    Found up front rather than at the first call, where a trial would already have started.
    Callables whose signature Python cannot read (some builtins) are let through.

    Args:
        name: The argument's name.
        func: The callable.
        what: What the one argument is, e.g. ``"a trial"``.
        fix: What to pass instead.

    Raises:
        TypeError: ``func`` cannot take exactly one positional argument.
    """
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object())
    except TypeError as error:
        raise TypeError(
            message(name, func, f"cannot be called with one argument, {what} ({error})", fix)
        ) from None
