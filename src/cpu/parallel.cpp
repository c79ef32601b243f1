// Fork-join over row ranges with std::thread (see parallel.h).
#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

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
}  // namespace

int threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : default_threads();
}

void set_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

void parallel_for(int64_t n, int64_t cost_per_item,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  // Below ~256K element-operations one thread finishes before a second one starts.
  const int64_t kMinWorkPerThread = 1 << 18;
  int64_t total = n * std::max<int64_t>(cost_per_item, 1);
  int64_t by_work = std::max<int64_t>(total / kMinWorkPerThread, 1);
  int nt = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(threads()), by_work, n}));
  if (nt <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(nt - 1);
  std::exception_ptr err;
  std::atomic<bool> failed{false};
  auto chunk = [&](int t) {
    int64_t b = n * t / nt, e = n * (t + 1) / nt;
    try {
      fn(b, e);
    } catch (...) {
      if (!failed.exchange(true)) err = std::current_exception();
    }
  };
  for (int t = 1; t < nt; ++t) workers.emplace_back(chunk, t);
  chunk(0);
  for (auto& w : workers) w.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace expertact::cpu
