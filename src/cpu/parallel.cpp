// Fork-join over a parked thread pool (see parallel.h).
#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define EA_HAVE_ATFORK 1
#endif

namespace expertact::cpu {
namespace {

std::atomic<int> g_threads{0};

int default_threads() {
  if (const char* env = std::getenv("EXPERTACT_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

// Workers 1..started_ park on cv_work_ between regions; a region bumps
// generation_, and worker i runs part i when i <= job_workers_. The pool is
// never destroyed (its threads are detached and die with the process), so
// nothing waits on it at exit.
class Pool {
 public:
  // Runs fn(0..nt-1); false (nothing run) if another region holds the pool.
  bool try_run(int nt, const std::function<void(int)>& fn) {
    // A flag, not a mutex: a nested call from fn(0) on this same thread must see
    // "busy" (try_lock on a mutex the thread owns is undefined).
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) return false;
    struct Release {
      std::atomic<bool>& b;
      ~Release() { b.store(false, std::memory_order_release); }
    } release{busy_};
    start_workers(nt - 1);
    const int k = std::min(nt - 1, started_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      job_workers_ = k;
      pending_ = k;
      err_ = nullptr;
      ++generation_;
    }
    if (k > 0) cv_work_.notify_all();
    std::exception_ptr mine;
    try {
      fn(0);
      for (int t = k + 1; t < nt; ++t) fn(t);  // parts no worker could be started for
    } catch (...) {
      mine = std::current_exception();
    }
    std::exception_ptr theirs;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_done_.wait(lk, [&] { return pending_ == 0; });
      job_ = nullptr;
      theirs = err_;
      err_ = nullptr;
    }
    if (mine) std::rethrow_exception(mine);
    if (theirs) std::rethrow_exception(theirs);
    return true;
  }

 private:
  // Called by the region's owner only. A failure to start a thread is not an error:
  // the caller then runs the parts that thread would have run.
  void start_workers(int n) {
    while (started_ < n) {
      try {
        std::thread(&Pool::worker, this, started_ + 1).detach();
      } catch (...) {
        return;
      }
      ++started_;
    }
  }

  void worker(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_work_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (id > job_workers_) continue;
      const std::function<void(int)>* job = job_;
      lk.unlock();
      std::exception_ptr e;
      try {
        (*job)(id);
      } catch (...) {
        e = std::current_exception();
      }
      lk.lock();
      if (e && !err_) err_ = e;
      if (--pending_ == 0) cv_done_.notify_one();
    }
  }

  std::atomic<bool> busy_{false};  // one parallel region at a time
  std::mutex mu_;                   // guards everything below but started_
  std::condition_variable cv_work_, cv_done_;
  uint64_t generation_ = 0;
  const std::function<void(int)>* job_ = nullptr;
  int job_workers_ = 0;
  int pending_ = 0;
  int started_ = 0;  // touched only by the region's owner
  std::exception_ptr err_;
};

std::atomic<Pool*> g_pool{nullptr};

#if EA_HAVE_ATFORK
// A forked child has none of the parent's pool threads (and possibly a locked
// mutex): it forgets the old pool (leaked on purpose) and starts a new one.
void forget_pool_in_child() { g_pool.store(nullptr, std::memory_order_relaxed); }
#endif

Pool* pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return p;
  static std::once_flag atfork_once;
#if EA_HAVE_ATFORK
  std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
#else
  (void)atfork_once;
#endif
  Pool* fresh = new Pool();
  if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
  delete fresh;
  return p;
}

}  // namespace

int threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : default_threads();
}

void set_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

int threads_for(int64_t work) {
  // One thread per ~128K element-operations: below that, waking a parked worker
  // (a tenth to a third of the time one core takes for that much work) and the
  // shared cache lines cost more than the split saves.
  const int64_t kMinWorkPerThread = int64_t{1} << 17;
  const int64_t by_work = std::max<int64_t>(work / kMinWorkPerThread, 1);
  return static_cast<int>(std::min<int64_t>(threads(), by_work));
}

void parallel_run(int nt, const std::function<void(int)>& fn) {
  if (nt <= 0) return;
  if (nt == 1 || !pool()->try_run(nt, fn)) {
    for (int t = 0; t < nt; ++t) fn(t);
  }
}

void parallel_for(int64_t n, int64_t cost_per_item,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int nt = static_cast<int>(
      std::min<int64_t>(threads_for(n * std::max<int64_t>(cost_per_item, 1)), n));
  parallel_run(nt, [&](int t) { fn(n * t / nt, n * (t + 1) / nt); });
}

}  // namespace expertact::cpu
