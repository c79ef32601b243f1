// The expert MLP's grouped GEMMs on Hopper (CUTLASS 3.x/4.x, sm90 TMA warp-specialized,
// ptr-array grouped) with the gated activation in their epilogues (docs/fused-gemm.md):
//   forward:  gate_up = x[rows of e] @ w13[e]^T   and   h = act(gate_up) * w   in one kernel;
//   backward: dh = dy[rows of e] @ w2[e]^T is never stored: the epilogue turns it into
//             dgate_up (optionally over gate_up) and the weights' gradient.
// Included by one generated .cu per kernel (src/cuda/gemm/moe_kernel.cu.in; a CUTLASS
// kernel compiles for 40-170 s).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "core/error.h"
#include "core/math.h"
#include "cuda/gemm/moe_gemm.h"

namespace expertact::gemm {

using namespace cute;
using Bf16 = cutlass::bfloat16_t;

// bf16 round trip of a float32 accumulator: the value the unfused path stores in gate_up
// (or dh) and its activation kernel reads back. Round to nearest even, NaN kept.
__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// The forward's h stores as 8 bytes. A row of a 64 or 128 x 32 epilogue subtile is spread
// over the 4 lanes of a quad (lane % 4 = t): lane t holds the row's pairs at gate_up columns
// base + 8g + 2t (g = 0..3), so its 4 h values sit at h columns H + 4g + t (H = base / 2),
// 2 bytes apart from its neighbours' (tests/cpp/test_gemm_layout.cu proves it for the
// instantiated tiles). A 4 x 4 transpose over the quad, two 32-bit shuffles, gives lane t
// the h columns H + 4t .. H + 4t + 3: one 8-byte store. The three steps are separate
// functions so that the host test runs this code with the shuffles emulated.
CUTLASS_HOST_DEVICE uint32_t pack_u16(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}
// What lane t sends to lane t ^ 1: its values at g = g0 ^ 1 and g0 ^ 1 + 2 (g0 = t & 1), the
// ones the partner keeps; chosen by selects (no dynamic indexing of registers).
CUTLASS_HOST_DEVICE uint32_t quad_send1(const uint16_t a[4], int t) {
  return (t & 1) ? pack_u16(a[0], a[2]) : pack_u16(a[1], a[3]);
}
// From the partner's reply: this lane's pairs P[g] = (even lane's a[g], odd lane's a[g]) for
// g = g0 and g0 + 2; returns the one this lane keeps in *own and the one for lane ^ 2.
CUTLASS_HOST_DEVICE uint32_t quad_send2(const uint16_t a[4], int t, uint32_t recv1, uint32_t* own) {
  const bool odd = t & 1;
  const uint16_t p0 = static_cast<uint16_t>(recv1 & 0xffffu), p2 = static_cast<uint16_t>(recv1 >> 16);
  const uint16_t m0 = odd ? a[1] : a[0], m2 = odd ? a[3] : a[2];  // a[g0], a[g0 + 2]
  const uint32_t pa = odd ? pack_u16(p0, m0) : pack_u16(m0, p0);  // g = g0
  const uint32_t pb = odd ? pack_u16(p2, m2) : pack_u16(m2, p2);  // g = g0 + 2
  const bool q = t & 2;
  *own = q ? pb : pa;  // g = t
  return q ? pa : pb;
}
// (lo, hi) 32-bit words of lane t's 8 bytes: h columns H + 4t + (0, 1) and (2, 3).
CUTLASS_HOST_DEVICE void quad_final(int t, uint32_t own, uint32_t recv2, uint32_t* lo, uint32_t* hi) {
  const bool q = t & 2;
  *lo = q ? recv2 : own;
  *hi = q ? own : recv2;
}

// ---------------------------------------------------------------------------
// Epilogue callbacks. Both are complete FusionCallbacks types (the collective
// builder takes them as they are): no smem, no producer loads, plain global
// loads and stores from the registers that hold the accumulators.
//
// Coordinates: args.tCcD holds, per thread, each accumulator element's (m, n)
// relative to the thread's first element, and args.residue_tCcD the problem's
// (M, N) minus that first element's coordinate; so an element is in bounds when
// its relative coordinate is elem_less than the residue, and its coordinate in
// the group's problem is (M, N) - residue + relative.
// ---------------------------------------------------------------------------

// Shared plumbing of the two callbacks: the static interface the collective asks for.
template <class Derived, class Params_>
struct CallbacksBase {
  struct SharedStorage {};
  using Arguments = Params_;
  using Params = Params_;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE CallbacksBase() {}
  CUTLASS_HOST_DEVICE CallbacksBase(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(
      cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }
};

// Where a thread's part of a tile sits: row0, the first row of the tile's group (expert)
// in the [T, ...] tensors (0, or the previous expert's cumulative end, clamped as the setup
// kernel clamps it, so that bad offsets can never move an access out of [0, T)); (m0, n0),
// the thread's first element in the group's (M, N) problem.
struct TileOrigin {
  int64_t row0, m0, n0;
};

template <class Args>
CUTLASS_DEVICE TileOrigin tile_origin(Args const& args, const int32_t* offsets, int64_t T) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  const int l = static_cast<int>(get<3>(args.tile_coord_mnkl));
  int64_t row0 = 0;
  if (l > 0) {
    row0 = offsets[l - 1];
    row0 = row0 < 0 ? 0 : (row0 > T ? T : row0);
  }
  return {row0, static_cast<int64_t>(M) - get<0>(args.residue_tCcD),
          static_cast<int64_t>(N) - get<1>(args.residue_tCcD)};
}

// Forward: D = gate_up (the collective stores it with TMA); h = act(gate_up) * w is
// stored here, one bf16 per (gate, up) pair. gate_up's columns are interleaved
// (gate, up, gate, up, ...), and the accumulator fragment of a thread holds each pair
// in adjacent elements (i, i + 1) with the gate at an even column: the wgmma
// accumulator layout gives every thread two adjacent columns per 8, and the epilogue's
// retiling keeps them adjacent (checked on the host for the instantiated tiles by
// tests/cpp/test_gemm_layout.cu). h is computed from the bf16-rounded accumulators,
// as the unfused path computes it from the stored gate_up.
template <Activation A>
struct GluFwdCallbacks : CallbacksBase<GluFwdCallbacks<A>, FwdEpilogueParams> {
  using Base = CallbacksBase<GluFwdCallbacks<A>, FwdEpilogueParams>;
  using Base::Base;
  using Base::params;
  using Params = typename Base::Params;
  using ElementAux = Bf16;  // unused: D is not void here

  template <class CTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor c, Residue r, int64_t m0, int64_t n0,
                                          __nv_bfloat16* h, const float* w, Params const& p)
        : tCcD(c), residue(r), m0(m0), n0(n0), h(h), w(w), p(p) {}
    CTensor tCcD;      // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) relative coordinates
    Residue residue;
    int64_t m0, n0;    // the thread's first element, in the group's (M, N)
    __nv_bfloat16* h;  // h of the group's first row
    const float* w;    // weights of the group's first row, or nullptr
    Params const& p;

    // Loads (the routing weights) first, then the math, then the stores: nothing
    // stored waits on a load issued after it.
    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementAccumulator, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& acc, int epi_v, int epi_m, int epi_n) {
      static_assert(FragmentSize % 2 == 0, "a fragment must hold whole (gate, up) pairs");
      constexpr int P = FragmentSize / 2;
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      const int base = epi_v * FragmentSize;
      float wt[P];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < P; ++j) {
        auto rc = c(base + 2 * j);
        wt[j] = (w != nullptr && elem_less(rc, residue)) ? w[(m0 + get<0>(rc)) * p.w_stride] : 1.0f;
      }
      uint16_t hv[P];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < P; ++j) {
        const float g = round_bf16(acc[2 * j]), u = round_bf16(acc[2 * j + 1]);
        hv[j] = __bfloat16_as_ushort(__float2bfloat16_rn(math::glu_fwd<A, float>(g, u, wt[j], p.coeffs)));
      }
      if constexpr (P == 8) {
        // The quad layout (pair j = row r + 2 * group g, rows 8 apart): 8-byte stores.
        if (p.h_vec8) {
          const int t = static_cast<int>(threadIdx.x & 3);
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            const uint16_t a[4] = {hv[r], hv[r + 2], hv[r + 4], hv[r + 6]};
            const uint32_t recv1 = __shfl_xor_sync(0xffffffffu, quad_send1(a, t), 1);
            uint32_t own;
            const uint32_t send2 = quad_send2(a, t, recv1, &own);
            const uint32_t recv2 = __shfl_xor_sync(0xffffffffu, send2, 2);
            uint2 out;
            quad_final(t, own, recv2, &out.x, &out.y);
            auto rc = c(base + 2 * r);  // this lane's element of row r, group 0
            // The chunk starts at gate_up column n + 6t (h column n / 2 + 3t); N % 8 == 0,
            // so a chunk is inside the problem or wholly past it.
            const auto chunk = make_coord(get<0>(rc), get<1>(rc) + 6 * t);
            if (elem_less(chunk, residue)) {
              const int64_t m = m0 + get<0>(rc);
              const int64_t hc = ((n0 + get<1>(rc)) >> 1) + 3 * t;
              *reinterpret_cast<uint2*>(h + m * p.ldh + hc) = out;
            }
          }
          return acc;
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < P; ++j) {
        auto rc = c(base + 2 * j);
        if (elem_less(rc, residue)) {
          const int64_t m = m0 + get<0>(rc);
          const int64_t n = n0 + get<1>(rc);  // even: the gate's column
          h[m * p.ldh + (n >> 1)] = __ushort_as_bfloat16(hv[j]);
        }
      }
      return acc;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    const TileOrigin o = tile_origin(args, params.offsets, params.T);
    __nv_bfloat16* h = params.h + o.row0 * params.ldh;
    const float* w = params.w != nullptr ? params.w + o.row0 * params.w_stride : nullptr;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        args.tCcD, args.residue_tCcD, o.m0, o.n0, h, w, params);
  }
};

// Per-thread row-sum registers for the backward's weight gradient: a (tile M, tile N)
// tensor with stride 0 along N, partitioned as the epilogue partitions the accumulators
// (CPY,CPY_M,CPY_N,EPI_M,EPI_N), so that every element of one row lands in one register.
// Host and device: tests/cpp/test_gemm_layout.cu checks it on the host.
template <bool ReferenceSrc, class TileShapeMNK, class EpiTile, class TiledCopy>
CUTE_HOST_DEVICE auto row_sum_registers(TileShapeMNK tile, EpiTile epi_tile, TiledCopy tiled_copy,
                                        int thread_idx) {
  Tensor gRow = make_tensor(make_gmem_ptr<float>(nullptr),
                            make_layout(take<0, 2>(tile), make_stride(_1{}, _0{})));
  Tensor tCgRow = cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue<ReferenceSrc>(
      gRow, epi_tile, tiled_copy, thread_idx);
  Tensor r = make_tensor_like<float>(tCgRow);
  fill(r, 0.0f);
  return r;
}

// The lanes of a warp that hold one row (as CUTLASS's column reduction finds them):
// the tiled copy's thread-value layout inverted to tile (m, n) -> lane, as a
// (lanes along M, lanes along N) -> lane index layout. Shuffling down by
// layout(0, k) for k = size<1> / 2 .. 1 sums a row into the lane at column 0.
template <bool ReferenceSrc, class TiledCopy>
CUTE_HOST_DEVICE auto row_lanes(TiledCopy tiled_copy) {
  auto mn_shape = shape(typename TiledCopy::Tiler_MN{});
  auto ref_layout_mn = [&]() {
    if constexpr (ReferenceSrc) return right_inverse(tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
    else return right_inverse(tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
  }();
  using W = Int<TiledCopy::TiledNumThr::value / 32>;
  auto tv2lane = cute::Layout<Shape<_32, W, _1>, Stride<_1, _0, _0>>{};
  auto ref2lane = composition(tv2lane, ref_layout_mn);
  return make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
}

// Backward: the accumulators are dh = dy @ w2^T (never stored: D is void). Each element
// (m, n) reads its (gate, up) pair at gate_up columns (2n, 2n + 1), writes their
// gradients there (in dgate_up, which may be gate_up itself: each pair is read and
// written by one thread, read first), and adds dh * a * (uc + beta) to the row's weight
// gradient. That row sum is kept per thread in registers over the whole tile (a thread
// holds few distinct rows: 2 for the wgmma layout here), summed over the lanes that share
// a row by shuffles, and added to dw with one float atomicAdd per row and N tile: dw must
// be zeroed first; its sum order across tiles is not fixed (float32, not bit-reproducible
// run to run, within float32 rounding). dh is rounded to bf16 first, as the unfused
// path stores it.
template <Activation A>
struct GluBwdCallbacks : CallbacksBase<GluBwdCallbacks<A>, BwdEpilogueParams> {
  using Base = CallbacksBase<GluBwdCallbacks<A>, BwdEpilogueParams>;
  using Base::Base;
  using Base::params;
  using Params = typename Base::Params;
  using ElementAux = Bf16;  // D is void: the collective takes its smem element type from here

  template <class CTensor, class Residue, class RowTensor, class RowCoord, class LaneLayout,
            class LaneCoord>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor c, Residue r, int64_t m0, int64_t n0,
                                          const __nv_bfloat16* gu, __nv_bfloat16* dgu,
                                          const float* w, float* dw, RowTensor rows,
                                          RowCoord rows_c, LaneLayout lanes, LaneCoord lane_mn,
                                          Params const& p)
        : tCcD(c), residue(r), m0(m0), n0(n0), gu(gu), dgu(dgu), w(w), dw(dw), tCrDw(rows),
          tCcDw(rows_c), lane_layout_mn(lanes), lane_mn(lane_mn), p(p) {}
    CTensor tCcD;
    Residue residue;
    int64_t m0, n0;
    const __nv_bfloat16* gu;  // gate_up of the group's first row
    __nv_bfloat16* dgu;       // its gradient (may equal gu)
    const float* w;           // nullptr: no weights
    float* dw;                // nullptr: no weight gradient wanted
    RowTensor tCrDw;          // per-thread row sums, stride 0 along N
    RowCoord tCcDw;           // their relative coordinates
    LaneLayout lane_layout_mn;
    LaneCoord lane_mn;
    Params const& p;

    // gate_up is read one epilogue subtile ahead: begin_loop() of subtile i issues the loads
    // of subtile i + 1 (in the collective's order: epi_m inner, epi_n outer) into `nxt`,
    // and visit() computes subtile i from `cur`, loaded one subtile earlier, so a load's
    // latency runs under the previous subtile's math. (Element by element, each load waited
    // for the store before it, since in place gate_up and dgate_up may be one tensor and
    // the compiler may not move a load above a store: one memory latency per element.) The
    // loads of i + 1 touch other rows or columns than the stores of i, so in place is safe.
    // Elements (2k, 2k + 1) are adjacent columns (n, n + 1), n even (the host test proves
    // it): their two (gate, up) pairs are 8 contiguous bytes, one load and one store when
    // aligned (vec8).
    static constexpr int kSub = decltype(size<0>(std::declval<CTensor>()) * size<1>(std::declval<CTensor>()) *
                                         size<2>(std::declval<CTensor>()))::value;  // per thread
    static constexpr int kEpiM = decltype(size<3>(std::declval<CTensor>()))::value;
    static constexpr int kEpiN = decltype(size<4>(std::declval<CTensor>()))::value;
    static_assert(kSub % 2 == 0, "elements come in adjacent column pairs");
    uint32_t cur[kSub], nxt[kSub];  // (gate, up) pairs as bf16x2 bits

    CUTLASS_DEVICE void load_subtile(int epi_m, int epi_n, uint32_t (&dst)[kSub]) const {
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kSub / 2; ++k) {
        auto rc = c(2 * k);
        dst[2 * k] = dst[2 * k + 1] = 0;
        if (elem_less(rc, residue)) {  // then n + 1 is in too: N is even
          const __nv_bfloat16* src = gu + (m0 + get<0>(rc)) * p.ld_gu + 2 * (n0 + get<1>(rc));
          if (p.vec8) {
            const uint2 v = *reinterpret_cast<const uint2*>(src);
            dst[2 * k] = v.x;
            dst[2 * k + 1] = v.y;
          } else {
            dst[2 * k] = *reinterpret_cast<const uint32_t*>(src);
            dst[2 * k + 1] = *reinterpret_cast<const uint32_t*>(src + 2);
          }
        }
      }
    }

    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      if (epi_m == 0 && epi_n == 0) load_subtile(0, 0, nxt);  // the first subtile: no lookahead
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kSub; ++i) cur[i] = nxt[i];
      int m = epi_m + 1, n = epi_n;
      if (m == kEpiM) {
        m = 0;
        ++n;
      }
      if (n < kEpiN) load_subtile(m, n, nxt);
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementAccumulator, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& acc, int epi_v, int epi_m, int epi_n) {
      static_assert(FragmentSize % 2 == 0 && kSub % FragmentSize == 0, "whole pairs per fragment");
      constexpr int P = FragmentSize / 2;
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      Tensor rsum = tCrDw(_, _, _, epi_m, epi_n);
      const int base = epi_v * FragmentSize;
      float wt[P];
      bool ok[P];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < P; ++k) {
        auto rc = c(base + 2 * k);
        ok[k] = elem_less(rc, residue);
        wt[k] = (w != nullptr && ok[k]) ? w[(m0 + get<0>(rc)) * p.w_stride] : 1.0f;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < P; ++k) {
        uint32_t out[2];
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * k + e;
          const uint32_t pair = cur[base + i];
          const float g = __uint_as_float(pair << 16), u = __uint_as_float(pair & 0xffff0000u);
          float dg, du, term;
          math::glu_bwd<A, float>(g, u, round_bf16(acc[i]), wt[k], p.coeffs, dg, du, term);
          const __nv_bfloat162 d2 = __floats2bfloat162_rn(dg, du);
          out[e] = *reinterpret_cast<const uint32_t*>(&d2);
          if (dw != nullptr && ok[k]) rsum(base + i) += term;
        }
        if (ok[k]) {
          auto rc = c(base + 2 * k);
          __nv_bfloat16* dst = dgu + (m0 + get<0>(rc)) * p.ld_dgu + 2 * (n0 + get<1>(rc));
          if (p.vec8) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(out[0], out[1]);
          } else {
            reinterpret_cast<uint32_t*>(dst)[0] = out[0];
            reinterpret_cast<uint32_t*>(dst)[1] = out[1];
          }
        }
      }
      return acc;
    }

    // After the last subtile: shuffle-reduce the row sums over the lanes of a row, then
    // one atomicAdd per row from the lane at column 0 of the lane layout.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (!is_last_iteration || dw == nullptr) return;
      Tensor flt = filter_zeros(tCrDw);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = size<1>(lane_layout_mn) / 2; cols > 0; cols /= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(flt); ++i)
          flt(i) += __shfl_down_sync(0xffffffffu, flt(i), lane_layout_mn(_0{}, cols));
      }
      if (get<1>(lane_mn) != 0) return;
      Tensor flt_c = make_tensor(tCcDw.data(), make_layout(flt.shape(), tCcDw.stride()));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(flt); ++i) {
        auto rc = flt_c(i);
        if (elem_less(rc, residue)) atomicAdd(dw + (m0 + get<0>(rc)) * p.dw_stride, flt(i));
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    const TileOrigin o = tile_origin(args, params.offsets, params.T);
    const int64_t row0 = o.row0;
    Tensor tCrDw = row_sum_registers<ReferenceSrc>(args.tile_shape_mnk, args.epi_tile,
                                                   args.tiled_copy, args.thread_idx);
    // The relative coordinates of those registers (same shape, tCcD's strides): in
    // reduce(), filter_zeros of the registers and this keep the distinct rows in one order.
    Tensor tCcDw = make_tensor(args.tCcD.data(), make_layout(tCrDw.shape(), args.tCcD.stride()));
    auto lane_layout_mn = row_lanes<ReferenceSrc>(args.tiled_copy);
    auto lane_mn = idx2crd(right_inverse(lane_layout_mn)(static_cast<int>(threadIdx.x % 32)),
                           shape(lane_layout_mn));

    const __nv_bfloat16* gu = params.gate_up + row0 * params.ld_gu;
    __nv_bfloat16* dgu = params.dgate_up + row0 * params.ld_dgu;
    const float* w = params.w != nullptr ? params.w + row0 * params.w_stride : nullptr;
    float* dw = params.dw != nullptr ? params.dw + row0 * params.dw_stride : nullptr;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD),
                                  decltype(tCrDw), decltype(tCcDw), decltype(lane_layout_mn),
                                  decltype(lane_mn)>(args.tCcD, args.residue_tCcD, o.m0, o.n0, gu,
                                                     dgu, w, dw, tCrDw, tCcDw, lane_layout_mn,
                                                     lane_mn, params);
  }
};

// ---------------------------------------------------------------------------
// The grouped GEMM: A [M_e, K] row-major (x or dy rows of expert e), B [N, K] per expert
// with K contiguous (w13 as [E, 2F, D], w2 as [E, F, D]), D [M_e, N] row-major bf16 or
// void, float32 accumulation, in one of two schedules (EXPERTACT_FUSED_SCHEDULE picks):
// - Pingpong: two consumer warpgroups on two 128 x 128 tiles, one's epilogue running while
//   the other's mainloop does: the activation math of an epilogue hides behind the tensor
//   cores' work, which is what the fusion needs (the default).
// - Cooperative: both warpgroups on one 128 x 256 tile (torch._grouped_mm's sm90 shape for
//   large groups); its epilogue runs with the tensor cores idle.
// Both with clusters of 2 along M, which share (multicast) the expert's B tile.
// ---------------------------------------------------------------------------

struct Pingpong {
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

struct Cooperative {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Pingpong on 64 x 256 tiles: each warpgroup's wgmma is 64 x 256 x 16, as each of the
// cooperative schedule's two, so the shared-memory bytes read per MMA are the cooperative
// kernel's (128 x 128 pingpong reads A and B for 64 x 128 each, 20% more per flop), while
// one warpgroup's epilogue still runs beside the other's mainloop.
struct Pingpong64 {
  using TileShape = Shape<_64, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <Schedule S>
using ScheduleOf = cute::conditional_t<
    S == Schedule::kPingpong, Pingpong,
    cute::conditional_t<S == Schedule::kPingpong64, Pingpong64, Cooperative>>;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlign = 8;  // 16 bytes of bf16: TMA's alignment of every leading stride

template <class Callbacks, class ElementD, class Sched>
struct GroupedGemm {
  using TileShape = typename Sched::TileShape;
  using ClusterShape = typename Sched::ClusterShape;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign,
      ElementD, LayoutD*, kAlign, typename Sched::EpilogueSchedule, Callbacks>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlign, Bf16, LayoutB*,
      kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Sched::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

}  // namespace expertact::gemm
