// Compile-time check that every CUDA driver function the `cuda` upstream dlopens has, in
// src/cuda_driver_api.hpp, exactly the type cuda.h declares for the symbol it is loaded from.
// Built only with -DWATERWAVE_CHECK_CUDA_H=ON, where cuda.h exists
// (tests/memory/test_cuda_headers.py skips with the reason elsewhere); nothing runs.
#define WATERWAVE_CUDA_H_CHECK 1
#include <type_traits>

#include "cuda_driver_api.hpp"

namespace api = ww::cuda_api;

#define WW_SAME(symbol, type)                                         \
  static_assert(std::is_same<decltype(&::symbol), api::type>::value, \
                #symbol " in cuda.h differs from ww::cuda_api::" #type)

WW_SAME(cuInit, cuInit_t);
WW_SAME(cuDeviceGet, cuDeviceGet_t);
WW_SAME(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain_t);
WW_SAME(cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease_t);
WW_SAME(cuCtxGetCurrent, cuCtxGetCurrent_t);
WW_SAME(cuCtxPushCurrent_v2, cuCtxPushCurrent_t);
WW_SAME(cuCtxPopCurrent_v2, cuCtxPopCurrent_t);
WW_SAME(cuMemAlloc_v2, cuMemAlloc_t);
WW_SAME(cuMemFree_v2, cuMemFree_t);
WW_SAME(cuEventCreate, cuEventCreate_t);
WW_SAME(cuEventDestroy_v2, cuEventDestroy_t);
WW_SAME(cuEventRecord, cuEventRecord_t);
WW_SAME(cuEventQuery, cuEventQuery_t);
WW_SAME(cuStreamWaitEvent, cuStreamWaitEvent_t);
WW_SAME(cuStreamSynchronize, cuStreamSynchronize_t);
WW_SAME(cuGetErrorString, cuGetErrorString_t);

// The stand-ins of the normal build (no cuda.h) must be ABI-equal to cuda.h's types.
static_assert(sizeof(CUresult) == sizeof(int) && alignof(CUresult) == alignof(int), "CUresult");
static_assert(std::is_same<CUdevice, int>::value, "CUdevice");
static_assert(std::is_pointer<CUcontext>::value && std::is_pointer<CUstream>::value &&
                  std::is_pointer<CUevent>::value,
              "handles are pointers");
static_assert(std::is_same<CUdeviceptr, unsigned long long>::value, "CUdeviceptr");  // NOLINT
static_assert(CUDA_SUCCESS == api::kSuccess, "CUDA_SUCCESS");
static_assert(CUDA_ERROR_OUT_OF_MEMORY == api::kErrorOutOfMemory, "CUDA_ERROR_OUT_OF_MEMORY");
static_assert(CUDA_ERROR_NOT_READY == api::kErrorNotReady, "CUDA_ERROR_NOT_READY");
static_assert(CU_EVENT_DISABLE_TIMING == api::kEventDisableTiming, "CU_EVENT_DISABLE_TIMING");

int ww_cuda_h_check_anchor = 0;
