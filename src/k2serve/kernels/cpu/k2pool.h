// k2pool.h: the CPU kernel's thread pool, included by k2cpu.cpp (one translation unit:
// the includes and helpers above its include line are its context).
#pragma once

// Thread pool: threads grouped by NUMA node; a job runs fn(node, rank in node) on every thread
// (the calling thread is rank 0 of node 0). Workers spin briefly, then sleep.
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <climits>
// Sleep while *addr == val / wake every sleeper: one syscall wakes all workers at once (a
// condition variable would hand its mutex from one waking thread to the next).
static inline void futex_wait(std::atomic<uint32_t>* addr, uint32_t val) {
  syscall(SYS_futex, (uint32_t*)addr, FUTEX_WAIT_PRIVATE, val, nullptr, nullptr, 0);
}
static inline void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, (uint32_t*)addr, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
#else
static inline void futex_wait(std::atomic<uint32_t>*, uint32_t) { std::this_thread::yield(); }
static inline void futex_wake_all(std::atomic<uint32_t>*) {}
#endif

static inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Pool {
  int nthreads = 1;
  int nnodes = 1;
  std::vector<int> node_of, rank_of, node_size;
  std::vector<std::thread> threads;
  std::mutex call_mu;  // one k2_* call at a time per pool
  std::atomic<uint32_t> gen{0};
  std::atomic<int> sleepers{0};
  std::atomic<int> pending{0};
  std::atomic<uint32_t> closed{0};  // the last generation whose job is finished
  std::atomic<int> inside{0};       // workers inside a job (or checking whether it is closed)
  int delay_rank = -1, delay_us = 0;  // tests: this worker starts its jobs late (k2_pool_delay)
  std::atomic<int64_t> spin_until{0};  // steady-clock ns: idle workers spin (not sleep) until then
  std::function<void(int, int)> job;
  std::atomic<bool> stop{false};
  int spin = 20000;
  // per-node work counters
  struct alignas(64) NodeSync {
    std::atomic<int64_t> next{0};
    alignas(64) std::atomic<int64_t> next2{0};  // a second phase's counter (no reset barrier)
  };
  std::vector<NodeSync> sync;

  void worker(int tid, const std::vector<int>& cpus) {
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cpus) CPU_SET(c, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    uint32_t seen = 0;
    for (;;) {
      uint32_t g;
      for (;;) {  // spin `spin` pauses (and until spin_until: prewake), then sleep
        int n = 0;
        while ((g = gen.load(std::memory_order_acquire)) == seen) {
          if (++n >= spin && (n & 255) == 0 && steady_ns() >= spin_until.load(std::memory_order_relaxed))
            break;
          K2_PAUSE();
        }
        if (g != seen) break;
        sleepers.fetch_add(1);  // seq_cst: pairs with run()'s gen increment, then load
        futex_wait(&gen, seen);  // returns for a job, a prewake (spin again) or spuriously
        sleepers.fetch_sub(1);
      }
      if (stop.load(std::memory_order_acquire)) return;
      seen = g;
      // a worker that wakes after its job was closed (an elastic job finished without it)
      // must not touch that job: `job` may already be the next one's
      inside.fetch_add(1);  // seq_cst: pairs with run()'s store of `closed`, then load
      if ((int32_t)(closed.load() - g) >= 0) {
        inside.fetch_sub(1);
        continue;
      }
      if (delay_rank == tid) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      job(node_of[tid], rank_of[tid]);
      pending.fetch_sub(1, std::memory_order_acq_rel);
      inside.fetch_sub(1, std::memory_order_release);
    }
  }

  // Run fn(node, rank) on every thread; the caller is rank 0 of node 0. `elastic`: fn takes its
  // work from shared counters and never waits for a given thread (its phases wait for work
  // done, not for threads arrived), so the call returns once the caller's fn returned and the
  // workers inside fn left it: a worker that did not get a core in time (torch's OpenMP
  // threads still spinning after its last parallel op, another process) skips the job instead
  // of holding up the step. Otherwise every worker runs fn before run() returns.
  void run(std::function<void(int, int)> fn, bool elastic = false) {
    job = std::move(fn);
    pending.store(nthreads - 1, std::memory_order_release);
    const uint32_t g = gen.fetch_add(1) + 1;
    if (sleepers.load() > 0) futex_wake_all(&gen);
    job(node_of[0], rank_of[0]);
    if (!elastic)
      for (int n = 0; pending.load(std::memory_order_acquire) != 0; ++n) relax(n);
    closed.store(g);  // seq_cst (see worker)
    for (int n = 0; inside.load() != 0; ++n) relax(n);
  }

  // Wake sleeping workers and keep idle ones spinning for `usec`: a step about to come (its
  // routing known, its inputs on the way) then starts on running threads instead of waking
  // them (a futex wake-up per thread; from a deep idle state, tens to hundreds of us).
  void prewake(int usec) {
    spin_until.store(steady_ns() + (int64_t)usec * 1000, std::memory_order_relaxed);
    if (sleepers.load() > 0) futex_wake_all(&gen);
  }

  ~Pool() {
    stop.store(true, std::memory_order_release);
    gen.fetch_add(1, std::memory_order_acq_rel);
    futex_wake_all(&gen);
    for (auto& t : threads) t.join();
  }
};
