// CPU path of the FP8 rowwise quantisation (src/core/fp8.h): threads over rows, each row in
// two passes (its amax, then the scaled cast), plain loops. The GLU form computes the row's
// float32 activation once into a per-thread buffer and quantises it from there.
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/bias.h"
#include "core/dispatch.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/math.h"
#include "cpu/fp8_cpu.h"
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

}  // namespace

// With col_amax: each thread's rows (contiguous, sorted by expert) keep a running column
// amax of their current expert, merged into col_amax under a lock when the expert changes
// and at the end (max is exact and order-free: the same result for any split).
Status cpu_fp8_quantize_rowwise(const Fp8Rows& p) {
  const int64_t E = p.col_amax ? p.col_amax_experts : 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < p.cols; ++j) p.col_amax[e * p.col_amax_stride + j] = 0.0f;
  std::mutex merge;
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    cpu::parallel_for(p.rows, 2 * p.cols, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(static_cast<size_t>(p.cols));
      std::vector<float> cm(E > 0 ? static_cast<size_t>(p.cols) : 0);
      int64_t e = E > 0 ? expert_of(p.col_amax_offsets, E, r0) : 0, held = -1;
      auto flush = [&] {
        if (held < 0) return;
        std::lock_guard<std::mutex> lock(merge);
        float* dst = p.col_amax + held * p.col_amax_stride;
        for (int64_t j = 0; j < p.cols; ++j) dst[j] = std::fmax(dst[j], cm[j]);
        held = -1;
      };
      for (int64_t r = r0; r < r1; ++r) {
        const T* x = static_cast<const T*>(p.x) + r * p.x_stride;
        for (int64_t j = 0; j < p.cols; ++j) buf[j] = Cv<T>::ld(x[j]);
        if (E > 0) {
          while (e < E && p.col_amax_offsets[e] <= r) ++e;
          if (e != held) {
            flush();
            if (e < E) {
              held = e;
              std::fill(cm.begin(), cm.end(), 0.0f);
            }
          }
          if (held >= 0)
            for (int64_t j = 0; j < p.cols; ++j) cm[j] = std::fmax(cm[j], std::fabs(buf[j]));  // NaN ignored
        }
        quantize_row(buf.data(), p.cols, static_cast<uint8_t*>(p.q) + r * p.q_stride, p.scale + r * p.scale_stride);
      }
      flush();
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

// With the column amax: each thread's rows (contiguous, sorted by expert) keep a running
// column amax of their expert, merged under a lock as cpu_fp8_quantize_rowwise does, of h in
// the problem's dtype as the activation's forward writes it: for the biased form the float32
// h rounded (the biased forward, src/cpu/bias_cpu.cpp, computes h with this same scalar
// math); for the unbiased form the forward's own kernels' output for the row
// (cpu_forward_rows), whose float32 values may differ in their last bit from h (the AVX2
// kernels' FMAs). q and scale come from the float32 h either way.
Status cpu_fp8_glu_rowwise(const GluProblem& p, const Fp8Out& o, const GluBias* bias, const Fp8ColAmax* amax) {
  const int64_t E = amax ? amax->experts : 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < p.F; ++j) amax->col_amax[e * amax->stride + j] = 0.0f;
  if (p.rows == 0) return Status::kOk;
  std::mutex merge;
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      constexpr Activation A = decltype(act)::value;
      const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
      cpu::parallel_for(p.rows, (E > 0 ? 6 : 4) * p.F, [&](int64_t r0, int64_t r1) {
        std::vector<float> h(static_cast<size_t>(p.F));
        std::vector<float> cm(E > 0 ? static_cast<size_t>(p.F) : 0);
        std::vector<T> fwd(E > 0 && !bias ? static_cast<size_t>(p.F) : 0);  // the forward's row
        int64_t e = bias ? expert_of(bias->er.offsets, bias->er.experts, r0) : 0;
        int64_t ea = E > 0 ? expert_of(amax->offsets, E, r0) : 0, held = -1;
        auto flush = [&] {
          if (held < 0) return;
          std::lock_guard<std::mutex> lock(merge);
          float* dst = amax->col_amax + held * amax->stride;
          for (int64_t j = 0; j < p.F; ++j) dst[j] = std::fmax(dst[j], cm[j]);
          held = -1;
        };
        for (int64_t r = r0; r < r1; ++r) {
          const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
          const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
          const float w = p.w ? p.w[r * p.w_stride] : 1.0f;
          if (bias) while (e < bias->er.experts && bias->er.offsets[e] <= r) ++e;
          if (bias && e < bias->er.experts) {
            // x + bias[e] in float32, as the biased activation (src/cpu/bias_cpu.cpp) adds it
            const T* bg = static_cast<const T*>(bias->bg) + e * bias->b_stride;
            const T* bu = static_cast<const T*>(bias->bu) + e * bias->b_stride;
            for (int64_t j = 0; j < p.F; ++j)
              h[j] = math::glu_fwd<A>(Cv<T>::ld(g[j * p.step]) + Cv<T>::ld(bg[j * p.step]),
                                      Cv<T>::ld(u[j * p.step]) + Cv<T>::ld(bu[j * p.step]), w, c);
          } else {
            for (int64_t j = 0; j < p.F; ++j)
              h[j] = math::glu_fwd<A>(Cv<T>::ld(g[j * p.step]), Cv<T>::ld(u[j * p.step]), w, c);
          }
          if (E > 0) {
            while (ea < E && amax->offsets[ea] <= r) ++ea;
            if (ea != held) {
              flush();
              if (ea < E) {
                held = ea;
                std::fill(cm.begin(), cm.end(), 0.0f);
              }
            }
            if (held >= 0) {
              if (bias) {
                for (int64_t j = 0; j < p.F; ++j)
                  cm[j] = std::fmax(cm[j], std::fabs(Cv<T>::ld(Cv<T>::st(h[j]))));  // NaN ignored
              } else {
                FwdOutput fo;
                fo.out = fwd.data();
                fo.out_stride = 0;  // row r lands at fwd
                const Status st = cpu_forward_rows(p, fo, r, r + 1);
                (void)st;  // p's dtype, act and step were dispatched above: it cannot fail
                for (int64_t j = 0; j < p.F; ++j) cm[j] = std::fmax(cm[j], std::fabs(Cv<T>::ld(fwd[j])));
              }
            }
          }
          quantize_row(h.data(), p.F, static_cast<uint8_t*>(o.q) + r * o.q_stride, o.scale + r * o.scale_stride);
        }
        flush();
      });
      return Status::kOk;
    });
  });
}

// Each row: its float32 gradient into a per-thread buffer in gate_up's column layout (its
// weight-gradient term summed in column order), the optional rounded copy and column amax,
// then quantize_row. The column amax is kept per thread and expert and merged under a lock,
// as cpu_fp8_quantize_rowwise does.
Status cpu_fp8_glu_backward_rowwise(const GluProblem& p, const Fp8BwdOut& o, const GluBias* bias) {
  const int64_t C = 2 * p.F, E = o.col_amax ? o.experts : 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < C; ++j) o.col_amax[e * o.col_amax_stride + j] = 0.0f;
  if (p.rows == 0) return Status::kOk;
  std::mutex merge;
  return dispatch_host_dtype<false>(p.dtype, "fp8", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      constexpr Activation A = decltype(act)::value;
      const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
      cpu::parallel_for(p.rows, 8 * p.F, [&](int64_t r0, int64_t r1) {
        std::vector<float> buf(static_cast<size_t>(C));
        std::vector<float> cm(E > 0 ? static_cast<size_t>(C) : 0);
        int64_t eb = bias ? expert_of(bias->er.offsets, bias->er.experts, r0) : 0;
        int64_t ea = E > 0 ? expert_of(o.offsets, E, r0) : 0, held = -1;
        auto flush = [&] {
          if (held < 0) return;
          std::lock_guard<std::mutex> lock(merge);
          float* dst = o.col_amax + held * o.col_amax_stride;
          for (int64_t j = 0; j < C; ++j) dst[j] = std::fmax(dst[j], cm[j]);
          held = -1;
        };
        for (int64_t r = r0; r < r1; ++r) {
          const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
          const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
          const T* dy = static_cast<const T*>(o.dy) + r * o.dy_stride;
          const float w = p.w ? p.w[r * p.w_stride] : 1.0f;
          const T* bg = nullptr;
          const T* bu = nullptr;
          if (bias) {
            while (eb < bias->er.experts && bias->er.offsets[eb] <= r) ++eb;
            if (eb < bias->er.experts) {
              bg = static_cast<const T*>(bias->bg) + eb * bias->b_stride;
              bu = static_cast<const T*>(bias->bu) + eb * bias->b_stride;
            }
          }
          float dw = 0.0f;
          for (int64_t j = 0; j < p.F; ++j) {
            float gv = Cv<T>::ld(g[j * p.step]), uv = Cv<T>::ld(u[j * p.step]);
            if (bg) {
              gv += Cv<T>::ld(bg[j * p.step]);
              uv += Cv<T>::ld(bu[j * p.step]);
            }
            float dg, du, term;
            math::glu_bwd<A>(gv, uv, Cv<T>::ld(dy[j]), w, c, dg, du, term);
            buf[o.q_g + j * p.step] = dg;
            buf[o.q_u + j * p.step] = du;
            dw += term;
          }
          if (o.dw) o.dw[r * o.dw_stride] = dw;
          if (o.dgu) {
            T* d = static_cast<T*>(o.dgu) + r * o.dgu_stride;
            for (int64_t j = 0; j < C; ++j) d[j] = Cv<T>::st(buf[j]);
          }
          if (E > 0) {
            while (ea < E && o.offsets[ea] <= r) ++ea;
            if (ea != held) {
              flush();
              if (ea < E) {
                held = ea;
                std::fill(cm.begin(), cm.end(), 0.0f);
              }
            }
            if (held >= 0)
              for (int64_t j = 0; j < C; ++j) cm[j] = std::fmax(cm[j], std::fabs(buf[j]));  // NaN ignored
          }
          quantize_row(buf.data(), C, static_cast<uint8_t*>(o.q) + r * o.q_stride, o.scale + r * o.scale_stride);
        }
        flush();
      });
      return Status::kOk;
    });
  });
}

}  // namespace expertact::detail
