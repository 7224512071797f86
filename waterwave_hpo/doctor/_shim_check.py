"""The doctor's ``torch_shim`` check: the pool's torch shim compiles and links against this torch.

The shim (``allocator_ext/torch_shim/``) is what makes a pool OOM PyTorch's own
``c10::OutOfMemoryError`` and, on a CUDA build of torch, makes ``Tensor.record_stream`` reach the
pool. It is compiled at first CUDA use against the installed
torch's C++ headers, so a torch upgrade can break it (torch 2.14 made c10's headers C++20-only):
this check builds it from scratch, the CUDA variant on a CUDA build (linked to
``libtorch_cuda.so``; no GPU needed), loads it and drives its allocation entry point on the
simulated device. FAIL carries the compiler's message.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
import tempfile

import torch

from waterwave_hpo.doctor._report import CheckResult
from waterwave_hpo.doctor._report import CheckStatus

NAME = "torch_shim"
_MIB = 1 << 20
#: The pool library's last device slot (it has 64): the probe's simulated pool sits there, away
#: from any real device's pool.
_PROBE_DEVICE = 63
#: What ``waterwave_shim_probe`` returns for a ``c10::OutOfMemoryError``.
_TORCH_OOM = 1


def _fail(detail: str) -> CheckResult:
    return CheckResult(NAME, CheckStatus.FAIL, None, "", detail)


def _probe_oom(lib: ctypes.CDLL) -> int:
    """What the shim's malloc throws when a 2 MiB simulated pool is asked for 4 MiB."""
    from waterwave_hpo.memory import StreamAwarePool
    from waterwave_hpo.memory._internal import load_library

    lib.waterwave_shim_probe.restype = ctypes.c_int
    lib.waterwave_shim_probe.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    pool = StreamAwarePool(2 * _MIB, backend="sim")
    pool_lib = load_library()
    pool_lib.ww_torch_set_pool(_PROBE_DEVICE, pool._handle())
    try:
        return int(lib.waterwave_shim_probe(4 * _MIB, _PROBE_DEVICE, 1))
    finally:
        pool_lib.ww_torch_set_pool(_PROBE_DEVICE, None)
        pool.close()


def check_torch_shim() -> CheckResult:
    """Compile and link the torch shim against the installed torch, load it, probe its OOM.

    On a CUDA build of torch the CUDA variant (record-stream registration, linked to
    ``libtorch_cuda.so``) is built, and its absence is a FAIL naming why (no CUDA runtime
    headers, or the compiler's message). The figure is the compiler's wall time in seconds.
    """
    from waterwave_hpo.memory._internal import CXX_STANDARD
    from waterwave_hpo.memory._internal import compile_shim
    from waterwave_hpo.memory._internal import cuda_variant_missing
    from waterwave_hpo.memory._internal import load_library

    cuda_build = torch.version.cuda is not None
    if cuda_build:
        missing = cuda_variant_missing()
        if missing:
            return _fail(f"the CUDA variant of the shim cannot be built: {missing}")
    variant = (
        f"CUDA variant (CUDA {torch.version.cuda}, record_stream registration, libtorch_cuda)"
        if cuda_build
        else "CPU variant (torch is a CPU build)"
    )
    with tempfile.TemporaryDirectory(prefix="waterwave-doctor-") as tmp:
        built = compile_shim(Path(tmp) / "libwaterwave_torch_shim.so", with_record_stream=True)
        if not built.ok:
            return _fail(
                f"compiling the shim ({variant}) against torch {torch.__version__} failed "
                f"(exit {built.returncode}): {built.describe()}"
            )
        load_library()  # the shim links to the pool library: the same instance
        try:
            lib = ctypes.CDLL(str(Path(tmp) / "libwaterwave_torch_shim.so"))
        except OSError as exc:
            return _fail(f"the shim compiled but does not load: {exc}")
        lib.waterwave_shim_has_record_stream.restype = ctypes.c_int
        has_record_stream = bool(lib.waterwave_shim_has_record_stream())
        if has_record_stream != cuda_build:
            return _fail(f"built for the {variant} but record-stream = {has_record_stream}")
        thrown = _probe_oom(lib)
    flag = "-DWATERWAVE_SHIM_TORCH_CUDA"
    after = built.argv[built.argv.index(flag) + 1 :] if flag in built.argv else []
    includes = [a[2:] for a in after if a.startswith("-I")]
    headers = f"; CUDA headers from {', '.join(includes)}" if includes else ""
    oom = "is" if thrown == _TORCH_OOM else f"is NOT (the probe returned {thrown})"
    detail = (
        f"compiled (-std={CXX_STANDARD}) and linked against torch {torch.__version__}: the "
        f"{variant}{headers}; a pool OOM through it {oom} c10::OutOfMemoryError"
    )
    status = CheckStatus.PASS if thrown == _TORCH_OOM else CheckStatus.FAIL
    return CheckResult(NAME, status, round(built.seconds, 2), "s", detail)
