// The CUDA upstream: the driver API (libcuda.so.1), dlopen'ed at run time so that the library builds
// with a plain C++ compiler and no CUDA toolkit. CUstream and cudaStream_t are the same handle.
// Segments come from cuMemAlloc (backend "cuda") or from callbacks (backend "external": CuPy's
// allocator); events and stream waits always come from the driver.
//
// Every driver call runs with the device's primary context current (the one the CUDA runtime, and
// so PyTorch and CuPy, use): if the calling thread has another or none, it is pushed and popped.
// The primary context is retained at the first call that needs it, not when the upstream is made:
// a pass-through pool exists for every visible device (memory/_torch.py), and retaining a context
// costs about 0.3-0.5 GiB of device memory and fails on an exclusive-process GPU another process
// holds. So a device the study never allocates on keeps no context of ours.
#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda_driver_api.hpp"
#include "format_bytes.hpp"
#include "upstream.hpp"

namespace ww {

namespace {

using namespace cuda_api;  // NOLINT(build/namespaces): the driver's types and constants
using CUresult = cuda_api::Result;
using CUdevice = cuda_api::Device;
using CUcontext = cuda_api::Context;
using CUstream = cuda_api::StreamHandle;
using CUevent = cuda_api::EventHandle;
using CUdeviceptr = cuda_api::DevicePtr;

constexpr CUresult kOutOfMemory = kErrorOutOfMemory;
constexpr CUresult kNotReady = kErrorNotReady;

struct Driver {
  void* handle = nullptr;
  cuInit_t cuInit = nullptr;
  cuDeviceGet_t cuDeviceGet = nullptr;
  cuDevicePrimaryCtxRetain_t cuDevicePrimaryCtxRetain = nullptr;
  cuDevicePrimaryCtxRelease_t cuDevicePrimaryCtxRelease = nullptr;
  cuCtxGetCurrent_t cuCtxGetCurrent = nullptr;
  cuCtxPushCurrent_t cuCtxPushCurrent = nullptr;
  cuCtxPopCurrent_t cuCtxPopCurrent = nullptr;
  cuMemAlloc_t cuMemAlloc = nullptr;
  cuMemFree_t cuMemFree = nullptr;
  cuEventCreate_t cuEventCreate = nullptr;
  cuEventDestroy_t cuEventDestroy = nullptr;
  cuEventRecord_t cuEventRecord = nullptr;
  cuEventQuery_t cuEventQuery = nullptr;
  cuStreamWaitEvent_t cuStreamWaitEvent = nullptr;
  cuStreamSynchronize_t cuStreamSynchronize = nullptr;
  cuGetErrorString_t cuGetErrorString = nullptr;
};

template <typename F>
void load(Driver& d, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(d.handle, name));
  if (fn == nullptr) throw std::runtime_error(std::string("libcuda.so.1 has no symbol ") + name);
}

// Loaded once per process; never unloaded.
Driver& driver() {
  static Driver* d = [] {
    auto* drv = new Driver;
    drv->handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (drv->handle == nullptr) {
      const char* err = dlerror();
      delete drv;
      throw std::runtime_error(std::string("cannot load the CUDA driver libcuda.so.1: ") +
                               (err != nullptr ? err : "unknown error") +
                               " (is an NVIDIA driver installed?)");
    }
    load(*drv, drv->cuInit, "cuInit");
    load(*drv, drv->cuDeviceGet, "cuDeviceGet");
    load(*drv, drv->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    load(*drv, drv->cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    load(*drv, drv->cuCtxGetCurrent, "cuCtxGetCurrent");
    load(*drv, drv->cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    load(*drv, drv->cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    load(*drv, drv->cuMemAlloc, "cuMemAlloc_v2");
    load(*drv, drv->cuMemFree, "cuMemFree_v2");
    load(*drv, drv->cuEventCreate, "cuEventCreate");
    load(*drv, drv->cuEventDestroy, "cuEventDestroy_v2");
    load(*drv, drv->cuEventRecord, "cuEventRecord");
    load(*drv, drv->cuEventQuery, "cuEventQuery");
    load(*drv, drv->cuStreamWaitEvent, "cuStreamWaitEvent");
    load(*drv, drv->cuStreamSynchronize, "cuStreamSynchronize");
    load(*drv, drv->cuGetErrorString, "cuGetErrorString");
    return drv;
  }();
  return *d;
}

std::string error_string(Driver& d, CUresult r) {
  const char* s = nullptr;
  if (d.cuGetErrorString(r, &s) != kSuccess || s == nullptr) return "CUDA error " + std::to_string(r);
  return std::string(s) + " (" + std::to_string(r) + ")";
}

// Makes `ctx` current in this thread for the guard's lifetime if it is not already.
class ContextGuard {
 public:
  ContextGuard(Driver& d, CUcontext ctx) : d_(d) {
    CUcontext cur = nullptr;
    if (d_.cuCtxGetCurrent(&cur) != kSuccess || cur != ctx) {
      pushed_ = d_.cuCtxPushCurrent(ctx) == kSuccess;
    }
  }
  ~ContextGuard() {
    if (pushed_) {
      CUcontext popped = nullptr;
      d_.cuCtxPopCurrent(&popped);
    }
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  Driver& d_;
  bool pushed_ = false;
};

class CudaUpstream final : public Upstream {
 public:
  CudaUpstream(int device, SegmentAllocFn a, SegmentFreeFn f, void* ctx)
      : d_(driver()), ordinal_(device), seg_alloc_(a), seg_free_(f), cb_ctx_(ctx) {
    CUresult r = d_.cuInit(0);
    if (r != kSuccess) throw std::runtime_error("cuInit failed: " + error_string(d_, r));
    r = d_.cuDeviceGet(&device_, device);
    if (r != kSuccess) {
      throw std::runtime_error("no CUDA device " + std::to_string(device) + ": " +
                               error_string(d_, r));
    }
  }

  ~CudaUpstream() override {
    if (ctx_.load() != nullptr) d_.cuDevicePrimaryCtxRelease(device_);
  }

  void* alloc_segment(std::size_t nbytes, Stream stream) override {
    if (seg_alloc_ != nullptr) {
      return reinterpret_cast<void*>(static_cast<std::uintptr_t>(seg_alloc_(cb_ctx_, nbytes, stream)));
    }
    CUcontext ctx = context();
    if (ctx == nullptr) {
      set_upstream_error(retain_error());
      return nullptr;
    }
    ContextGuard g(d_, ctx);
    CUdeviceptr p = 0;
    CUresult r = d_.cuMemAlloc(&p, nbytes);
    if (r == kSuccess) return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
    // Only CUDA_ERROR_OUT_OF_MEMORY is out of memory. Anything else (an
    // illegal address left by a kernel, a device assert, a lost device) is a backend error with
    // the driver's message, so a dead context is never "retried with fewer neighbours".
    if (r != kOutOfMemory) {
      set_upstream_error("cuMemAlloc of " + format_bytes(nbytes) + " on CUDA device " +
                         std::to_string(ordinal_) + " failed: " + error_string(d_, r));
    }
    return nullptr;
  }

  std::string sticky_error() override {
    // Asked twice per allocation: a healthy device answers without a lock or a string copy.
    if (!has_sticky_.load(std::memory_order_acquire)) return std::string();
    std::lock_guard<std::mutex> g(sticky_mu_);
    return sticky_;
  }

  void free_segment(void* ptr, std::size_t nbytes) override {
    if (seg_free_ != nullptr) {
      seg_free_(cb_ctx_, reinterpret_cast<std::uintptr_t>(ptr), nbytes);
      return;
    }
    CUcontext ctx = context();  // retained: the segment came from cuMemAlloc in it
    if (ctx == nullptr) return;
    ContextGuard g(d_, ctx);
    d_.cuMemFree(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr)));
  }

  Event create_event() override {
    CUcontext ctx = context();
    if (ctx == nullptr) return 0;
    ContextGuard g(d_, ctx);
    CUevent e = nullptr;
    if (d_.cuEventCreate(&e, kEventDisableTiming) != kSuccess) return 0;
    return reinterpret_cast<Event>(e);
  }

  void destroy_event(Event ev) override {
    ContextGuard g(d_, context());  // an event exists only once the context was retained
    d_.cuEventDestroy(reinterpret_cast<CUevent>(ev));
  }

  bool record_event(Event ev, Stream stream) override {
    ContextGuard g(d_, context());
    return check("cuEventRecord", d_.cuEventRecord(reinterpret_cast<CUevent>(ev),
                                                   reinterpret_cast<CUstream>(stream)));
  }

  bool event_completed(Event ev) override {
    ContextGuard g(d_, context());
    CUresult r = d_.cuEventQuery(reinterpret_cast<CUevent>(ev));
    if (r == kSuccess) return true;
    // NOT_READY: pending. Any other error (e.g. CUDA_ERROR_ILLEGAL_ADDRESS: the context is
    // poisoned): pending too (never hand out memory on doubt), and the pool stops serving.
    if (r != kNotReady) check("cuEventQuery", r);
    return false;
  }

  bool stream_wait_event(Stream waiter, Event ev) override {
    ContextGuard g(d_, context());
    return check("cuStreamWaitEvent", d_.cuStreamWaitEvent(reinterpret_cast<CUstream>(waiter),
                                                           reinterpret_cast<CUevent>(ev), 0));
  }

  bool synchronize_stream(Stream stream) override {
    CUcontext ctx = context();
    if (ctx == nullptr) return false;
    ContextGuard g(d_, ctx);
    return check("cuStreamSynchronize",
                 d_.cuStreamSynchronize(reinterpret_cast<CUstream>(stream)));
  }

 private:
  // True on success; otherwise remembers the first failure as the sticky error.
  bool check(const char* what, CUresult r) {
    if (r == kSuccess) return true;
    std::lock_guard<std::mutex> g(sticky_mu_);
    if (sticky_.empty()) {
      sticky_ = std::string(what) + " on CUDA device " + std::to_string(ordinal_) +
                " failed: " + error_string(d_, r) + "; the CUDA context is unusable";
      has_sticky_.store(true, std::memory_order_release);
    }
    return false;
  }

  // The device's primary context, retained at the first call that needs it (see the file's
  // head); nullptr while not retained, or when retaining failed (retain_error() says why, and
  // the next call tries again: an exclusive-process GPU may be let go by its holder).
  CUcontext context() {
    CUcontext ctx = ctx_.load(std::memory_order_acquire);
    if (ctx != nullptr) return ctx;
    std::lock_guard<std::mutex> g(ctx_mu_);
    ctx = ctx_.load(std::memory_order_relaxed);
    if (ctx != nullptr) return ctx;
    CUresult r = d_.cuDevicePrimaryCtxRetain(&ctx, device_);
    if (r != kSuccess || ctx == nullptr) {
      retain_error_ = "cannot retain the primary context of CUDA device " +
                      std::to_string(ordinal_) + ": " + error_string(d_, r) +
                      " (an exclusive-process GPU held by another process refuses it)";
      return nullptr;
    }
    ctx_.store(ctx, std::memory_order_release);
    return ctx;
  }

  std::string retain_error() {
    std::lock_guard<std::mutex> g(ctx_mu_);
    return retain_error_;
  }

  Driver& d_;
  int ordinal_ = 0;
  std::mutex ctx_mu_;
  std::string retain_error_;  // under ctx_mu_
  std::mutex sticky_mu_;
  std::string sticky_;
  std::atomic<bool> has_sticky_{false};
  SegmentAllocFn seg_alloc_;
  SegmentFreeFn seg_free_;
  void* cb_ctx_;
  CUdevice device_ = 0;
  std::atomic<CUcontext> ctx_{nullptr};
};


}  // namespace

std::unique_ptr<Upstream> make_cuda_upstream(int device, SegmentAllocFn seg_alloc,
                                             SegmentFreeFn seg_free, void* ctx) {
  return std::make_unique<CudaUpstream>(device, seg_alloc, seg_free, ctx);
}

}  // namespace ww
