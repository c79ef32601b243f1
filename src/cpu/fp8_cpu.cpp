// CPU path of the FP8 rowwise quantisation (src/core/fp8.h): threads over rows, each row in
// two passes (its amax, then the scaled cast), plain loops. The GLU form computes the row's
// float32 activation once into a per-thread buffer and quantises it from there.
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/bias.h"
#include "core/checks.h"
#include "core/dispatch.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/math.h"
#include "cpu/fp8_cpu.h"
#include "cpu/fp8_rows_cpu.h"
#include "cpu/host_dtype.h"
#include "cpu/parallel.h"

namespace expertact::detail {
namespace {

// amax (NaN ignored), then q and the dequantisation scale 1 / s of one row of float32 values.
void quantize_row(const float* v, int64_t n, uint8_t* q, float* scale_out) {
  float amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) amax = std::fmax(amax, std::fabs(v[j]));
  const float s = fp8::scale_of(amax);
  for (int64_t j = 0; j < n; ++j) q[j] = fp8::quantize(v[j], s);
  *scale_out = 1.0f / s;
}

// A column amax per expert and column, dst [E, C] (row stride `stride`): zeroed by the
// constructor; each thread's Run keeps a running amax over its rows (contiguous, sorted by
// expert) and merges it into dst under the lock when the row's expert changes and at finish()
// (max is exact and order-free: the same result for any split of the rows). E = 0: nothing.
class ColAmax {
 public:
  ColAmax(const int32_t* offs, int64_t E, float* dst, int64_t stride, int64_t C)
      : offs_(offs), E_(E), dst_(dst), stride_(stride), C_(C) {
    for (int64_t e = 0; e < E; ++e)
      for (int64_t j = 0; j < C; ++j) dst[e * stride + j] = 0.0f;
  }
  bool on() const { return E_ > 0; }

  class Run {
   public:
    Run(ColAmax& a, int64_t r0)
        : a_(a), cm_(a.E_ > 0 ? static_cast<size_t>(a.C_) : 0), e_(a.E_ > 0 ? expert_of(a.offs_, a.E_, r0) : 0) {}
    // Moves to row r's expert; whether the row counts (it belongs to one of the E).
    bool at(int64_t r) {
      if (a_.E_ == 0) return false;
      while (e_ < a_.E_ && a_.offs_[e_] <= r) ++e_;
      if (e_ != held_) {
        finish();
        if (e_ < a_.E_) {
          held_ = e_;
          std::fill(cm_.begin(), cm_.end(), 0.0f);
        }
      }
      return held_ >= 0;
    }
    void add(int64_t j, float v) { cm_[static_cast<size_t>(j)] = std::fmax(cm_[static_cast<size_t>(j)], std::fabs(v)); }  // NaN ignored
    void finish() {
      if (held_ < 0) return;
      std::lock_guard<std::mutex> lock(a_.merge_);
      float* dst = a_.dst_ + held_ * a_.stride_;
      for (int64_t j = 0; j < a_.C_; ++j) dst[j] = std::fmax(dst[j], cm_[static_cast<size_t>(j)]);
      held_ = -1;
    }

   private:
    ColAmax& a_;
    std::vector<float> cm_;
    int64_t e_, held_ = -1;
  };

 private:
  const int32_t* offs_;
  int64_t E_;
  float* dst_;
  int64_t stride_, C_;
  std::mutex merge_;
};

}  // namespace

// With col_amax: each thread's rows (contiguous, sorted by expert) keep a running column
// amax of their current expert, merged into col_amax under a lock when the expert changes
// and at the end (max is exact and order-free: the same result for any split).
Status cpu_fp8_quantize_rowwise(const Fp8Rows& p) {
  ColAmax amax(p.col_amax_offsets, p.col_amax ? p.col_amax_experts : 0, p.col_amax, p.col_amax_stride, p.cols);
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    cpu::parallel_for(p.rows, 2 * p.cols, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(static_cast<size_t>(p.cols));
      ColAmax::Run run(amax, r0);
      for (int64_t r = r0; r < r1; ++r) {
        const T* x = static_cast<const T*>(p.x) + r * p.x_stride;
        for (int64_t j = 0; j < p.cols; ++j) buf[j] = Cv<T>::ld(x[j]);
        if (run.at(r))
          for (int64_t j = 0; j < p.cols; ++j) run.add(j, buf[j]);
        quantize_row(buf.data(), p.cols, static_cast<uint8_t*>(p.q) + r * p.q_stride, p.scale + r * p.scale_stride);
      }
      run.finish();
    });
    return Status::kOk;
  });
}

Status cpu_fp8_quantize_colwise_grouped(const Fp8Cols& p) {
  const int32_t* padded = p.padded ? p.padded : p.offsets;
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    // Threads over columns: each column's experts in row order (reads stride down rows).
    cpu::parallel_for(p.cols, 2 * p.rows, [&](int64_t c0, int64_t c1) {
      const T* x = static_cast<const T*>(p.x);
      for (int64_t c = c0; c < c1; ++c) {
        uint8_t* qc = static_cast<uint8_t*>(p.q_t) + c * p.q_stride;
        int64_t start = 0, pstart = 0;
        for (int64_t e = 0; e < p.experts; ++e) {
          const int64_t end = p.offsets[e], pend = padded[e];
          float amax = 0.0f;
          if (p.amax)
            amax = p.amax[e * p.amax_stride + c];
          else
            for (int64_t r = start; r < end; ++r) amax = std::fmax(amax, std::fabs(Cv<T>::ld(x[r * p.x_stride + c])));
          const float s = fp8::scale_of(amax);
          uint8_t* qe = qc + (pstart - start);  // row r at pstart + (r - start)
          for (int64_t r = start; r < end; ++r) qe[r] = fp8::quantize(Cv<T>::ld(x[r * p.x_stride + c]), s);
          for (int64_t j = pstart + (end - start); j < pend; ++j) qc[j] = 0;  // the block's padding
          p.scale[e * p.scale_stride + c] = 1.0f / s;
          start = end;
          pstart = pend;
        }
        for (int64_t j = pstart; j < p.out_rows; ++j) qc[j] = 0;  // past the last block
      }
    });
    return Status::kOk;
  });
}

Status cpu_forward_run(const GluProblem& p, const GluBias* bias, int64_t r0, int64_t n, void* h, int32_t* offsets) {
  const int64_t es = dtype_size(p.dtype);
  GluProblem sub = p;
  sub.rows = n;
  sub.g = static_cast<const char*>(p.g) + r0 * p.g_stride * es;
  sub.u = static_cast<const char*>(p.u) + r0 * p.u_stride * es;
  if (p.w) sub.w = p.w + r0 * p.w_stride;
  const FwdOutput out{h, p.F};
  if (!bias) return cpu_forward(sub, out);
  GluBias rb = *bias;
  for (int64_t k = 0; k < bias->er.experts; ++k)
    offsets[k] = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(bias->er.offsets[k] - r0, 0), n));
  rb.er.offsets = offsets;
  rb.er.chunk = bias_chunk_rows(n);
  return cpu_glu_bias_forward(sub, rb, out);
}

int64_t forward_run_elements() {
  return std::min<int64_t>(std::max<int64_t>(int64_t{1} << 18, int64_t{cpu::threads()} << 17), int64_t{1} << 22);
}

// h in row tiles: each tile is written in the problem's dtype by the activation's own CPU
// forward (cpu_forward, or cpu_glu_bias_forward with a bias: the same kernels, so the same
// bits, as glu_forward / glu_forward_bias write, whichever instruction set they run on) into a
// buffer, then threads over columns quantise the tile's rows into q_t with their expert's
// multiplier. Why the forward itself rather than math::glu_fwd here: the AVX2 kernels contract
// multiply-adds into FMAs and this file's plain loops do not, so a recompute here would differ
// in the last bit of some float32 values, and the bytes must be those of h. The scales and the
// padding bytes are written first; rows past the last offset are not computed (they land
// nowhere).
Status cpu_fp8_glu_colwise_grouped(const GluProblem& p, const GluBias* bias, const Fp8Cols& c) {
  const int64_t E = c.experts, F = p.F;
  if (F == 0) return Status::kOk;
  if (c.amax == nullptr) return fail(Status::kInternal, "cpu_fp8_glu_colwise_grouped: no amax");
  const int32_t* padded = c.padded ? c.padded : c.offsets;
  std::vector<float> mult(static_cast<size_t>(E * F));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < F; ++j) {
      const float s = fp8::scale_of(c.amax[e * c.amax_stride + j]);
      mult[static_cast<size_t>(e * F + j)] = s;
      c.scale[e * c.scale_stride + j] = 1.0f / s;
    }
  uint8_t* const q_t = static_cast<uint8_t*>(c.q_t);
  cpu::parallel_for(F, c.out_rows, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      uint8_t* qc = q_t + j * c.q_stride;
      int64_t start = 0, pstart = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t end = c.offsets[e], pend = padded[e];
        for (int64_t k = pstart + (end - start); k < pend; ++k) qc[k] = 0;  // the block's padding
        start = end;
        pstart = pend;
      }
      for (int64_t k = pstart; k < c.out_rows; ++k) qc[k] = 0;  // past the last block
    }
  });
  const int64_t covered = E > 0 ? c.offsets[E - 1] : 0;
  if (covered <= 0) return Status::kOk;

  // Tiles of forward_run_elements() elements.
  const int64_t R = std::min<int64_t>(covered, std::max<int64_t>(1, forward_run_elements() / F));
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) -> Status {
    using T = decltype(t);
    std::vector<T> h(static_cast<size_t>(R * F));
    std::vector<int32_t> row_expert(static_cast<size_t>(R)), tile_offsets(bias ? static_cast<size_t>(E) : 0);
    std::vector<int64_t> row_dst(static_cast<size_t>(R));
    int64_t e = 0, start = 0, pstart = 0;  // the current row's expert, that expert's first row and q_t column
    for (int64_t r0 = 0; r0 < covered; r0 += R) {
      const int64_t n = std::min<int64_t>(R, covered - r0);
      EA_TRY(cpu_forward_run(p, bias, r0, n, h.data(), tile_offsets.data()));
      // Each row's expert and q_t column.
      for (int64_t r = r0; r < r0 + n; ++r) {
        while (c.offsets[e] <= r) {  // r < covered = offsets[E - 1]: stops at e < E
          start = c.offsets[e];
          pstart = padded[e];
          ++e;
        }
        row_expert[static_cast<size_t>(r - r0)] = static_cast<int32_t>(e);
        row_dst[static_cast<size_t>(r - r0)] = pstart + (r - start);
      }
      cpu::parallel_for(F, 2 * n, [&](int64_t j0, int64_t j1) {
        constexpr int64_t kRows = 64;  // rows of h a pass over the columns reads (L1-resident)
        for (int64_t b0 = 0; b0 < n; b0 += kRows) {
          const int64_t b1 = std::min<int64_t>(n, b0 + kRows);
          for (int64_t j = j0; j < j1; ++j) {
            uint8_t* qc = q_t + j * c.q_stride;
            for (int64_t r = b0; r < b1; ++r) {
              const float s = mult[static_cast<size_t>(row_expert[static_cast<size_t>(r)] * F + j)];
              qc[row_dst[static_cast<size_t>(r)]] = fp8::quantize(Cv<T>::ld(h[static_cast<size_t>(r * F + j)]), s);
            }
          }
        }
      });
    }
    return Status::kOk;
  });
}

// With the column amax: each thread's rows (contiguous, sorted by expert) keep a running
// column amax of their expert, merged under a lock as cpu_fp8_quantize_rowwise does, of h in
// the problem's dtype as the activation's forward writes it: for the biased form the float32
// h rounded (the biased forward, src/cpu/bias_cpu.cpp, computes h with this same scalar
// math); for the unbiased form the forward's own kernels' output for the row
// (cpu_forward_rows), whose float32 values may differ in their last bit from h (the AVX2
// kernels' FMAs). q and scale come from the float32 h either way.
Status cpu_fp8_glu_rowwise(const GluProblem& p, const Fp8Out& o, const GluBias* bias, const Fp8ColAmax* amax) {
  const int64_t E = amax ? amax->experts : 0;
  ColAmax ca(amax ? amax->offsets : nullptr, E, amax ? amax->col_amax : nullptr, amax ? amax->stride : 0, p.F);
  if (p.rows == 0) return Status::kOk;
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      constexpr Activation A = decltype(act)::value;
      const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
      cpu::parallel_for(p.rows, (E > 0 ? 6 : 4) * p.F, [&](int64_t r0, int64_t r1) {
        std::vector<float> h(static_cast<size_t>(p.F));
        std::vector<T> fwd(E > 0 && !bias ? static_cast<size_t>(p.F) : 0);  // the forward's row
        int64_t e = bias ? expert_of(bias->er.offsets, bias->er.experts, r0) : 0;
        ColAmax::Run run(ca, r0);
        for (int64_t r = r0; r < r1; ++r) {
          if (bias) while (e < bias->er.experts && bias->er.offsets[e] <= r) ++e;
          const T *bg, *bu;
          bias_rows<T>(bias, e, bg, bu);  // x + bias[e] in float32, as src/cpu/bias_cpu.cpp adds it
          glu_row<A>(p, c, r, bg, bu, h.data());
          if (run.at(r)) {
            if (bias) {
              for (int64_t j = 0; j < p.F; ++j) run.add(j, Cv<T>::ld(Cv<T>::st(h[j])));
            } else {
              FwdOutput fo;
              fo.out = fwd.data();
              fo.out_stride = 0;  // row r lands at fwd
              const Status st = cpu_forward_rows(p, fo, r, r + 1);
              (void)st;  // p's dtype, act and step were dispatched above: it cannot fail
              for (int64_t j = 0; j < p.F; ++j) run.add(j, Cv<T>::ld(fwd[j]));
            }
          }
          quantize_row(h.data(), p.F, static_cast<uint8_t*>(o.q) + r * o.q_stride, o.scale + r * o.scale_stride);
        }
        run.finish();
      });
      return Status::kOk;
    });
  });
}

// Each row: its float32 gradient into a per-thread buffer in gate_up's column layout (its
// weight-gradient term summed in column order), the optional rounded copy and the column amax
// (of the gradient rounded to T, as the copy holds it), then quantize_row. The column amax
// is kept per thread and expert and merged under a lock, as cpu_fp8_quantize_rowwise does.
Status cpu_fp8_glu_backward_rowwise(const GluProblem& p, const Fp8BwdOut& o, const GluBias* bias) {
  const int64_t C = 2 * p.F;
  ColAmax ca(o.offsets, o.col_amax ? o.experts : 0, o.col_amax, o.col_amax_stride, C);
  if (p.rows == 0) return Status::kOk;
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      constexpr Activation A = decltype(act)::value;
      const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
      cpu::parallel_for(p.rows, 8 * p.F, [&](int64_t r0, int64_t r1) {
        std::vector<float> buf(static_cast<size_t>(C));
        int64_t eb = bias ? expert_of(bias->er.offsets, bias->er.experts, r0) : 0;
        ColAmax::Run run(ca, r0);
        for (int64_t r = r0; r < r1; ++r) {
          if (bias) while (eb < bias->er.experts && bias->er.offsets[eb] <= r) ++eb;
          const T *bg, *bu;
          bias_rows<T>(bias, eb, bg, bu);
          glu_grad_row<A>(p, c, o, r, bg, bu, buf.data());
          if (run.at(r))  // of the gradient as rounded to T (what dgu gets)
            for (int64_t j = 0; j < C; ++j) run.add(j, Cv<T>::ld(Cv<T>::st(buf[j])));
          quantize_row(buf.data(), C, static_cast<uint8_t*>(o.q) + r * o.q_stride, o.scale + r * o.scale_stride);
        }
        run.finish();
      });
      return Status::kOk;
    });
  });
}

}  // namespace expertact::detail
