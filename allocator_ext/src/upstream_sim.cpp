// The simulated device: host memory for segments, virtual streams and events whose completion the
// caller controls (SimDevice::submit / finish). Every rule of the pool is tested against it on a
// machine with no GPU; the pool's block logic is the same code as on CUDA.
#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <algorithm>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>
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

// The simulated device memory: one anonymous mapping (pages are committed only when touched),
// handed out first-fit. Segment addresses are therefore the same, relative to the base, from run
// to run, which keeps traces and property-test replays deterministic. The mapping is 16x the
// pool's capacity: like a real GPU's virtual address space, it does not run out through
// fragmentation (the pool enforces the capacity itself).
class SimArena {
 public:
  explicit SimArena(std::uint64_t capacity) {
    constexpr std::uint64_t kMaxArena = 1ull << 40;  // 1 TiB of address space at most
    const std::uint64_t want = capacity > kMaxArena / 16 ? kMaxArena : capacity * 16;
    size_ = static_cast<std::size_t>(std::max<std::uint64_t>(want, 1ull << 30));
    size_ = (size_ + kAlign - 1) / kAlign * kAlign;
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("sim backend: cannot map the simulated device");
    base_ = reinterpret_cast<std::uintptr_t>(p);
    free_[0] = size_;
  }
  ~SimArena() { munmap(reinterpret_cast<void*>(base_), size_); }
  SimArena(const SimArena&) = delete;
  SimArena& operator=(const SimArena&) = delete;

  void* allocate(std::size_t nbytes) {
    std::lock_guard<std::mutex> g(mu_);
    nbytes = (nbytes + kAlign - 1) / kAlign * kAlign;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < nbytes) continue;
      std::size_t off = it->first;
      std::size_t rest = it->second - nbytes;
      free_.erase(it);
      if (rest != 0) free_[off + nbytes] = rest;
      return reinterpret_cast<void*>(base_ + off);
    }
    return nullptr;
  }

  void release(void* ptr, std::size_t nbytes) {
    std::lock_guard<std::mutex> g(mu_);
    nbytes = (nbytes + kAlign - 1) / kAlign * kAlign;
    std::size_t off = reinterpret_cast<std::uintptr_t>(ptr) - base_;
    madvise(ptr, nbytes, MADV_DONTNEED);  // give the pages back, like freeing device memory
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + nbytes == next->first) {
      nbytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += nbytes;
        return;
      }
    }
    free_[off] = nbytes;
  }

 private:
  static constexpr std::size_t kAlign = 4096;
  std::mutex mu_;
  std::uintptr_t base_ = 0;
  std::size_t size_ = 0;
  std::map<std::size_t, std::size_t> free_;  // offset -> length
};

class SimUpstream final : public Upstream {
 public:
  SimUpstream(Trace* trace, std::uint64_t capacity, SegmentAllocFn a, SegmentFreeFn f, void* ctx)
      : trace_(trace), seg_alloc_(a), seg_free_(f), ctx_(ctx) {
    if (seg_alloc_ == nullptr) arena_ = std::make_unique<SimArena>(capacity);
  }

  void* alloc_segment(std::size_t nbytes, Stream stream) override {
    if (seg_alloc_ != nullptr) {
      return reinterpret_cast<void*>(static_cast<std::uintptr_t>(seg_alloc_(ctx_, nbytes, stream)));
    }
    return arena_->allocate(nbytes);
  }

  void free_segment(void* ptr, std::size_t nbytes) override {
    if (seg_free_ != nullptr) {
      seg_free_(ctx_, reinterpret_cast<std::uintptr_t>(ptr), nbytes);
      return;
    }
    arena_->release(ptr, nbytes);
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
    return complete_locked(it->second.stream, it->second.seq);
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

  std::uint64_t stream_position(Stream stream) override {
    std::lock_guard<std::mutex> g(mu_);
    return streams_[stream].submitted;
  }

  bool is_sim() const override { return true; }

  // The stream-hazard checker: every use of a range by a stream is kept
  // until that stream's work up to the use has completed; a handout of an overlapping range to
  // another stream that has neither seen it complete nor waited on it is a hazard. Uses are noted
  // by the pool at every free (the freeing stream) and by the test through ww_sim_use (kernels
  // on other streams, the cross-stream case PyTorch's record_stream exists for).
  void note_use(std::uintptr_t addr, std::size_t size, Stream stream) override {
    std::lock_guard<std::mutex> g(mu_);
    add_use_locked(addr, size, stream);
  }

  void check_handout(std::uintptr_t addr, std::size_t size, Stream stream) override {
    std::lock_guard<std::mutex> g(mu_);
    if (uses_.empty()) return;
    const std::uintptr_t lo = addr;
    const std::uintptr_t hi = addr + size;
    auto it = uses_.lower_bound(lo > max_use_bytes_ ? lo - max_use_bytes_ : 0);
    while (it != uses_.end() && it->first < hi) {
      const Use& u = it->second;
      const std::uint64_t done = streams_[u.stream].completed;
      if (done >= u.seq) {  // complete: forget it
        it = uses_.erase(it);
        continue;
      }
      if (u.end > lo && u.stream != stream && !waited_locked(stream, u.stream, u.seq)) {
        hazards_.push_back(ww_hazard{static_cast<std::uint64_t>(lo), size, stream, u.stream, u.seq,
                                     done});
      }
      ++it;
    }
  }

  void use(std::uintptr_t addr, std::size_t size, Stream stream) {
    std::lock_guard<std::mutex> g(mu_);
    add_use_locked(addr, size, stream);
  }

  std::uint64_t hazards(ww_hazard* out, std::uint64_t max) {
    std::lock_guard<std::mutex> g(mu_);
    for (std::uint64_t i = 0; i < hazards_.size() && i < max && out != nullptr; ++i) {
      out[i] = hazards_[i];
    }
    return hazards_.size();
  }

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

  struct Use {
    std::uintptr_t end;
    Stream stream;
    std::uint64_t seq;  // the stream's submitted count at the use
  };

  void add_use_locked(std::uintptr_t addr, std::size_t size, Stream stream) {
    StreamState& s = streams_[stream];
    if (s.completed >= s.submitted) return;  // nothing queued: the use is already complete
    uses_.emplace(addr, Use{addr + size, stream, s.submitted});
    max_use_bytes_ = std::max<std::uintptr_t>(max_use_bytes_, size);
  }

  // Whether `stream`'s first `seq` units have completed, including the stream waits enqueued
  // before the point `seq` (as on CUDA, an event recorded after cuStreamWaitEvent completes only
  // once the waited-on event has).
  // Whether `stream`'s work up to `seq` has completed, and with it everything that work waited
  // on (the waits enqueued up to `seq`, and theirs, transitively). A search over the wait
  // records that visits each stream once per bound it is asked for with: the waits of two
  // streams handing blocks back and forth form a web whose paths are exponential in number.
  bool complete_locked(Stream stream, std::uint64_t seq) {
    std::unordered_map<Stream, std::uint64_t> seen;  // stream -> highest seq already checked
    std::vector<std::pair<Stream, std::uint64_t>> todo{{stream, seq}};
    while (!todo.empty()) {
      const auto [s, n] = todo.back();
      todo.pop_back();
      const auto f = seen.find(s);
      if (f != seen.end() && f->second >= n) continue;
      seen[s] = n;
      const StreamState& st = streams_[s];
      if (st.completed < n) return false;
      for (const SimWait& w : st.waits) {
        if (w.position <= n) todo.emplace_back(w.target, w.seq);
      }
    }
    return true;
  }

  // Whether `waiter`'s work from now on is ordered after `target`'s first `seq` units: a stream
  // wait on it, directly or through the waits of a stream it waited on, enqueued up to `upto`.
  // The same search as above: a stream is searched again only with a larger bound (its waits
  // up to a larger position), so each wait record is looked at a bounded number of times.
  bool waited_locked(Stream waiter, Stream target, std::uint64_t seq,
                     std::uint64_t upto = ~0ull) {
    std::unordered_map<Stream, std::uint64_t> seen;  // stream -> largest bound searched
    std::vector<std::pair<Stream, std::uint64_t>> todo{{waiter, upto}};
    while (!todo.empty()) {
      const auto [s, bound] = todo.back();
      todo.pop_back();
      const auto f = seen.find(s);
      if (f != seen.end() && f->second >= bound) continue;
      seen[s] = bound;
      for (const SimWait& w : streams_[s].waits) {
        if (w.position > bound) continue;
        if (w.target == target && w.seq >= seq) return true;
        if (w.target != s) todo.emplace_back(w.target, w.seq);
      }
    }
    return false;
  }

  // Completes `stream` up to `n` units, first completing what its waits made it depend on.
  void finish_upto_locked(Stream stream, std::uint64_t n, int depth) {
    // Terminates: every wait record is consumed once. The guard only bounds the C++ stack.
    if (depth > 4096) return;
    StreamState* s = &streams_[stream];
    if (s->completed >= n && (n < s->submitted || s->waits.empty())) return;
    std::vector<SimWait> due;
    std::vector<SimWait> keep;
    // Finishing everything submitted also settles the waits enqueued after the last unit.
    const bool all = n >= s->submitted;
    for (const SimWait& w : s->waits) {
      (w.position < n || (all && w.position <= n) ? due : keep).push_back(w);
    }
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
  std::unique_ptr<SimArena> arena_;
  SegmentAllocFn seg_alloc_;
  SegmentFreeFn seg_free_;
  void* ctx_;
  std::mutex mu_;
  Event next_event_ = 0;
  std::unordered_map<Event, SimEvent> events_;
  std::map<Stream, StreamState> streams_;
  std::multimap<std::uintptr_t, Use> uses_;  // by start address
  std::uintptr_t max_use_bytes_ = 0;
  std::vector<ww_hazard> hazards_;
};

}  // namespace

std::unique_ptr<Upstream> make_sim_upstream(Trace* trace, std::uint64_t capacity,
                                            SegmentAllocFn seg_alloc, SegmentFreeFn seg_free,
                                            void* ctx) {
  return std::make_unique<SimUpstream>(trace, capacity, seg_alloc, seg_free, ctx);
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

bool sim_use(Upstream* up, std::uintptr_t addr, std::size_t size, Stream stream) {
  if (up == nullptr || !up->is_sim()) return false;
  static_cast<SimUpstream*>(up)->use(addr, size, stream);
  return true;
}

std::uint64_t sim_hazards(Upstream* up, ww_hazard* out, std::uint64_t max) {
  if (up == nullptr || !up->is_sim()) return 0;
  return static_cast<SimUpstream*>(up)->hazards(out, max);
}

}  // namespace ww
