// A minimal fork-join for the CPU path: a lazily started pool of std::threads, no
// runtime dependency (OpenMP's runtime can clash with the one a framework loads).
#pragma once

#include <cstdint>
#include <functional>

namespace expertact::cpu {

// Number of worker threads the CPU path uses (EXPERTACT_NUM_THREADS, else the
// hardware concurrency), overridable with set_threads.
int threads();
void set_threads(int n);

// Calls fn(t) for t in [0, nt): t = 0 on the calling thread, the others on pool
// threads (started on first use, kept parked between calls: starting a thread
// costs 10-20 times as much as waking a parked one). A call made while
// another parallel region runs (a second caller thread, or from inside fn) runs
// all nt parts inline, in order. Exceptions from fn are rethrown on the caller.
void parallel_run(int nt, const std::function<void(int)>& fn);

// Calls fn(begin, end) over [0, n) split into contiguous chunks, one per
// thread; runs inline when the work (n * cost_per_item) is too small to repay
// waking threads.
void parallel_for(int64_t n, int64_t cost_per_item,
                  const std::function<void(int64_t, int64_t)>& fn);

// How many threads a job of `work` element-operations should use: one per
// kMinWorkPerThread, at most threads().
int threads_for(int64_t work);

}  // namespace expertact::cpu
