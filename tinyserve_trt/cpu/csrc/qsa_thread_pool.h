// A small persistent thread pool for the decode op's (sequence, KV head) tasks - used when the
// ORT runtime lacks KernelContext_ParallelFor (C API < 18) or TINYSERVE_NATIVE_POOL=own; otherwise
// parallel_for runs on the session's own intra-op pool (ExternalPool below). Measured on SmolLM2,
// 2 cores, ORT threads spinning (its default): 512 batch 1 26.4 ms on ORT's pool vs 30.5 on ours
// (33.9 with spinning off); 8K batch 1 34.3 vs 42.2 (34.9).
//
// Size: env TINYSERVE_NATIVE_THREADS (read once; default min(2, cores); 1 = no pool, run on
// ORT's calling thread). The caller works too, so N threads start N - 1 workers. One
// call uses the pool at a time; a concurrent caller (another session) runs its tasks
// serially instead of waiting. No OpenMP: the library must not bring its own runtime into
// ORT's process.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

namespace qsa {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int64_t size() const { return static_cast<int64_t>(workers_.size()) + 1; }
  bool usable() const { return getpid() == owner_; }

  // Runs fn(0 .. n-1); returns when all are done. Fewer than min_per_thread tasks per thread
  // run serially on the caller.
  void run(int64_t n, const std::function<void(int64_t)>& fn, int64_t min_per_thread) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    // A forked child has the pool object but not its threads: it runs serially.
    if (workers_.empty() || n < 2 || n < min_per_thread * size() || !busy.owns_lock() || getpid() != owner_) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      fn_ = &fn, total_ = n, next_ = 0, running_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    start_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [this] { return running_ == 0; });
    fn_ = nullptr;
  }

 private:
  void drain() {
    for (int64_t i; (i = next_.fetch_add(1)) < total_;) (*fn_)(i);
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(m_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard<std::mutex> lock(m_);
      if (--running_ == 0) done_.notify_one();
    }
  }

  const pid_t owner_ = getpid();
  std::vector<std::thread> workers_;
  std::mutex m_, busy_;
  std::condition_variable start_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t total_ = 0;
  std::atomic<int64_t> next_{0};
  int running_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Read once, at the first call: getenv on every call would race with a Python thread's
// os.environ write (setenv frees the array a concurrent getenv reads).
inline int pool_threads() {
  static const int threads = [] {
    const char* env = std::getenv("TINYSERVE_NATIVE_THREADS");
    int n = env ? std::atoi(env) : static_cast<int>(std::min(2u, std::max(1u, std::thread::hardware_concurrency())));
    return n < 1 ? 1 : n > 64 ? 64 : n;
  }();
  return threads;
}

inline ThreadPool& pool() {
  static ThreadPool instance(pool_threads());
  return instance;
}

// Another pool to run this thread's parallel_for calls on (the ORT session's intra-op pool,
// set by the op's compute for the call: qsa_decode_cpu.cpp). Its threads are ORT's own, which
// spin between nodes, so the call needs no cores ORT is spinning on.
struct ExternalPool {
  void (*run)(void* self, int64_t n, const std::function<void(int64_t)>& fn) = nullptr;
  void* self = nullptr;
};
inline thread_local ExternalPool external_pool;

// 1 in a forked child (no pool threads there).
inline int64_t pool_size() {
  if (external_pool.run) return pool_threads();
  return pool().usable() ? pool().size() : 1;
}

// A busy-wait's pause (another thread of the same call is about to publish what this one needs).
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

inline void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, int64_t min_per_thread = 2) {
  if (external_pool.run && n >= 2 && pool_threads() > 1) return external_pool.run(external_pool.self, n, fn);
  pool().run(n, fn, min_per_thread);
}

}  // namespace qsa
