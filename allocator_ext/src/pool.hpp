// The stream-aware pool: segments split into blocks, coalesced on free, rounded to size classes;
// free blocks remember the stream that freed them and an event recorded there; allocation follows
// the prioritized order of Waterwave (IEEE TC 2023), see waterwave_pool.h.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "upstream.hpp"
#include "waterwave_pool.h"

namespace ww {

constexpr std::size_t kMinBlock = 512;                  // allocation granularity, bytes
constexpr std::size_t kSmallSize = 1 << 20;             // <= 1 MiB: "small" requests
constexpr std::size_t kSmallSegment = 2 << 20;          // small requests share 2 MiB segments
constexpr std::size_t kMidSize = 10 << 20;              // < 10 MiB: share 20 MiB segments
constexpr std::size_t kMidSegment = 20 << 20;
constexpr std::size_t kLargeGranularity = 2 << 20;      // larger segments: multiples of 2 MiB

std::size_t round_size(std::size_t nbytes);

struct Segment;

// The work a stream had queued when blocks were freed on it: one event, shared by every block
// freed there in one "epoch" (RMM's stream_ordered_memory_resource keeps one event per stream for
// the same reason). An epoch is open (no event yet) until someone needs to know whether its frees
// are complete: a cross-stream search, a segment release, a snapshot, or its kEpochFrees-th free.
// Then one event is recorded on the stream; it covers every free of the epoch, since events on a
// stream complete in order and it is recorded after them. So a stream that reuses its own blocks
// (the common case) records one event per kEpochFrees frees instead of one per free, inside the
// pool's mutex. The stream must stay alive while an epoch of its is open:
// PyTorch's streams (pooled, never destroyed) and the null stream do, and closing or unbinding a
// stream's account (a trial's end) closes its epoch while the stream is still the trial's.
struct SyncPoint {
  Stream stream = 0;
  Event event = 0;          // recorded on `stream` when the epoch closed; 0 while open
  bool open = true;         // frees still join it; no event recorded yet
  bool complete = false;    // its event completed (or the stream was synchronized)
  std::uint32_t refs = 0;   // blocks pointing at it, +1 while it is its stream's open epoch
  std::uint32_t frees = 0;  // frees it covers
  std::uint64_t order = 0;  // creation order (epochs of one stream close in this order)
};

struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  Segment* seg = nullptr;
  Block* prev = nullptr;  // address order inside the segment
  Block* next = nullptr;
  bool allocated = false;
  bool deferred = false;  // freed, waiting for record_stream events before it can be reused
  Stream stream = 0;      // live: allocating stream; free: the stream that freed it
  SyncPoint* sync = nullptr;  // free: covers `stream`'s work at the free; nullptr = known complete
  std::uint64_t free_order = 0;
  std::int64_t account = -1;
  std::size_t requested = 0;
  std::vector<Stream> extra_streams;  // record_stream
  std::vector<Event> extra_events;    // deferred: events on extra_streams
};

struct Segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t live_blocks = 0;
  Stream creator_stream = 0;
  std::int64_t creator_account = -1;
  Block* first = nullptr;
};

struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};

struct Counters {
  ww_counters c{};
  void on_alloc(std::size_t size, std::size_t requested, int source);
  void on_free(std::size_t size, std::size_t requested);
  void on_reserve(std::size_t size);
  void on_unreserve(std::size_t size);
};

// The pool's mutex, timing how long it is held while `profiling` is on (two clock reads per
// acquisition, so off by default). A BasicLockable: std::unique_lock<TimedMutex> works.
class TimedMutex {
 public:
  void lock() {
    mu_.lock();
    on_locked();
  }
  bool try_lock() {
    if (!mu_.try_lock()) return false;
    on_locked();
    return true;
  }
  void unlock() {
    if (timed_) {
      hold_ns.fetch_add(static_cast<std::uint64_t>(
                            std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - t0_)
                                .count()),
                        std::memory_order_relaxed);
    }
    mu_.unlock();
  }
  std::atomic<bool> profiling{false};
  std::atomic<std::uint64_t> hold_ns{0};

 private:
  void on_locked() {
    timed_ = profiling.load(std::memory_order_relaxed);
    if (timed_) t0_ = std::chrono::steady_clock::now();
  }
  std::mutex mu_;
  bool timed_ = false;  // under mu_
  std::chrono::steady_clock::time_point t0_;
};

// What the pool asked of its upstream (the driver, on the cuda backend), by kind: see
// ww_driver_counters. Relaxed atomics: counted under the mutex or outside it.
struct DriverCounts {
  std::atomic<std::uint64_t> allocs{0}, frees{0}, segment_allocs{0}, segment_frees{0},
      event_creates{0}, event_destroys{0}, event_records{0}, event_queries{0}, stream_waits{0},
      stream_syncs{0}, coalesce_scans{0}, cross_stream_searches{0};
  static void bump(std::atomic<std::uint64_t>& c) { c.fetch_add(1, std::memory_order_relaxed); }
};

struct Account {
  Counters counters;
  std::vector<Stream> streams;
};

class Pool {
 public:
  Pool(std::unique_ptr<Upstream> upstream, std::unique_ptr<Trace> trace, std::uint64_t capacity);
  ~Pool();

  int allocate(std::size_t nbytes, Stream stream, std::uintptr_t* out, int* source);
  int free(std::uintptr_t ptr, Stream stream, bool has_stream);
  // For PyTorch's entry point: never waits for the pool's mutex (queues the free if it is held).
  // An unknown pointer is then not reported. Always WW_OK when queued.
  int free_nonblocking(std::uintptr_t ptr, Stream stream);
  int record_stream(std::uintptr_t ptr, Stream stream);
  std::uint64_t release_cached();
  // Segments already held are kept; a new one is taken only within the new capacity.
  void set_capacity(std::uint64_t capacity);

  void stats(ww_counters* out);
  void stream_stats(Stream s, ww_counters* out);
  void reset_peaks();
  std::uint64_t snapshot(ww_block_info* out, std::uint64_t max);

  std::int64_t account_open();
  int account_close(std::int64_t id);
  int account_bind(std::int64_t id, Stream s);
  int account_unbind(std::int64_t id, Stream s);
  int account_set_quota(std::int64_t id, std::uint64_t quota);
  int account_stats(std::int64_t id, ww_counters* out);
  std::int64_t stream_account(Stream s);

  // The pool mutex's acquisitions, how many found it held, and the nanoseconds spent waiting.
  void lock_stats(std::uint64_t* acquisitions, std::uint64_t* contended, std::uint64_t* wait_ns,
                  std::uint64_t* deferred_frees);
  // out[6]: the four above, then PyTorch-path frees that waited for the mutex and their ns.
  void lock_stats(std::uint64_t* out);
  // out[2]: events recorded for frees (epochs closed) and frees, since the pool was made.
  void event_stats(std::uint64_t* out);
  void driver_stats(ww_driver_counters* out);
  void reset_driver_stats();
  void set_profiling(bool on) { mu_.profiling.store(on); }
  // Benchmark knob: make free_nonblocking wait for the mutex as the pool first did.
  void set_blocking_torch_free(bool on) { blocking_torch_free_.store(on); }

  Trace* trace() { return trace_.get(); }
  Upstream* upstream() { return upstream_.get(); }

 private:
  using FreeSet = std::set<Block*, BlockOrder>;

  // Locks mu_, counting contention.
  std::unique_lock<TimedMutex> acquire();
  // The upstream's calls, counted by kind (DriverCounts).
  void* up_alloc_segment(std::size_t nbytes, Stream s) {
    DriverCounts::bump(driver_.segment_allocs);
    return upstream_->alloc_segment(nbytes, s);
  }
  void up_free_segment(void* p, std::size_t nbytes) {
    DriverCounts::bump(driver_.segment_frees);
    upstream_->free_segment(p, nbytes);
  }
  Event up_create_event() {
    DriverCounts::bump(driver_.event_creates);
    return upstream_->create_event();
  }
  void up_destroy_event(Event e) {
    DriverCounts::bump(driver_.event_destroys);
    upstream_->destroy_event(e);
  }
  bool up_record_event(Event e, Stream s) {
    DriverCounts::bump(driver_.event_records);
    return upstream_->record_event(e, s);
  }
  bool up_event_completed(Event e) {
    DriverCounts::bump(driver_.event_queries);
    return upstream_->event_completed(e);
  }
  bool up_stream_wait_event(Stream waiter, Event e) {
    DriverCounts::bump(driver_.stream_waits);
    return upstream_->stream_wait_event(waiter, e);
  }
  bool up_synchronize_stream(Stream s) {
    DriverCounts::bump(driver_.stream_syncs);
    return upstream_->synchronize_stream(s);
  }
  // All *_locked functions require mu_.
  int free_locked(std::uintptr_t ptr, Stream stream, bool has_stream);
  void drain_pending_locked();
  Block* find_free_locked(std::size_t size, Stream stream, int* source);
  Block* take_locked(Block* b, std::size_t size, Stream stream, int source, std::size_t requested,
                     std::int64_t account);
  void insert_free_locked(Block* b);
  void erase_free_locked(Block* b);
  // Whether b's frees are complete; drops b's epoch when they are. An open epoch is closed
  // (its one event recorded) only with `close_open`; otherwise it counts as pending.
  bool sync_done_locked(Block* b, bool close_open);
  void close_epoch_locked(SyncPoint* sp);
  void close_stream_epoch_locked(Stream s);  // its open epoch, if any (account close/unbind)
  void unref_sync_locked(SyncPoint* sp);
  // The newer of two epochs of one stream (the later one covers both).
  static SyncPoint* newer_sync(SyncPoint* a, SyncPoint* b);
  Block* coalesce_locked(Block* b);
  bool try_merge_locked(Block* left, Block* right, bool close_open = false,
                        bool same_stream_any = false);
  // Merges the free neighbours of stream s that were kept apart (see try_merge_locked).
  void coalesce_stream_locked(Stream s);
  void coalesce_all_locked();
  void process_deferred_locked();
  std::vector<Segment*> collect_releasable_locked();
  void release_segments_unlocked(std::unique_lock<TimedMutex>& lk, std::vector<Segment*>& segs);
  Event get_event_locked();
  void put_event_locked(Event ev);
  void trace_oom_locked(std::size_t nbytes, Stream s, int status, std::int64_t account);
  Counters& stream_counters_locked(Stream s) { return streams_[s]; }
  Account* account_locked(std::int64_t id);

  std::unique_ptr<Trace> trace_;
  std::unique_ptr<Upstream> upstream_;
  std::uint64_t capacity_;
  TimedMutex mu_;
  DriverCounts driver_;
  std::atomic<std::uint64_t> lock_acquisitions_{0};
  std::atomic<std::uint64_t> lock_contended_{0};
  std::atomic<std::uint64_t> lock_wait_ns_{0};
  std::atomic<std::uint64_t> deferred_frees_{0};
  std::atomic<std::uint64_t> torch_free_waits_{0};
  std::atomic<std::uint64_t> torch_free_wait_ns_{0};
  std::atomic<bool> blocking_torch_free_{false};
  struct PendingFree {
    std::uintptr_t ptr;
    Stream stream;
  };
  std::mutex pending_mu_;  // guards pending_frees_ only; never held with anything else
  std::vector<PendingFree> pending_frees_;
  std::atomic<bool> has_pending_{false};
  std::uint64_t pending_reserve_ = 0;  // capacity promised to in-flight segment requests
  std::uint64_t pending_release_ = 0;  // segments being handed back (not yet freed upstream)
  std::uint64_t free_counter_ = 0;
  bool dirty_ = false;  // some adjacent free blocks were kept apart for pending events
  std::set<Stream> fragmented_;  // streams whose own free neighbours were kept apart
  std::map<Stream, FreeSet> free_;  // free blocks by the stream that freed them
  std::unordered_map<std::uintptr_t, Block*> live_;
  std::map<std::uintptr_t, Segment*> segments_;
  std::vector<Block*> deferred_;
  std::vector<Event> event_cache_;
  std::unordered_map<Stream, SyncPoint*> open_sync_;  // each stream's open epoch
  std::uint64_t sync_order_ = 0;                      // numbers epochs in creation order
  std::atomic<std::uint64_t> epochs_closed_{0};
  std::atomic<std::uint64_t> frees_{0};
  Counters total_;
  std::map<Stream, Counters> streams_;
  std::map<std::int64_t, Account> accounts_;
  std::unordered_map<Stream, std::int64_t> stream_to_account_;
  std::int64_t next_account_ = 1;
};

}  // namespace ww
