"""is_out_of_memory: which errors count as running out of device memory."""

from __future__ import annotations

import torch

from waterwave_hpo.executor import is_out_of_memory


def test_torch_out_of_memory_error() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))


def test_runtime_error_with_cuda_oom_message() -> None:
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))


def test_wrapped_oom_is_found_through_the_cause_chain() -> None:
    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError as inner:
            raise ValueError("training step failed") from inner
    except ValueError as outer:
        assert is_out_of_memory(outer)


def test_other_errors_are_not_oom() -> None:
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("host out of memory"))


def test_cublas_and_cudnn_allocation_failures_are_out_of_memory() -> None:
    cublas = RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    )
    cudnn = RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")
    assert is_out_of_memory(cublas)
    assert is_out_of_memory(cudnn)
    assert not is_out_of_memory(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"))
