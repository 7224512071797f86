// Where segments and synchronization come from (RMM's "upstream" idea): the CUDA driver, callbacks
// (CuPy), or a simulated device. The block-level logic in pool.cpp is the same for all of them.
#pragma once

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
    enabled_ = on;
  }
  bool enabled() const {
    std::lock_guard<std::mutex> g(mu_);
    return enabled_;
  }
  void add(const ww_trace_entry& e) {
    std::lock_guard<std::mutex> g(mu_);
    if (enabled_) entries_.push_back(e);
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
  bool enabled_ = false;
  std::vector<ww_trace_entry> entries_;
};

class Upstream {
 public:
  virtual ~Upstream() = default;
  // A new segment of `nbytes`, or nullptr. Called WITHOUT the pool's lock (it may call into Python).
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
  virtual bool is_sim() const { return false; }
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

}  // namespace ww
