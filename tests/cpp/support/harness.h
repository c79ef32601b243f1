// The test harness: a Case (params, layout, dtype, sizes, view geometry),
// inputs drawn for it, runners that lay the operands out in backend memory
// (poisoned outputs, padded rows, offset pointers) and call the C++ API, and
// the checks: every element against the float64 oracle, two runs with
// different poisons bitwise equal, nothing written outside the outputs, inputs
// unmodified, and on CUDA the same call on the CPU path within a tight bound.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "expertact/expertact.hpp"
#include "support/backend.h"
#include "support/numeric.h"
#include "support/oracle.h"

namespace eat {

using expertact::DType;
using expertact::GluParams;
using expertact::Layout;
using expertact::Status;

// Tolerance factors on the oracle's float32 error bound e: a result must lie
// in [round(v - K e), round(v + K e)] with K = 4 against the oracle (CUDA's
// __expf / __fdividef are ~2-3x the error the bound assumes, operations may
// be ordered differently); two implementations may differ by one ulp of the
// dtype + 2 e (each within its bound).
constexpr double kOracleK = 4.0;
constexpr double kPeerK = 2.0;

// ---- parameters under test, from docs/spec.md section 1 (written out, not taken from the library)
struct PresetSpec {
  const char* name;
  GluParams params;
};
// swiglu, swiglu_clamped7, swiglu_clamped10, swiglu_oai, geglu_tanh,
// silu_general (alpha 0.5, limit 3, beta -0.25), gelu_general (limit 5, beta 1).
const std::vector<PresetSpec>& presets();
const PresetSpec& preset(const std::string& name);
GluParams make_params(expertact::Activation act, float alpha, float limit, float beta);

const char* layout_name(Layout l);
const std::vector<Layout>& all_layouts();
const std::vector<DType>& all_dtypes();
inline bool is_separate(Layout l) { return l == Layout::kSeparate; }

enum class WMode { kNone, kWeights, kWeightsNoGrad };
enum class InPlace { kNo, kGate, kAll };  // kGate: grad_x = x only (separate: grad_up apart)
const char* wmode_name(WMode m);
const char* inplace_name(InPlace m);

struct Case {
  GluParams params;
  Layout layout = Layout::kSeparate;
  DType dtype = DType::kFloat32;
  int64_t rows = 0, F = 0;
  // View geometry (elements): extra columns after every row of the inputs,
  // the outputs/gradients and grad_out; every matrix starts `offset` elements
  // past a 16-byte (in fact 256-byte) aligned address.
  int64_t x_extra = 0, out_extra = 0, dy_extra = 0, offset = 0;
  bool shared_gate_up = false;          // separate: gate and up are the halves of one buffer
  bool zero_stride_single_row = false;  // rows == 1: every row_stride passed as 0
  int64_t w_stride = 1, gw_stride = 1;  // may be negative
  bool specials = false;                // limits, just past them, NaN, +-Inf, zeros
  double scale = 6.0;                   // gate and up ~ scale * N(0, 1)
  uint64_t seed = 1;
  std::string describe() const;
};

struct Inputs {
  int64_t rows = 0, F = 0;
  std::vector<float> gate, up, dy, w;  // values exact in the dtype; [rows, F] and [rows]
};
Inputs make_inputs(const Case& c);
// The logical packed [rows, 2F] input of a layout from gate and up, and back.
std::vector<float> pack_layout(Layout l, int64_t rows, int64_t F, const std::vector<float>& g,
                               const std::vector<float>& u);
void unpack_layout(Layout l, int64_t rows, int64_t F, const std::vector<float>& x,
                   std::vector<float>& g, std::vector<float>& u);
// The special values used for a case (in the dtype).
std::vector<double> special_values(const Case& c);

// One run, results logical: out, dgate, dup [rows, F], dw [rows].
struct RunResult {
  Status status = Status::kInternal;
  std::string error;
  std::vector<float> out, dgate, dup, dw;
  std::vector<std::string> issues;  // bytes written outside outputs, inputs modified
};
constexpr uint8_t kPoisonA = 0xFF;  // NaN in every dtype
constexpr uint8_t kPoisonB = 0x7B;  // large finite values (f32 1.3e36, f16 61280, bf16 1.3e36)

RunResult run_forward(Backend& be, const Case& c, const Inputs& in, WMode wm, uint8_t poison);
RunResult run_backward(Backend& be, const Case& c, const Inputs& in, WMode wm, InPlace ip,
                       uint8_t poison);

// ---- element checks
struct Tally {
  std::string what;
  DType dtype = DType::kFloat32;
  double K = kOracleK;
  int64_t n = 0, bad = 0;
  double worst = 0;  // largest |got - ref| / tol among finite comparisons
  std::vector<std::string> examples;
  const Inputs* inputs = nullptr;  // when set, failure messages show the element's inputs
  Tally(std::string w, DType d, double k) : what(std::move(w)), dtype(d), K(k) {}
  // got against the oracle value rounded once to the dtype.
  void check(int64_t r, int64_t c, double got, const Ref& want);
  // Two implementations against each other, the bound taken from want.e.
  void check_pair(int64_t r, int64_t c, double a, double b, const Ref& want);
  std::string report() const;
  bool ok() const { return bad == 0; }
};
// Whether got passes against want (ratio: |got - ref| / tol when finite).
bool within(DType d, double K, double got, const Ref& want, double* ratio, std::string* why);

// Oracle checks of one run's results (null = not checked). K as above; the
// forward check uses the same weights as the run (wm).
struct Verdict {
  Tally out, dg, du, dw;
  Verdict(DType d, double K) : out("out", d, K), dg("grad_gate", d, K), du("grad_up", d, K),
                               dw("grad_weights", DType::kFloat32, K) {}
};
Verdict verify(const Case& c, const Inputs& in, WMode wm, const RunResult* fwd,
               const RunResult* bwd, const OracleParams& op, double K = kOracleK);
Verdict verify_pair(const Case& c, const Inputs& in, WMode wm, const RunResult* fwd_a,
                    const RunResult* fwd_b, const RunResult* bwd_a, const RunResult* bwd_b);
void expect_verdict(const Verdict& v, const std::string& label);

// Whether two runs gave bitwise the same values (NaN equal to NaN).
std::string bitwise_diff(const std::vector<float>& a, const std::vector<float>& b,
                         const char* what, int64_t cols);

// The full check of one case on one backend: forward and/or backward (two
// poisons, bitwise equal), in-place backward, against the oracle, and on a
// GPU backend against the CPU path too.
struct Plan {
  WMode wmode = WMode::kNone;
  bool forward = true, backward = true;
  InPlace inplace = InPlace::kNo;  // an extra in-place backward run when not kNo
};
void check_case(BackendKind kind, const Case& c, const Plan& plan);
// The same with inputs given (rows and F must match the case).
void check_case(BackendKind kind, const Case& c, const Inputs& in, const Plan& plan);
// The usual set: no weights + in-place (all), weights + grad + in-place
// (gate only), weights without grad_weights.
void check_case_all_modes(BackendKind kind, const Case& c);
void check_case_all_modes(BackendKind kind, const Case& c, const Inputs& in);

inline void PrintTo(BackendKind k, std::ostream* os) { *os << backend_name(k); }

}  // namespace eat

// Readable parameter values in gtest's output.
namespace expertact {
inline void PrintTo(Layout l, std::ostream* os) { *os << eat::layout_name(l); }
inline void PrintTo(DType d, std::ostream* os) { *os << eat::dtype_name(d); }
inline void PrintTo(Status s, std::ostream* os) {
  static const char* names[] = {"kOk", "kInvalidArgument", "kUnsupported", "kCudaError", "kInternal"};
  const int i = static_cast<int>(s);
  *os << (i >= 0 && i < 5 ? names[i] : "Status(?)");
}
}  // namespace expertact
