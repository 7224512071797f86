// The block-level hot path of the stream-aware pool; the same code for the sim, cuda and external
// (CuPy) upstreams. Source of the allocation order: Waterwave (IEEE TC 72(10), 2023), "prioritized
// allocation by synchronization attributes"; cross-stream reuse after a GPU-side wait as in RMM's
// stream_ordered_memory_resource.
#include "pool.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>
#include <string>

#include "format_bytes.hpp"

namespace ww {

void set_last_error(const std::string& msg);  // c_api.cpp

namespace {

constexpr std::size_t kEventCacheMax = 4096;
// Frees of one stream that share one event at most (see SyncPoint in pool.hpp): bounds how much
// later work of the freeing stream a cross-stream reuse may wait for.
constexpr std::uint32_t kEpochFrees = 64;
constexpr int kCrossStreamProbe = 8;  // candidates examined per other stream

std::size_t next_pow2(std::size_t n) {
  std::size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }

std::size_t segment_size_for(std::size_t size) {
  if (size <= kSmallSize) return kSmallSegment;
  if (size < kMidSize) return kMidSegment;
  return round_up(size, kLargeGranularity);
}

}  // namespace

// Size classes: multiples of 512 bytes up to 1 MiB; above, multiples of 1/16 of the next power of
// two (at most 6.25% rounding waste, a bounded number of classes per octave).
std::size_t round_size(std::size_t nbytes) {
  if (nbytes == 0) return kMinBlock;
  if (nbytes <= kSmallSize) return round_up(nbytes, kMinBlock);
  std::size_t g = std::max<std::size_t>(kMinBlock, next_pow2(nbytes) / 16);
  return round_up(nbytes, g);
}

void Counters::on_alloc(std::size_t size, std::size_t requested, int source) {
  c.allocated_bytes += size;
  c.requested_bytes += requested;
  c.peak_allocated_bytes = std::max(c.peak_allocated_bytes, c.allocated_bytes);
  c.num_allocs += 1;
  switch (source) {
    case WW_SOURCE_SAME_STREAM: c.num_same_stream += 1; break;
    case WW_SOURCE_COMPLETED_EVENT: c.num_completed_event += 1; break;
    case WW_SOURCE_STREAM_WAIT: c.num_stream_wait += 1; break;
    case WW_SOURCE_NEW_SEGMENT: c.num_new_segment += 1; break;
    default: break;
  }
}

void Counters::on_free(std::size_t size, std::size_t requested) {
  c.allocated_bytes -= size;
  c.requested_bytes -= requested;
  c.num_frees += 1;
}

void Counters::on_reserve(std::size_t size) {
  c.reserved_bytes += size;
  c.peak_reserved_bytes = std::max(c.peak_reserved_bytes, c.reserved_bytes);
  c.num_segments += 1;
}

void Counters::on_unreserve(std::size_t size) {
  c.reserved_bytes -= size;
  c.num_segments -= 1;
}

Pool::Pool(std::unique_ptr<Upstream> upstream, std::unique_ptr<Trace> trace, std::uint64_t capacity)
    : trace_(std::move(trace)), upstream_(std::move(upstream)), capacity_(capacity) {
  total_.c.capacity_bytes = capacity;
}

Pool::~Pool() {
  std::lock_guard<TimedMutex> g(mu_);
  drain_pending_locked();
  std::set<SyncPoint*> syncs;
  for (auto& kv : open_sync_) syncs.insert(kv.second);
  for (auto& kv : segments_) {
    for (Block* b = kv.second->first; b != nullptr; b = b->next) {
      if (b->sync != nullptr) syncs.insert(b->sync);
    }
  }
  for (SyncPoint* sp : syncs) {
    if (sp->event != 0) up_destroy_event(sp->event);
    delete sp;
  }
  for (auto& kv : segments_) {
    Segment* seg = kv.second;
    bool idle = seg->live_blocks == 0;
    Block* b = seg->first;
    while (b != nullptr) {
      Block* n = b->next;
      for (Event e : b->extra_events) up_destroy_event(e);
      delete b;
      b = n;
    }
    // Segments with live blocks are leaked on purpose: someone still holds pointers into them.
    if (idle) up_free_segment(reinterpret_cast<void*>(seg->addr), seg->size);
    delete seg;
  }
  for (Event e : event_cache_) up_destroy_event(e);
}

std::unique_lock<TimedMutex> Pool::acquire() {
  std::unique_lock<TimedMutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) {
    const auto t0 = std::chrono::steady_clock::now();
    lk.lock();
    const auto waited = std::chrono::steady_clock::now() - t0;
    lock_contended_.fetch_add(1, std::memory_order_relaxed);
    lock_wait_ns_.fetch_add(
        static_cast<std::uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count()),
        std::memory_order_relaxed);
  }
  lock_acquisitions_.fetch_add(1, std::memory_order_relaxed);
  drain_pending_locked();
  return lk;
}

void Pool::driver_stats(ww_driver_counters* out) {
  auto get = [](const std::atomic<std::uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  ww_driver_counters c{};
  c.allocs = get(driver_.allocs);
  c.frees = get(driver_.frees);
  c.segment_allocs = get(driver_.segment_allocs);
  c.segment_frees = get(driver_.segment_frees);
  c.event_creates = get(driver_.event_creates);
  c.event_destroys = get(driver_.event_destroys);
  c.event_records = get(driver_.event_records);
  c.event_queries = get(driver_.event_queries);
  c.stream_waits = get(driver_.stream_waits);
  c.stream_syncs = get(driver_.stream_syncs);
  c.lock_acquisitions = get(lock_acquisitions_);
  c.lock_contended = get(lock_contended_);
  c.lock_wait_ns = get(lock_wait_ns_);
  c.lock_hold_ns = get(mu_.hold_ns);
  c.coalesce_scans = get(driver_.coalesce_scans);
  c.cross_stream_searches = get(driver_.cross_stream_searches);
  *out = c;
}

void Pool::reset_driver_stats() {
  for (std::atomic<std::uint64_t>* c :
       {&driver_.allocs, &driver_.frees, &driver_.segment_allocs, &driver_.segment_frees,
        &driver_.event_creates, &driver_.event_destroys, &driver_.event_records,
        &driver_.event_queries, &driver_.stream_waits, &driver_.stream_syncs,
        &driver_.coalesce_scans, &driver_.cross_stream_searches, &lock_acquisitions_,
        &lock_contended_, &lock_wait_ns_, &mu_.hold_ns}) {
    c->store(0, std::memory_order_relaxed);
  }
}

void Pool::event_stats(std::uint64_t* out) {
  out[0] = epochs_closed_.load(std::memory_order_relaxed);
  out[1] = frees_.load(std::memory_order_relaxed);
}

void Pool::lock_stats(std::uint64_t* out) {
  out[0] = lock_acquisitions_.load(std::memory_order_relaxed);
  out[1] = lock_contended_.load(std::memory_order_relaxed);
  out[2] = lock_wait_ns_.load(std::memory_order_relaxed);
  out[3] = deferred_frees_.load(std::memory_order_relaxed);
  out[4] = torch_free_waits_.load(std::memory_order_relaxed);
  out[5] = torch_free_wait_ns_.load(std::memory_order_relaxed);
}

void Pool::lock_stats(std::uint64_t* acquisitions, std::uint64_t* contended,
                      std::uint64_t* wait_ns, std::uint64_t* deferred_frees) {
  *deferred_frees = deferred_frees_.load(std::memory_order_relaxed);
  *acquisitions = lock_acquisitions_.load(std::memory_order_relaxed);
  *contended = lock_contended_.load(std::memory_order_relaxed);
  *wait_ns = lock_wait_ns_.load(std::memory_order_relaxed);
}

Event Pool::get_event_locked() {
  if (!event_cache_.empty()) {
    Event e = event_cache_.back();
    event_cache_.pop_back();
    return e;
  }
  return up_create_event();
}

void Pool::put_event_locked(Event ev) {
  if (ev == 0) return;
  if (event_cache_.size() < kEventCacheMax) {
    event_cache_.push_back(ev);
  } else {
    up_destroy_event(ev);
  }
}

void Pool::insert_free_locked(Block* b) { free_[b->stream].insert(b); }

void Pool::erase_free_locked(Block* b) {
  auto it = free_.find(b->stream);
  if (it != free_.end()) it->second.erase(b);
}

void Pool::close_epoch_locked(SyncPoint* sp) {
  if (!sp->open) return;
  sp->open = false;
  open_sync_.erase(sp->stream);
  if (sp->refs == 1) {  // every block of the epoch was reused by its stream: nothing to cover
    unref_sync_locked(sp);
    return;
  }
  Event ev = get_event_locked();
  if (ev != 0 && up_record_event(ev, sp->stream)) {
    sp->event = ev;
    epochs_closed_.fetch_add(1, std::memory_order_relaxed);
  } else {
    // No event could be recorded: fall back to a CPU-side wait (an error path, never taken by sim).
    put_event_locked(ev);
    up_synchronize_stream(sp->stream);
    sp->complete = true;
  }
  unref_sync_locked(sp);  // the stream's open slot; the epoch's blocks keep theirs
}

void Pool::close_stream_epoch_locked(Stream s) {
  // The stream's owner (a trial) is done with it while it is alive: record its epoch's event
  // now, not later on a stream the owner may destroy.
  auto it = open_sync_.find(s);
  if (it != open_sync_.end()) close_epoch_locked(it->second);
}

void Pool::unref_sync_locked(SyncPoint* sp) {
  if (sp == nullptr || --sp->refs != 0) return;
  put_event_locked(sp->event);  // a pending event may be recorded again: it is overwritten
  delete sp;
}

SyncPoint* Pool::newer_sync(SyncPoint* a, SyncPoint* b) { return a->order >= b->order ? a : b; }

bool Pool::sync_done_locked(Block* b, bool close_open) {
  SyncPoint* sp = b->sync;
  if (sp == nullptr) return true;
  if (sp->open) {
    if (!close_open) return false;
    close_epoch_locked(sp);
  }
  if (!sp->complete) {
    if (!up_event_completed(sp->event)) return false;
    sp->complete = true;
  }
  b->sync = nullptr;
  unref_sync_locked(sp);
  return true;
}

Account* Pool::account_locked(std::int64_t id) {
  auto it = accounts_.find(id);
  return it == accounts_.end() ? nullptr : &it->second;
}

Block* Pool::find_free_locked(std::size_t size, Stream stream, int* source) {
  Block probe;
  probe.size = size;
  probe.addr = 0;
  // 1. a free block last used by this stream: stream order makes it safe.
  for (int pass = 0; pass < 2; ++pass) {
    auto own = free_.find(stream);
    if (own != free_.end()) {
      auto it = own->second.lower_bound(&probe);
      if (it != own->second.end()) {
        *source = WW_SOURCE_SAME_STREAM;
        return *it;
      }
    }
    // A miss: merge this stream's own free neighbours that were kept apart (one completed,
    // one pending), without a driver call, and look again before taking a neighbour's block.
    if (pass != 0 || fragmented_.count(stream) == 0) break;
    coalesce_stream_locked(stream);
  }
  // 2./3. other streams: best fit among completed events, else best fit among pending ones.
  // Probing closes the candidates' open epochs (an event recorded on each such stream, at most
  // one per stream and search) to learn whether they completed: Waterwave's priority puts a
  // completed block before a pending one.
  DriverCounts::bump(driver_.cross_stream_searches);
  Block* done = nullptr;
  Block* pending = nullptr;
  for (auto& kv : free_) {
    if (kv.first == stream) continue;
    int k = 0;
    for (auto it = kv.second.lower_bound(&probe); it != kv.second.end() && k < kCrossStreamProbe;
         ++it, ++k) {
      Block* b = *it;
      if (done != nullptr && b->size >= done->size) break;
      if (sync_done_locked(b, true)) {
        done = b;
        break;
      }
      if (pending == nullptr || b->size < pending->size) pending = b;
    }
  }
  if (done != nullptr) {
    *source = WW_SOURCE_COMPLETED_EVENT;
    return done;
  }
  if (pending != nullptr) {
    // sync_done_locked closed its epoch: it has an event, pending.
    if (up_stream_wait_event(stream, pending->sync->event)) {
      *source = WW_SOURCE_STREAM_WAIT;
      return pending;
    }
  }
  return nullptr;
}

Block* Pool::take_locked(Block* b, std::size_t size, Stream stream, int source,
                         std::size_t requested, std::int64_t account) {
  erase_free_locked(b);
  if (b->size - size >= kMinBlock) {
    Block* r = new Block;
    r->addr = b->addr + size;
    r->size = b->size - size;
    r->seg = b->seg;
    r->prev = b;
    r->next = b->next;
    if (b->next != nullptr) b->next->prev = r;
    b->next = r;
    r->stream = b->stream;  // the remainder keeps the freeing stream and its pending epoch
    r->sync = b->sync;
    r->free_order = b->free_order;
    b->sync = nullptr;
    b->size = size;
    insert_free_locked(r);
  } else {
    unref_sync_locked(b->sync);
    b->sync = nullptr;
  }
  b->allocated = true;
  b->stream = stream;
  b->account = account;
  b->requested = requested;
  b->seg->live_blocks += 1;
  live_[b->addr] = b;
  total_.on_alloc(b->size, requested, source);
  stream_counters_locked(stream).on_alloc(b->size, requested, source);
  if (Account* a = account_locked(account)) a->counters.on_alloc(b->size, requested, source);
  if (source == WW_SOURCE_STREAM_WAIT) {
    total_.c.num_stream_waits_issued += 1;
    stream_counters_locked(stream).c.num_stream_waits_issued += 1;
    if (Account* a = account_locked(account)) a->counters.c.num_stream_waits_issued += 1;
  }
  ww_trace_entry t{};
  t.kind = WW_TRACE_ALLOC;
  t.source = source;
  t.ptr = b->addr;
  t.size = b->size;
  t.requested = requested;
  t.stream = stream;
  t.account = account;
  trace_->add(t);
  upstream_->check_handout(b->addr, b->size, stream);
  return b;
}

void Pool::trace_oom_locked(std::size_t nbytes, Stream s, int status, std::int64_t account) {
  total_.c.num_ooms += 1;
  stream_counters_locked(s).c.num_ooms += 1;
  if (Account* a = account_locked(account)) a->counters.c.num_ooms += 1;
  ww_trace_entry t{};
  t.kind = WW_TRACE_OOM;
  t.source = status;
  t.requested = nbytes;
  t.size = round_size(nbytes);
  t.stream = s;
  t.account = account;
  trace_->add(t);
}

int Pool::allocate(std::size_t nbytes, Stream stream, std::uintptr_t* out, int* source) {
  *out = 0;
  *source = WW_SOURCE_NONE;
  std::unique_lock<TimedMutex> lk = acquire();
  DriverCounts::bump(driver_.allocs);
  std::int64_t account = -1;
  auto ai = stream_to_account_.find(stream);
  if (ai != stream_to_account_.end()) account = ai->second;
  if (nbytes > (std::numeric_limits<std::size_t>::max() >> 2)) {
    trace_oom_locked(nbytes, stream, WW_OOM_CAPACITY, account);
    set_last_error("out of memory: " + format_bytes(nbytes) + " exceeds any capacity");
    return WW_OOM_CAPACITY;
  }
  const std::size_t size = round_size(nbytes);
  auto over_quota = [&]() {
    Account* a = account_locked(account);
    return a != nullptr && a->counters.c.quota_bytes != 0 &&
           a->counters.c.allocated_bytes + size > a->counters.c.quota_bytes;
  };
  auto quota_oom = [&]() {
    Account* a = account_locked(account);
    trace_oom_locked(nbytes, stream, WW_OOM_QUOTA, account);
    set_last_error("out of memory: account " + std::to_string(account) + " quota of " +
                   std::to_string(a->counters.c.quota_bytes) + " bytes, " +
                   std::to_string(a->counters.c.allocated_bytes) + " allocated, " +
                   std::to_string(size) + " more requested");
    return WW_OOM_QUOTA;
  };
  if (over_quota()) return quota_oom();
  auto backend_failed = [&](const std::string& why) {
    set_last_error("CUDA backend error, not a memory shortage: " + why);
    return WW_BACKEND_ERROR;
  };
  // A poisoned context (illegal address, device assert) serves nothing, not even cached blocks:
  // the trial must fail as a backend error, never be retried as an OOM.
  if (std::string sticky = upstream_->sticky_error(); !sticky.empty()) return backend_failed(sticky);

  int status = WW_OOM_CAPACITY;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (!deferred_.empty()) process_deferred_locked();
    int src = WW_SOURCE_NONE;
    Block* b = find_free_locked(size, stream, &src);
    if (b == nullptr && dirty_) {
      // Merge neighbours whose events completed since they were freed, then look again.
      coalesce_all_locked();
      b = find_free_locked(size, stream, &src);
    }
    if (b != nullptr) {
      // The search may have met the driver error (an event query): hand nothing out then.
      if (std::string sticky = upstream_->sticky_error(); !sticky.empty()) {
        return backend_failed(sticky);
      }
      take_locked(b, size, stream, src, nbytes, account);
      *out = b->addr;
      *source = src;
      return WW_OK;
    }
    // 4. a new segment, within capacity.
    std::uint64_t used = total_.c.reserved_bytes + pending_reserve_ + pending_release_;
    std::uint64_t avail = capacity_ > used ? capacity_ - used : 0;
    std::size_t seg_size = segment_size_for(size);
    if (seg_size > avail) seg_size = size <= avail ? size : 0;
    if (seg_size != 0) {
      pending_reserve_ += seg_size;
      lk.unlock();
      take_upstream_error();
      void* p = up_alloc_segment(seg_size, stream);
      std::string upstream_error = p == nullptr ? take_upstream_error() : std::string();
      lk.lock();
      pending_reserve_ -= seg_size;
      if (!upstream_error.empty()) return backend_failed(upstream_error);
      if (p != nullptr) {
        Segment* seg = new Segment;
        seg->addr = reinterpret_cast<std::uintptr_t>(p);
        seg->size = seg_size;
        seg->creator_stream = stream;
        seg->creator_account = account;
        Block* b = new Block;
        b->addr = seg->addr;
        b->size = seg_size;
        b->seg = seg;
        b->stream = stream;
        seg->first = b;
        segments_[seg->addr] = seg;
        total_.on_reserve(seg_size);
        stream_counters_locked(stream).on_reserve(seg_size);
        if (Account* a = account_locked(account)) a->counters.on_reserve(seg_size);
        ww_trace_entry t{};
        t.kind = WW_TRACE_SEGMENT_NEW;
        t.ptr = seg->addr;
        t.size = seg_size;
        t.stream = stream;
        t.account = account;
        trace_->add(t);
        if (over_quota()) {  // another thread of this account won the race while unlocked
          insert_free_locked(b);
          return quota_oom();
        }
        take_locked(b, size, stream, WW_SOURCE_NEW_SEGMENT, nbytes, account);
        *out = b->addr;
        *source = WW_SOURCE_NEW_SEGMENT;
        return WW_OK;
      }
      status = WW_OOM_UPSTREAM;
    } else {
      status = WW_OOM_CAPACITY;
    }
    // 5. coalesce what completed, release wholly free segments, retry once.
    if (attempt == 0) {
      coalesce_all_locked();
      std::vector<Segment*> segs = collect_releasable_locked();
      release_segments_unlocked(lk, segs);
    }
  }
  trace_oom_locked(nbytes, stream, status, account);
  set_last_error(std::string("out of memory: ") + format_bytes(nbytes) + ", " +
                 format_bytes(size) + " rounded, on stream " + std::to_string(stream) + "; " +
                 (status == WW_OOM_UPSTREAM
                      ? std::string("the device refused a new segment")
                      : "the pool's capacity of " + format_bytes(capacity_) + " is reached") +
                 " (" + format_bytes(total_.c.allocated_bytes) + " allocated, " +
                 format_bytes(total_.c.reserved_bytes) + " reserved)");
  return status;
}

bool Pool::try_merge_locked(Block* left, Block* right, bool close_open, bool same_stream_any) {
  if (left->allocated || right->allocated || left->deferred || right->deferred) return false;
  Stream st;
  SyncPoint* sync;
  std::uint64_t order;
  SyncPoint* drop = nullptr;
  Block* newer = left->free_order >= right->free_order ? left : right;
  // On a free (close_open false) no epoch is closed: a free coalesces with its neighbours every
  // time. The slow path (coalesce_all_locked) closes them to learn what completed.
  const bool ld = sync_done_locked(left, close_open);
  const bool rd = sync_done_locked(right, close_open);
  if (ld && rd) {
    // Both synchronized: the merged block is free for every stream.
    st = newer->stream;
    sync = nullptr;
    order = newer->free_order;
  } else if (!ld && !rd && left->stream == right->stream) {
    // Both pending on one stream: epochs there close in order, the later one covers both.
    st = left->stream;
    sync = newer_sync(left->sync, right->sync);
    drop = sync == left->sync ? right->sync : left->sync;  // the same epoch: one reference less
    order = newer->free_order;
  } else if (left->stream == right->stream && same_stream_any) {
    // One completed, one pending, both freed by one stream: merged under the pending epoch.
    // For that stream nothing changes (stream order covers its own frees); another stream
    // taking the merged block waits on the GPU for this stream's epoch, which covers the
    // pending part. Done only when the stream's own request missed (coalesce_stream_locked):
    // at every free it would merge and re-split a block per allocation (about 900 more
    // instructions per allocate+free pair, measured with callgrind).
    st = left->stream;
    sync = ld ? right->sync : left->sync;  // the completed one already dropped its epoch
    order = newer->free_order;
  } else {
    // A completed block is never tied to another stream's pending one: a stream taking it would
    // wait on the GPU for a neighbour's work (a false dependency between trials). Merged
    // later, once both complete. One stream's pair is merged when that stream misses.
    // Either way a request nothing else serves merges them first (coalesce_all_locked, once
    // their epochs complete); the stream's own pair also on its own miss.
    if (left->stream == right->stream) fragmented_.insert(left->stream);
    dirty_ = true;
    return false;
  }
  erase_free_locked(left);
  erase_free_locked(right);
  left->size += right->size;
  left->next = right->next;
  if (right->next != nullptr) right->next->prev = left;
  left->stream = st;
  left->sync = sync;
  left->free_order = order;
  right->sync = nullptr;
  unref_sync_locked(drop);
  delete right;
  insert_free_locked(left);
  return true;
}

Block* Pool::coalesce_locked(Block* b) {
  Block* prev = b->prev;  // try_merge deletes b when it merges it into prev
  if (prev != nullptr && try_merge_locked(prev, b)) b = prev;
  if (b->next != nullptr) try_merge_locked(b, b->next);
  return b;
}

void Pool::coalesce_stream_locked(Stream s) {
  fragmented_.erase(s);
  auto it = free_.find(s);
  if (it == free_.end()) return;
  std::vector<Block*> blocks(it->second.begin(), it->second.end());
  std::set<Block*> gone;
  for (Block* b : blocks) {
    if (gone.count(b) != 0) continue;
    // Walk left to the run's first free block of this stream, then merge rightwards.
    while (b->prev != nullptr && !b->prev->allocated && !b->prev->deferred && b->prev->stream == s) {
      b = b->prev;
    }
    while (b->next != nullptr && b->next->stream == s) {
      Block* right = b->next;
      if (!try_merge_locked(b, right, false, true)) break;
      gone.insert(right);
    }
  }
}

void Pool::coalesce_all_locked() {
  DriverCounts::bump(driver_.coalesce_scans);
  dirty_ = false;
  for (auto& kv : segments_) {
    Block* b = kv.second->first;
    while (b != nullptr && b->next != nullptr) {
      if (!try_merge_locked(b, b->next, true)) b = b->next;
    }
  }
}

void Pool::process_deferred_locked() {
  std::vector<Block*> still;
  std::vector<Block*> ready;
  for (Block* b : deferred_) {
    bool all = true;
    for (Event e : b->extra_events) all = all && up_event_completed(e);
    (all ? ready : still).push_back(b);
  }
  deferred_ = std::move(still);
  for (Block* b : ready) {
    for (Event e : b->extra_events) put_event_locked(e);
    b->extra_events.clear();
    b->deferred = false;
    insert_free_locked(b);
    coalesce_locked(b);
  }
}

std::vector<Segment*> Pool::collect_releasable_locked() {
  std::vector<Segment*> out;
  for (auto it = segments_.begin(); it != segments_.end();) {
    Segment* seg = it->second;
    bool ok = seg->live_blocks == 0;
    for (Block* b = seg->first; ok && b != nullptr; b = b->next) {
      ok = !b->deferred && sync_done_locked(b, true);
    }
    if (!ok) {
      ++it;
      continue;
    }
    Block* b = seg->first;
    while (b != nullptr) {
      Block* n = b->next;
      erase_free_locked(b);
      delete b;
      b = n;
    }
    seg->first = nullptr;
    total_.on_unreserve(seg->size);
    stream_counters_locked(seg->creator_stream).on_unreserve(seg->size);
    if (Account* a = account_locked(seg->creator_account)) a->counters.on_unreserve(seg->size);
    ww_trace_entry t{};
    t.kind = WW_TRACE_SEGMENT_RELEASE;
    t.ptr = seg->addr;
    t.size = seg->size;
    t.stream = seg->creator_stream;
    t.account = seg->creator_account;
    trace_->add(t);
    out.push_back(seg);
    it = segments_.erase(it);
  }
  return out;
}

void Pool::release_segments_unlocked(std::unique_lock<TimedMutex>& lk,
                                     std::vector<Segment*>& segs) {
  if (segs.empty()) return;
  std::uint64_t bytes = 0;
  for (Segment* s : segs) bytes += s->size;
  pending_release_ += bytes;
  lk.unlock();
  for (Segment* s : segs) {
    up_free_segment(reinterpret_cast<void*>(s->addr), s->size);
    delete s;
  }
  lk.lock();
  pending_release_ -= bytes;
  segs.clear();
}

void Pool::set_capacity(std::uint64_t capacity) {
  std::unique_lock<TimedMutex> lk = acquire();
  capacity_ = capacity;
  total_.c.capacity_bytes = capacity;
}

std::uint64_t Pool::release_cached() {
  std::unique_lock<TimedMutex> lk = acquire();
  if (!deferred_.empty()) process_deferred_locked();
  coalesce_all_locked();
  std::vector<Segment*> segs = collect_releasable_locked();
  std::uint64_t bytes = 0;
  for (Segment* s : segs) bytes += s->size;
  release_segments_unlocked(lk, segs);
  return bytes;
}

int Pool::free(std::uintptr_t ptr, Stream stream, bool has_stream) {
  auto g = acquire();
  return free_locked(ptr, stream, has_stream);
}

// PyTorch frees a tensor's block from its deallocator with the GIL held: waiting there for the
// pool's mutex stalls every Python thread of the process for as long as the holder runs (on a
// loaded host, milliseconds when the holder is preempted). So a free that finds the mutex held
// queues the block (a push under a lock held for nothing else) and returns; the next thread that
// takes the mutex frees it first. Later is safe: the event recorded then on `stream` covers at
// least the work queued at the free, and the block is nobody's meanwhile. Measured by
// experiments/bench_allocator.py --contention.
int Pool::free_nonblocking(std::uintptr_t ptr, Stream stream) {
  std::unique_lock<TimedMutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() && blocking_torch_free_.load(std::memory_order_relaxed)) {
    // The pool's first behaviour (kept as a knob for experiments/bench_allocator.py).
    const auto t0 = std::chrono::steady_clock::now();
    lk.lock();
    const auto ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
    lock_contended_.fetch_add(1, std::memory_order_relaxed);
    lock_wait_ns_.fetch_add(ns, std::memory_order_relaxed);
    torch_free_waits_.fetch_add(1, std::memory_order_relaxed);
    torch_free_wait_ns_.fetch_add(ns, std::memory_order_relaxed);
  }
  if (lk.owns_lock()) {
    lock_acquisitions_.fetch_add(1, std::memory_order_relaxed);
    drain_pending_locked();
    return free_locked(ptr, stream, true);
  }
  {
    std::lock_guard<std::mutex> q(pending_mu_);
    pending_frees_.push_back(PendingFree{ptr, stream});
    has_pending_.store(true, std::memory_order_release);
  }
  deferred_frees_.fetch_add(1, std::memory_order_relaxed);
  return WW_OK;
}

void Pool::drain_pending_locked() {
  if (!has_pending_.load(std::memory_order_acquire)) return;
  std::vector<PendingFree> todo;
  {
    std::lock_guard<std::mutex> q(pending_mu_);
    todo.swap(pending_frees_);
    has_pending_.store(false, std::memory_order_release);
  }
  for (const PendingFree& f : todo) free_locked(f.ptr, f.stream, true);
}

int Pool::free_locked(std::uintptr_t ptr, Stream stream, bool has_stream) {
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    set_last_error("free: pointer " + std::to_string(ptr) +
                   " was not allocated by this pool or was already freed");
    return WW_INVALID;
  }
  Block* b = it->second;
  live_.erase(it);
  DriverCounts::bump(driver_.frees);
  const Stream s = has_stream ? stream : b->stream;
  // Freed on another stream than the one it was allocated on: the work already queued on the
  // allocating stream may still use the block (it is the stream PyTorch and CuPy order the
  // block's uses by), so it is waited for like a record_stream stream. Found by the sim's
  // stream-hazard checker.
  if (s != b->stream && std::find(b->extra_streams.begin(), b->extra_streams.end(), b->stream) ==
                            b->extra_streams.end()) {
    b->extra_streams.push_back(b->stream);
  }
  total_.on_free(b->size, b->requested);
  stream_counters_locked(b->stream).on_free(b->size, b->requested);
  if (Account* a = account_locked(b->account)) a->counters.on_free(b->size, b->requested);
  b->seg->live_blocks -= 1;
  b->allocated = false;
  const std::int64_t account = b->account;
  b->account = -1;
  b->requested = 0;
  // The block joins its stream's open epoch; no event is recorded now (see SyncPoint).
  SyncPoint*& slot = open_sync_[s];
  if (slot == nullptr) {
    slot = new SyncPoint;
    slot->stream = s;
    slot->refs = 1;  // the open slot's reference
    slot->order = ++sync_order_;
  }
  SyncPoint* sp = slot;
  sp->refs += 1;
  sp->frees += 1;
  b->sync = sp;
  b->stream = s;
  b->free_order = ++free_counter_;
  frees_.fetch_add(1, std::memory_order_relaxed);
  upstream_->note_use(b->addr, b->size, s);
  ww_trace_entry t{};
  t.kind = WW_TRACE_FREE;
  t.ptr = b->addr;
  t.size = b->size;
  t.stream = s;
  t.seq = upstream_->stream_position(s);  // the work the free covers (sim; 0 on a device)
  t.account = account;
  trace_->add(t);
  if (sp->frees >= kEpochFrees) close_epoch_locked(sp);
  if (!b->extra_streams.empty()) {
    for (Stream x : b->extra_streams) {
      if (x == s) continue;
      Event e = get_event_locked();
      if (e != 0 && up_record_event(e, x)) {
        b->extra_events.push_back(e);
      } else {
        put_event_locked(e);
        up_synchronize_stream(x);
      }
    }
    b->extra_streams.clear();
    if (!b->extra_events.empty()) {
      b->deferred = true;
      deferred_.push_back(b);
      return WW_OK;
    }
  }
  insert_free_locked(b);
  coalesce_locked(b);
  return WW_OK;
}

int Pool::record_stream(std::uintptr_t ptr, Stream stream) {
  auto g = acquire();
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    set_last_error("record_stream: pointer " + std::to_string(ptr) + " is not live in this pool");
    return WW_INVALID;
  }
  Block* b = it->second;
  // Kept even for the allocating stream: the block may be freed on another stream (the free's
  // stream argument), and then the allocating stream's use must be waited for too. At the free,
  // only the freeing stream itself is skipped (stream order covers it).
  if (std::find(b->extra_streams.begin(), b->extra_streams.end(), stream) == b->extra_streams.end()) {
    b->extra_streams.push_back(stream);
  }
  return WW_OK;
}

void Pool::stats(ww_counters* out) {
  auto g = acquire();
  *out = total_.c;
}

void Pool::stream_stats(Stream s, ww_counters* out) {
  auto g = acquire();
  auto it = streams_.find(s);
  *out = it == streams_.end() ? ww_counters{} : it->second.c;
}

void Pool::reset_peaks() {
  auto g = acquire();
  auto reset = [](Counters& c) {
    c.c.peak_allocated_bytes = c.c.allocated_bytes;
    c.c.peak_reserved_bytes = c.c.reserved_bytes;
  };
  reset(total_);
  for (auto& kv : streams_) reset(kv.second);
  for (auto& kv : accounts_) reset(kv.second.counters);
}

std::uint64_t Pool::snapshot(ww_block_info* out, std::uint64_t max) {
  auto g = acquire();
  std::uint64_t n = 0;
  for (auto& kv : segments_) {
    Segment* seg = kv.second;
    for (Block* b = seg->first; b != nullptr; b = b->next) {
      if (n < max && out != nullptr) {
        ww_block_info& i = out[n];
        i.ptr = b->addr;
        i.size = b->size;
        i.segment_ptr = seg->addr;
        i.segment_size = seg->size;
        i.stream = b->stream;
        i.requested = b->requested;
        i.account = b->allocated ? b->account : -1;
        i.allocated = b->allocated ? 1 : 0;
        i.event_pending = (!b->allocated && (b->deferred || !sync_done_locked(b, true))) ? 1 : 0;
      }
      ++n;
    }
  }
  return n;
}

std::int64_t Pool::account_open() {
  auto g = acquire();
  std::int64_t id = next_account_++;
  accounts_[id] = Account{};
  return id;
}

int Pool::account_close(std::int64_t id) {
  auto g = acquire();
  auto it = accounts_.find(id);
  if (it == accounts_.end()) {
    set_last_error("account " + std::to_string(id) + " is not open");
    return WW_INVALID;
  }
  for (Stream s : it->second.streams) {
    stream_to_account_.erase(s);
    close_stream_epoch_locked(s);
  }
  accounts_.erase(it);
  return WW_OK;
}

int Pool::account_bind(std::int64_t id, Stream s) {
  auto g = acquire();
  Account* a = account_locked(id);
  if (a == nullptr) {
    set_last_error("account " + std::to_string(id) + " is not open");
    return WW_INVALID;
  }
  auto it = stream_to_account_.find(s);
  if (it != stream_to_account_.end()) {
    if (it->second == id) return WW_OK;
    set_last_error("stream " + std::to_string(s) + " is already bound to account " +
                   std::to_string(it->second) + "; unbind it there first");
    return WW_INVALID;
  }
  stream_to_account_[s] = id;
  a->streams.push_back(s);
  return WW_OK;
}

int Pool::account_unbind(std::int64_t id, Stream s) {
  auto g = acquire();
  Account* a = account_locked(id);
  auto it = stream_to_account_.find(s);
  if (a == nullptr || it == stream_to_account_.end() || it->second != id) {
    set_last_error("stream " + std::to_string(s) + " is not bound to account " +
                   std::to_string(id));
    return WW_INVALID;
  }
  stream_to_account_.erase(it);
  a->streams.erase(std::remove(a->streams.begin(), a->streams.end(), s), a->streams.end());
  close_stream_epoch_locked(s);
  return WW_OK;
}

int Pool::account_set_quota(std::int64_t id, std::uint64_t quota) {
  auto g = acquire();
  Account* a = account_locked(id);
  if (a == nullptr) {
    set_last_error("account " + std::to_string(id) + " is not open");
    return WW_INVALID;
  }
  a->counters.c.quota_bytes = quota;
  return WW_OK;
}

int Pool::account_stats(std::int64_t id, ww_counters* out) {
  auto g = acquire();
  Account* a = account_locked(id);
  if (a == nullptr) {
    set_last_error("account " + std::to_string(id) + " is not open");
    return WW_INVALID;
  }
  *out = a->counters.c;
  return WW_OK;
}

std::int64_t Pool::stream_account(Stream s) {
  auto g = acquire();
  auto it = stream_to_account_.find(s);
  return it == stream_to_account_.end() ? -1 : it->second;
}

}  // namespace ww
