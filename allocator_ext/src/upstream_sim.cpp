// The simulated device: host memory for segments, virtual streams and events whose completion the
// caller controls (SimDevice::submit / finish). Every rule of the pool is tested against it on a
// machine with no GPU; the pool's block logic is the same code as on CUDA.
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "upstream.hpp"

namespace ww {

namespace {

struct SimEvent {
  Stream stream = 0;
  std::uint64_t seq = 0;
  bool recorded = false;
};

struct SimWait {
  std::uint64_t position;  // waiter's submitted count when the wait was enqueued
  Stream target;
  std::uint64_t seq;
};

class SimUpstream final : public Upstream {
 public:
  SimUpstream(Trace* trace, SegmentAllocFn a, SegmentFreeFn f, void* ctx)
      : trace_(trace), seg_alloc_(a), seg_free_(f), ctx_(ctx) {}

  void* alloc_segment(std::size_t nbytes, Stream stream) override {
    if (seg_alloc_ != nullptr) {
      return reinterpret_cast<void*>(static_cast<std::uintptr_t>(seg_alloc_(ctx_, nbytes, stream)));
    }
    // 512-byte aligned host memory; never touched by the pool itself.
    std::size_t rounded = (nbytes + 511) / 512 * 512;
    return std::aligned_alloc(512, rounded);
  }

  void free_segment(void* ptr, std::size_t nbytes) override {
    if (seg_free_ != nullptr) {
      seg_free_(ctx_, reinterpret_cast<std::uintptr_t>(ptr), nbytes);
      return;
    }
    std::free(ptr);
  }

  Event create_event() override {
    std::lock_guard<std::mutex> g(mu_);
    Event id = ++next_event_;
    events_[id] = SimEvent{};
    return id;
  }

  void destroy_event(Event ev) override {
    std::lock_guard<std::mutex> g(mu_);
    events_.erase(ev);
  }

  bool record_event(Event ev, Stream stream) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = events_.find(ev);
    if (it == events_.end()) return false;
    it->second = SimEvent{stream, streams_[stream].submitted, true};
    return true;
  }

  bool event_completed(Event ev) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = events_.find(ev);
    if (it == events_.end() || !it->second.recorded) return true;  // like cuEventQuery
    return streams_[it->second.stream].completed >= it->second.seq;
  }

  bool stream_wait_event(Stream waiter, Event ev) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = events_.find(ev);
    if (it == events_.end()) return false;
    const SimEvent e = it->second;
    if (!e.recorded) return true;
    StreamState& w = streams_[waiter];
    w.waits.push_back(SimWait{w.submitted, e.stream, e.seq});
    ww_trace_entry t{};
    t.kind = WW_TRACE_STREAM_WAIT;
    t.stream = waiter;
    t.other_stream = e.stream;
    t.seq = e.seq;
    t.account = -1;
    trace_->add(t);
    return true;
  }

  bool synchronize_stream(Stream stream) override {
    std::lock_guard<std::mutex> g(mu_);
    finish_upto_locked(stream, streams_[stream].submitted, 0);
    return true;
  }

  std::uint64_t event_seq(Event ev) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = events_.find(ev);
    return it == events_.end() ? 0 : it->second.seq;
  }

  Stream event_stream(Event ev) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = events_.find(ev);
    return it == events_.end() ? 0 : it->second.stream;
  }

  bool is_sim() const override { return true; }

  std::int64_t submit(Stream stream) {
    std::lock_guard<std::mutex> g(mu_);
    StreamState& s = streams_[stream];
    s.submitted += 1;
    ww_trace_entry t{};
    t.kind = WW_TRACE_SUBMIT;
    t.stream = stream;
    t.seq = s.submitted;
    t.account = -1;
    trace_->add(t);
    return static_cast<std::int64_t>(s.submitted);
  }

  void finish(Stream stream, bool all) {
    std::lock_guard<std::mutex> g(mu_);
    if (all) {
      std::vector<Stream> ids;
      ids.reserve(streams_.size());
      for (auto& kv : streams_) ids.push_back(kv.first);
      for (Stream s : ids) finish_upto_locked(s, streams_[s].submitted, 0);
    } else {
      finish_upto_locked(stream, streams_[stream].submitted, 0);
    }
  }

 private:
  struct StreamState {
    std::uint64_t submitted = 0;
    std::uint64_t completed = 0;
    std::vector<SimWait> waits;
  };

  // Completes `stream` up to `n` units, first completing what its waits made it depend on.
  void finish_upto_locked(Stream stream, std::uint64_t n, int depth) {
    // Terminates: every wait record is consumed once. The guard only bounds the C++ stack.
    if (depth > 4096) return;
    StreamState* s = &streams_[stream];
    if (s->completed >= n) return;
    std::vector<SimWait> due;
    std::vector<SimWait> keep;
    for (const SimWait& w : s->waits) (w.position < n ? due : keep).push_back(w);
    s->waits = std::move(keep);
    for (const SimWait& w : due) finish_upto_locked(w.target, w.seq, depth + 1);
    s = &streams_[stream];  // the map may have grown
    if (s->completed >= n) return;
    s->completed = n;
    ww_trace_entry t{};
    t.kind = WW_TRACE_FINISH;
    t.stream = stream;
    t.seq = n;
    t.account = -1;
    trace_->add(t);
  }

  Trace* trace_;
  SegmentAllocFn seg_alloc_;
  SegmentFreeFn seg_free_;
  void* ctx_;
  std::mutex mu_;
  Event next_event_ = 0;
  std::unordered_map<Event, SimEvent> events_;
  std::map<Stream, StreamState> streams_;
};

}  // namespace

std::unique_ptr<Upstream> make_sim_upstream(Trace* trace, SegmentAllocFn seg_alloc,
                                            SegmentFreeFn seg_free, void* ctx) {
  return std::make_unique<SimUpstream>(trace, seg_alloc, seg_free, ctx);
}

std::int64_t sim_submit(Upstream* up, Stream stream) {
  if (up == nullptr || !up->is_sim()) return -1;
  return static_cast<SimUpstream*>(up)->submit(stream);
}

bool sim_finish(Upstream* up, Stream stream, bool all_streams) {
  if (up == nullptr || !up->is_sim()) return false;
  static_cast<SimUpstream*>(up)->finish(stream, all_streams);
  return true;
}

}  // namespace ww
