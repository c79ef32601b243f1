// fp8_glu_backward_rowwise on CUDA, the entry: the operands' check and the column amax's zeroing,
// then the kernels of the operands' storage type (fp8_backward.cuh; one translation unit per
// type, fp8_act_*.cu).
#include "cuda/fp8_act_entry.h"
#include "cuda/fp8_common.cuh"

namespace expertact::detail {

Status cuda_fp8_glu_backward_rowwise(const GluProblem& p, const Fp8BwdOut& o, const GluBias* bias, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"gate_up", p.g}, {"grad_out", o.dy}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", bias ? bias->er.offsets : o.offsets},
                         {"q", o.q}, {"scale", o.scale}, {"grad_weights", o.dw}, {"col_amax", o.col_amax},
                         {"grad_gate_up", o.dgu}}));
  if (p.rows > 0x7fffffffLL) return fail(Status::kInvalidArgument, "too many rows (", p.rows, ")");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (o.col_amax && o.experts > 0) {
    EA_TRY(cuda::cuda_check(cudaMemset2DAsync(o.col_amax, static_cast<size_t>(o.col_amax_stride) * sizeof(float), 0,
                                              static_cast<size_t>(2 * p.F) * sizeof(float),
                                              static_cast<size_t>(o.experts), st),
                            "fp8 col_amax zero"));
  }
  if (p.rows == 0) return Status::kOk;
  return dispatch_dtype(p.dtype, [&](auto tag) -> Status {
    constexpr DType D = decltype(tag)::value;
    if constexpr (D == DType::kFloat32) return cuda::fp8_glu_backward_rowwise_f32(p, o, bias, st);
    else if constexpr (D == DType::kFloat16) return cuda::fp8_glu_backward_rowwise_f16(p, o, bias, st);
    else return cuda::fp8_glu_backward_rowwise_bf16(p, o, bias, st);
  });
}

}  // namespace expertact::detail
