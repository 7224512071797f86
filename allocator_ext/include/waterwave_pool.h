/*
 * waterwave_pool.h: the C API of the stream-aware memory pool (libwaterwave_pool.so).
 *
 * One pool serves every co-hosted trial on one GPU. Free blocks remember the stream that freed them
 * and an event recorded there, and an allocation for stream S takes, in this order (Waterwave,
 * IEEE TC 72(10) 2023, "prioritized allocation"):
 *   1. a free block last used by S (no synchronization),
 *   2. a free block from another stream whose event has completed,
 *   3. a free block from another stream whose event is pending, after cuStreamWaitEvent(S, event)
 *      (a GPU-side wait; the CPU never blocks),
 *   4. a new segment from the upstream, within the pool's capacity,
 *   5. coalesce and release wholly free cached segments, retry; then fail.
 *
 * All sizes are bytes. Streams are opaque 64-bit handles (CUstream == cudaStream_t; for the sim
 * backend any integer, 0 being the default stream). Every function is thread-safe.
 * Loaded from Python with ctypes (waterwave_hpo/memory/_lib.py mirrors these declarations).
 */
#ifndef WATERWAVE_POOL_H_
#define WATERWAVE_POOL_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define WW_API __attribute__((visibility("default")))
#else
#define WW_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Where segments come from. */
enum ww_backend {
  WW_BACKEND_SIM = 0,          /* host memory, virtual streams and events (tests, CPU-only machines) */
  WW_BACKEND_CUDA = 1,         /* the CUDA driver (libcuda.so.1, dlopen'ed) */
  WW_BACKEND_EXTERNAL = 2,     /* segments from callbacks (CuPy), events from the CUDA driver */
  WW_BACKEND_SIM_EXTERNAL = 3, /* segments from callbacks, simulated events (tests the callback path) */
};

/* Result of ww_pool_allocate. */
enum ww_status {
  WW_OK = 0,
  WW_OOM_CAPACITY = 1, /* the pool's capacity_bytes would be exceeded */
  WW_OOM_QUOTA = 2,    /* the stream's account quota would be exceeded */
  WW_OOM_UPSTREAM = 3, /* the upstream (device) refused a new segment */
  WW_INVALID = 4,      /* bad argument (unknown pointer, unknown account, ...) */
  WW_BACKEND_ERROR = 5, /* the backend failed: no driver or device, or a driver error other than
                          CUDA_ERROR_OUT_OF_MEMORY (illegal address, ...): never an OOM */
  WW_NO_POOL = 6        /* PyTorch entry points: no pool is installed for that device */
};

/* Where an allocation was served from (the priority order above). */
enum ww_source {
  WW_SOURCE_NONE = 0,
  WW_SOURCE_SAME_STREAM = 1,
  WW_SOURCE_COMPLETED_EVENT = 2,
  WW_SOURCE_STREAM_WAIT = 3,
  WW_SOURCE_NEW_SEGMENT = 4
};

enum ww_trace_kind {
  WW_TRACE_ALLOC = 1,
  WW_TRACE_FREE = 2,
  WW_TRACE_STREAM_WAIT = 3,
  WW_TRACE_OOM = 4,
  WW_TRACE_SUBMIT = 5,
  WW_TRACE_FINISH = 6,
  WW_TRACE_SEGMENT_NEW = 7,
  WW_TRACE_SEGMENT_RELEASE = 8
};

/* Counters of the whole pool, of one stream, or of one account. */
typedef struct ww_counters {
  uint64_t allocated_bytes;      /* bytes in live blocks (rounded sizes) */
  uint64_t requested_bytes;      /* bytes asked for by live allocations (before rounding) */
  uint64_t reserved_bytes;       /* bytes of live segments (for a stream/account: segments it caused) */
  uint64_t peak_allocated_bytes;
  uint64_t peak_reserved_bytes;
  uint64_t num_allocs;
  uint64_t num_frees;
  uint64_t num_same_stream;
  uint64_t num_completed_event;
  uint64_t num_stream_wait;
  uint64_t num_new_segment;
  uint64_t num_stream_waits_issued;
  uint64_t num_ooms;
  uint64_t num_segments;         /* live segments (pool) / segments caused (stream, account) */
  uint64_t quota_bytes;          /* accounts only; 0 = none */
  uint64_t capacity_bytes;       /* pool only */
} ww_counters;

/* What the pool cost since it was made (or since ww_pool_reset_driver_stats): its calls into the
 * upstream by kind (on the cuda backend each is one driver call, plus the cuCtxGetCurrent that
 * checks the primary context is current) and its mutex. A steady-state training step should cost
 * no segment call and no synchronisation; see tests/memory/test_step_counts.py. */
typedef struct ww_driver_counters {
  uint64_t allocs;            /* ww_pool_allocate / PyTorch mallocs served (failures included) */
  uint64_t frees;             /* frees taken under the mutex (queued PyTorch frees included) */
  uint64_t segment_allocs;    /* cuMemAlloc (or the segment callback) */
  uint64_t segment_frees;     /* cuMemFree (or the segment callback) */
  uint64_t event_creates;     /* cuEventCreate (the pool keeps a cache of up to 4096 events) */
  uint64_t event_destroys;    /* cuEventDestroy */
  uint64_t event_records;     /* cuEventRecord */
  uint64_t event_queries;     /* cuEventQuery */
  uint64_t stream_waits;      /* cuStreamWaitEvent (GPU-side, never blocks the CPU) */
  uint64_t stream_syncs;      /* cuStreamSynchronize (CPU-side wait: only when no event could be had) */
  uint64_t lock_acquisitions; /* the pool's mutex taken */
  uint64_t lock_contended;    /* ... found held */
  uint64_t lock_wait_ns;      /* ns waited for it (contended acquisitions) */
  uint64_t lock_hold_ns;      /* ns it was held; measured only while profiling is on */
  uint64_t coalesce_scans;    /* walks over every segment's blocks (coalesce_all), O(blocks) each */
  uint64_t cross_stream_searches; /* allocations that looked beyond their own stream's free blocks */
} ww_driver_counters;

typedef struct ww_trace_entry {
  int32_t kind;          /* ww_trace_kind */
  int32_t source;        /* ww_source (ALLOC) or ww_status (OOM) */
  uint64_t ptr;
  uint64_t size;         /* rounded block size, or segment size */
  uint64_t requested;    /* bytes asked for (ALLOC, OOM) */
  uint64_t stream;       /* allocating / freeing / waiting / submitting stream */
  uint64_t other_stream; /* STREAM_WAIT: the stream whose event was waited on */
  uint64_t seq;          /* sim event sequence: FREE, STREAM_WAIT: event's seq; SUBMIT/FINISH: count */
  int64_t account;       /* -1 = none */
} ww_trace_entry;

typedef struct ww_block_info {
  uint64_t ptr;
  uint64_t size;
  uint64_t segment_ptr;
  uint64_t segment_size;
  uint64_t stream;        /* allocating stream (live) or freeing stream (free) */
  uint64_t requested;     /* live blocks */
  int64_t account;        /* live blocks; -1 = none */
  int32_t allocated;      /* 1 live, 0 free */
  int32_t event_pending;  /* free blocks: 1 if the freeing stream's event has not completed */
} ww_block_info;

/* One stream hazard the sim's checker found: [ptr, ptr + size) was handed to `stream` while
 * `other_stream`'s use of it (its first `use_seq` units of work) had neither completed (only
 * `completed` units had) nor been waited on by `stream`. */
typedef struct ww_hazard {
  uint64_t ptr;
  uint64_t size;
  uint64_t stream;
  uint64_t other_stream;
  uint64_t use_seq;
  uint64_t completed;
} ww_hazard;

/* Segment upstream callbacks (backends EXTERNAL and SIM_EXTERNAL). Called without the pool's lock. */
typedef uint64_t (*ww_segment_alloc_fn)(void* ctx, uint64_t nbytes, uint64_t stream); /* 0 = fail */
typedef void (*ww_segment_free_fn)(void* ctx, uint64_t ptr, uint64_t nbytes);

WW_API const char* ww_last_error(void); /* this thread's last error message */
/* For segment callbacks: the failure about to be returned (0) is not "out of memory" but a backend
 * error with this message; the allocation then fails with WW_BACKEND_ERROR. */
WW_API void ww_set_upstream_error(const char* message);
WW_API uint64_t ww_round_size(uint64_t nbytes);

WW_API void* ww_pool_create(int backend, int device, uint64_t capacity_bytes, ww_segment_alloc_fn seg_alloc,
                     ww_segment_free_fn seg_free, void* ctx);
WW_API void ww_pool_destroy(void* pool);
WW_API int ww_pool_allocate(void* pool, uint64_t nbytes, uint64_t stream, uint64_t* out_ptr, int* out_source);
WW_API int ww_pool_free(void* pool, uint64_t ptr, uint64_t stream, int has_stream);
WW_API int ww_pool_record_stream(void* pool, uint64_t ptr, uint64_t stream);
WW_API uint64_t ww_pool_release_cached(void* pool);
/* The most bytes of segments the pool may hold from now on (UINT64_MAX: no limit). Segments it
 * already holds are kept; while they exceed the new capacity no new segment is taken. */
WW_API void ww_pool_set_capacity(void* pool, uint64_t capacity_bytes);
WW_API void ww_pool_stats(void* pool, ww_counters* out);
WW_API void ww_pool_stream_stats(void* pool, uint64_t stream, ww_counters* out);
WW_API void ww_pool_reset_peaks(void* pool);
/* Contention of the pool's mutex: out6 = {acquisitions, contended acquisitions, ns waited,
 * frees of waterwave_torch_free queued because the mutex was held, waterwave_torch_free calls that
 * waited for it (only with the knob below), ns they waited}. */
WW_API void ww_pool_lock_stats(void* pool, uint64_t* out6);
/* Events the pool recorded for frees, and frees, since it was made: out2 = {events, frees}. Frees
 * of one stream share one event per epoch (at most 64 frees), recorded only when another stream,
 * a segment release or a snapshot needs it. */
WW_API void ww_pool_event_stats(void* pool, uint64_t* out2);
/* Benchmark knob: 1 makes waterwave_torch_free wait for the mutex (the pool's first behaviour),
 * 0 (default) queues the free when the mutex is held. */
WW_API void ww_pool_set_torch_free_blocking(void* pool, int blocking);
/* What the pool cost so far (ww_driver_counters); reset sets every count to zero. */
WW_API void ww_pool_driver_stats(void* pool, ww_driver_counters* out);
WW_API void ww_pool_reset_driver_stats(void* pool);
/* 1: measure how long the mutex is held (two clock reads per acquisition); 0 (default): not. */
WW_API void ww_pool_set_profiling(void* pool, int enabled);
WW_API uint64_t ww_pool_snapshot(void* pool, ww_block_info* out, uint64_t max_entries);

WW_API int64_t ww_account_open(void* pool);
WW_API int ww_account_close(void* pool, int64_t account);
WW_API int ww_account_bind(void* pool, int64_t account, uint64_t stream);
WW_API int ww_account_unbind(void* pool, int64_t account, uint64_t stream);
WW_API int ww_account_set_quota(void* pool, int64_t account, uint64_t quota_bytes);
WW_API int ww_account_stats(void* pool, int64_t account, ww_counters* out);
WW_API int64_t ww_stream_account(void* pool, uint64_t stream);

WW_API void ww_pool_set_tracing(void* pool, int enabled);
WW_API uint64_t ww_trace_count(void* pool);
WW_API uint64_t ww_trace_read(void* pool, uint64_t first, ww_trace_entry* out, uint64_t max_entries);
WW_API void ww_trace_clear(void* pool);

/* sim backends only; return -1 when the pool has no simulated device. */
WW_API int64_t ww_sim_submit(void* pool, uint64_t stream);
WW_API int ww_sim_finish(void* pool, uint64_t stream, int all_streams);
/* Stream-hazard checker: `stream`'s work queued so far uses [ptr, ptr + size). -1 if not sim. */
WW_API int ww_sim_use(void* pool, uint64_t ptr, uint64_t size, uint64_t stream);
/* Hazards found so far (copies up to max_entries); the total, or -1 if not sim. */
WW_API int64_t ww_sim_hazards(void* pool, ww_hazard* out, uint64_t max_entries);

/* PyTorch bridge: torch.cuda.memory.CUDAPluggableAllocator(path, "waterwave_torch_malloc",
 * "waterwave_torch_free"); signatures match torch/csrc/cuda/CUDAPluggableAllocator.h
 * (std::function<void*(size_t, int, cudaStream_t)>, std::function<void(void*, size_t, int, cudaStream_t)>). */
WW_API int ww_torch_set_pool(int device, void* pool);
/* Why `device` has no pool (named by the WW_NO_POOL error of the PyTorch entry points). */
WW_API int ww_torch_set_unavailable(int device, const char* reason);
/* The non-throwing core of waterwave_torch_malloc: a ww_status; the message in ww_last_error().
 * The torch-facing shim (allocator_ext/torch_shim/) turns it into PyTorch's own exception types. */
WW_API int waterwave_torch_try_malloc(size_t size, int device, void* stream, void** out);
WW_API void* waterwave_torch_malloc(size_t size, int device, void* stream);
WW_API void waterwave_torch_free(void* ptr, size_t size, int device, void* stream);
WW_API void waterwave_torch_record_stream(void* ptr, void* stream);

#ifdef __cplusplus
}
#endif
#endif /* WATERWAVE_POOL_H_ */
