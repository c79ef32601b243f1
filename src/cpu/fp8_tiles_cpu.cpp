// CPU path of the blockwise FP8 operands (src/core/fp8_tiles.h): threads over 128-row tiles
// (row tiles alone: over rows), each tile's values gathered as float32 into a per-thread buffer
// 128 columns at a time, then quantised per row (1 x 128), per column (128 x 1) or per block
// (128 x 128) with fp8.h's scale and conversion, as the rowwise path does per row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/bias.h"
#include "core/checks.h"
#include "core/dispatch.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/fp8_tiles.h"
#include "core/math.h"
#include "cpu/fp8_cpu.h"
#include "cpu/fp8_rows_cpu.h"
#include "cpu/host_dtype.h"
#include "cpu/parallel.h"

namespace expertact::detail {
namespace {

constexpr int64_t kT = fp8::kTile;

// Row tiles of one row of n float32 values: q[j] for j < n, the scale of tile k at
// scale[k * stride].
void row_tiles(const float* v, int64_t n, uint8_t* q, float* scale, int64_t stride) {
  for (int64_t c0 = 0, k = 0; c0 < n; c0 += kT, ++k) {
    const int64_t c1 = std::min(n, c0 + kT);
    float amax = 0.0f;
    for (int64_t j = c0; j < c1; ++j) amax = std::fmax(amax, std::fabs(v[j]));  // NaN ignored
    const float s = fp8::scale_of(amax);
    for (int64_t j = c0; j < c1; ++j) q[j] = fp8::quantize(v[j], s);
    scale[k * stride] = 1.0f / s;
  }
}

// Column tiles of the tile buffer buf (n rows, row i's value of column c at buf[i * ld + c]) over
// columns [c0, c0 + nc) of the output: q_t's columns 128 ct .. 128 ct + 127 (rows n .. 127 are
// padding, 0x00) and tile ct's scales.
void column_tiles(const float* buf, int64_t ld, int64_t n, int64_t c0, int64_t nc, const TileOut& o, int64_t ct) {
  uint8_t* q_t = static_cast<uint8_t*>(o.q_t);
  for (int64_t c = 0; c < nc; ++c) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(buf[i * ld + c]));
    const float s = fp8::scale_of(amax);
    uint8_t* qc = q_t + (c0 + c) * o.qt_stride + ct * kT;
    for (int64_t i = 0; i < n; ++i) qc[i] = fp8::quantize(buf[i * ld + c], s);
    for (int64_t i = n; i < kT; ++i) qc[i] = 0;
    o.col_scale[ct * o.cs_stride + c0 + c] = 1.0f / s;
  }
}

// The tiles a call covers, in the order of fp8_tiles.h's schedule: the padded tiles of q_t (when
// column tiles are wanted), then, with `tail`, the rows past the last offset (every row without
// column tiles).
std::vector<TileRows> schedule(const TileOut& o, int64_t rows, bool tail) {
  const int64_t E = o.q_t ? o.experts : 0, out_tiles = o.q_t ? o.out_rows / kT : 0;
  const int64_t tail0 = tail_start(o.offsets, E, rows);
  const int64_t n = tile_count(out_tiles, tail, rows, tail0);
  std::vector<TileRows> tiles(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) tiles[static_cast<size_t>(b)] = tile_rows(b, out_tiles, rows, o.offsets, o.pends, E, tail0);
  return tiles;
}

}  // namespace

Status cpu_fp8_tiles(const TileSrc& s, const TileOut& o) {
  const std::vector<TileRows> tiles = schedule(o, s.rows, o.q != nullptr);
  return dispatch_host_dtype<false>(s.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    cpu::parallel_for(static_cast<int64_t>(tiles.size()), 3 * kT * s.cols, [&](int64_t t0, int64_t t1) {
      std::vector<float> buf(static_cast<size_t>(kT * kT));
      for (int64_t ti = t0; ti < t1; ++ti) {
        const TileRows& tr = tiles[static_cast<size_t>(ti)];
        for (int64_t c0 = 0, k = 0; c0 < s.cols; c0 += kT, ++k) {
          const int64_t nc = std::min(kT, s.cols - c0);
          for (int64_t i = 0; i < tr.n; ++i) {
            const T* x = static_cast<const T*>(s.x) + (tr.r0 + i) * s.x_stride + c0;
            for (int64_t j = 0; j < nc; ++j) buf[static_cast<size_t>(i * kT + j)] = Cv<T>::ld(x[j]);
          }
          if (o.q) {
            for (int64_t i = 0; i < tr.n; ++i) {
              const int64_t r = tr.r0 + i;
              row_tiles(buf.data() + i * kT, nc, static_cast<uint8_t*>(o.q) + r * o.q_stride + c0,
                        o.scale + k * o.scale_stride + r, 0);
            }
          }
          if (o.q_t && tr.ct >= 0) column_tiles(buf.data(), kT, tr.n, c0, nc, o, tr.ct);
        }
      }
    });
    return Status::kOk;
  });
}

Status cpu_fp8_blocks(const BlockProblem& b) {
  const int64_t RB = (b.rows + kT - 1) / kT, CB = (b.cols + kT - 1) / kT;
  return dispatch_host_dtype<false>(b.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    cpu::parallel_for(b.experts * RB, 3 * kT * b.cols, [&](int64_t i0, int64_t i1) {
      std::vector<float> buf(static_cast<size_t>(kT * kT));
      for (int64_t idx = i0; idx < i1; ++idx) {
        const int64_t e = idx / RB, r0 = (idx % RB) * kT, nr = std::min(kT, b.rows - r0);
        const T* w = static_cast<const T*>(b.w) + e * b.w_estride;
        for (int64_t cb = 0; cb < CB; ++cb) {
          const int64_t c0 = cb * kT, nc = std::min(kT, b.cols - c0);
          float amax = 0.0f;
          for (int64_t i = 0; i < nr; ++i)
            for (int64_t j = 0; j < nc; ++j) {
              const float v = Cv<T>::ld(w[(r0 + i) * b.w_rstride + (c0 + j) * b.w_cstride]);
              buf[static_cast<size_t>(i * kT + j)] = v;
              amax = std::fmax(amax, std::fabs(v));
            }
          const float s = fp8::scale_of(amax);
          for (int64_t i = 0; i < nr; ++i) {
            uint8_t* q = static_cast<uint8_t*>(b.q) + (e * b.rows + r0 + i) * b.q_stride + c0;
            for (int64_t j = 0; j < nc; ++j) q[j] = fp8::quantize(buf[static_cast<size_t>(i * kT + j)], s);
          }
          b.scale[(e * RB + r0 / kT) * b.scale_stride + cb] = 1.0f / s;
        }
      }
    });
    return Status::kOk;
  });
}

// Each row's float32 activation as cpu_fp8_glu_rowwise computes it (the same scalar math, the
// bias added in float32), then its row tiles.
Status cpu_fp8_glu_row_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o) {
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      constexpr Activation A = decltype(act)::value;
      const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
      cpu::parallel_for(p.rows, 4 * p.F, [&](int64_t r0, int64_t r1) {
        std::vector<float> h(static_cast<size_t>(p.F));
        int64_t e = bias ? expert_of(bias->er.offsets, bias->er.experts, r0) : 0;
        for (int64_t r = r0; r < r1; ++r) {
          if (bias)
            while (e < bias->er.experts && bias->er.offsets[e] <= r) ++e;
          const T *bg, *bu;
          bias_rows<T>(bias, e, bg, bu);
          glu_row<A>(p, c, r, bg, bu, h.data());
          row_tiles(h.data(), p.F, static_cast<uint8_t*>(o.q) + r * o.q_stride, o.scale + r, o.scale_stride);
        }
      });
      return Status::kOk;
    });
  });
}

// h of runs of whole tiles written in the problem's dtype by the activation's own CPU forward
// (cpu_forward, or cpu_glu_bias_forward with a bias: the bytes glu_forward / glu_forward_bias
// write, whichever instruction set they run on; cpu_fp8_glu_colwise_grouped says why not
// math::glu_fwd here) into a buffer, then threads over the run's tiles quantise its columns.
Status cpu_fp8_glu_column_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o) {
  const std::vector<TileRows> tiles = schedule(o, p.rows, false);
  const int64_t F = p.F, E = o.experts;
  // Runs of forward_run_elements() elements (as cpu_fp8_glu_colwise_grouped's), whole tiles, at
  // least one.
  const int64_t want = forward_run_elements();
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) -> Status {
    using T = decltype(t);
    std::vector<T> h;
    std::vector<int32_t> run_offsets(bias ? static_cast<size_t>(E) : 0);
    const int64_t nt = static_cast<int64_t>(tiles.size());
    for (int64_t t0 = 0; t0 < nt;) {
      // The run [t0, t1): consecutive tiles of consecutive rows.
      int64_t t1 = t0 + 1, rows = tiles[static_cast<size_t>(t0)].n;
      const int64_t a = tiles[static_cast<size_t>(t0)].r0;
      while (rows > 0 && t1 < nt && tiles[static_cast<size_t>(t1)].n > 0 &&
             tiles[static_cast<size_t>(t1)].r0 == a + rows && (rows + tiles[static_cast<size_t>(t1)].n) * F <= want) {
        rows += tiles[static_cast<size_t>(t1)].n;
        ++t1;
      }
      if (rows > 0) {
        h.resize(static_cast<size_t>(rows * F));
        EA_TRY(cpu_forward_run(p, bias, a, rows, h.data(), run_offsets.data()));
      }
      cpu::parallel_for(t1 - t0, 3 * kT * F, [&](int64_t i0, int64_t i1) {
        std::vector<float> buf(static_cast<size_t>(kT * kT));
        for (int64_t ti = t0 + i0; ti < t0 + i1; ++ti) {
          const TileRows& tr = tiles[static_cast<size_t>(ti)];
          for (int64_t c0 = 0; c0 < F; c0 += kT) {
            const int64_t nc = std::min(kT, F - c0);
            for (int64_t i = 0; i < tr.n; ++i) {
              const T* hr = h.data() + (tr.r0 - a + i) * F + c0;
              for (int64_t j = 0; j < nc; ++j) buf[static_cast<size_t>(i * kT + j)] = Cv<T>::ld(hr[j]);
            }
            column_tiles(buf.data(), kT, tr.n, c0, nc, o, tr.ct);
          }
        }
      });
      t0 = t1;
    }
    return Status::kOk;
  });
}

// Each tile's rows: the float32 gradient in gate_up's column layout into the tile's buffer (the
// weights' gradient summed in column order, as cpu_fp8_glu_backward_rowwise sums it), the
// optional rounded copy and the row tiles; then the tile's column tiles from the buffer.
Status cpu_fp8_glu_backward_tiles(const GluProblem& p, const GluBias* bias, const PackedBwdIO& d, const TileOut& o) {
  const std::vector<TileRows> tiles = schedule(o, p.rows, true);
  const int64_t C = 2 * p.F;
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      constexpr Activation A = decltype(act)::value;
      const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
      cpu::parallel_for(static_cast<int64_t>(tiles.size()), 8 * kT * p.F, [&](int64_t t0, int64_t t1) {
        std::vector<float> buf(static_cast<size_t>(kT * C)), cbuf(o.q_t ? static_cast<size_t>(kT * kT) : 0);
        for (int64_t ti = t0; ti < t1; ++ti) {
          const TileRows& tr = tiles[static_cast<size_t>(ti)];
          for (int64_t i = 0; i < tr.n; ++i) {
            const int64_t r = tr.r0 + i;
            const T *bg, *bu;
            bias_rows<T>(bias, tr.e >= 0 ? tr.e : (bias ? expert_of(bias->er.offsets, bias->er.experts, r) : -1), bg,
                         bu);
            float* row = buf.data() + i * C;
            glu_grad_row<A>(p, c, d, r, bg, bu, row);
            row_tiles(row, C, static_cast<uint8_t*>(o.q) + r * o.q_stride, o.scale + r, o.scale_stride);
          }
          if (!o.q_t || tr.ct < 0) continue;
          for (int64_t c0 = 0; c0 < C; c0 += kT) {
            const int64_t nc = std::min(kT, C - c0);
            for (int64_t i = 0; i < tr.n; ++i)
              std::copy(buf.data() + i * C + c0, buf.data() + i * C + c0 + nc, cbuf.data() + i * kT);
            column_tiles(cbuf.data(), kT, tr.n, c0, nc, o, tr.ct);
          }
        }
      });
      return Status::kOk;
    });
  });
}

}  // namespace expertact::detail
