// Pass 2 of the per-expert, per-column FP8 quantisation (quantize_colwise_grouped and
// glu_colwise_grouped, src/cuda/fp8_colwise.cu): tiles of 128 output rows x 64 columns, written
// transposed into q_t.
//
// Thread t of a block takes output rows 4 (t / 8) .. + 3 of its tile (their source rows, or
// none: padding) at columns 8 (t % 8) .. + 7, quantises them with their expert's s = 1 / scale
// and packs each column's 4 bytes into one word of a shared tile (64 columns x 32 words; word w
// of column j at j * 32 + (w ^ 4 (j / 8)): the stores (a warp: 4 words x 8 column groups) and
// the 16-byte loads of the write-out each hit 32 distinct banks), written out as 16-byte runs of
// q_t's rows. Padding rows are written as 0 from the same tile.
//
// quant_kernel, one tile a block (any operands; run_kernel below takes the common ones), was
// bound by instructions, not by memory (Nsight Compute on an H200: 64% of the SM's issue
// throughput against 45% of DRAM's; without any global load it still took 91% of its time), so
// the work per tile is kept small: the row map in 32-bit integers (every row index
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

// The first expert e with pends[e] > p (E when none): the expert of output row p (pends
// ascending; a binary search).
__device__ __forceinline__ int32_t expert_at(const int32_t* __restrict__ pends, int32_t ne, int32_t p) {
  int32_t lo = 0, hi = ne;
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    if (__ldg(pends + mid) <= p) lo = mid + 1; else hi = mid;
  }
  return lo;
}

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
  int32_t e = expert_at(pends, ne, pf);
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
    for (int i = 0; i < 8; ++i) v[i] = pack_f(in[k], i);
  });
  __syncthreads();
  tile_store<kAligned>(ct, tile, cols, out_rows, q, q_stride, q_align);
}

// ---- runs: the form quantize_colwise_grouped takes where the operands allow it ----
//
// quant_kernel spends most of its instructions on what every tile repeats: finding its place,
// its rows' experts (a search of the offsets), their scales, then 32 values a thread. run_kernel
// gives a block kCols columns of `subs` consecutive 128-row tiles (a run) and carries what the
// tiles share: the row map is a cursor over the experts (advanced when a row passes its expert's
// padded end, which happens a few times a run at most), the scales stay in registers until the
// expert changes, and the next tile's loads are copied into shared memory (cp.async) while the
// current tile is packed. No longer bound by instructions, it took about half quant_kernel's
// time on an H200 (docs/notes/perf-notes-fp8.md, column-wise pass 2). Its bytes are quant_kernel's
// and the CPU path's (the tests compare the CUDA path's with the CPU's). It takes 16-bit x with
// 16-byte rows of whole packs (cols % 8 == 0), q_t 16-byte aligned, out_rows % 16 == 0 and every
// output row index (run ends included) inside int32; the launcher checks (runs_apply) and takes
// quant_kernel otherwise.

// An expert's output rows, as the cursor holds them: output rows [vlo, vhi) have source rows
// (p - delta, in 32-bit wrapping arithmetic: the result lies in [0, rows) wherever it is used).
struct Cursor {
  int32_t e;     // the expert (E: past the last)
  int32_t pend;  // its padded end (INT32_MAX past the last expert)
  int32_t vlo, vhi;
  uint32_t delta;
};

// The cursor at expert e. The source row of output row p is start + (p - pstart); only rows with
// p in [pstart, pend) and that source row in [0, min(end, rows)) have one: offsets that are not
// ascending (not checked on the device) read nothing outside x.
__device__ __forceinline__ Cursor cursor_at(int32_t e, int32_t ne, int32_t nrows, const int32_t* __restrict__ offsets,
                                            const int32_t* __restrict__ pends) {
  Cursor cu;
  cu.e = e;
  if (e >= ne) {
    cu.pend = 0x7fffffff, cu.vlo = 1, cu.vhi = 0, cu.delta = 0;
    return cu;
  }
  const int64_t start = e == 0 ? 0 : __ldg(offsets + e - 1), pstart = e == 0 ? 0 : __ldg(pends + e - 1);
  const int64_t end = __ldg(offsets + e), pend = __ldg(pends + e);
  const int64_t lo = pstart > pstart - start ? pstart : pstart - start;                // source row >= 0
  const int64_t src_end = end < nrows ? end : nrows;
  const int64_t hi = pend < pstart + src_end - start ? pend : pstart + src_end - start;  // < min(end, rows)
  auto clamp32 = [](int64_t v) -> int32_t { return v < 0 ? 0 : v > 0x7fffffff ? 0x7fffffff : static_cast<int32_t>(v); };
  cu.pend = clamp32(pend);
  cu.vlo = clamp32(lo);
  cu.vhi = clamp32(hi);
  cu.delta = static_cast<uint32_t>(pstart) - static_cast<uint32_t>(start);
  return cu;
}

constexpr int kRunMaxSubs = 16;  // tiles a run at most

// What run_kernel reads of a row: Raw (one load's worth: 8 columns from c), load_async (those
// bytes copied into shared memory: cp_async, the caller commits and waits), value(raw, i) (the
// float that column c + i quantises). The plain source: x's 16-bit values. (glu_colwise_grouped's
// source computes h from gate_up.)
template <typename T>
struct PlainRows {
  static_assert(sizeof(T) == 2, "16-bit rows: 8 values a 16-byte pack");
  using Raw = Pack<T, 8>;
  const T* x;
  int64_t stride;
  __device__ __forceinline__ float value(const Raw& p, int i) const { return pack_f(p, i); }
  __device__ __forceinline__ void load_async(int32_t r, int32_t c, Raw* dst) const {
    cp_async<16>(dst, x + static_cast<int64_t>(r) * stride + c);
  }
};

// The next tile's loads go into shared memory (Src::load_async: the thread's own 4 Raws, read
// back by it alone, so no barrier) while the current tile is packed: two stages of them in the
// dynamic shared memory (async_stage_bytes<Src>()).
template <typename Src>
constexpr int async_stage_bytes() {
  return 2 * 4 * kThreads * static_cast<int>(sizeof(typename Src::Raw));
}

// Sources whose rows load more than 16 bytes (the GLU's) take two blocks an SM, others three.
template <typename Src>
__global__ void __launch_bounds__(kThreads, sizeof(typename Src::Raw) > 16 ? 2 : 3)
    run_kernel(const Src src, int32_t rows, int32_t cols, const int32_t* __restrict__ offsets,
               const int32_t* __restrict__ pends, int32_t E, const float* __restrict__ scale, int64_t scale_stride,
               uint8_t* __restrict__ q, int64_t q_stride, int32_t out_rows, int32_t col_tiles, int32_t subs) {
  using Raw = typename Src::Raw;
  __shared__ __align__(16) uint32_t tile[2][kCols * kWords];
  // Two stages of the thread's 4 loads, load k of stage b at stage[(4 b + k) kThreads + t].
  extern __shared__ __align__(16) unsigned char run_stage[];
  Raw* const stage = reinterpret_cast<Raw*>(run_stage);
  const int cg = threadIdx.x & 7, rq = threadIdx.x >> 3;
  const int32_t ct = static_cast<int32_t>(blockIdx.x % static_cast<uint32_t>(col_tiles));
  const int32_t run = static_cast<int32_t>(blockIdx.x / static_cast<uint32_t>(col_tiles));
  const int32_t c0 = ct * kCols, c = c0 + 8 * cg;
  const bool col_ok = c < cols;
  const int32_t row_tiles = (out_rows + kRows - 1) / kRows;
  const int32_t first = run * subs;
  const int32_t nsub = row_tiles - first < subs ? row_tiles - first : subs;
  int32_t P = first * kRows;  // the current tile's first output row

  // The map cursor: the expert of the thread's next row.
  Cursor mc = cursor_at(expert_at(pends, E, P + 4 * rq), E, rows, offsets, pends);
  // Rows P + 4 rq + k: their source rows (-1: none) and experts.
  auto map = [&](int32_t P0, int32_t (&rs)[4], int32_t (&es)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int32_t p = P0 + 4 * rq + k;
      while (p >= mc.pend) mc = cursor_at(mc.e + 1, E, rows, offsets, pends);
      const bool has = p >= mc.vlo && p < mc.vhi;
      rs[k] = has ? static_cast<int32_t>(static_cast<uint32_t>(p) - mc.delta) : -1;
      es[k] = has ? mc.e : -1;
    }
  };

  // The copies of rows rs into stage b (rows without a source copy nothing: their bytes are
  // masked off below, whatever the stage holds).
  auto issue = [&](bool any, int b, const int32_t (&rs)[4]) {
    if (any) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (col_ok && rs[k] >= 0) src.load_async(rs[k], c, &stage[(4 * b + k) * kThreads + threadIdx.x]);
    }
    cp_async_commit();
  };

  int32_t rsrc[4], ex[4];
  Raw in[4];
  map(P, rsrc, ex);
  issue(true, 0, rsrc);
  float s[8] = {};
  int32_t se = -1;  // the expert whose scales s holds
  for (int t = 0; t < nsub; ++t, P += kRows) {
    int32_t nsrc[4], nex[4];
    if (t + 1 < nsub) map(P + kRows, nsrc, nex);
    issue(t + 1 < nsub, (t + 1) & 1, nsrc);  // (past the last tile an empty group: the wait counts it)
    cp_async_wait<1>();                      // this tile's copies are in
#pragma unroll
    for (int k = 0; k < 4; ++k) in[k] = stage[(4 * (t & 1) + k) * kThreads + threadIdx.x];
    uint32_t* tl = tile[t & 1];
    {
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = 0;
      if (col_ok) {
        // Once for each expert among the 4 rows (once, but at an expert's boundary): its
        // scales, its rows' bytes (the others' masked off).
        uint32_t left = 0;  // byte k set while row k (with a source) is still to be written
#pragma unroll
        for (int k = 0; k < 4; ++k) left |= ex[k] >= 0 ? 0xffu << (8 * k) : 0u;
        while (left) {
          const int k0 = (__ffs(left) - 1) >> 3;
          int32_t e0 = ex[0];
#pragma unroll
          for (int k = 1; k < 4; ++k) e0 = k == k0 ? ex[k] : e0;
          if (e0 != se) {
            se = e0;
            tile_scales(scale, scale_stride, se, c, cols, s);
          }
          uint32_t keep = 0;
#pragma unroll
          for (int k = 0; k < 4; ++k) keep |= ex[k] == e0 ? 0xffu << (8 * k) : 0u;
#pragma unroll
          for (int i = 0; i < 8; ++i)
            w[i] |= fp8::from_scaled4(src.value(in[0], i) * s[i], src.value(in[1], i) * s[i],
                                      src.value(in[2], i) * s[i], src.value(in[3], i) * s[i]) & keep;
          left &= ~keep;
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) tl[(8 * cg + i) * kWords + (rq ^ (cg << 2))] = w[i];
    }
    __syncthreads();  // (tile[t & 1] is written again two tiles on, after the next barrier)
#pragma unroll
    for (int it = 0; it < kCols * kRows / 16 / kThreads; ++it) {
      const int idx = threadIdx.x + it * kThreads;
      const int cl = idx >> 3, wg = idx & 7;
      const int32_t pw = P + 16 * wg;
      if (c0 + cl >= cols || pw >= out_rows) continue;
      *reinterpret_cast<uint4*>(q + static_cast<int64_t>(c0 + cl) * q_stride + pw) =
          *reinterpret_cast<const uint4*>(&tl[cl * kWords + 4 * (wg ^ (cl >> 3))]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) ex[k] = nex[k];
  }
}

// Whether run_kernel takes these operands (the source's pointers and row strides checked by the
// caller: `vec`, 16-bit values in 16-byte packs), and its runs: `subs` tiles a run, `blocks`
// blocks.
inline bool runs_apply(int64_t elem_size, bool vec, int q_align, int64_t rows, int64_t cols, int64_t out_rows,
                       int64_t experts, int64_t sm_count, int32_t& subs, int64_t& blocks) {
  if (elem_size != 2 || !vec || q_align != 16 || cols % 8 != 0 || out_rows % 16 != 0) return false;
  if (rows > 0x7fffffff || cols > 0x7fffffff || experts > 0x7fffffff) return false;
  const int64_t row_tiles = (out_rows + kRows - 1) / kRows, col_tiles = (cols + kCols - 1) / kCols;
  // About 16 waves of 3 blocks an SM at least, up to kRunMaxSubs tiles a run.
  int64_t want = row_tiles * col_tiles / (sm_count * 3 * 16);
  subs = static_cast<int32_t>(want < 1 ? 1 : want > kRunMaxSubs ? kRunMaxSubs : want);
  const int64_t runs = (row_tiles + subs - 1) / subs;
  // Every output row a run touches (its last tile's end included) fits in int32.
  if ((runs * subs) * kRows > 0x7fffffffLL - kRows) return false;
  blocks = runs * col_tiles;
  return blocks > 0 && blocks <= 0x7fffffff;
}

}  // namespace expertact::cuda::colwise
