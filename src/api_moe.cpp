// The boundary of the experimental fused grouped GEMMs (expertact/experimental/
// fused_gemm.h): every argument checked once, with the shared checks of core/checks.h,
// then the validated views handed to the CUTLASS launchers (src/cuda/gemm/), which exist
// when the build found CUTLASS (EXPERTACT_WITH_CUTLASS); otherwise kUnsupported.
#include <cstdint>
#include <utility>

#include "api.h"
#include "core/checks.h"
#include "core/error.h"
#include "expertact/experimental/fused_gemm.h"
#include "expertact/expertact.hpp"
#if EXPERTACT_WITH_CUTLASS
#include "cuda/gemm/moe_gemm.h"
#endif

namespace expertact {
namespace detail {
namespace {

// CUTLASS's problem shapes are int: rows, columns and depth up to 2^31 - 1.
constexpr int64_t kMaxDim = 2147483647;

// The operand contract of the fused kernels: bfloat16 on a CUDA device (well-formed
// otherwise, but not what these kernels take: kUnsupported, the caller's cue to use the
// unfused path).
Status check_operand(const char* name, const MatrixRef& m) {
  EA_TRY(check_matrix(name, m));
  if (m.dtype != DType::kBFloat16)
    return fail(Status::kUnsupported, name, ".dtype is ", m.dtype,
                ": the fused grouped GEMM takes bfloat16 only (use the unfused path)");
  if (m.device != DeviceType::kCUDA)
    return fail(Status::kUnsupported, name, " is on ", m.device,
                ": the fused grouped GEMM runs on CUDA (Hopper) devices only");
  return Status::kOk;
}

// Operands read or written by the tensor memory accelerator: 16-byte aligned base and
// row strides that are multiples of 16 bytes (8 bfloat16 elements).
Status check_tma(const char* name, const MatrixRef& m) {
  if (m.rows == 0 || m.cols == 0) return Status::kOk;
  if (reinterpret_cast<uintptr_t>(m.data) % 16 != 0)
    return fail(Status::kInvalidArgument, name, ".data ", static_cast<const void*>(m.data),
                " is not 16-byte aligned (the fused GEMM reads it with TMA)");
  if (m.row_stride % 8 != 0)
    return fail(Status::kInvalidArgument, name, ".row_stride ", m.row_stride,
                " is not a multiple of 8 elements (16 bytes, for TMA); e.g. D and F must be "
                "multiples of 8 and 4 for compact tensors");
  return Status::kOk;
}

// gate_up and its gradient in the backward: read and written as (gate, up) pairs of 4 bytes.
Status check_pairs(const char* name, const MatrixRef& m) {
  if (m.rows == 0 || m.cols == 0) return Status::kOk;
  if (reinterpret_cast<uintptr_t>(m.data) % 4 != 0 || m.row_stride % 2 != 0)
    return fail(Status::kInvalidArgument, name, " (data ", static_cast<const void*>(m.data),
                ", row_stride ", m.row_stride,
                ") must be 4-byte aligned with an even row stride: each (gate, up) pair is one "
                "4-byte access");
  return Status::kOk;
}

Status check_dim(const char* what, int64_t v) {
  if (v > kMaxDim)
    return fail(Status::kUnsupported, what, " = ", v, " is past the fused GEMM's int32 limit ",
                kMaxDim);
  return Status::kOk;
}

Status check_experts(int32_t E, const int32_t* offsets) {
  if (E < 1) return fail(Status::kInvalidArgument, "num_experts must be >= 1 (got ", E, ")");
  if (offsets == nullptr) return fail(Status::kInvalidArgument, "offsets is null");
  return Status::kOk;
}

// w13 or w2 as [E * rows_per_expert, D]: expert e's block at rows e * rows_per_expert.
Status check_weight(const char* name, const MatrixRef& w, int32_t E, int64_t rows_per_expert,
                    int64_t D, const char* why) {
  EA_TRY(check_operand(name, w));
  EA_TRY(check_shape(name, w, static_cast<int64_t>(E) * rows_per_expert, D, DType::kBFloat16, why));
  return check_tma(name, w);
}

// gate_up [T, 2F], interleaved: F from its width, its rows those of the A operand.
Status check_gate_up(const MatrixRef& gu, int64_t T, const char* a_name, int64_t& F) {
  if (gu.cols % 2 != 0)
    return fail(Status::kInvalidArgument, "gate_up's last dimension is ", gu.cols,
                ", which is odd: it holds 2 * F interleaved columns");
  F = gu.cols / 2;
  if (gu.rows != T)
    return fail(Status::kInvalidArgument, "gate_up has ", gu.rows, " rows but ", a_name, " has ",
                T, " (gate_up is [T, 2F])");
  return Status::kOk;
}

Status check_weights_vector(const char* name, const VectorRef* v, int64_t T, const MatrixRef& x,
                            const char* xname) {
  if (v == nullptr) return Status::kOk;
  EA_TRY(check_vector(name, *v, T));
  return check_same_device(name, v->device, v->device_id, x.device, x.device_id, xname);
}

#if !EXPERTACT_WITH_CUTLASS
// The answer of a build without the fused GEMMs.
Status not_built() {
  return fail(Status::kUnsupported,
              "this expertact build has no fused grouped GEMM (it needs CUDA and the CUTLASS "
              "headers at build time: pip install nvidia-cutlass, or -DEXPERTACT_CUTLASS_DIR)");
}
#endif

}  // namespace

Status moe_fused_forward_body(const GluParams& params, const MatrixRef& x, const MatrixRef& w13,
                              int32_t E, const int32_t* offsets, const VectorRef* weights,
                              const MatrixRef& gu, const MatrixRef& h, void* stream) {
  EA_TRY(check_params(params));
  EA_TRY(check_experts(E, offsets));
  EA_TRY(check_operand("x", x));
  EA_TRY(check_operand("gate_up", gu));
  EA_TRY(check_operand("h", h));
  const int64_t T = x.rows, D = x.cols;
  int64_t F = 0;
  EA_TRY(check_gate_up(gu, T, "x", F));
  EA_TRY(check_shape("h", h, T, F, DType::kBFloat16, "h is [T, F]"));
  EA_TRY(check_weight("w13", w13, E, 2 * F, D, "w13 is [num_experts * 2F, D]"));
  for (auto [name, m] : {std::pair{"w13", &w13}, std::pair{"gate_up", &gu}, std::pair{"h", &h}})
    EA_TRY(check_same_device(name, m->device, m->device_id, x.device, x.device_id, "x"));
  EA_TRY(check_weights_vector("weights", weights, T, x, "x"));
  EA_TRY(check_tma("x", x));
  EA_TRY(check_tma("gate_up", gu));
  EA_TRY(check_dim("T", T));
  EA_TRY(check_dim("D", D));
  EA_TRY(check_dim("2F", 2 * F));
  if (D == 0 && T > 0 && F > 0)
    return fail(Status::kInvalidArgument, "x has D = 0 columns: the GEMM has no depth");
  // Outputs may share memory with nothing.
  const Extent e_gu = extent_of(gu), e_h = extent_of(h);
  const Extent e_x = extent_of(x), e_w13 = extent_of(w13);
  const Extent e_w = weights ? extent_of(*weights) : Extent{};
  EA_TRY(check_no_overlap("gate_up", e_gu, "x", e_x));
  EA_TRY(check_no_overlap("gate_up", e_gu, "w13", e_w13));
  EA_TRY(check_no_overlap("gate_up", e_gu, "weights", e_w));
  EA_TRY(check_no_overlap("gate_up", e_gu, "h", e_h));
  EA_TRY(check_no_overlap("h", e_h, "x", e_x));
  EA_TRY(check_no_overlap("h", e_h, "w13", e_w13));
  EA_TRY(check_no_overlap("h", e_h, "weights", e_w));
  if (T == 0 || F == 0) return Status::kOk;
#if EXPERTACT_WITH_CUTLASS
  return gemm::fused_forward(params, x, w13, E, offsets, weights, gu, h, stream);
#else
  (void)stream;
  return not_built();
#endif
}

Status moe_fused_backward_body(const GluParams& params, const MatrixRef& dy, const MatrixRef& w2,
                               int32_t E, const int32_t* offsets, const MatrixRef& gu,
                               const VectorRef* weights, const MatrixRef& dgu,
                               const VectorRef* grad_weights, void* stream) {
  EA_TRY(check_params(params));
  EA_TRY(check_experts(E, offsets));
  EA_TRY(check_operand("grad_y", dy));
  EA_TRY(check_operand("gate_up", gu));
  EA_TRY(check_operand("grad_gate_up", dgu));
  const int64_t T = dy.rows, D = dy.cols;
  int64_t F = 0;
  EA_TRY(check_gate_up(gu, T, "grad_y", F));
  EA_TRY(check_shape("grad_gate_up", dgu, T, 2 * F, DType::kBFloat16, "a gradient matches its input"));
  EA_TRY(check_weight("w2", w2, E, F, D, "w2 is [num_experts * F, D]"));
  for (auto [name, m] : {std::pair{"w2", &w2}, std::pair{"gate_up", &gu},
                         std::pair{"grad_gate_up", &dgu}})
    EA_TRY(check_same_device(name, m->device, m->device_id, dy.device, dy.device_id, "grad_y"));
  EA_TRY(check_weights_vector("weights", weights, T, dy, "grad_y"));
  if (grad_weights != nullptr && weights == nullptr)
    return fail(Status::kInvalidArgument, "grad_weights is given but weights is null");
  EA_TRY(check_weights_vector("grad_weights", grad_weights, T, dy, "grad_y"));
  EA_TRY(check_tma("grad_y", dy));
  EA_TRY(check_pairs("gate_up", gu));
  EA_TRY(check_pairs("grad_gate_up", dgu));
  EA_TRY(check_dim("T", T));
  EA_TRY(check_dim("D", D));
  EA_TRY(check_dim("F", F));
  if (D == 0 && T > 0 && F > 0)
    return fail(Status::kInvalidArgument, "grad_y has D = 0 columns: the GEMM has no depth");
  // grad_gate_up may be gate_up itself (in place); nothing else may overlap an output.
  const Extent e_dgu = extent_of(dgu), e_gu = extent_of(gu), e_dy = extent_of(dy),
               e_w2 = extent_of(w2);
  const Extent e_w = weights ? extent_of(*weights) : Extent{};
  const Extent e_dw = grad_weights ? extent_of(*grad_weights) : Extent{};
  if (!same_view(dgu, gu)) EA_TRY(check_no_overlap("grad_gate_up", e_dgu, "gate_up", e_gu));
  EA_TRY(check_no_overlap("grad_gate_up", e_dgu, "grad_y", e_dy));
  EA_TRY(check_no_overlap("grad_gate_up", e_dgu, "w2", e_w2));
  EA_TRY(check_no_overlap("grad_gate_up", e_dgu, "weights", e_w));
  EA_TRY(check_no_overlap("grad_gate_up", e_dgu, "grad_weights", e_dw));
  EA_TRY(check_no_overlap("grad_weights", e_dw, "grad_y", e_dy));
  EA_TRY(check_no_overlap("grad_weights", e_dw, "w2", e_w2));
  EA_TRY(check_no_overlap("grad_weights", e_dw, "gate_up", e_gu));
  EA_TRY(check_no_overlap("grad_weights", e_dw, "weights", e_w));
  if (T == 0) return Status::kOk;
#if EXPERTACT_WITH_CUTLASS
  // No columns and no weight gradient: nothing to compute. (With a weight gradient the
  // launcher zeroes it: a sum over an empty row.)
  if (F == 0 && grad_weights == nullptr) return Status::kOk;
  return gemm::fused_backward(params, dy, w2, E, offsets, gu, weights, dgu, grad_weights, stream);
#else
  (void)stream;
  return not_built();
#endif
}

}  // namespace detail

namespace experimental {

bool has_fused_gemm() { return EXPERTACT_WITH_CUTLASS != 0; }

Status moe_fused_forward(const GluParams& params, const MatrixRef& x, const MatrixRef& w13,
                         int32_t num_experts, const int32_t* offsets, const VectorRef* weights,
                         const MatrixRef& gate_up, const MatrixRef& h, void* stream) {
  return detail::guarded("moe_fused_forward", [&] {
    return detail::moe_fused_forward_body(params, x, w13, num_experts, offsets, weights, gate_up,
                                          h, stream);
  });
}

Status moe_fused_backward(const GluParams& params, const MatrixRef& grad_y, const MatrixRef& w2,
                          int32_t num_experts, const int32_t* offsets, const MatrixRef& gate_up,
                          const VectorRef* weights, const MatrixRef& grad_gate_up,
                          const VectorRef* grad_weights, void* stream) {
  return detail::guarded("moe_fused_backward", [&] {
    return detail::moe_fused_backward_body(params, grad_y, w2, num_experts, offsets, gate_up,
                                           weights, grad_gate_up, grad_weights, stream);
  });
}

}  // namespace experimental
}  // namespace expertact
