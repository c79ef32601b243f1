// Host side of the CUDA path for one storage type: proves alignment to pick the
// pack width, merges contiguous rows, picks lanes per row and column splits,
// and launches. Included by one .cu file per dtype so they compile in parallel.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/problem.h"
#include "cuda/common.cuh"
#include "cuda/entry.h"
#include "cuda/glu_flat.cuh"
#include "cuda/glu_kernels.cuh"
#include "cuda/glu_realign.cuh"

namespace expertact::cuda {

constexpr int kThreads = 128;

// One operand as seen by the alignment proof: its base pointer, row stride (in
// elements) and the elements one pack of it holds; rows: its own row count when it
// differs from the call's (a per-expert bias has E rows), else -1.
struct Operand {
  const void* ptr;
  int64_t stride;
  int mult;  // elements per output element: 1, or 2 for an interleaved gate_up row
  int64_t rows = -1;
};

inline bool operand_aligned(const Operand& o, int V, int es, int64_t rows) {
  const int64_t bytes = std::min<int64_t>(16, static_cast<int64_t>(o.mult) * V * es);
  if (reinterpret_cast<uintptr_t>(o.ptr) % bytes != 0) return false;
  return rows <= 1 || (o.stride * es) % bytes == 0;
}

// The widest pack that every operand's pointer and row stride allow and that
// divides F: 16 bytes of the widest operand (for interleaved rows, 16 bytes of
// gate_up, so every access of a warp is one contiguous 512-byte run; 16-byte
// output packs made the gate_up accesses two strided halves, 25% slower in
// backward), then 4 bytes, then one element.
inline int pick_pack(const Operand* ops, int n, int64_t F, int64_t rows, int es, int step) {
  const int widest = 16 / es / step;
  const int narrow = 4 / es;  // 2 halves, or 1 float
  for (int V : {widest, narrow, 1}) {
    if (V < 1 || F % V != 0) continue;
    bool ok = true;
    for (int i = 0; i < n && ok; ++i)
      ok = operand_aligned(ops[i], V, es, ops[i].rows >= 0 ? ops[i].rows : rows);
    if (ok) return V;
  }
  return 1;
}

// The pick_pack operands of one gate/up pair, written to out (at most 2); returns how many.
// Separate halves (step 1) are two operands; an interleaved pair (step 2) is one pack of
// double width whose alignment is gate's (up sits one element after it), so up's pointer is
// not an operand of its own. rows: the pair's row count when it differs from the call's.
inline int gu_operands(Operand* out, const void* g, int64_t g_stride, const void* u, int64_t u_stride, int step,
                       int64_t rows = -1) {
  out[0] = {g, g_stride, step, rows};
  if (step != 1) return 1;
  out[1] = {u, u_stride, 1, rows};
  return 2;
}

inline int sm_count(int device) {
  static int cache[64] = {0};
  if (device >= 0 && device < 64 && cache[device] > 0) return cache[device];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0)
    n = 132;
  if (device >= 0 && device < 64) cache[device] = n;
  return n;
}

struct LaunchShape {
  int threads = kThreads;
  int G = 32;
  int64_t splits = 1;
  int64_t blocks = 1;
};

// Tuned at the seed size (docs/notes/perf-notes.md, "Row kernels"): blocks
// of 128 threads; 32 lanes per row (a 3072-wide bf16 row is then 12 packs per
// lane; 64 lanes were 5-15% slower); when rows alone leave the GPU underfilled,
// the row goes to whole blocks, one tile of G * U packs per block.
// A row sum (weight gradient) keeps G <= 32 and no splits; max_lanes caps G
// (32 for kernels whose lanes of a row shuffle among themselves).
inline LaunchShape shape_for(int64_t rows, int64_t packs, int U, bool row_sum, int device,
                             int max_lanes) {
  LaunchShape s;
  s.threads = kThreads;
  auto lanes_for = [&](int cap) {
    int G = 1;
    while (G < cap && static_cast<int64_t>(G) * 2 * U <= packs) G *= 2;
    return G;
  };
  s.G = lanes_for(32);
  int64_t row_blocks = (rows + s.threads / s.G - 1) / (s.threads / s.G);
  const int64_t target = static_cast<int64_t>(sm_count(device)) * 32;  // blocks for a full GPU
  if (!row_sum && row_blocks < target) {
    s.G = lanes_for(std::min(s.threads, max_lanes));
    row_blocks = (rows + s.threads / s.G - 1) / (s.threads / s.G);
    const int64_t tile = static_cast<int64_t>(s.G) * U;
    const int64_t tiles = (packs + tile - 1) / tile;
    // One tile per block, but at most 2^31 - 1 blocks in all.
    s.splits = std::max<int64_t>(1, std::min<int64_t>(tiles, 0x7fffffff / row_blocks));
  }
  s.blocks = row_blocks * s.splits;
  return s;
}

// Rows that follow each other in every operand (no gap, no weights) form one
// long row: the pack width then depends on the base pointers alone, so an odd
// F in a contiguous tensor still moves 16-byte packs.
inline bool rows_mergeable(const detail::GluProblem& p, std::initializer_list<int64_t> planar_strides,
                           std::initializer_list<int64_t> input_strides) {
  if (p.w != nullptr || p.rows <= 1) return false;
  for (int64_t s : planar_strides)
    if (s != p.F) return false;
  for (int64_t s : input_strides)
    if (s != p.step * p.F) return false;
  return true;
}

// Merging contiguous rows into one helps the row kernels when the rows alone
// only allow a narrower pack (odd F) or are too short to give a warp work
// (under 64 packs); otherwise rows of their own were faster (merged rows took
// 2-10% longer in the seed-size forward). The flat kernels merge
// whenever the merged pack is 16 bytes (flat_wide): one row needs no division.
inline void merge_if_better(const Operand* ops, int n, int es, int step, int64_t& rows,
                            int64_t& F, int& V, bool flat_wide = false) {
  const int Vm = pick_pack(ops, n, rows * F, 1, es, step);
  if (Vm > V || F / V < 64 || (flat_wide && Vm == 16 / es / step)) {
    F = rows * F;
    rows = 1;
    V = Vm;
  }
}

// Calls go(IntTag<V>) for a pack width V that has a kernel instance: the widths
// pick_pack can return (16 bytes of the widest operand, 4 bytes, 1); planar
// rows narrower than 16 bytes go to the realigning kernels instead.
template <typename T, int kStep, typename Go>
Status dispatch_pack(int V, Go&& go) {
  constexpr int kWide = 16 / sizeof(T) / kStep, kNarrow = 4 / sizeof(T) > 0 ? 4 / sizeof(T) : 1;
  if (V == kWide) return go(detail::IntTag<kWide>{});
  if constexpr (kStep == 2) {
    if constexpr (kNarrow != kWide && kNarrow != 1) {
      if (V == kNarrow) return go(detail::IntTag<kNarrow>{});
    }
    if (V == 1) return go(detail::IntTag<1>{});
  }
  // A width with no kernel would silently skip elements: refuse loudly instead.
  return detail::fail(Status::kInternal, "no kernel for a pack of ", V, " elements");
}

template <typename T, Activation A, int kStep, bool kW>
Status launch_fwd_v(int V, const KernelArgs<T>& a, const LaunchShape& s, cudaStream_t st) {
  return dispatch_pack<T, kStep>(V, [&](auto vtag) {
    constexpr int Vc = decltype(vtag)::value;
    glu_fwd_kernel<T, A, kStep, kW, Vc><<<static_cast<unsigned>(s.blocks), s.threads, 0, st>>>(a, s.G);
    return Status::kOk;
  });
}

template <typename T, Activation A, int kStep, bool kW, bool kDW>
Status launch_bwd_v(int V, const KernelArgs<T>& a, const LaunchShape& s, cudaStream_t st) {
  return dispatch_pack<T, kStep>(V, [&](auto vtag) {
    constexpr int Vc = decltype(vtag)::value;
    glu_bwd_kernel<T, A, kStep, kW, kDW, Vc><<<static_cast<unsigned>(s.blocks), s.threads, 0, st>>>(a, s.G);
    return Status::kOk;
  });
}

template <typename T>
KernelArgs<T> base_args(const detail::GluProblem& p) {
  KernelArgs<T> a{};
  a.g = static_cast<const T*>(p.g);
  a.u = static_cast<const T*>(p.u);
  a.g_stride = p.g_stride;
  a.u_stride = p.u_stride;
  a.w = p.w;
  a.w_stride = p.w_stride;
  a.rows = p.rows;
  a.c = math::Coeffs{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  return a;
}

// Planar rows whose operands allow no 16-byte pack (after merging contiguous
// rows) go to the realigning kernels (glu_realign.cuh), which keep 16-byte
// accesses by realigning in registers.
template <typename T>
bool use_realign(int step, int V) {
  return step == 1 && V != static_cast<int>(16 / sizeof(T));
}

// The realigning kernels' packs (16 bytes, counted up: a row's own packs
// depend on its alignment) and launch shape: lanes of a row shuffle, so G <= 32.
template <typename T>
LaunchShape realign_shape(KernelArgs<T>& a, bool row_sum, int device) {
  constexpr int V = 16 / sizeof(T);
  a.packs = (a.cols + V - 1) / V;
  const LaunchShape s = shape_for(a.rows, a.packs, 1, row_sum, device, 32);
  a.splits = s.splits;
  return s;
}

// The flat kernels (glu_flat.cuh) take the calls whose operands all allow
// 16-byte packs and that want no weight gradient, when chosen (entry.h).
template <typename T>
bool use_flat(KernelChoice k, int step, int V, bool row_sum) {
  return k != KernelChoice::kRows && !row_sum && V == static_cast<int>(16 / sizeof(T)) / step;
}

// Blocks of 256 threads: 128 gained nothing beyond the round-to-round spread at
// the seed size where flat is the choice (within 0.3% for swiglu; as unsteady as
// 256 with a limit; docs/notes/perf-notes.md, "Flat kernels and the `auto` choice").
constexpr int kFlatThreads = 256;

// Fills the flat numbering of rows x packs; false (take the row kernels) when
// the grid would pass 2^31 - 1 blocks, or several rows hold more packs than the
// 32-bit division allows.
template <typename T>
bool flat_shape(KernelArgs<T>& a, int64_t rows, int64_t packs, LaunchShape& s) {
  s.threads = kFlatThreads;
  a.packs = packs;
  a.total = rows * packs;
  const int64_t per_block = static_cast<int64_t>(s.threads) * kFlatUnroll;
  s.blocks = (a.total + per_block - 1) / per_block;
  if (s.blocks > 0x7fffffff || (rows > 1 && a.total > kFlatDiv32Max)) return false;
  if (rows > 1) a.pdiv = math::div_magic(static_cast<uint32_t>(packs));
  return true;
}

template <typename T, bool kFwd>
Status launch_flat(const detail::GluProblem& p, const KernelArgs<T>& a, const LaunchShape& s,
                   cudaStream_t st) {
  return detail::dispatch_act(p.params.act, [&](auto act) {
    return detail::dispatch_step(p.step, [&](auto step) {
      return detail::dispatch_bool(!p.has_limit, [&](auto nl) {
        constexpr Activation A = decltype(act)::value;
        constexpr int kStep = decltype(step)::value;
        constexpr bool kNoLimit = decltype(nl)::value;
        const unsigned blocks = static_cast<unsigned>(s.blocks);
        if constexpr (kFwd)
          glu_fwd_flat<T, A, kStep, kNoLimit><<<blocks, s.threads, 0, st>>>(a);
        else
          glu_bwd_flat<T, A, kStep, kNoLimit><<<blocks, s.threads, 0, st>>>(a);
        return Status::kOk;
      });
    });
  });
}

template <typename T>
Status run_forward(const detail::GluProblem& p, const detail::FwdOutput& o, KernelChoice k,
                   cudaStream_t st) {
  constexpr int es = sizeof(T);
  k = resolve_auto(k, p, false);
  KernelArgs<T> a = base_args<T>(p);
  a.out = static_cast<T*>(o.out);
  a.out_stride = o.out_stride;
  int64_t rows = p.rows, F = p.F;
  Operand ops[3] = {{o.out, o.out_stride, 1}};
  const int n = 1 + gu_operands(ops + 1, p.g, p.g_stride, p.u, p.u_stride, p.step);
  int V = pick_pack(ops, n, F, rows, es, p.step);
  if (rows_mergeable(p, {o.out_stride}, {p.g_stride, p.u_stride}))
    merge_if_better(ops, n, es, p.step, rows, F, V, k != KernelChoice::kRows);
  a.rows = rows;
  a.cols = F;
  const bool weighted = p.w != nullptr;
  Status r = Status::kOk;
  LaunchShape fs;
  if (use_flat<T>(k, p.step, V, false) && flat_shape(a, rows, F / V, fs)) {
    r = launch_flat<T, true>(p, a, fs, st);
  } else if (use_realign<T>(p.step, V)) {
    const LaunchShape s = realign_shape(a, false, p.device_id);
    r = detail::dispatch_act(p.params.act, [&](auto act) {
      return detail::dispatch_bool(weighted, [&](auto wt) {
        glu_fwd_realign<T, decltype(act)::value, decltype(wt)::value>
            <<<static_cast<unsigned>(s.blocks), s.threads, 0, st>>>(a, s.G);
        return Status::kOk;
      });
    });
  } else {
    a.packs = F / V;
    const LaunchShape s =
        shape_for(rows, a.packs, fwd_unroll_for(es * V * p.step), false, p.device_id, kThreads);
    a.splits = s.splits;
    r = detail::dispatch_act(p.params.act, [&](auto act) {
      return detail::dispatch_step(p.step, [&](auto step) {
        return detail::dispatch_bool(weighted, [&](auto wt) {
          return launch_fwd_v<T, decltype(act)::value, decltype(step)::value, decltype(wt)::value>(
              V, a, s, st);
        });
      });
    });
  }
  if (r != Status::kOk) return r;
  return cuda_check(cudaGetLastError(), "glu forward kernel launch");
}

template <typename T>
Status run_backward(const detail::GluProblem& p, const detail::BwdIO& io, KernelChoice k,
                    cudaStream_t st) {
  constexpr int es = sizeof(T);
  k = resolve_auto(k, p, true);
  KernelArgs<T> a = base_args<T>(p);
  a.dy = static_cast<const T*>(io.dy);
  a.dy_stride = io.dy_stride;
  a.dg = static_cast<T*>(io.dg);
  a.du = static_cast<T*>(io.du);
  a.dg_stride = io.dg_stride;
  a.du_stride = io.du_stride;
  a.dw = io.dw;
  a.dw_stride = io.dw_stride;
  int64_t rows = p.rows, F = p.F;
  Operand ops[5] = {{io.dy, io.dy_stride, 1}};
  int n = 1 + gu_operands(ops + 1, p.g, p.g_stride, p.u, p.u_stride, p.step);
  n += gu_operands(ops + n, io.dg, io.dg_stride, io.du, io.du_stride, p.step);
  int V = pick_pack(ops, n, F, rows, es, p.step);
  if (rows_mergeable(p, {io.dy_stride}, {p.g_stride, p.u_stride, io.dg_stride, io.du_stride}))
    merge_if_better(ops, n, es, p.step, rows, F, V, k != KernelChoice::kRows);
  a.rows = rows;
  a.cols = F;
  const bool weighted = p.w != nullptr;
  const bool row_sum = weighted && io.dw != nullptr;
  Status r = Status::kOk;
  LaunchShape fs;
  if (use_flat<T>(k, p.step, V, row_sum) && flat_shape(a, rows, F / V, fs)) {
    r = launch_flat<T, false>(p, a, fs, st);
  } else if (use_realign<T>(p.step, V)) {
    const LaunchShape s = realign_shape(a, row_sum, p.device_id);
    r = detail::dispatch_act(p.params.act, [&](auto act) {
      return detail::dispatch_bool(weighted, [&](auto wt) {
        return detail::dispatch_bool(row_sum, [&](auto rs) {
          constexpr bool kW = decltype(wt)::value;
          constexpr bool kDW = kW && decltype(rs)::value;
          glu_bwd_realign<T, decltype(act)::value, kW, kDW>
              <<<static_cast<unsigned>(s.blocks), s.threads, 0, st>>>(a, s.G);
          return Status::kOk;
        });
      });
    });
  } else {
    a.packs = F / V;
    const LaunchShape s =
        shape_for(rows, a.packs, bwd_unroll_for(es * V * p.step), row_sum, p.device_id, kThreads);
    a.splits = s.splits;
    r = detail::dispatch_act(p.params.act, [&](auto act) {
      return detail::dispatch_step(p.step, [&](auto step) {
        return detail::dispatch_bool(weighted, [&](auto wt) {
          return detail::dispatch_bool(row_sum, [&](auto rs) {
            constexpr bool kW = decltype(wt)::value;
            constexpr bool kDW = kW && decltype(rs)::value;
            return launch_bwd_v<T, decltype(act)::value, decltype(step)::value, kW, kDW>(V, a, s,
                                                                                         st);
          });
        });
      });
    });
  }
  if (r != Status::kOk) return r;
  return cuda_check(cudaGetLastError(), "glu backward kernel launch");
}

}  // namespace expertact::cuda
