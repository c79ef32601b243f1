// The FP8 blockwise grouped GEMM's problem as the API boundary hands it to the launcher
// (src/api_fp8_gemm.cpp validates it), and the per-expert arithmetic of its device-side
// argument builder: which rows (or tokens) each expert owns, where its operands start, which
// slot of the problem list it takes and what output nobody computes. Plain C++ with
// __host__ __device__ functions, no CUTLASS: the builder kernel (fp8_gemm_sm90.cuh) runs
// them on the GPU and tests/cpp/test_fp8_gemm.cpp runs the same functions on the host.
#pragma once

#include <cstdint>

#include "core/math.h"  // EA_HD
#include "expertact/expertact.hpp"

namespace expertact::fp8gemm {

// The tile of the recipe's scales along K and of the padding of the K-grouped blocks.
constexpr int64_t kTile = 128;

// Every size and stride in elements; pointers on one CUDA device. See expertact.hpp
// (fp8_grouped_gemm_blockwise) for the formats.
//   M-grouped: D[rows of e] = (A[rows of e] * sfa) (B[e] * sfb[e])^T
//     a [T, K] e4m3 (row stride lda), sfa [KB, T] float32 (row stride ld_sfa),
//     b [E][N, K] e4m3 (row stride ldb, expert stride b_es), sfb [E][NB, KB] float32 (row
//     stride ld_sfb, expert stride sfb_es), d [T, N] bf16 (row stride ldd).
//   K-grouped: D[e] = (A^T[:, tokens of e] * sfa) (B^T[:, tokens of e] * sfb)^T
//     a [M, Tp] e4m3 (T = Tp), sfa [Tp / 128, M], b [N, Tp], sfb [Tp / 128, N],
//     d [E][M, N] bf16 (row stride ldd, expert stride d_es).
struct Problem {
  GemmGrouping grouping = GemmGrouping::kM;
  int32_t E = 0;
  int64_t T = 0;  // M-grouped: A's rows; K-grouped: the padded token count Tp
  int64_t M = 0;  // K-grouped only (M-grouped: each expert's rows)
  int64_t N = 0;
  int64_t K = 0;  // M-grouped only (K-grouped: each expert's padded tokens)
  const void* a = nullptr;
  int64_t lda = 0;
  const float* sfa = nullptr;
  int64_t ld_sfa = 0;
  const void* b = nullptr;
  int64_t ldb = 0, b_es = 0;
  const float* sfb = nullptr;
  int64_t ld_sfb = 0, sfb_es = 0;
  const int32_t* offsets = nullptr;  // device, [E]
  void* d = nullptr;
  int64_t ldd = 0, d_es = 0;
  int device = 0;
};

EA_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Expert e's span along the grouped dimension: rows [begin, end) of A and D (M-grouped) or
// tokens [begin, end) of A^T and B^T (K-grouped). The offsets live on the GPU and are never
// read on the host, so the builder makes any values safe: each is clamped to [0, limit]
// (limit = T, or Tp rounded down to the tile), K-grouped ones rounded down to a multiple of
// 128 (the TMA base addresses and the scale rows need it), and an end below its begin is
// the begin. Offsets that break the contract (decreasing, past T, not multiples of 128)
// then give wrong output, never an access outside the tensors.
struct Span {
  int64_t begin = 0, end = 0;
  EA_HD int64_t size() const { return end - begin; }
};

EA_HD int64_t sanitize_offset(const Problem& p, int64_t v) {
  const bool k = p.grouping == GemmGrouping::kK;
  const int64_t limit = k ? p.T / kTile * kTile : p.T;
  v = v < 0 ? 0 : (v > limit ? limit : v);
  return k ? v / kTile * kTile : v;
}

EA_HD Span span_of(const Problem& p, const int32_t* offsets, int64_t e) {
  Span s;
  s.begin = e == 0 ? 0 : sanitize_offset(p, offsets[e - 1]);
  const int64_t end = sanitize_offset(p, offsets[e]);
  s.end = end < s.begin ? s.begin : end;
  return s;
}

// Whether expert e has a GEMM to run: rows (tokens) and a non-empty product. The others are
// left out of the problem list; their output is zeroed apart (zero_region below).
EA_HD bool has_work(const Problem& p, const Span& s) {
  if (p.N <= 0 || s.size() <= 0) return false;
  return p.grouping == GemmGrouping::kM ? p.K > 0 : p.M > 0;
}

// The slot of expert e in the problem list: the number of experts before it with work, so
// that the experts with work fill slots 0 .. W - 1 in expert order (W: all of them,
// slot_of(E)). O(e) reads of the offsets: E is an expert count (tens to hundreds) and each
// expert's thread of the builder computes its own slot, with no synchronisation.
EA_HD int32_t slot_of(const Problem& p, const int32_t* offsets, int64_t e) {
  int32_t n = 0;
  for (int64_t i = 0; i < e; ++i) n += has_work(p, span_of(p, offsets, i)) ? 1 : 0;
  return n;
}

// Where expert e's operands start (element offsets from a, sfa, b, sfb, d) and its problem
// (M, N, K), for a span with work.
struct GroupOperands {
  int64_t M = 0, N = 0, K = 0;
  int64_t a = 0, sfa = 0, b = 0, sfb = 0, d = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  int64_t sfa_k = 0;  // the scale of (m, k-block j) of A is at sfa + m + j * sfa_k (m-major)
  int64_t sfb_k = 0;  // K-grouped: the scale of (n, j) of B at sfb + n + j * sfb_k (n-major)
  int64_t sfb_n = 0;  // M-grouped: the scale of (n-block i, j) of B at sfb + i * sfb_n + j
};

EA_HD GroupOperands operands_of(const Problem& p, int64_t e, const Span& s) {
  GroupOperands g;
  g.N = p.N;
  g.lda = p.lda;
  g.ldb = p.ldb;
  g.ldd = p.ldd;
  if (p.grouping == GemmGrouping::kM) {
    g.M = s.size();
    g.K = p.K;
    g.a = s.begin * p.lda;
    g.sfa = s.begin;  // column s.begin of [KB, T]
    g.sfa_k = p.ld_sfa;
    g.b = e * p.b_es;
    g.sfb = e * p.sfb_es;
    g.sfb_n = p.ld_sfb;
    g.d = s.begin * p.ldd;
  } else {
    g.M = p.M;
    g.K = s.size();
    g.a = s.begin;  // column s.begin of A^T [M, Tp]
    g.b = s.begin;
    g.sfa = s.begin / kTile * p.ld_sfa;  // row s.begin / 128 of [Tp / 128, M]
    g.sfa_k = p.ld_sfa;
    g.sfb = s.begin / kTile * p.ld_sfb;
    g.sfb_k = p.ld_sfb;
    g.d = e * p.d_es;
  }
  return g;
}

// The output no GEMM writes, which the builder kernel zeroes: M-grouped, the rows from the
// last expert's end (or all rows when K == 0: an empty sum) to T; K-grouped, D[e] of each
// expert without tokens (D = 0, an empty sum). Rows [row_begin, row_end) of the [rows, N]
// matrix at d + d_offset.
struct ZeroRegion {
  int64_t d_offset = 0;
  int64_t row_begin = 0, row_end = 0;
};

// Region i of zero_regions(p) (count: M-grouped 1, K-grouped E); empty when nothing to zero.
EA_HD ZeroRegion zero_region(const Problem& p, const int32_t* offsets, int64_t i) {
  ZeroRegion z;
  if (p.grouping == GemmGrouping::kM) {
    int64_t covered = p.K > 0 ? span_of(p, offsets, p.E - 1).end : 0;
    // With decreasing offsets the last end may lie below an earlier one: zero only past all.
    for (int64_t e = 0; e + 1 < p.E && p.K > 0; ++e) {
      const int64_t end = span_of(p, offsets, e).end;
      covered = end > covered ? end : covered;
    }
    z.row_begin = covered;
    z.row_end = p.T;
  } else {
    z.d_offset = i * p.d_es;
    z.row_end = span_of(p, offsets, i).size() > 0 ? 0 : p.M;
  }
  return z;
}

EA_HD int64_t zero_region_count(const Problem& p) { return p.grouping == GemmGrouping::kM ? 1 : p.E; }

}  // namespace expertact::fp8gemm
