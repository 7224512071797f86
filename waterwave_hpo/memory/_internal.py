"""What the memory package offers the project's other packages beyond its public facade.

The executor runs CuPy work on a trial's stream and pool and leases device memory to its
worker processes (the per-GPU broker's book, shared with the cluster's ``shared_gpu()``);
``waterwave-hpo doctor`` loads the C++ library, installs PyTorch's allocator guards and
compiles the torch shim. They import these from here only. Not part of the
public API.
"""

from __future__ import annotations

from waterwave_hpo.memory._cupy import cupy_on_stream
from waterwave_hpo.memory._leases import LeaseBook
from waterwave_hpo.memory._leases import LeaseStats
from waterwave_hpo.memory._leases import MemoryLease
from waterwave_hpo.memory._lib import load_library
from waterwave_hpo.memory._shim import CXX_STANDARD
from waterwave_hpo.memory._shim import build_shim
from waterwave_hpo.memory._shim import compile_shim
from waterwave_hpo.memory._shim import cuda_variant_missing
from waterwave_hpo.memory._torch_api import install_guards
from waterwave_hpo.memory._torch_api import remove_guards

__all__ = [
    "CXX_STANDARD",
    "LeaseBook",
    "LeaseStats",
    "MemoryLease",
    "build_shim",
    "compile_shim",
    "cuda_variant_missing",
    "cupy_on_stream",
    "install_guards",
    "load_library",
    "remove_guards",
]
