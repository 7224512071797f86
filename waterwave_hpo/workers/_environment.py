"""What a worker takes from the driver's process so that a trial runs as it would there.

A worker never ran the user's script (it is forked from a zygote that imported only torch,
Optuna and this package, or a fresh interpreter): what the script set up at run time (logging
levels and handlers, warning filters, ``multiprocessing``'s start method) is not there unless it
is sent.
:func:`capture` takes it in the driver when ``optimize`` starts; :meth:`WorkerEnvironment.apply`
sets it in the worker before the objective is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
import multiprocessing
import sys
from typing import Any
from typing import cast

_STREAMS = {"stderr", "stdout"}


@dataclass(frozen=True)
class HandlerRecipe:
    """A logging handler the worker rebuilds: a stream handler (stderr, stdout) or a file one.

    Attributes:
        target: ``"stderr"``, ``"stdout"``, or a file's absolute path (appended to).
        level: The handler's level.
        fmt: Its formatter's format string (``None``: logging's default).
        datefmt: Its formatter's date format.
        style: Its formatter's style (``"%"``, ``"{"``, ``"$"``).
    """

    target: str
    level: int
    fmt: str | None
    datefmt: str | None
    style: str

    def build(self) -> logging.Handler:
        """The handler, in this process."""
        handler: logging.Handler
        if self.target in _STREAMS:
            handler = logging.StreamHandler(getattr(sys, self.target))
        else:
            handler = logging.FileHandler(self.target, mode="a", delay=True)
        handler.setLevel(self.level)
        handler.setFormatter(logging.Formatter(self.fmt, self.datefmt, self.style))  # type: ignore[arg-type]
        return handler


@dataclass(frozen=True)
class LoggerSetting:
    """One logger's configuration: level, propagation, and the handlers the worker can rebuild."""

    name: str
    """``""`` for the root logger."""
    level: int
    propagate: bool
    disabled: bool
    handlers: tuple[HandlerRecipe, ...]


@dataclass(frozen=True)
class WorkerEnvironment:
    """The driver's run-time setup that a trial's code may depend on, sent to each worker.

    Attributes:
        loggers: The root logger and every logger the driver configured (a level, a handler,
            propagation turned off, or disabled). Handlers writing to stderr, stdout or a file
            are rebuilt with their level and formatter; others (a socket, a queue) are not sent.
        optuna_default_handler: Whether Optuna's own stderr handler is on
            (``optuna.logging.disable_default_handler()`` turns it off).
        warning_filters: ``warnings.filters`` (``warnings.filterwarnings``, ``-W``).
        capture_warnings: ``logging.captureWarnings(True)`` is in effect.
        start_method: The start method of the worker's own processes (``DataLoader``
            workers, ``multiprocessing.Pool``): the driver's, and ``"fork"`` (where there is
            one) if the driver chose none. A spawned worker (where the zygote cannot serve) would
            otherwise pass ``spawn`` down as its own default: each ``DataLoader`` worker would
            then start an interpreter, import torch and the user's script, every epoch (seconds
            where a fork takes milliseconds), and could not load a dataset class that came to the
            worker by value.
    """

    loggers: tuple[LoggerSetting, ...]
    optuna_default_handler: bool
    warning_filters: tuple[Any, ...]
    capture_warnings: bool
    start_method: str | None

    def apply(self) -> None:
        """Set this process's logging, warning filters and start method to the driver's."""
        import warnings

        import optuna

        for setting in self.loggers:
            logger = logging.getLogger(setting.name or None)
            logger.setLevel(setting.level)
            logger.propagate = setting.propagate
            logger.disabled = setting.disabled
            for handler in list(logger.handlers):
                if not _is_optuna_default(handler):
                    logger.removeHandler(handler)
            for recipe in setting.handlers:
                logger.addHandler(recipe.build())
        if self.optuna_default_handler:
            optuna.logging.enable_default_handler()
        else:
            optuna.logging.disable_default_handler()
        warnings.resetwarnings()  # invalidates the registries of warnings already shown
        cast("list[Any]", warnings.filters)[:] = list(self.warning_filters)
        logging.captureWarnings(self.capture_warnings)
        if self.start_method is not None:
            multiprocessing.set_start_method(self.start_method, force=True)


def capture() -> WorkerEnvironment:
    """The driver's :class:`WorkerEnvironment`, now."""
    import warnings

    loggers = [_setting("", logging.getLogger())]
    for name, logger in sorted(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger):
            continue  # a placeholder: no logger of that name was configured
        if (
            logger.level != logging.NOTSET
            or logger.handlers
            or not logger.propagate
            or logger.disabled
        ):
            loggers.append(_setting(name, logger))
    optuna_logger = logging.getLogger("optuna")
    return WorkerEnvironment(
        loggers=tuple(loggers),
        optuna_default_handler=any(_is_optuna_default(h) for h in optuna_logger.handlers),
        warning_filters=tuple(warnings.filters),
        capture_warnings=_captures_warnings(),
        start_method=_worker_start_method(),
    )


def _setting(name: str, logger: logging.Logger) -> LoggerSetting:
    recipes = []
    for handler in logger.handlers:
        recipe = _recipe(handler)
        if recipe is not None:
            recipes.append(recipe)
    return LoggerSetting(
        name=name,
        level=logger.level,
        propagate=logger.propagate,
        disabled=logger.disabled,
        handlers=tuple(recipes),
    )


def _recipe(handler: logging.Handler) -> HandlerRecipe | None:
    if _is_optuna_default(handler):
        return None  # the worker's Optuna has its own (optuna_default_handler)
    formatter = handler.formatter
    fmt = datefmt = None
    style = "%"
    if formatter is not None:
        fmt = formatter._fmt
        datefmt = formatter.datefmt
        if isinstance(formatter._style, logging.StrFormatStyle):
            style = "{"
        elif isinstance(formatter._style, logging.StringTemplateStyle):
            style = "$"
    if isinstance(handler, logging.FileHandler):
        target = handler.baseFilename
    elif type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.stdout):
        target = "stderr" if handler.stream is sys.stderr else "stdout"
    else:
        return None
    return HandlerRecipe(target, handler.level, fmt, datefmt, style)


def _is_optuna_default(handler: logging.Handler) -> bool:
    from optuna import logging as optuna_logging

    return handler is getattr(optuna_logging, "_default_handler", None)


def _captures_warnings() -> bool:
    import warnings

    # logging.captureWarnings(True) routes warnings.showwarning to logging's own function.
    return getattr(warnings.showwarning, "__module__", "") == "logging"


def _worker_start_method() -> str | None:
    chosen = multiprocessing.get_start_method(allow_none=True)
    if chosen is not None:
        return chosen
    if "fork" in multiprocessing.get_all_start_methods() and sys.platform != "darwin":
        return "fork"
    return None
