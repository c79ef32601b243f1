// The float64 oracle of docs/spec.md section 1, written from the formulas (no library
// code), together with a first-order bound on how far a float32 evaluation of
// the same formula may be from the exact value (running error analysis:
// every float32 operation adds u |result|, u = 2^-24; errors propagate through
// the derivative). The tolerances of the checks are built from that bound.
#pragma once

#include <cstdint>
#include <vector>

#include "expertact/expertact.hpp"

namespace eat {

// An expected value: v exact (float64), e a bound on |float32 evaluation - v|,
// exact: the value must be met exactly (a masked gradient: 0).
// nan_ok: v is +-inf from an infinity times a value that a float32
// evaluation may round to 0 (e.g. gelu(-5.4) = -2e-8 is 0 in float32, as in
// eager PyTorch float32): NaN is then as right as the infinity.
struct Ref {
  double v = 0;
  double e = 0;
  bool exact = false;
  bool nan_ok = false;
};

struct OracleParams {
  bool gelu = false;
  double alpha = 1, limit = 0, beta = 0;
  bool has_limit = false;
  float beta_f = 0;  // kept to perturb in negative tests
};
OracleParams oracle_params(const expertact::GluParams& p);

// One row of F elements. w = 1 when there are no weights.
void oracle_forward_row(const OracleParams& p, const float* g, const float* u, double w,
                        int64_t F, Ref* out);
// dw gets the row's weight gradient: sum_j dy a (uc + beta), with the bound of
// a float32 accumulation of F terms.
void oracle_backward_row(const OracleParams& p, const float* g, const float* u, const float* dy,
                         double w, int64_t F, Ref* dg, Ref* du, Ref* dw);

// Scalar pieces, exposed for the oracle's own sanity tests.
double oracle_silu(double x, double alpha);
double oracle_gelu_tanh(double x);

}  // namespace eat
