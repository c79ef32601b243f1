// float64 on the CPU, for gradient checking (torch.autograd.gradcheck needs
// float64 to tell a wrong derivative from rounding): the shared math of
// src/core/math.h instantiated for double, rows over threads, no vector tricks.
#include <cstdint>

#include "core/dispatch.h"
#include "core/math.h"
#include "core/problem.h"
#include "cpu/parallel.h"

namespace expertact::detail {
namespace {

template <Activation A>
void fwd_rows(const GluProblem& p, const FwdOutput& o, int64_t r0, int64_t r1) {
  const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  for (int64_t r = r0; r < r1; ++r) {
    const double* g = static_cast<const double*>(p.g) + r * p.g_stride;
    const double* u = static_cast<const double*>(p.u) + r * p.u_stride;
    double* out = static_cast<double*>(o.out) + r * o.out_stride;
    const double w = p.w ? p.w[r * p.w_stride] : 1.0;
    for (int64_t j = 0; j < p.F; ++j) out[j] = math::glu_fwd<A>(g[j * p.step], u[j * p.step], w, c);
  }
}

template <Activation A>
void bwd_rows(const GluProblem& p, const BwdIO& io, int64_t r0, int64_t r1) {
  const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  for (int64_t r = r0; r < r1; ++r) {
    const double* g = static_cast<const double*>(p.g) + r * p.g_stride;
    const double* u = static_cast<const double*>(p.u) + r * p.u_stride;
    const double* dy = static_cast<const double*>(io.dy) + r * io.dy_stride;
    double* dg = static_cast<double*>(io.dg) + r * io.dg_stride;
    double* du = static_cast<double*>(io.du) + r * io.du_stride;
    const double w = p.w ? p.w[r * p.w_stride] : 1.0;
    double acc = 0.0;
    for (int64_t j = 0; j < p.F; ++j) {
      double dgv, duv, dwt;
      // Read both inputs before writing: dg/du may be g/u themselves (in-place).
      math::glu_bwd<A>(g[j * p.step], u[j * p.step], dy[j], w, c, dgv, duv, dwt);
      dg[j * p.step] = dgv;
      du[j * p.step] = duv;
      acc += dwt;
    }
    // The weights are float32: their gradient is stored as float32 too.
    if (io.dw) io.dw[r * io.dw_stride] = static_cast<float>(acc);
  }
}

}  // namespace

Status cpu_forward_f64(const GluProblem& p, const FwdOutput& o) {
  return dispatch_act(p.params.act, [&](auto act) {
    cpu::parallel_for(p.rows, p.F, [&](int64_t r0, int64_t r1) {
      fwd_rows<decltype(act)::value>(p, o, r0, r1);
    });
    return Status::kOk;
  });
}

Status cpu_backward_f64(const GluProblem& p, const BwdIO& io) {
  if (p.F == 0) {
    zero_weight_gradient_host(p, io);
    return Status::kOk;
  }
  return dispatch_act(p.params.act, [&](auto act) {
    cpu::parallel_for(p.rows, 2 * p.F, [&](int64_t r0, int64_t r1) {
      bwd_rows<decltype(act)::value>(p, io, r0, r1);
    });
    return Status::kOk;
  });
}

}  // namespace expertact::detail
