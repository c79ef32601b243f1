// A minimal fork-join over row ranges for the CPU path: std::thread, no runtime
// dependency (OpenMP's runtime can clash with the one a framework loads).
#pragma once

#include <cstdint>
#include <functional>

namespace expertact::cpu {

// Number of worker threads the CPU path uses (EXPERTACT_NUM_THREADS, else the
// hardware concurrency), overridable with set_threads.
int threads();
void set_threads(int n);

// Calls fn(begin, end) over [0, n) split into contiguous chunks, one per
// thread; runs inline when the work (n * cost_per_item) is too small to repay
// starting threads (~20 us each).
void parallel_for(int64_t n, int64_t cost_per_item,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace expertact::cpu
