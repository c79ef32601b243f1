// The experimental fused grouped GEMMs' launchers behind the API boundary: fill the
// kernels' parameters from the validated views, enter the tensors' device, prove every
// pointer is its memory and that it is a Hopper GPU (the kernels are sm_90a machine code
// only), zero the weight gradient the backward accumulates, dispatch on activation and
// schedule.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/dispatch.h"
#include "core/error.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/gemm/moe_gemm.h"

namespace expertact::gemm {
namespace {

__global__ void zero_strided(float* x, int64_t n, int64_t stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i * stride] = 0.0f;
}

// wgmma and setmaxnreg exist on sm_90a only: another GPU would fail the launch with
// "no kernel image", after the caller's tensors were allocated; say so up front.
Status check_hopper(int device) {
  int major = 0, minor = 0;
  EA_TRY(cuda::cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                          "cudaDeviceGetAttribute"));
  EA_TRY(cuda::cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                          "cudaDeviceGetAttribute"));
  if (major != 9 || minor != 0)
    return ::expertact::detail::fail(
        Status::kUnsupported, "the fused grouped GEMM runs on Hopper (sm_90) GPUs only; cuda:",
        device, " is sm_", major, minor, " (use the unfused path there)");
  return Status::kOk;
}

// The schedules this build has (CMake's EXPERTACT_CUTLASS_SCHEDULES; the first is the
// default).
#ifndef EXPERTACT_FUSED_PINGPONG
#define EXPERTACT_FUSED_PINGPONG 0
#endif
#ifndef EXPERTACT_FUSED_COOPERATIVE
#define EXPERTACT_FUSED_COOPERATIVE 0
#endif
#ifndef EXPERTACT_FUSED_PINGPONG64
#define EXPERTACT_FUSED_PINGPONG64 0
#endif
#ifndef EXPERTACT_FUSED_DEFAULT
#define EXPERTACT_FUSED_DEFAULT 0
#endif

// Every schedule by its EXPERTACT_FUSED_SCHEDULE name, and whether this build has it.
struct ScheduleName {
  const char* name;
  Schedule s;
  bool built;
};
constexpr ScheduleName kSchedules[] = {
    {"pingpong", Schedule::kPingpong, EXPERTACT_FUSED_PINGPONG != 0},
    {"cooperative", Schedule::kCooperative, EXPERTACT_FUSED_COOPERATIVE != 0},
    {"pingpong64", Schedule::kPingpong64, EXPERTACT_FUSED_PINGPONG64 != 0},
};

// EXPERTACT_FUSED_SCHEDULE (a name above; unset: the build's default), read once per
// process. A value that names no built schedule fails every call, naming it, rather than
// timing another kernel than the one asked for.
Status schedule_choice(Schedule& out) {
  struct Parsed {
    bool ok = true;
    Schedule s = static_cast<Schedule>(EXPERTACT_FUSED_DEFAULT);
    std::string value;
  };
  static const Parsed parsed = [] {
    Parsed r;
    const char* env = std::getenv("EXPERTACT_FUSED_SCHEDULE");
    if (env == nullptr || env[0] == '\0') return r;
    r.value = env;
    r.ok = false;
    for (const ScheduleName& k : kSchedules) {
      if (k.built && std::strcmp(env, k.name) == 0) {
        r.s = k.s;
        r.ok = true;
      }
    }
    return r;
  }();
  if (!parsed.ok) {
    std::string built;
    for (const ScheduleName& k : kSchedules)
      if (k.built) built += std::string(" ") + k.name;
    return ::expertact::detail::fail(Status::kInvalidArgument, "EXPERTACT_FUSED_SCHEDULE=",
                                     parsed.value, " is not a schedule of this build (built:",
                                     built, ")");
  }
  out = parsed.s;
  return Status::kOk;
}

bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <Schedule S>
using SchedTag = std::integral_constant<Schedule, S>;

// run(ActTag, SchedTag) for the call's activation and the chosen schedule.
template <class Run>
Status dispatch(Activation act, Run&& run) {
  Schedule sch;
  EA_TRY(schedule_choice(sch));
  return ::expertact::detail::dispatch_act(act, [&](auto a) -> Status {
#if EXPERTACT_FUSED_PINGPONG
    if (sch == Schedule::kPingpong) return run(a, SchedTag<Schedule::kPingpong>{});
#endif
#if EXPERTACT_FUSED_COOPERATIVE
    if (sch == Schedule::kCooperative) return run(a, SchedTag<Schedule::kCooperative>{});
#endif
#if EXPERTACT_FUSED_PINGPONG64
    if (sch == Schedule::kPingpong64) return run(a, SchedTag<Schedule::kPingpong64>{});
#endif
    return ::expertact::detail::fail(Status::kInternal, "fused GEMM: schedule ",
                                     static_cast<int>(sch), " is not built");
  });
}

math::Coeffs coeffs_of(const GluParams& p) {
  return math::Coeffs{p.alpha, p.limit, p.beta, std::isfinite(p.limit)};
}

}  // namespace

Status fused_forward(const GluParams& params, const MatrixRef& x, const MatrixRef& w13,
                     int32_t num_experts, const int32_t* offsets, const VectorRef* weights,
                     const MatrixRef& gate_up, const MatrixRef& h, void* stream) {
  const int64_t F = gate_up.cols / 2;
  GroupedShape s;
  s.E = num_experts;
  s.T = x.rows;
  s.N = 2 * F;
  s.K = x.cols;
  s.a = x.data;
  s.lda = x.row_stride;
  s.b = w13.data;
  s.ldb = w13.row_stride;
  s.ldb_e = 2 * F * w13.row_stride;
  s.d = gate_up.data;
  s.ldd = gate_up.row_stride;
  s.device = x.device_id;
  FwdEpilogueParams p;
  p.h = static_cast<__nv_bfloat16*>(h.data);
  p.ldh = h.row_stride;
  p.offsets = offsets;
  p.T = x.rows;
  p.w = weights ? weights->data : nullptr;
  p.w_stride = weights ? weights->stride : 1;
  p.coeffs = coeffs_of(params);
  p.h_vec8 = aligned(p.h, 8) && p.ldh % 4 == 0;

  cuda::DeviceGuard guard(s.device);
  EA_TRY(::expertact::detail::enter_operands(
      s.device, guard,
      {{"x", s.a}, {"w13", s.b}, {"offsets", p.offsets}, {"weights", p.w}, {"gate_up", s.d},
       {"h", p.h}}));
  EA_TRY(check_hopper(s.device));
  return dispatch(params.act, [&](auto a, auto sch) {
    return detail::fwd<decltype(a)::value, decltype(sch)::value>(s, p, stream);
  });
}

Status fused_backward(const GluParams& params, const MatrixRef& grad_y, const MatrixRef& w2,
                      int32_t num_experts, const int32_t* offsets, const MatrixRef& gate_up,
                      const VectorRef* weights, const MatrixRef& grad_gate_up,
                      const VectorRef* grad_weights, void* stream) {
  const int64_t F = gate_up.cols / 2;
  GroupedShape s;
  s.E = num_experts;
  s.T = grad_y.rows;
  s.N = F;
  s.K = grad_y.cols;
  s.a = grad_y.data;
  s.lda = grad_y.row_stride;
  s.b = w2.data;
  s.ldb = w2.row_stride;
  s.ldb_e = F * w2.row_stride;
  s.device = grad_y.device_id;
  BwdEpilogueParams p;
  p.gate_up = static_cast<const __nv_bfloat16*>(gate_up.data);
  p.ld_gu = gate_up.row_stride;
  p.dgate_up = static_cast<__nv_bfloat16*>(grad_gate_up.data);
  p.ld_dgu = grad_gate_up.row_stride;
  p.offsets = offsets;
  p.T = grad_y.rows;
  p.w = weights ? weights->data : nullptr;
  p.w_stride = weights ? weights->stride : 1;
  p.dw = grad_weights ? grad_weights->data : nullptr;
  p.dw_stride = grad_weights ? grad_weights->stride : 1;
  p.coeffs = coeffs_of(params);
  p.vec8 = aligned(p.gate_up, 8) && aligned(p.dgate_up, 8) && p.ld_gu % 4 == 0 &&
           p.ld_dgu % 4 == 0;

  cuda::DeviceGuard guard(s.device);
  EA_TRY(::expertact::detail::enter_operands(
      s.device, guard,
      {{"grad_y", s.a}, {"w2", s.b}, {"offsets", p.offsets}, {"gate_up", p.gate_up},
       {"weights", p.w}, {"grad_gate_up", p.dgate_up}, {"grad_weights", p.dw}}));
  EA_TRY(check_hopper(s.device));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.dw != nullptr) {  // the epilogue adds each tile's row sums into it
    if (p.dw_stride == 1) {
      EA_TRY(cuda::cuda_check(cudaMemsetAsync(p.dw, 0, static_cast<size_t>(s.T) * sizeof(float), st),
                              "cudaMemsetAsync (grad_weights)"));
    } else {
      const int threads = 256;
      zero_strided<<<static_cast<unsigned>((s.T + threads - 1) / threads), threads, 0, st>>>(
          p.dw, s.T, p.dw_stride);
      EA_TRY(cuda::cuda_check(cudaGetLastError(), "zero grad_weights kernel launch"));
    }
  }
  if (s.N == 0) return Status::kOk;  // F == 0: the zeroed weight gradient is the whole answer
  return dispatch(params.act, [&](auto a, auto sch) {
    return detail::bwd<decltype(a)::value, decltype(sch)::value>(s, p, stream);
  });
}

}  // namespace expertact::gemm
