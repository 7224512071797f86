// Where segments and synchronization come from (RMM's "upstream" idea): the CUDA driver, callbacks
// (CuPy), or a simulated device. The block-level logic in pool.cpp is the same for all of them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "waterwave_pool.h"

namespace ww {

using Stream = std::uint64_t;
using Event = std::uint64_t;  // opaque backend handle; 0 = none

// The pool's ordered log of what it did (allocations, frees, waits) and, for the sim backend, what
// the simulated GPU did (submits, finishes). Its own lock; appended under the pool's lock or the
// sim's lock (lock order: pool -> sim -> trace).
class Trace {
 public:
  void set_enabled(bool on) {
    std::lock_guard<std::mutex> g(mu_);
    enabled_.store(on, std::memory_order_release);
  }
  bool enabled() const { return enabled_.load(std::memory_order_acquire); }
  // Called for every allocation and free: with tracing off (the default) it takes no lock.
  void add(const ww_trace_entry& e) {
    if (!enabled_.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> g(mu_);
    if (enabled_.load(std::memory_order_relaxed)) entries_.push_back(e);
  }
  std::uint64_t count() const {
    std::lock_guard<std::mutex> g(mu_);
    return entries_.size();
  }
  std::uint64_t read(std::uint64_t first, ww_trace_entry* out, std::uint64_t max) const {
    std::lock_guard<std::mutex> g(mu_);
    std::uint64_t n = 0;
    for (std::uint64_t i = first; i < entries_.size() && n < max; ++i, ++n) out[n] = entries_[i];
    return n;
  }
  void clear() {
    std::lock_guard<std::mutex> g(mu_);
    entries_.clear();
  }

 private:
  mutable std::mutex mu_;
  std::atomic<bool> enabled_{false};
  std::vector<ww_trace_entry> entries_;
};

// The calling thread's upstream error: an upstream whose alloc_segment fails for any reason other
// than "out of memory" (an illegal address, a device assert, a lost device) sets it before it
// returns nullptr; the pool then reports WW_BACKEND_ERROR with this message instead of an OOM.
// CUDA: only CUDA_ERROR_OUT_OF_MEMORY is out of memory. Defined in c_api.cpp.
void set_upstream_error(const std::string& msg);
// Returns and clears the calling thread's upstream error (empty: none).
std::string take_upstream_error();

class Upstream {
 public:
  virtual ~Upstream() = default;
  // A new segment of `nbytes`, or nullptr: out of memory, or (after set_upstream_error) a backend
  // error. Called WITHOUT the pool's lock (it may call into Python).
  virtual void* alloc_segment(std::size_t nbytes, Stream stream) = 0;
  // Called WITHOUT the pool's lock, only for segments whose blocks are all free and synchronized.
  virtual void free_segment(void* ptr, std::size_t nbytes) = 0;
  virtual Event create_event() = 0;  // 0 on failure
  virtual void destroy_event(Event ev) = 0;
  virtual bool record_event(Event ev, Stream stream) = 0;
  virtual bool event_completed(Event ev) = 0;
  // Make `waiter` wait on the GPU for `ev` (never a CPU-side wait).
  virtual bool stream_wait_event(Stream waiter, Event ev) = 0;
  // Last resort when no event can be recorded: CPU-side wait for the stream.
  virtual bool synchronize_stream(Stream stream) = 0;
  // The sim's sequence number of an event (for the trace); 0 for real devices.
  virtual std::uint64_t event_seq(Event) { return 0; }
  virtual Stream event_stream(Event) { return 0; }
  // The sim's count of work submitted on `stream` so far (the trace's position of a free); 0 for
  // real devices.
  virtual std::uint64_t stream_position(Stream) { return 0; }
  virtual bool is_sim() const { return false; }
  // A driver error that poisons the device context (e.g. CUDA_ERROR_ILLEGAL_ADDRESS from an event
  // query): once set, the pool serves no allocation and reports WW_BACKEND_ERROR with it. Empty
  // while the device is healthy. Thread-safe.
  virtual std::string sticky_error() { return std::string(); }
  // Stream-hazard checker hooks (sim only): `stream` used [addr, addr + size) with the work it
  // has queued so far; the pool hands [addr, addr + size) to `stream`. Called under the pool's lock.
  virtual void note_use(std::uintptr_t, std::size_t, Stream) {}
  virtual void check_handout(std::uintptr_t, std::size_t, Stream) {}
};

// A simulated device: host memory, virtual streams and events whose completion the caller controls.
// Stream s has `submitted[s]` units of work, of which `completed[s]` are done. An event recorded on s
// captures seq = submitted[s]; it has completed when completed[s] >= seq. A stream wait of W on an
// event (A, seq) orders W's later work after A's first seq units: finishing W finishes those first.
class SimDevice;

using SegmentAllocFn = ww_segment_alloc_fn;
using SegmentFreeFn = ww_segment_free_fn;

// Without callbacks, segments come from an arena mapping `capacity` bytes of host memory.
std::unique_ptr<Upstream> make_sim_upstream(Trace* trace, std::uint64_t capacity,
                                            SegmentAllocFn seg_alloc, SegmentFreeFn seg_free,
                                            void* ctx);
// Throws std::runtime_error with the reason when the driver or the device is unavailable.
std::unique_ptr<Upstream> make_cuda_upstream(int device, SegmentAllocFn seg_alloc,
                                             SegmentFreeFn seg_free, void* ctx);

// sim-only controls (nullptr-safe casts done by the caller).
std::int64_t sim_submit(Upstream* up, Stream stream);
bool sim_finish(Upstream* up, Stream stream, bool all_streams);
// Records that `stream`'s work queued so far reads or writes [addr, addr + size) (a kernel on a
// stream that is not the block's own: a cross-stream use).
bool sim_use(Upstream* up, std::uintptr_t addr, std::size_t size, Stream stream);
// Hazards the checker found so far (handouts to a stream while another stream's use of the range
// was neither complete nor waited on); copies up to `max` into `out`, returns the total.
std::uint64_t sim_hazards(Upstream* up, ww_hazard* out, std::uint64_t max);

}  // namespace ww
