// The CUDA driver API functions the `cuda` upstream dlopens (libcuda.so.1), as function-pointer
// types. Without the CUDA toolkit (the normal build) the driver's types are spelled with ABI-equal
// stand-ins; with WATERWAVE_CUDA_H_CHECK (allocator_ext/tests/cuda_h_check.cpp, CMake option
// WATERWAVE_CHECK_CUDA_H) they are cuda.h's own, and every type below is static_assert'ed equal
// to decltype(&the cuda.h function), so a signature that drifts from cuda.h fails to compile.
#pragma once

#include <cstddef>

#ifdef WATERWAVE_CUDA_H_CHECK
#include <cuda.h>
#endif

namespace ww::cuda_api {

#ifdef WATERWAVE_CUDA_H_CHECK
using Result = ::CUresult;
using Device = ::CUdevice;
using Context = ::CUcontext;
using StreamHandle = ::CUstream;
using EventHandle = ::CUevent;
using DevicePtr = ::CUdeviceptr;
#else
using Result = int;                    // enum cudaError_enum
using Device = int;                    // CUdevice
using Context = void*;                 // CUctx_st*
using StreamHandle = void*;            // CUstream_st*, the same handle as cudaStream_t
using EventHandle = void*;             // CUevent_st*
using DevicePtr = unsigned long long;  // NOLINT(runtime/int): CUdeviceptr_v2
#endif

// The symbol each is loaded from (dlsym) is named in upstream_cuda.cpp, and checked by name there.
using cuInit_t = Result (*)(unsigned int);
using cuDeviceGet_t = Result (*)(Device*, int);
using cuDevicePrimaryCtxRetain_t = Result (*)(Context*, Device);
using cuDevicePrimaryCtxRelease_t = Result (*)(Device);              // cuDevicePrimaryCtxRelease_v2
using cuCtxGetCurrent_t = Result (*)(Context*);
using cuCtxPushCurrent_t = Result (*)(Context);                      // cuCtxPushCurrent_v2
using cuCtxPopCurrent_t = Result (*)(Context*);                      // cuCtxPopCurrent_v2
using cuMemAlloc_t = Result (*)(DevicePtr*, std::size_t);            // cuMemAlloc_v2
using cuMemFree_t = Result (*)(DevicePtr);                           // cuMemFree_v2
using cuEventCreate_t = Result (*)(EventHandle*, unsigned int);
using cuEventDestroy_t = Result (*)(EventHandle);                    // cuEventDestroy_v2
using cuEventRecord_t = Result (*)(EventHandle, StreamHandle);
using cuEventQuery_t = Result (*)(EventHandle);
using cuStreamWaitEvent_t = Result (*)(StreamHandle, EventHandle, unsigned int);
using cuStreamSynchronize_t = Result (*)(StreamHandle);
using cuGetErrorString_t = Result (*)(Result, const char**);

// The driver's constants the pool relies on (checked against cuda.h by the same test).
constexpr int kSuccess = 0;                // CUDA_SUCCESS
constexpr int kErrorOutOfMemory = 2;       // CUDA_ERROR_OUT_OF_MEMORY: the only "out of memory"
constexpr int kErrorNotReady = 600;        // CUDA_ERROR_NOT_READY
constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING

}  // namespace ww::cuda_api
