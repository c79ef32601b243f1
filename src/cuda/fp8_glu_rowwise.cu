// glu_rowwise on CUDA, the entry: the operands' check and the column amax's zeroing, then the
// kernels of the operands' storage type (fp8_glu_rowwise.cuh; one translation unit per type,
// fp8_act_*.cu).
#include "cuda/fp8_act_entry.h"
#include "cuda/fp8_common.cuh"

namespace expertact::detail {

Status cuda_fp8_glu_rowwise(const GluProblem& p, const Fp8Out& o, const GluBias* bias, const Fp8ColAmax* amax,
                            void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", bias ? bias->er.offsets : nullptr},
                         {"q", o.q}, {"scale", o.scale}, {"col_amax_offsets", amax ? amax->offsets : nullptr},
                         {"col_amax", amax ? amax->col_amax : nullptr}}));
  if (p.rows > 0x7fffffffLL) return fail(Status::kInvalidArgument, "too many rows (", p.rows, ")");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (amax) {
    // Zeroed first (the atomics' identity).
    const int64_t n = amax->experts * p.F;
    if (n > 0) {
      const unsigned zb =
          static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, cuda::sm_count(p.device_id) * 8));
      EA_TRY(fp8_zero_matrix(amax->col_amax, amax->stride, amax->experts, p.F, zb, st,
                             "fp8 glu col_amax zero kernel launch"));
    }
  }
  if (p.rows == 0) return Status::kOk;
  const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  unsigned* am = amax ? reinterpret_cast<unsigned*>(amax->col_amax) : nullptr;
  return dispatch_dtype(p.dtype, [&](auto tag) -> Status {
    constexpr DType D = decltype(tag)::value;
    if constexpr (D == DType::kFloat32) return cuda::fp8_glu_rowwise_f32(p, o, bias, amax, c, am, st);
    else if constexpr (D == DType::kFloat16) return cuda::fp8_glu_rowwise_f16(p, o, bias, amax, c, am, st);
    else return cuda::fp8_glu_rowwise_bf16(p, o, bias, amax, c, am, st);
  });
}

}  // namespace expertact::detail
