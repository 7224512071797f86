// The extern "C" surface of libwaterwave_pool.so (declared in include/waterwave_pool.h), loaded from
// Python with ctypes, and the PyTorch pluggable-allocator entry points.
#include <array>
#include <atomic>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>

#include "pool.hpp"
#include "upstream.hpp"
#include "waterwave_pool.h"

namespace ww {

namespace {
thread_local std::string g_last_error;
thread_local std::string g_upstream_error;
}  // namespace

void set_last_error(const std::string& msg) { g_last_error = msg; }
void set_upstream_error(const std::string& msg) { g_upstream_error = msg; }
std::string take_upstream_error() {
  std::string out;
  out.swap(g_upstream_error);
  return out;
}

namespace {

Pool* as_pool(void* p) { return static_cast<Pool*>(p); }

constexpr int kMaxDevices = 64;
std::array<std::atomic<Pool*>, kMaxDevices> g_torch_pools{};
std::mutex g_unavailable_mu;
std::array<std::string, kMaxDevices> g_unavailable;  // why a device has no pool (under the mutex)

// Thrown by waterwave_torch_malloc when the pool is exhausted. PyTorch's pluggable allocator does
// not check alloc_fn's result for nullptr (torch/csrc/cuda/CUDAPluggableAllocator.cpp, malloc:
// a null data pointer would reach kernels), and it turns C++ exceptions from alloc_fn into a
// RuntimeError carrying what(). waterwave_hpo.memory.translate_oom recognises the marker and
// re-raises torch.cuda.OutOfMemoryError (pytorch/pytorch issue 133280). A std::runtime_error, not
// std::bad_alloc: pybind11 would turn the latter into a bare MemoryError on some bindings.
// The torch-facing shim (allocator_ext/torch_shim/) is the allocator PyTorch
// loads where it can be built: it throws c10::OutOfMemoryError itself, so PyTorch's internal
// fallbacks (cuDNN's smaller workspace) run. This class remains for the plain entry points.
class OutOfMemory : public std::runtime_error {
 public:
  explicit OutOfMemory(const std::string& msg) : std::runtime_error(msg) {}
};

}  // namespace

}  // namespace ww

using ww::as_pool;

extern "C" {

const char* ww_last_error(void) { return ww::g_last_error.c_str(); }

void ww_set_upstream_error(const char* message) {
  ww::set_upstream_error(message != nullptr && *message != 0 ? message : "unknown upstream error");
}

uint64_t ww_round_size(uint64_t nbytes) { return ww::round_size(nbytes); }

void* ww_pool_create(int backend, int device, uint64_t capacity_bytes, ww_segment_alloc_fn seg_alloc,
                     ww_segment_free_fn seg_free, void* ctx) {
  try {
    auto trace = std::make_unique<ww::Trace>();
    std::unique_ptr<ww::Upstream> up;
    switch (backend) {
      case WW_BACKEND_SIM:
        up = ww::make_sim_upstream(trace.get(), capacity_bytes, nullptr, nullptr, nullptr);
        trace->set_enabled(true);
        break;
      case WW_BACKEND_SIM_EXTERNAL:
        if (seg_alloc == nullptr || seg_free == nullptr) {
          ww::set_last_error("backend sim_external needs segment callbacks");
          return nullptr;
        }
        up = ww::make_sim_upstream(trace.get(), capacity_bytes, seg_alloc, seg_free, ctx);
        trace->set_enabled(true);
        break;
      case WW_BACKEND_CUDA:
        up = ww::make_cuda_upstream(device, nullptr, nullptr, nullptr);
        break;
      case WW_BACKEND_EXTERNAL:
        if (seg_alloc == nullptr || seg_free == nullptr) {
          ww::set_last_error("backend external needs segment callbacks");
          return nullptr;
        }
        up = ww::make_cuda_upstream(device, seg_alloc, seg_free, ctx);
        break;
      default:
        ww::set_last_error("unknown backend " + std::to_string(backend));
        return nullptr;
    }
    return new ww::Pool(std::move(up), std::move(trace), capacity_bytes);
  } catch (const std::exception& e) {
    ww::set_last_error(e.what());
    return nullptr;
  }
}

void ww_pool_destroy(void* pool) {
  for (auto& slot : ww::g_torch_pools) {
    ww::Pool* expected = as_pool(pool);
    slot.compare_exchange_strong(expected, nullptr);
  }
  delete as_pool(pool);
}

int ww_pool_allocate(void* pool, uint64_t nbytes, uint64_t stream, uint64_t* out_ptr,
                     int* out_source) {
  std::uintptr_t p = 0;
  int src = 0;
  int r = as_pool(pool)->allocate(nbytes, stream, &p, &src);
  *out_ptr = p;
  *out_source = src;
  return r;
}

int ww_pool_free(void* pool, uint64_t ptr, uint64_t stream, int has_stream) {
  return as_pool(pool)->free(ptr, stream, has_stream != 0);
}

int ww_pool_record_stream(void* pool, uint64_t ptr, uint64_t stream) {
  return as_pool(pool)->record_stream(ptr, stream);
}

uint64_t ww_pool_release_cached(void* pool) { return as_pool(pool)->release_cached(); }

void ww_pool_set_capacity(void* pool, uint64_t capacity_bytes) {
  as_pool(pool)->set_capacity(capacity_bytes);
}

void ww_pool_stats(void* pool, ww_counters* out) { as_pool(pool)->stats(out); }

void ww_pool_stream_stats(void* pool, uint64_t stream, ww_counters* out) {
  as_pool(pool)->stream_stats(stream, out);
}

void ww_pool_reset_peaks(void* pool) { as_pool(pool)->reset_peaks(); }

void ww_pool_lock_stats(void* pool, uint64_t* out6) { as_pool(pool)->lock_stats(out6); }

void ww_pool_event_stats(void* pool, uint64_t* out2) { as_pool(pool)->event_stats(out2); }

void ww_pool_driver_stats(void* pool, ww_driver_counters* out) {
  as_pool(pool)->driver_stats(out);
}

void ww_pool_reset_driver_stats(void* pool) { as_pool(pool)->reset_driver_stats(); }

void ww_pool_set_profiling(void* pool, int enabled) { as_pool(pool)->set_profiling(enabled != 0); }

void ww_pool_set_torch_free_blocking(void* pool, int blocking) {
  as_pool(pool)->set_blocking_torch_free(blocking != 0);
}

uint64_t ww_pool_snapshot(void* pool, ww_block_info* out, uint64_t max_entries) {
  return as_pool(pool)->snapshot(out, max_entries);
}

int64_t ww_account_open(void* pool) { return as_pool(pool)->account_open(); }
int ww_account_close(void* pool, int64_t account) { return as_pool(pool)->account_close(account); }
int ww_account_bind(void* pool, int64_t account, uint64_t stream) {
  return as_pool(pool)->account_bind(account, stream);
}
int ww_account_unbind(void* pool, int64_t account, uint64_t stream) {
  return as_pool(pool)->account_unbind(account, stream);
}
int ww_account_set_quota(void* pool, int64_t account, uint64_t quota_bytes) {
  return as_pool(pool)->account_set_quota(account, quota_bytes);
}
int ww_account_stats(void* pool, int64_t account, ww_counters* out) {
  return as_pool(pool)->account_stats(account, out);
}
int64_t ww_stream_account(void* pool, uint64_t stream) {
  return as_pool(pool)->stream_account(stream);
}

void ww_pool_set_tracing(void* pool, int enabled) { as_pool(pool)->trace()->set_enabled(enabled != 0); }
uint64_t ww_trace_count(void* pool) { return as_pool(pool)->trace()->count(); }
uint64_t ww_trace_read(void* pool, uint64_t first, ww_trace_entry* out, uint64_t max_entries) {
  return as_pool(pool)->trace()->read(first, out, max_entries);
}
void ww_trace_clear(void* pool) { as_pool(pool)->trace()->clear(); }

int64_t ww_sim_submit(void* pool, uint64_t stream) {
  return ww::sim_submit(as_pool(pool)->upstream(), stream);
}

int ww_sim_finish(void* pool, uint64_t stream, int all_streams) {
  return ww::sim_finish(as_pool(pool)->upstream(), stream, all_streams != 0) ? 0 : -1;
}

int ww_sim_use(void* pool, uint64_t ptr, uint64_t size, uint64_t stream) {
  return ww::sim_use(as_pool(pool)->upstream(), ptr, size, stream) ? 0 : -1;
}

int64_t ww_sim_hazards(void* pool, ww_hazard* out, uint64_t max_entries) {
  ww::Upstream* up = as_pool(pool)->upstream();
  if (up == nullptr || !up->is_sim()) return -1;
  return static_cast<int64_t>(ww::sim_hazards(up, out, max_entries));
}

int ww_torch_set_pool(int device, void* pool) {
  if (device < 0 || device >= ww::kMaxDevices) {
    ww::set_last_error("device " + std::to_string(device) + " out of range");
    return WW_INVALID;
  }
  ww::g_torch_pools[device].store(as_pool(pool));
  return WW_OK;
}

int ww_torch_set_unavailable(int device, const char* reason) {
  if (device < 0 || device >= ww::kMaxDevices) {
    ww::set_last_error("device " + std::to_string(device) + " out of range");
    return WW_INVALID;
  }
  std::lock_guard<std::mutex> g(ww::g_unavailable_mu);
  ww::g_unavailable[device] = reason != nullptr ? reason : "";
  return WW_OK;
}

int waterwave_torch_try_malloc(size_t size, int device, void* stream, void** out) {
  *out = nullptr;
  if (size == 0) return WW_OK;  // as PyTorch's own caching allocator: no block for 0 bytes
  ww::Pool* pool = (device >= 0 && device < ww::kMaxDevices) ? ww::g_torch_pools[device].load()
                                                              : nullptr;
  if (pool == nullptr) {
    // Not an OOM: retrying with fewer neighbours cannot help.
    std::string why;
    if (device >= 0 && device < ww::kMaxDevices) {
      std::lock_guard<std::mutex> g(ww::g_unavailable_mu);
      why = ww::g_unavailable[device];
    }
    ww::set_last_error("WATERWAVE_POOL_NO_POOL: no waterwave pool is installed for CUDA device " +
                       std::to_string(device) +
                       (why.empty() ? std::string() : " (" + why + ")") +
                       ", and PyTorch's allocator is swapped process-wide; call "
                       "waterwave_hpo.memory.use_pool(StreamAwarePool(device=" +
                       std::to_string(device) + ")) before CUDA's first allocation");
    return WW_NO_POOL;
  }
  std::uintptr_t p = 0;
  int src = 0;
  int r = pool->allocate(size, reinterpret_cast<std::uintptr_t>(stream), &p, &src);
  if (r == WW_OK) {
    *out = reinterpret_cast<void*>(p);
  } else if (r == WW_BACKEND_ERROR) {
    ww::set_last_error("WATERWAVE_POOL_BACKEND_ERROR: CUDA error on device " +
                       std::to_string(device) + ": " + ww::g_last_error);
  } else {
    ww::set_last_error("WATERWAVE_POOL_OOM: CUDA out of memory on device " +
                       std::to_string(device) + ": " + ww::g_last_error);
  }
  return r;
}

// Matches torch/csrc/cuda/CUDAPluggableAllocator.h: alloc_fn is
// std::function<void*(size_t size, int device, cudaStream_t stream)>.
void* waterwave_torch_malloc(size_t size, int device, void* stream) {
  void* p = nullptr;
  int r = waterwave_torch_try_malloc(size, device, stream, &p);
  if (r == WW_OK) return p;
  if (r == WW_OOM_CAPACITY || r == WW_OOM_QUOTA || r == WW_OOM_UPSTREAM) {
    throw ww::OutOfMemory(ww::g_last_error);
  }
  throw std::runtime_error(ww::g_last_error);  // no OOM marker: a backend error or no pool
}

// Matches torch/csrc/cuda/CUDAPluggableAllocator.h: free_fn is
// std::function<void(void* ptr, size_t size, int device, cudaStream_t stream)>; PyTorch passes the
// stream the block was allocated on. Never throws (called from destructors).
void waterwave_torch_free(void* ptr, size_t size, int device, void* stream) {
  (void)size;
  if (ptr == nullptr) return;
  ww::Pool* pool = (device >= 0 && device < ww::kMaxDevices) ? ww::g_torch_pools[device].load()
                                                              : nullptr;
  if (pool == nullptr) return;
  // PyTorch calls this with the GIL held (tensor deallocation): never wait for the pool's mutex.
  pool->free_nonblocking(reinterpret_cast<std::uintptr_t>(ptr),
                         reinterpret_cast<std::uintptr_t>(stream));
}

// For CUDAPluggableAllocator's record_stream hook (set_record_stream_fn(void*, cudaStream_t)),
// where the PyTorch build exposes it; otherwise called from Python via ww_pool_record_stream.
void waterwave_torch_record_stream(void* ptr, void* stream) {
  for (auto& slot : ww::g_torch_pools) {
    ww::Pool* pool = slot.load();
    if (pool != nullptr &&
        pool->record_stream(reinterpret_cast<std::uintptr_t>(ptr),
                            reinterpret_cast<std::uintptr_t>(stream)) == WW_OK) {
      return;
    }
  }
}

}  // extern "C"
