// Thread stress test of the pool on the sim backend, for ThreadSanitizer (and ASan/UBSan).
// Many trial threads, one stream and account each, allocate, write and check a pattern, free on
// their own or a neighbour's stream, submit and finish simulated work; a reader thread takes
// stats and snapshots and reads the trace meanwhile. Exit status 0 on success.
//
//   pool_stress [threads=8] [iterations=3000]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "waterwave_pool.h"

namespace {

struct Live {
  uint64_t ptr;
  uint64_t nbytes;
  unsigned char pattern;
};

int fail(const char* what) {
  std::fprintf(stderr, "pool_stress: FAILED: %s\n", what);
  std::exit(1);
}

void worker(void* pool, int index, int threads, int iterations) {
  std::mt19937_64 rng(static_cast<uint64_t>(index) * 7919 + 1);
  const uint64_t stream = static_cast<uint64_t>(index) + 1;
  int64_t account = ww_account_open(pool);
  if (ww_account_bind(pool, account, stream) != WW_OK) fail("bind");
  std::vector<Live> live;
  for (int i = 0; i < iterations; ++i) {
    const unsigned op = static_cast<unsigned>(rng() % 100);
    if ((op < 50 || live.empty()) && live.size() < 32) {
      uint64_t nbytes = (rng() % 4 == 0) ? 1 + rng() % (2 << 20) : 1 + rng() % 8192;
      uint64_t ptr = 0;
      int src = 0;
      if (ww_pool_allocate(pool, nbytes, stream, &ptr, &src) != WW_OK) continue;
      unsigned char pattern = static_cast<unsigned char>(1 + rng() % 255);
      uint64_t n = nbytes < 4096 ? nbytes : 4096;
      std::memset(reinterpret_cast<void*>(ptr), pattern, n);
      live.push_back({ptr, nbytes, pattern});
    } else if (op < 85 || live.size() >= 32) {
      size_t k = static_cast<size_t>(rng() % live.size());
      Live l = live[k];
      live[k] = live.back();
      live.pop_back();
      const unsigned char* p = reinterpret_cast<const unsigned char*>(l.ptr);
      uint64_t n = l.nbytes < 4096 ? l.nbytes : 4096;
      for (uint64_t j = 0; j < n; ++j) {
        if (p[j] != l.pattern) fail("a live block was overwritten by another owner");
      }
      ww_sim_submit(pool, stream);
      uint64_t free_stream = (rng() % 5 == 0) ? (stream % threads) + 1 : stream;
      if (free_stream == stream && rng() % 2 == 0) {
        // PyTorch's entry point: queues the free when the pool's mutex is held (device 1 slot).
        waterwave_torch_free(reinterpret_cast<void*>(l.ptr), l.nbytes, 1,
                             reinterpret_cast<void*>(stream));
      } else if (ww_pool_free(pool, l.ptr, free_stream, 1) != WW_OK) {
        fail("free");
      }
    } else if (op < 95) {
      ww_sim_finish(pool, stream, 0);
    } else {
      ww_sim_finish(pool, 0, 1);
    }
  }
  for (const Live& l : live) {
    if (ww_pool_free(pool, l.ptr, 0, 0) != WW_OK) fail("final free");
  }
  ww_counters c{};
  if (ww_account_stats(pool, account, &c) != WW_OK || c.allocated_bytes != 0) fail("account");
  ww_account_close(pool, account);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 8;
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 3000;
  void* pool = ww_pool_create(WW_BACKEND_SIM, 0, 48ull << 20, nullptr, nullptr, nullptr);
  if (pool == nullptr) fail(ww_last_error());
  ww_pool_set_tracing(pool, 0);  // the trace would grow without bound here
  if (ww_torch_set_pool(1, pool) != WW_OK) fail("ww_torch_set_pool(1)");

  bool done = false;
  std::thread reader([&] {
    std::vector<ww_block_info> blocks(4096);
    for (int i = 0; !__atomic_load_n(&done, __ATOMIC_ACQUIRE); ++i) {
      ww_counters c{};
      ww_pool_stats(pool, &c);
      if (c.reserved_bytes > c.capacity_bytes) fail("capacity exceeded");
      ww_pool_snapshot(pool, blocks.data(), blocks.size());
      if (i % 16 == 0) ww_pool_release_cached(pool);
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> pool_threads;
  for (int i = 0; i < threads; ++i) pool_threads.emplace_back(worker, pool, i, threads, iterations);
  for (auto& t : pool_threads) t.join();
  __atomic_store_n(&done, true, __ATOMIC_RELEASE);
  reader.join();

  ww_sim_finish(pool, 0, 1);
  ww_counters c{};
  ww_pool_stats(pool, &c);
  if (c.allocated_bytes != 0 || c.num_allocs != c.num_frees) fail("accounting");
  uint64_t lock[6] = {0, 0, 0, 0, 0, 0};
  ww_pool_lock_stats(pool, lock);
  std::printf("pool_stress: %llu lock acquisitions, %llu contended, %llu frees queued\n",
              static_cast<unsigned long long>(lock[0]), static_cast<unsigned long long>(lock[1]),
              static_cast<unsigned long long>(lock[3]));
  ww_pool_release_cached(pool);
  ww_pool_stats(pool, &c);
  if (c.reserved_bytes != 0) fail("segments not released");
  // The PyTorch entry points: a pointer in the pool, and exhaustion as an exception with the
  // marker waterwave_hpo.memory.translate_oom looks for (PyTorch does not check for nullptr).
  if (ww_torch_set_pool(0, pool) != WW_OK) fail("ww_torch_set_pool");
  void* t = waterwave_torch_malloc(4096, 0, reinterpret_cast<void*>(7));
  if (t == nullptr) fail("waterwave_torch_malloc");
  waterwave_torch_free(t, 4096, 0, reinterpret_cast<void*>(7));
  bool threw = false;
  try {
    waterwave_torch_malloc(1ull << 40, 0, nullptr);
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()).find("WATERWAVE_POOL_OOM") != std::string::npos;
  }
  if (!threw) fail("waterwave_torch_malloc did not throw the marked OOM error");
  ww_pool_destroy(pool);  // also unregisters it from the PyTorch bridge
  bool threw_unset = false;
  try {
    waterwave_torch_malloc(16, 0, nullptr);
  } catch (const std::runtime_error&) {
    threw_unset = true;
  }
  if (!threw_unset) fail("waterwave_torch_malloc served a destroyed pool");
  std::printf("pool_stress: OK (%d threads x %d iterations)\n", threads, iterations);
  return 0;
}
