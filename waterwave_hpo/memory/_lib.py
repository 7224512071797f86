"""Loads ``libwaterwave_pool.so`` (the C++ core built from ``allocator_ext/``) with ctypes.

The library is a plain shared library with the ``extern "C"`` API of
``allocator_ext/include/waterwave_pool.h``; the declarations below mirror that header.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
from pathlib import Path

#: Environment variable naming a ``libwaterwave_pool.so`` to load instead of the installed one
#: (the sanitizer builds of ``.ci/sanitizers.sh`` use it).
LIBRARY_ENV_VAR = "WATERWAVE_HPO_POOL_LIBRARY"
LIBRARY_NAME = "libwaterwave_pool.so"


class Counters(ctypes.Structure):
    """``ww_counters``: byte and event counters of the pool, a stream or an account."""

    _fields_ = [
        ("allocated_bytes", ctypes.c_uint64),
        ("requested_bytes", ctypes.c_uint64),
        ("reserved_bytes", ctypes.c_uint64),
        ("peak_allocated_bytes", ctypes.c_uint64),
        ("peak_reserved_bytes", ctypes.c_uint64),
        ("num_allocs", ctypes.c_uint64),
        ("num_frees", ctypes.c_uint64),
        ("num_same_stream", ctypes.c_uint64),
        ("num_completed_event", ctypes.c_uint64),
        ("num_stream_wait", ctypes.c_uint64),
        ("num_new_segment", ctypes.c_uint64),
        ("num_stream_waits_issued", ctypes.c_uint64),
        ("num_ooms", ctypes.c_uint64),
        ("num_segments", ctypes.c_uint64),
        ("quota_bytes", ctypes.c_uint64),
        ("capacity_bytes", ctypes.c_uint64),
    ]


class DriverCountersStruct(ctypes.Structure):
    """``ww_driver_counters``: what the pool asked of its upstream (the driver) and its mutex."""

    _fields_ = [
        ("allocs", ctypes.c_uint64),
        ("frees", ctypes.c_uint64),
        ("segment_allocs", ctypes.c_uint64),
        ("segment_frees", ctypes.c_uint64),
        ("event_creates", ctypes.c_uint64),
        ("event_destroys", ctypes.c_uint64),
        ("event_records", ctypes.c_uint64),
        ("event_queries", ctypes.c_uint64),
        ("stream_waits", ctypes.c_uint64),
        ("stream_syncs", ctypes.c_uint64),
        ("lock_acquisitions", ctypes.c_uint64),
        ("lock_contended", ctypes.c_uint64),
        ("lock_wait_ns", ctypes.c_uint64),
        ("lock_hold_ns", ctypes.c_uint64),
        ("coalesce_scans", ctypes.c_uint64),
        ("cross_stream_searches", ctypes.c_uint64),
    ]


class TraceEntryStruct(ctypes.Structure):
    """``ww_trace_entry``: one thing the pool or the simulated device did."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("source", ctypes.c_int32),
        ("ptr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("requested", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("other_stream", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
        ("account", ctypes.c_int64),
    ]


class BlockInfoStruct(ctypes.Structure):
    """``ww_block_info``: one block of a segment, for snapshots."""

    _fields_ = [
        ("ptr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("segment_ptr", ctypes.c_uint64),
        ("segment_size", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("requested", ctypes.c_uint64),
        ("account", ctypes.c_int64),
        ("allocated", ctypes.c_int32),
        ("event_pending", ctypes.c_int32),
    ]


class HazardStruct(ctypes.Structure):
    """``ww_hazard``: a block handed to a stream while another stream's use was unordered."""

    _fields_ = [
        ("ptr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("other_stream", ctypes.c_uint64),
        ("use_seq", ctypes.c_uint64),
        ("completed", ctypes.c_uint64),
    ]


#: ``ww_segment_alloc_fn``: (ctx, nbytes, stream) -> pointer, 0 on failure.
SEGMENT_ALLOC_FN = ctypes.CFUNCTYPE(
    ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64
)
#: ``ww_segment_free_fn``: (ctx, pointer, nbytes).
SEGMENT_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64)

_P = ctypes.c_void_p
_U64 = ctypes.c_uint64
_I64 = ctypes.c_int64
_INT = ctypes.c_int

_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "ww_last_error": (ctypes.c_char_p, []),
    "ww_set_upstream_error": (None, [ctypes.c_char_p]),
    "ww_round_size": (_U64, [_U64]),
    "ww_pool_create": (_P, [_INT, _INT, _U64, SEGMENT_ALLOC_FN, SEGMENT_FREE_FN, _P]),
    "ww_pool_destroy": (None, [_P]),
    "ww_pool_allocate": (_INT, [_P, _U64, _U64, ctypes.POINTER(_U64), ctypes.POINTER(_INT)]),
    "ww_pool_free": (_INT, [_P, _U64, _U64, _INT]),
    "ww_pool_record_stream": (_INT, [_P, _U64, _U64]),
    "ww_pool_release_cached": (_U64, [_P]),
    "ww_pool_set_capacity": (None, [_P, _U64]),
    "ww_pool_stats": (None, [_P, ctypes.POINTER(Counters)]),
    "ww_pool_stream_stats": (None, [_P, _U64, ctypes.POINTER(Counters)]),
    "ww_pool_reset_peaks": (None, [_P]),
    "ww_pool_lock_stats": (None, [_P, ctypes.POINTER(_U64)]),
    "ww_pool_event_stats": (None, [_P, ctypes.POINTER(_U64)]),
    "ww_pool_set_torch_free_blocking": (None, [_P, _INT]),
    "ww_pool_driver_stats": (None, [_P, ctypes.POINTER(DriverCountersStruct)]),
    "ww_pool_reset_driver_stats": (None, [_P]),
    "ww_pool_set_profiling": (None, [_P, _INT]),
    "ww_pool_snapshot": (_U64, [_P, ctypes.POINTER(BlockInfoStruct), _U64]),
    "ww_account_open": (_I64, [_P]),
    "ww_account_close": (_INT, [_P, _I64]),
    "ww_account_bind": (_INT, [_P, _I64, _U64]),
    "ww_account_unbind": (_INT, [_P, _I64, _U64]),
    "ww_account_set_quota": (_INT, [_P, _I64, _U64]),
    "ww_account_stats": (_INT, [_P, _I64, ctypes.POINTER(Counters)]),
    "ww_stream_account": (_I64, [_P, _U64]),
    "ww_pool_set_tracing": (None, [_P, _INT]),
    "ww_trace_count": (_U64, [_P]),
    "ww_trace_read": (_U64, [_P, _U64, ctypes.POINTER(TraceEntryStruct), _U64]),
    "ww_trace_clear": (None, [_P]),
    "ww_sim_submit": (_I64, [_P, _U64]),
    "ww_sim_finish": (_INT, [_P, _U64, _INT]),
    "ww_sim_use": (_INT, [_P, _U64, _U64, _U64]),
    "ww_sim_hazards": (_I64, [_P, ctypes.POINTER(HazardStruct), _U64]),
    "ww_torch_set_pool": (_INT, [_INT, _P]),
    "ww_torch_set_unavailable": (_INT, [_INT, ctypes.c_char_p]),
}


def library_path() -> Path:
    """The path of the pool library this process loads.

    Returns:
        ``$WATERWAVE_HPO_POOL_LIBRARY`` if set; else ``waterwave_hpo/_lib/libwaterwave_pool.so``
        next to the package (a regular install); else the one the installed distribution
        lists (an editable install, ``pip install -e .``: the sources stay in the checkout and
        scikit-build-core puts the built library in site-packages).
    """
    override = os.environ.get(LIBRARY_ENV_VAR)
    if override:
        return Path(override)
    beside = Path(__file__).resolve().parent.parent / "_lib" / LIBRARY_NAME
    if beside.is_file():
        return beside
    try:
        distribution = importlib.metadata.distribution("waterwave-hpo")
    except importlib.metadata.PackageNotFoundError:
        return beside
    for file in distribution.files or ():
        if file.name == LIBRARY_NAME:
            return Path(str(distribution.locate_file(file))).resolve()
    return beside


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL:
    """Loads the pool library once per process and declares its C signatures.

    ctypes releases the GIL around every call into it, so trial threads allocate in parallel.

    Returns:
        The loaded library.

    Raises:
        ImportError: The library file does not exist (the package was not built and installed)
            or cannot be loaded.
    """
    path = library_path()
    if os.environ.get(LIBRARY_ENV_VAR) and path.is_file():
        _check_private(path)
    if not path.is_file():
        source = (
            f"${LIBRARY_ENV_VAR}" if os.environ.get(LIBRARY_ENV_VAR) else "the installed package"
        )
        raise ImportError(
            f"The waterwave_hpo memory pool library {path} (from {source}) does not exist. "
            "It is built from allocator_ext/ by the package build: reinstall with "
            "`pip install .` from the repository root (a plain source checkout on sys.path has "
            f"no built library), or set {LIBRARY_ENV_VAR} to a built libwaterwave_pool.so."
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise ImportError(
            f"Cannot load the waterwave_hpo memory pool library {path}: {exc}. "
            "Rebuild it with `pip install .` from the repository root."
        ) from exc
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _check_private(path: Path) -> None:
    """Refuse a pool library that another user could have written.

    Refuse a library named by ``$WATERWAVE_HPO_POOL_LIBRARY`` that another user could have
    written: loading it runs its code in this process.

    Raises:
        ImportError: The file is not owned by this user (or root), or it or its directory is
            writable by group or others (a directory with the sticky bit, like ``/tmp``, may be).
    """
    import stat

    allowed_owners = {os.getuid(), 0}
    file_stat = path.stat()
    dir_stat = path.resolve().parent.stat()
    problem = None
    if file_stat.st_uid not in allowed_owners:
        problem = f"it is owned by uid {file_stat.st_uid}, not by you (uid {os.getuid()}) or root"
    elif file_stat.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"it is writable by group or others (mode {stat.filemode(file_stat.st_mode)})"
    elif dir_stat.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not dir_stat.st_mode & stat.S_ISVTX:
        problem = (
            f"its directory is writable by group or others without the sticky bit (mode "
            f"{stat.filemode(dir_stat.st_mode)})"
        )
    if problem is not None:
        raise ImportError(
            f"${LIBRARY_ENV_VAR}={path} is not loaded: {problem}, so another user could put "
            "their code in this process. Build or copy the library into a directory only you "
            "can write (chmod go-w on the file and its directory), or unset the variable to "
            "load the installed one."
        )


def last_error() -> str:
    """The calling thread's last error message from the library (empty if none)."""
    raw = load_library().ww_last_error()
    return raw.decode("utf-8", "replace") if raw else ""
