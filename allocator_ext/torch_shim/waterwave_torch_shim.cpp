// The torch-facing shim of the stream-aware pool: the allocator
// functions PyTorch's CUDAPluggableAllocator loads when the shim could be built, compiled against
// the headers of the torch that runs (torch/include) and linked to its libc10.so.
//
// 1.2: a pool OOM is thrown as c10::OutOfMemoryError (c10/util/Exception.h), the type PyTorch's
//      own recovery catches (cuDNN v8 retries with a smaller workspace on it) and that its Python
//      bindings raise as torch.OutOfMemoryError. The message keeps the WATERWAVE_POOL_OOM marker, so
//      waterwave_hpo.memory.translate_oom still recognises it on paths that lose the type.
//      Other failures (a backend error, no pool for the device) are a plain c10::Error: never OOM.
// 1.4: with WATERWAVE_SHIM_TORCH_CUDA (a CUDA build of torch, linked to libtorch_cuda.so), the
//      pool's record-stream hook is registered with PyTorch's pluggable allocator
//      (CUDAPluggableAllocator::set_record_stream_fn, torch/csrc/cuda/CUDAPluggableAllocator.h),
//      so Tensor.record_stream (also called by autograd when a gradient crosses streams) reaches
//      the pool: a block used on several streams is not handed out until every use completed.
//
// Built at first CUDA use by waterwave_hpo/memory/_shim.py (or by a test), never at install: the
// package build has no torch. Entry points mirror torch/csrc/cuda/CUDAPluggableAllocator.h:
// alloc_fn void*(size_t, int device, cudaStream_t), free_fn void(void*, size_t, int, cudaStream_t).
#include <c10/util/Exception.h>

#include <cstddef>
#include <string>

#include "waterwave_pool.h"

#ifdef WATERWAVE_SHIM_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#endif

namespace {

// Throws the pool's failure `status` (message in ww_last_error()) as PyTorch's own type.
[[noreturn]] void throw_torch_error(int status) {
  const std::string msg = ww_last_error();
  if (status == WW_OOM_CAPACITY || status == WW_OOM_QUOTA || status == WW_OOM_UPSTREAM) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  TORCH_CHECK(false, msg);
  __builtin_unreachable();
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* waterwave_shim_malloc(size_t size, int device,
                                                                   void* stream) {
  void* p = nullptr;
  int status = waterwave_torch_try_malloc(size, device, stream, &p);
  if (status != WW_OK) throw_torch_error(status);
  return p;
}

__attribute__((visibility("default"))) void waterwave_shim_free(void* ptr, size_t size, int device,
                                                                void* stream) {
  waterwave_torch_free(ptr, size, device, stream);
}

// What waterwave_shim_malloc throws, for a test on a machine without CUDA: 0 nothing (the block
// is freed again), 1 c10::OutOfMemoryError, 2 another c10::Error, 3 anything else.
__attribute__((visibility("default"))) int waterwave_shim_probe(size_t size, int device,
                                                                void* stream) {
  try {
    void* p = waterwave_shim_malloc(size, device, stream);
    waterwave_shim_free(p, size, device, stream);
    return 0;
  } catch (const c10::OutOfMemoryError&) {
    return 1;
  } catch (const c10::Error&) {
    return 2;
  } catch (...) {
    return 3;
  }
}

// 1 if this shim was built with the record-stream registration (a CUDA build of torch).
__attribute__((visibility("default"))) int waterwave_shim_has_record_stream(void) {
#ifdef WATERWAVE_SHIM_TORCH_CUDA
  return 1;
#else
  return 0;
#endif
}

// Registers the pool's record-stream hook with PyTorch's current CUDA allocator, which must be the
// CUDAPluggableAllocator made from this shim. 0 on success, -1 if the current allocator is not a
// pluggable one, -2 if the shim was built without torch's CUDA library.
__attribute__((visibility("default"))) int waterwave_shim_register_record_stream(void) {
#ifdef WATERWAVE_SHIM_TORCH_CUDA
  auto* current = c10::cuda::CUDACachingAllocator::get();
  auto* pluggable =
      dynamic_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator*>(current);
  if (pluggable == nullptr) return -1;
  pluggable->set_record_stream_fn(
      [](void* ptr, cudaStream_t stream) { waterwave_torch_record_stream(ptr, stream); });
  return 0;
#else
  return -2;
#endif
}

}  // extern "C"
