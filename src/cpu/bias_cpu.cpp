// CPU path of the per-expert biases (src/core/bias.h): plain loops over the shared math of
// src/core/math.h, threads over fixed chunks of rows, float32 sums (float64 for float64
// tensors) reduced in chunk order, so the results do not depend on the thread count.
#include <cstdint>
#include <vector>

#include "core/bias.h"
#include "core/dispatch.h"
#include "core/error.h"
#include "cpu/host_dtype.h"
#include "cpu/parallel.h"

namespace expertact::detail {
namespace {

// Calls fn(e, r0, r1) for each run of one expert's rows in chunk c (e == E: past the last
// offset), in row order.
template <typename Fn>
void for_runs(const ExpertRows& er, int64_t rows, int64_t c, Fn&& fn) {
  const int64_t r0 = c * er.chunk, r1 = std::min(r0 + er.chunk, rows);
  int64_t e = expert_of(er.offsets, er.experts, r0);
  for (int64_t r = r0; r < r1; ++e) {
    const int64_t end = run_end(er.offsets, er.experts, e, r, r1);
    if (end > r) fn(e, r, end);
    r = end;
    if (e >= er.experts) break;
  }
}

// The second pass: grad[e][c] = sum over e's chunks of the partial rows, in chunk order;
// column c < split goes to g + c * step, the others to u + (c - split) * step.
template <typename T, typename S>
void reduce_partials(const ExpertRows& er, int64_t rows, const std::vector<S>& part,
                     int64_t cols, int64_t split, int step, T* g, T* u, int64_t stride) {
  for (int64_t e = 0; e < er.experts; ++e) {
    int64_t c0, c1;
    expert_chunks(er.offsets, e, rows, er.chunk, c0, c1);
    for (int64_t c = 0; c < cols; ++c) {
      S acc = 0;
      for (int64_t k = c0; k < c1; ++k) acc += part[static_cast<size_t>(k + e) * cols + c];
      T* dst = c < split ? g + e * stride + c * step : u + e * stride + (c - split) * step;
      *dst = Cv<T>::st(acc);
    }
  }
}

template <typename T, Activation A>
void glu_fwd(const GluProblem& p, const GluBias& b, const FwdOutput& o) {
  using S = typename Cv<T>::S;
  const math::Coeffs k{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  const int64_t nchunks = bias_chunks(p.rows);
  cpu::parallel_for(nchunks, b.er.chunk * p.F, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      for_runs(b.er, p.rows, c, [&](int64_t e, int64_t r0, int64_t r1) {
        const bool has = e < b.er.experts;
        const T* bg = static_cast<const T*>(b.bg) + (has ? e : 0) * b.b_stride;
        const T* bu = static_cast<const T*>(b.bu) + (has ? e : 0) * b.b_stride;
        for (int64_t r = r0; r < r1; ++r) {
          const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
          const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
          T* out = static_cast<T*>(o.out) + r * o.out_stride;
          const S w = p.w ? S(p.w[r * p.w_stride]) : S(1);
          for (int64_t j = 0; j < p.F; ++j) {
            S gv = Cv<T>::ld(g[j * p.step]), uv = Cv<T>::ld(u[j * p.step]);
            if (has) {
              gv += Cv<T>::ld(bg[j * p.step]);
              uv += Cv<T>::ld(bu[j * p.step]);
            }
            out[j] = Cv<T>::st(math::glu_fwd<A>(gv, uv, w, k));
          }
        }
      });
    }
  });
}

template <typename T, Activation A>
void glu_bwd(const GluProblem& p, const GluBias& b, const BwdIO& io) {
  using S = typename Cv<T>::S;
  const math::Coeffs k{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  const int64_t nchunks = bias_chunks(p.rows), C = 2 * p.F;
  const bool want_db = b.dbg != nullptr;
  std::vector<S> part(want_db ? static_cast<size_t>(nchunks + b.er.experts) * C : 0);
  cpu::parallel_for(nchunks, b.er.chunk * p.F * 2, [&](int64_t c0, int64_t c1) {
    std::vector<S> acc(want_db ? C : 0);
    for (int64_t c = c0; c < c1; ++c) {
      for_runs(b.er, p.rows, c, [&](int64_t e, int64_t r0, int64_t r1) {
        const bool has = e < b.er.experts;
        const T* bg = static_cast<const T*>(b.bg) + (has ? e : 0) * b.b_stride;
        const T* bu = static_cast<const T*>(b.bu) + (has ? e : 0) * b.b_stride;
        std::fill(acc.begin(), acc.end(), S(0));
        for (int64_t r = r0; r < r1; ++r) {
          const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
          const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
          const T* dy = static_cast<const T*>(io.dy) + r * io.dy_stride;
          T* dg = static_cast<T*>(io.dg) + r * io.dg_stride;
          T* du = static_cast<T*>(io.du) + r * io.du_stride;
          const S w = p.w ? S(p.w[r * p.w_stride]) : S(1);
          S rs = 0;
          for (int64_t j = 0; j < p.F; ++j) {
            S gv = Cv<T>::ld(g[j * p.step]), uv = Cv<T>::ld(u[j * p.step]);
            if (has) {
              gv += Cv<T>::ld(bg[j * p.step]);
              uv += Cv<T>::ld(bu[j * p.step]);
            }
            S dgv, duv, dwt;
            math::glu_bwd<A>(gv, uv, S(Cv<T>::ld(dy[j])), w, k, dgv, duv, dwt);
            dg[j * p.step] = Cv<T>::st(dgv);  // after both reads: dg may be g (in place)
            du[j * p.step] = Cv<T>::st(duv);
            rs += dwt;
            if (want_db && has) {
              acc[j] += dgv;
              acc[p.F + j] += duv;
            }
          }
          if (io.dw) io.dw[r * io.dw_stride] = static_cast<float>(rs);
        }
        if (want_db && has)
          std::copy(acc.begin(), acc.end(), part.begin() + static_cast<size_t>(c + e) * C);
      });
    }
  });
  if (want_db)
    reduce_partials<T, S>(b.er, p.rows, part, C, p.F, p.step, static_cast<T*>(b.dbg),
                          static_cast<T*>(b.dbu), b.db_stride);
}

template <typename T>
void row_fwd(const RowBias& p) {
  using S = typename Cv<T>::S;
  cpu::parallel_for(bias_chunks(p.rows), p.er.chunk * p.cols, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      for_runs(p.er, p.rows, c, [&](int64_t e, int64_t r0, int64_t r1) {
        const bool has = e < p.er.experts;
        const T* bias = static_cast<const T*>(p.b) + (has ? e : 0) * p.b_stride;
        for (int64_t r = r0; r < r1; ++r) {
          const T* x = static_cast<const T*>(p.x) + r * p.x_stride;
          T* out = static_cast<T*>(p.out) + r * p.out_stride;
          const S w = p.w ? S(p.w[r * p.w_stride]) : S(1);
          for (int64_t j = 0; j < p.cols; ++j) {
            const S v = Cv<T>::ld(x[j]);
            out[j] = Cv<T>::st(has ? v + w * S(Cv<T>::ld(bias[j])) : v);
          }
        }
      });
    }
  });
}

template <typename T>
void row_bwd(const RowBias& p) {
  using S = typename Cv<T>::S;
  const int64_t nchunks = bias_chunks(p.rows), C = p.cols;
  const bool want_db = p.db != nullptr;
  std::vector<S> part(want_db ? static_cast<size_t>(nchunks + p.er.experts) * C : 0);
  cpu::parallel_for(nchunks, p.er.chunk * p.cols, [&](int64_t c0, int64_t c1) {
    std::vector<S> acc(want_db ? C : 0);
    for (int64_t c = c0; c < c1; ++c) {
      for_runs(p.er, p.rows, c, [&](int64_t e, int64_t r0, int64_t r1) {
        const bool has = e < p.er.experts;
        const T* bias = static_cast<const T*>(p.b) + (has ? e : 0) * p.b_stride;
        std::fill(acc.begin(), acc.end(), S(0));
        for (int64_t r = r0; r < r1; ++r) {
          const T* dy = static_cast<const T*>(p.dy) + r * p.dy_stride;
          const S w = p.w ? S(p.w[r * p.w_stride]) : S(1);
          S dot = 0;
          for (int64_t j = 0; j < C; ++j) {
            const S d = Cv<T>::ld(dy[j]);
            if (has) {
              dot += d * S(Cv<T>::ld(bias[j]));
              if (want_db) acc[j] += w * d;
            }
          }
          if (p.dw) p.dw[r * p.dw_stride] = static_cast<float>(dot);
        }
        if (want_db && has)
          std::copy(acc.begin(), acc.end(), part.begin() + static_cast<size_t>(c + e) * C);
      });
    }
  });
  if (want_db)
    reduce_partials<T, S>(p.er, p.rows, part, C, C, 1, static_cast<T*>(p.db), nullptr, p.db_stride);
}

}  // namespace

Status cpu_glu_bias_forward(const GluProblem& p, const GluBias& b, const FwdOutput& o) {
  return dispatch_host_dtype<true>(p.dtype, "bias", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      glu_fwd<T, decltype(act)::value>(p, b, o);
      return Status::kOk;
    });
  });
}

Status cpu_glu_bias_backward(const GluProblem& p, const GluBias& b, const BwdIO& io) {
  return dispatch_host_dtype<true>(p.dtype, "bias", [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      glu_bwd<T, decltype(act)::value>(p, b, io);
      return Status::kOk;
    });
  });
}

Status cpu_row_bias_forward(const RowBias& p) {
  return dispatch_host_dtype<true>(p.dtype, "bias", [&](auto t) {
    row_fwd<decltype(t)>(p);
    return Status::kOk;
  });
}

Status cpu_row_bias_backward(const RowBias& p) {
  return dispatch_host_dtype<true>(p.dtype, "bias", [&](auto t) {
    row_bwd<decltype(t)>(p);
    return Status::kOk;
  });
}

}  // namespace expertact::detail
