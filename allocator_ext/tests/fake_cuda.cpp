// A fake CUDA driver (libcuda.so.1) for testing the pool's `cuda` backend on machines with no GPU:
// the driver functions the backend dlopens, over host memory, with a per-thread context stack.
// Calls that need a current context fail with CUDA_ERROR_INVALID_CONTEXT when none is current,
// so a test through it checks that the backend makes the primary context current. An event
// reports NOT_READY to the first query after each record, then success, so both the
// completed-event and the stream-wait paths run.
//
// Fault knobs (fake_cuda_set_fault): make cuMemAlloc or cuEventQuery return a given error code
// (e.g. 700, CUDA_ERROR_ILLEGAL_ADDRESS; 2, CUDA_ERROR_OUT_OF_MEMORY), as a poisoned context does.
//
//   g++ -std=c++17 -shared -fPIC -o libcuda.so.1 fake_cuda.cpp
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kOutOfMemory = 2;
constexpr int kNotInitialized = 3;
constexpr int kInvalidContext = 201;
constexpr int kNotReady = 600;
constexpr int kDevicesUnavailable = 46;
constexpr int kMaxFakeDevices = 8;
std::atomic<long> g_retains[kMaxFakeDevices];  // primary-context retains held, per device

int g_primary_ctx_storage = 0;
void* const kPrimary = &g_primary_ctx_storage;
std::atomic<bool> g_initialized{false};
std::atomic<long> g_calls_without_context{0};
std::atomic<long> g_stream_waits{0};
std::atomic<long> g_event_records{0};
std::atomic<std::uint64_t> g_mem_used{0};
constexpr std::uint64_t kDeviceBytes = 256ull << 20;

thread_local std::vector<void*> t_ctx_stack;

struct FakeEvent {
  bool recorded = false;
  int queries_until_ready = 0;
};

std::atomic<int> g_fault_alloc{0};        // error code cuMemAlloc returns; 0 = none
std::atomic<int> g_fault_event_query{0};  // error code cuEventQuery returns; 0 = none

std::mutex g_mu;
std::unordered_map<void*, std::uint64_t> g_allocs;

bool has_context() { return !t_ctx_stack.empty() && t_ctx_stack.back() == kPrimary; }

int need_context() {
  if (!g_initialized) return kNotInitialized;
  if (!has_context()) {
    g_calls_without_context += 1;
    return kInvalidContext;
  }
  return kSuccess;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int cuInit(unsigned) {
  g_initialized = true;
  return kSuccess;
}
__attribute__((visibility("default"))) int cuDeviceGet(int* dev, int ordinal) {
  // $FAKE_CUDA_DEVICES devices (default 1); they share the fake's memory and primary context.
  const char* n = std::getenv("FAKE_CUDA_DEVICES");
  if (ordinal < 0 || ordinal >= (n != nullptr ? std::atoi(n) : 1)) return kInvalidValue;
  *dev = ordinal;
  return kSuccess;
}
// Retains per device (fake_cuda_retains). A device listed in $FAKE_CUDA_EXCLUSIVE_BUSY (one digit
// per device, e.g. "2") is an exclusive-process GPU held by another process: retaining its primary
// context fails with CUDA_ERROR_DEVICES_UNAVAILABLE (46), as on such a GPU.
__attribute__((visibility("default"))) int cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  const char* busy = std::getenv("FAKE_CUDA_EXCLUSIVE_BUSY");
  for (const char* c = busy; c != nullptr && *c != 0; ++c) {
    if (*c - '0' == dev) return kDevicesUnavailable;
  }
  if (dev >= 0 && dev < kMaxFakeDevices) g_retains[dev] += 1;
  *ctx = kPrimary;
  return kSuccess;
}
__attribute__((visibility("default"))) int cuDevicePrimaryCtxRelease_v2(int dev) {
  if (dev >= 0 && dev < kMaxFakeDevices) g_retains[dev] -= 1;
  return kSuccess;
}
__attribute__((visibility("default"))) int cuCtxGetCurrent(void** ctx) {
  if (!g_initialized) return kNotInitialized;
  *ctx = t_ctx_stack.empty() ? nullptr : t_ctx_stack.back();
  return kSuccess;
}
__attribute__((visibility("default"))) int cuCtxPushCurrent_v2(void* ctx) {
  t_ctx_stack.push_back(ctx);
  return kSuccess;
}
__attribute__((visibility("default"))) int cuCtxPopCurrent_v2(void** ctx) {
  if (t_ctx_stack.empty()) return kInvalidContext;
  if (ctx != nullptr) *ctx = t_ctx_stack.back();
  t_ctx_stack.pop_back();
  return kSuccess;
}
__attribute__((visibility("default"))) int cuMemAlloc_v2(std::uint64_t* p, std::size_t n) {
  if (int r = need_context()) return r;
  if (int f = g_fault_alloc.load()) return f;
  if (g_mem_used + n > kDeviceBytes) return kOutOfMemory;
  void* m = std::aligned_alloc(512, (n + 511) / 512 * 512);
  if (m == nullptr) return kOutOfMemory;
  std::lock_guard<std::mutex> g(g_mu);
  g_allocs[m] = n;
  g_mem_used += n;
  *p = reinterpret_cast<std::uintptr_t>(m);
  return kSuccess;
}
__attribute__((visibility("default"))) int cuMemFree_v2(std::uint64_t p) {
  if (int r = need_context()) return r;
  void* m = reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.find(m);
  if (it == g_allocs.end()) return kInvalidValue;
  g_mem_used -= it->second;
  g_allocs.erase(it);
  std::free(m);
  return kSuccess;
}
__attribute__((visibility("default"))) int cuEventCreate(void** ev, unsigned flags) {
  if (int r = need_context()) return r;
  if (flags != 2) return kInvalidValue;  // the pool asks for CU_EVENT_DISABLE_TIMING
  *ev = new FakeEvent;
  return kSuccess;
}
__attribute__((visibility("default"))) int cuEventDestroy_v2(void* ev) {
  delete static_cast<FakeEvent*>(ev);
  return kSuccess;
}
__attribute__((visibility("default"))) int cuEventRecord(void* ev, void*) {
  if (int r = need_context()) return r;
  g_event_records += 1;
  auto* e = static_cast<FakeEvent*>(ev);
  e->recorded = true;
  e->queries_until_ready = 1;
  return kSuccess;
}
__attribute__((visibility("default"))) int cuEventQuery(void* ev) {
  if (int f = g_fault_event_query.load()) return f;
  auto* e = static_cast<FakeEvent*>(ev);
  if (e->queries_until_ready > 0) {
    e->queries_until_ready -= 1;
    return kNotReady;
  }
  return kSuccess;
}
__attribute__((visibility("default"))) int cuStreamWaitEvent(void*, void*, unsigned flags) {
  if (int r = need_context()) return r;
  if (flags != 0) return kInvalidValue;
  g_stream_waits += 1;
  return kSuccess;
}
__attribute__((visibility("default"))) int cuStreamSynchronize(void*) { return need_context(); }
__attribute__((visibility("default"))) int cuGetErrorString(int code, const char** s) {
  switch (code) {
    case kOutOfMemory: *s = "out of memory"; break;
    case 700: *s = "an illegal memory access was encountered"; break;
    case kDevicesUnavailable: *s = "all CUDA-capable devices are busy or unavailable"; break;
    case 710: *s = "device-side assert triggered"; break;
    default: *s = "fake CUDA error"; break;
  }
  return kSuccess;
}

// Test hooks.
__attribute__((visibility("default"))) long fake_cuda_retains(int dev) {
  return dev >= 0 && dev < kMaxFakeDevices ? g_retains[dev].load() : -1;
}
__attribute__((visibility("default"))) long fake_cuda_calls_without_context() {
  return g_calls_without_context.load();
}
__attribute__((visibility("default"))) long fake_cuda_stream_waits() { return g_stream_waits.load(); }
__attribute__((visibility("default"))) long fake_cuda_event_records() { return g_event_records.load(); }
__attribute__((visibility("default"))) std::uint64_t fake_cuda_mem_used() { return g_mem_used.load(); }
// where: 1 = cuMemAlloc, 2 = cuEventQuery; code 0 clears the fault.
__attribute__((visibility("default"))) void fake_cuda_set_fault(int where, int code) {
  if (where == 1) g_fault_alloc = code;
  if (where == 2) g_fault_event_query = code;
}

}  // extern "C"
