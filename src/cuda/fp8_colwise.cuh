// Pass 2 of the per-expert, per-column FP8 quantisation (quantize_colwise_grouped and
// glu_colwise_grouped, src/cuda/fp8_cuda.cu): tiles of 128 output rows x 64 columns, written
// transposed into q_t. Kept in a header so that bench/colwise_pass2.cu times this code, not a
// copy of it.
//
// Thread t of a block takes output rows 4 (t / 8) .. + 3 of its tile (their source rows, or
// none: padding) at columns 8 (t % 8) .. + 7, quantises them with their expert's s = 1 / scale
// and packs each column's 4 bytes into one word of a shared tile (64 columns x 32 words; word w
// of column j at j * 32 + (w ^ 4 (j / 8)): the stores (a warp: 4 words x 8 column groups) and
// the 16-byte loads of the write-out each hit 32 distinct banks), written out as 16-byte runs of
// q_t's rows. Padding rows are written as 0 from the same tile.
//
// The pass is bound by instructions, not by memory (Nsight Compute on an H200: 64% of the SM's
// issue throughput against 45% of DRAM's; without any global load it still took 91% of its
// time), so the work per tile is kept small: the row map in 32-bit integers (every row index
// fits: the offsets are int32), s from scale by exponent arithmetic (scale is a power of two;
// anything else takes the division), four bytes converted per NaN fix-up (fp8::from_scaled4),
// the write-out's addresses without per-byte branches where q_t takes 16-byte stores.
#pragma once

#include <cstdint>

#include "core/bias.h"
#include "core/fp8.h"
#include "cuda/common.cuh"

namespace expertact::cuda::colwise {

constexpr int kThreads = 256;            // 8 lanes x 8 columns, 32 x 4 rows
constexpr int kRows = 128, kCols = 64;   // output rows x columns per tile
constexpr int kWords = kRows / 4;        // shared words per column

// A tile's place and the thread's 4 rows: their source rows in x (-1: none) and experts.
struct Tile {
  int64_t p0, c0;
  int32_t src[4], ex[4];
};

// Tile t (row tile t / col_tiles, column tile t % col_tiles). pends: the padded cumulative
// ends (offsets when unpadded). Every offset is an int32, so the row map runs in 32 bits: a
// thread whose rows start past INT32_MAX - 256 has no source rows (they are past every offset).
__device__ __forceinline__ Tile tile_of(int64_t t, int64_t col_tiles, int64_t rows, int64_t out_rows,
                                        const int32_t* __restrict__ offsets, const int32_t* __restrict__ pends,
                                        int64_t E) {
  Tile ct;
  ct.p0 = (t / col_tiles) * kRows;
  ct.c0 = (t % col_tiles) * kCols;
  const int64_t pf64 = ct.p0 + 4 * (threadIdx.x >> 3);
  const int32_t ne = static_cast<int32_t>(E);
  if (pf64 >= 0x7fffff00) {
#pragma unroll
    for (int k = 0; k < 4; ++k) ct.src[k] = -1, ct.ex[k] = ne;
    return ct;
  }
  const int32_t pf = static_cast<int32_t>(pf64);
  const int32_t nrows = rows < 0x7fffffff ? static_cast<int32_t>(rows) : 0x7fffffff;
  const int32_t nout = out_rows < 0x7fffffff ? static_cast<int32_t>(out_rows) : 0x7fffffff;
  int32_t lo = 0, hi = ne;  // the first e with pends[e] > pf
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    if (__ldg(pends + mid) <= pf) lo = mid + 1; else hi = mid;
  }
  int32_t e = lo;
  // Expert e's run: source rows [start, end), output rows [pstart, pend).
  int32_t start = 0, end = 0, pstart = 0, pend = 0;
  auto load = [&] {
    if (e < ne) {
      start = e == 0 ? 0 : __ldg(offsets + e - 1);
      pstart = e == 0 ? 0 : __ldg(pends + e - 1);
      end = __ldg(offsets + e);
      pend = __ldg(pends + e);
    }
  };
  load();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int32_t p = pf + k;
    while (e < ne && pend <= p) {
      ++e;
      load();
    }
    ct.ex[k] = e;
    // In 64 bits: offsets that are not ascending (not checked on the device) must not wrap.
    // r in [0, nrows) keeps every read inside x whatever the offsets hold.
    const int64_t r = static_cast<int64_t>(start) + (p - static_cast<int64_t>(pstart));
    ct.src[k] = e < ne && p < nout && p >= pstart && r < end && r >= 0 && r < nrows ? static_cast<int32_t>(r) : -1;
  }
  return ct;
}

// s = 1 / scale for columns c .. c + 7 of expert e (0 past the end). All 8 loads are issued
// before any is used: a division's branch between them made each load wait for the last (the
// pass then stalled on them more than on x). fp8::recip_pow2 gives the bits __fdiv_rn(1, v)
// gives wherever it applies; where it does not for one of the 8 (0, infinities, NaN, scales
// that are not powers of two), all 8 take the division, behind one branch.
__device__ __forceinline__ void tile_scales(const float* __restrict__ scale, int64_t scale_stride, int32_t e,
                                            int64_t c, int64_t cols, float (&s)[8]) {
  const float* sr = scale + e * scale_stride + c;
  float v[8];
  if (c + 8 <= cols && (reinterpret_cast<uintptr_t>(sr) & 15) == 0) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(sr)), b = __ldg(reinterpret_cast<const float4*>(sr) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = c + i < cols ? __ldg(sr + i) : 0.0f;
  }
  bool all = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) all &= fp8::recip_pow2(v[i], s[i]);
  if (!all) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = c + i < cols ? __fdiv_rn(1.0f, v[i]) : 0.0f;
  }
}

// The thread's 4 x 8 values (v(k, x): row k's 8 floats; rows without a source and columns past
// the end give bytes 0x00), scaled by their expert's s and packed into the shared tile.
template <typename Values>
__device__ __forceinline__ void tile_pack(const Tile& ct, int64_t cols, const float* __restrict__ scale,
                                          int64_t scale_stride, uint32_t* tile, Values&& v) {
  const int cg = threadIdx.x & 7, rq = threadIdx.x >> 3;
  const int64_t c = ct.c0 + 8 * cg;
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = 0;
  if (c < cols) {
    float xs[4][8];
    float s[8];
    int32_t se = -1;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (ct.src[k] < 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) xs[k][i] = 0.0f;
        continue;
      }
      if (ct.ex[k] != se) {
        se = ct.ex[k];
        tile_scales(scale, scale_stride, se, c, cols, s);
      }
      v(k, xs[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) xs[k][i] *= s[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = fp8::from_scaled4(xs[0][i], xs[1][i], xs[2][i], xs[3][i]);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) tile[(8 * cg + i) * kWords + (rq ^ (cg << 2))] = w[i];
}

// The shared tile written out: 16 bytes a thread and step, along q_t's rows (kAligned: q_t's
// pointer and row stride are multiples of 16 bytes, so every full run takes one store).
template <bool kAligned>
__device__ __forceinline__ void tile_store(const Tile& ct, const uint32_t* tile, int64_t cols, int64_t out_rows,
                                           uint8_t* __restrict__ q, int64_t q_stride, int q_align) {
#pragma unroll
  for (int it = 0; it < kCols * kRows / 16 / kThreads; ++it) {
    const int idx = threadIdx.x + it * kThreads;
    const int cl = idx >> 3, wg = idx & 7;
    const int64_t cc = ct.c0 + cl;
    const int64_t pw = ct.p0 + 16 * wg;
    if (cc >= cols || pw >= out_rows) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(&tile[cl * kWords + 4 * (wg ^ (cl >> 3))]);
    uint8_t* dst = q + cc * q_stride + pw;
    const int64_t n = out_rows - pw < 16 ? out_rows - pw : 16;
    if (kAligned && n == 16) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (q_align >= 4 && 4 * j + 4 <= n) {
          reinterpret_cast<uint32_t*>(dst)[j] = words[j];
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k)
            if (4 * j + k < n) dst[4 * j + k] = static_cast<uint8_t>(words[j] >> (8 * k));
        }
      }
    }
  }
}

// Up to 8 elements of a row from column c on (0 past the row's end): one 16-byte access (two
// for float32) when kVec and all 8 lie in the row, else one by one.
template <typename T, bool kVec>
__device__ __forceinline__ void load8(const T* row, int64_t c, int64_t cols, Pack<T, 8>& p) {
  if (kVec && c + 8 <= cols) {
    p = *reinterpret_cast<const Pack<T, 8>*>(row + c);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) p.v[i] = c + i < cols ? row[c + i] : from_f<T>(0.0f);
  }
}

// quantize_colwise_grouped's pass 2: a block a tile, its loads straight into registers (4 x 16
// bytes a thread, or element by element where rows allow no 16-byte pack).
template <typename T, bool kVec, bool kAligned>
__global__ void __launch_bounds__(kThreads, 3) quant_kernel(const T* __restrict__ x, int64_t x_stride, int64_t rows,
                                                            int64_t cols, const int32_t* __restrict__ offsets,
                                                            const int32_t* __restrict__ pends, int64_t E,
                                                            const float* __restrict__ scale, int64_t scale_stride,
                                                            uint8_t* __restrict__ q, int64_t q_stride,
                                                            int64_t out_rows, int64_t col_tiles, int q_align) {
  __shared__ __align__(16) uint32_t tile[kCols * kWords];
  const Tile ct = tile_of(blockIdx.x, col_tiles, rows, out_rows, offsets, pends, E);
  const int64_t c = ct.c0 + 8 * (threadIdx.x & 7);
  Pack<T, 8> in[4];
  if (c < cols) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (ct.src[k] >= 0) load8<T, kVec>(x + static_cast<int64_t>(ct.src[k]) * x_stride, c, cols, in[k]);
  }
  tile_pack(ct, cols, scale, scale_stride, tile, [&](int k, float (&v)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f(in[k].v[i]);
  });
  __syncthreads();
  tile_store<kAligned>(ct, tile, cols, out_rows, q, q_stride, q_align);
}

}  // namespace expertact::cuda::colwise
