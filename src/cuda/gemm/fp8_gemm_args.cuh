// The per-group argument arrays of the FP8 blockwise grouped GEMM in CUTLASS's types, the
// workspace they live in, and the builder's per-expert step that fills them (run on the GPU
// by fp8_gemm_sm90.cuh's builder kernel; on the host by tests/cpp/test_fp8_gemm_args.cu,
// which checks every pointer, stride and scale layout it writes). Only CuTe and the scale
// layouts' header: the kernel's own headers are not needed to include this one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/numeric_types.h"

#include "cuda/gemm/fp8_gemm_plan.h"

namespace expertact::fp8gemm {

// A row-major [rows, cols, 1] operand: (row stride, 1, 0), CUTLASS's stride of a K-major A,
// a K-major B ([N, K]) and a row-major D.
using StrideRow = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
using Shape3 = cute::Shape<int, int, int>;  // a group's (M, N, K)

// The two instantiations' scale layouts (CUTLASS's Sm90BlockwiseScaleConfig):
//  M-grouped: A 1 x 128 m-major (the [KB, T] row tiles), B 128 x 128 k-major (the weights'
//             [NB, KB] blocks): one scale per row and K tile of A, one per tile of B, so the
//             promotion is one FFMA per accumulator.
//  K-grouped: A and B 1 x 128 along the tokens, m- and n-major (the [Tp / 128, M] and
//             [Tp / 128, N] column tiles): a scale per row of A and per row of B, so the
//             promotion multiplies two scales per accumulator.
using ScalesM = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
using ScalesK = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;

constexpr size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

// A scale layout of type L: shape ((G, ceil(mn / G)), (128, ceil(k / 128)), 1), G the
// layout's granularity along M (N). Its one dynamic stride is the K blocks' (m/n-major
// layouts: the stride between K blocks, k_stride) or the M/N blocks' (k-major: mn_stride).
template <class L>
EA_HD L scale_layout(int64_t mn, int64_t k, int64_t mn_stride, int64_t k_stride) {
  using S = cute::remove_cvref_t<decltype(L{}.shape())>;
  using D = cute::remove_cvref_t<decltype(L{}.stride())>;
  constexpr int G = cute::remove_cvref_t<decltype(cute::get<0, 0>(S{}))>::value;
  static_assert(cute::remove_cvref_t<decltype(cute::get<1, 0>(S{}))>::value == kTile, "K blocks of 128");
  S shape{};
  cute::get<0, 1>(shape) = static_cast<int>(ceil_div(mn, G));
  cute::get<1, 1>(shape) = static_cast<int>(ceil_div(k, kTile));
  cute::get<2>(shape) = 1;
  D stride{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0, 1>(D{}))>>::value) {
    cute::get<1, 1>(stride) = static_cast<int>(k_stride);  // m/n-major
  } else {
    cute::get<0, 1>(stride) = static_cast<int>(mn_stride);  // k-major
  }
  return L(shape, stride);
}

// The arrays CUTLASS reads, E entries each, in one workspace.
template <class LayoutSFA_, class LayoutSFB_>
struct GroupArgs {
  using LayoutSFA = LayoutSFA_;
  using LayoutSFB = LayoutSFB_;
  Shape3* shapes = nullptr;
  const cutlass::float_e4m3_t** ptr_a = nullptr;
  StrideRow* stride_a = nullptr;
  const cutlass::float_e4m3_t** ptr_b = nullptr;
  StrideRow* stride_b = nullptr;
  const float** ptr_sfa = nullptr;
  LayoutSFA* layout_sfa = nullptr;
  const float** ptr_sfb = nullptr;
  LayoutSFB* layout_sfb = nullptr;
  cutlass::bfloat16_t** ptr_d = nullptr;
  StrideRow* stride_d = nullptr;

  // Bytes of the arrays for E groups, each array 256-byte aligned.
  static size_t bytes(int64_t E) {
    const size_t n = static_cast<size_t>(E < 1 ? 1 : E);
    return round_up(n * sizeof(Shape3)) + 5 * round_up(n * sizeof(void*)) + 3 * round_up(n * sizeof(StrideRow)) +
           round_up(n * sizeof(LayoutSFA)) + round_up(n * sizeof(LayoutSFB));
  }
  // The arrays laid out from base (256-byte aligned) for E groups.
  static GroupArgs carve(char* base, int64_t E) {
    const size_t n = static_cast<size_t>(E < 1 ? 1 : E);
    size_t off = 0;
    auto take = [&](size_t b) {
      char* p = base + off;
      off += round_up(b);
      return p;
    };
    GroupArgs a;
    a.shapes = reinterpret_cast<Shape3*>(take(n * sizeof(Shape3)));
    a.ptr_a = reinterpret_cast<const cutlass::float_e4m3_t**>(take(n * sizeof(void*)));
    a.ptr_b = reinterpret_cast<const cutlass::float_e4m3_t**>(take(n * sizeof(void*)));
    a.ptr_sfa = reinterpret_cast<const float**>(take(n * sizeof(void*)));
    a.ptr_sfb = reinterpret_cast<const float**>(take(n * sizeof(void*)));
    a.ptr_d = reinterpret_cast<cutlass::bfloat16_t**>(take(n * sizeof(void*)));
    a.stride_a = reinterpret_cast<StrideRow*>(take(n * sizeof(StrideRow)));
    a.stride_b = reinterpret_cast<StrideRow*>(take(n * sizeof(StrideRow)));
    a.stride_d = reinterpret_cast<StrideRow*>(take(n * sizeof(StrideRow)));
    a.layout_sfa = reinterpret_cast<LayoutSFA*>(take(n * sizeof(LayoutSFA)));
    a.layout_sfb = reinterpret_cast<LayoutSFB*>(take(n * sizeof(LayoutSFB)));
    return a;
  }
};

EA_HD StrideRow row_stride(int64_t ld) {
  StrideRow s{};
  cute::get<0>(s) = ld;
  return s;
}

// The builder's step for expert e: when e has work, its entry in its slot of the problem
// list (fp8_gemm_plan.h: slot_of); when e >= W (W: the experts with work), an empty problem
// (0, 0, 0) in slot e, which has no tiles. Every slot is written exactly once, by one expert,
// whatever the order the experts are taken in.
template <class Args>
EA_HD void build_expert(const Problem& p, const int32_t* offsets, int64_t e, const Args& out) {
  using LayoutSFA = typename Args::LayoutSFA;
  using LayoutSFB = typename Args::LayoutSFB;
  const Span s = span_of(p, offsets, e);
  if (has_work(p, s)) {
    const int32_t slot = slot_of(p, offsets, e);
    const GroupOperands g = operands_of(p, e, s);
    out.shapes[slot] = Shape3(static_cast<int>(g.M), static_cast<int>(g.N), static_cast<int>(g.K));
    out.ptr_a[slot] = static_cast<const cutlass::float_e4m3_t*>(p.a) + g.a;
    out.ptr_b[slot] = static_cast<const cutlass::float_e4m3_t*>(p.b) + g.b;
    out.ptr_sfa[slot] = p.sfa + g.sfa;
    out.ptr_sfb[slot] = p.sfb + g.sfb;
    out.ptr_d[slot] = static_cast<cutlass::bfloat16_t*>(p.d) + g.d;
    out.stride_a[slot] = row_stride(g.lda);
    out.stride_b[slot] = row_stride(g.ldb);
    out.stride_d[slot] = row_stride(g.ldd);
    out.layout_sfa[slot] = scale_layout<LayoutSFA>(g.M, g.K, 0, g.sfa_k);
    out.layout_sfb[slot] = scale_layout<LayoutSFB>(g.N, g.K, g.sfb_n, g.sfb_k);
  }
  if (e >= slot_of(p, offsets, p.E)) {
    // Nothing of it is read: the group has no tiles. Valid values all the same.
    out.shapes[e] = Shape3(0, 0, 0);
    out.ptr_a[e] = static_cast<const cutlass::float_e4m3_t*>(p.a);
    out.ptr_b[e] = static_cast<const cutlass::float_e4m3_t*>(p.b);
    out.ptr_sfa[e] = p.sfa;
    out.ptr_sfb[e] = p.sfb;
    out.ptr_d[e] = static_cast<cutlass::bfloat16_t*>(p.d);
    out.stride_a[e] = row_stride(p.lda);
    out.stride_b[e] = row_stride(p.ldb);
    out.stride_d[e] = row_stride(p.ldd);
    out.layout_sfa[e] = LayoutSFA{};
    out.layout_sfb[e] = LayoutSFB{};
  }
}

}  // namespace expertact::fp8gemm
