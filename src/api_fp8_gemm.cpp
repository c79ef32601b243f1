// The FP8 blockwise grouped GEMM's entry point (expertact.hpp, fp8_grouped_gemm_blockwise):
// every check of its operands, once, naming the argument and its value, then the CUTLASS
// launcher of the grouping (src/cuda/gemm/fp8_gemm_m.cu, fp8_gemm_k.cu), present when the build
// found the CUTLASS headers (EXPERTACT_WITH_CUTLASS).
#include <cstdint>
#include <limits>

#include "api.h"
#include "api_fp8_common.h"
#include "core/checks.h"
#include "core/error.h"
#include "expertact/expertact.hpp"
#if EXPERTACT_WITH_CUTLASS
#include "cuda/gemm/fp8_gemm.h"
#else
#include "cuda/gemm/fp8_gemm_plan.h"
#endif

namespace expertact {
namespace detail {
namespace {

using fp8gemm::ceil_div;
using fp8gemm::kTile;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "an unknown dtype";
}

Status check_dtype(const char* name, const MatrixRef& m, DType want) {
  if (m.dtype != want)
    return fail(Status::kInvalidDtype, name, ".dtype is ", dtype_name(m.dtype), " but ", dtype_name(want),
                " is expected");
  return Status::kOk;
}

Status check_dims(const char* name, const MatrixRef& m, int64_t rows, int64_t cols, const char* why) {
  if (m.rows != rows || m.cols != cols)
    return fail(Status::kInvalidArgument, name, " has shape [", m.rows, ", ", m.cols, "] but [", rows, ", ", cols,
                "] is expected (", why, ")");
  return Status::kOk;
}

// What TMA reads or writes: data aligned to 16 bytes and a row stride of whole 16-byte units
// (`unit` elements), for a tensor with something in it.
Status check_tma_rows(const char* name, const MatrixRef& m, int64_t unit) {
  if (m.rows == 0 || m.cols == 0) return Status::kOk;
  if (reinterpret_cast<uintptr_t>(m.data) % 16 != 0)
    return fail(Status::kInvalidArgument, name, ".data ", static_cast<const void*>(m.data),
                " is not 16-byte aligned (the GEMM's TMA copies need it)");
  if (m.rows > 1 && m.row_stride % unit != 0)
    return fail(Status::kInvalidArgument, name, ".row_stride ", m.row_stride, " is not a multiple of ", unit,
                " elements (16 bytes: the GEMM's TMA copies need it)");
  return Status::kOk;
}

Status check_expert_stride(const char* name, int64_t stride, int64_t unit) {
  if (stride < 0) return fail(Status::kInvalidArgument, name, " expert_stride ", stride, " is negative");
  if (stride % unit != 0)
    return fail(Status::kInvalidArgument, name, " expert_stride ", stride, " is not a multiple of ", unit,
                " elements (16 bytes: each expert's matrix must start 16-byte aligned)");
  return Status::kOk;
}

// A scale matrix's (row stride) * rows within int32: CUTLASS's scale layouts index in 32 bits.
Status check_scale_span(const char* name, const MatrixRef& m) {
  const int64_t ld = m.rows > 1 ? m.row_stride : m.cols;
  if (m.rows > 0 && ld > kInt32Max / m.rows)
    return fail(Status::kInvalidArgument, name, " spans ", m.rows, " rows of stride ", ld,
                ": more than 2^31 - 1 elements (the GEMM's scale layouts index in 32 bits)");
  return Status::kOk;
}

// The bytes a stack of E matrices spans, for the overlap checks (stride 0 within: one block).
Extent extent_of(const ExpertsRef& x, int64_t E) {
  Extent e = detail::extent_of(x.m);
  if (e.empty || E <= 1 || x.expert_stride == 0) return e;
  e.end += static_cast<uintptr_t>((E - 1) * x.expert_stride * dtype_size(x.m.dtype));
  e.stride = 0;
  e.row_bytes = static_cast<int64_t>(e.end - e.begin);
  return e;
}

}  // namespace

Status fp8_grouped_gemm_blockwise_body(GemmGrouping grouping, const MatrixRef& a, const MatrixRef& sa,
                                       const ExpertsRef& b, const ExpertsRef& sb, const OffsetsRef& offsets,
                                       const ExpertsRef& d, void* workspace, size_t workspace_bytes, void* stream) {
  if (grouping != GemmGrouping::kM && grouping != GemmGrouping::kK)
    return fail(Status::kInvalidArgument, "grouping ", static_cast<int>(grouping),
                " is not 0 (M-grouped: forward, input gradient) or 1 (K-grouped: weight gradients)");
  const bool kM = grouping == GemmGrouping::kM;
  EA_TRY(check_matrix_view("a", a));
  EA_TRY(check_matrix_view("a_scale", sa));
  EA_TRY(check_matrix_view("b", b.m));
  EA_TRY(check_matrix_view("b_scale", sb.m));
  EA_TRY(check_matrix_view("d", d.m));
  EA_TRY(check_dtype("a", a, DType::kFloat8E4M3));
  EA_TRY(check_dtype("a_scale", sa, DType::kFloat32));
  EA_TRY(check_dtype("b", b.m, DType::kFloat8E4M3));
  EA_TRY(check_dtype("b_scale", sb.m, DType::kFloat32));
  EA_TRY(check_dtype("d", d.m, DType::kBFloat16));
  EA_TRY(check_same_device("a_scale", sa.device, sa.device_id, a.device, a.device_id, "a"));
  EA_TRY(check_same_device("b", b.m.device, b.m.device_id, a.device, a.device_id, "a"));
  EA_TRY(check_same_device("b_scale", sb.m.device, sb.m.device_id, a.device, a.device_id, "a"));
  EA_TRY(check_same_device("d", d.m.device, d.m.device_id, a.device, a.device_id, "a"));
  // The sizes: M-grouped a [T, K], b [N, K], d [T, N]; K-grouped a [M, Tp], b [N, Tp], d [M, N].
  const int64_t N = b.m.rows;
  const int64_t T = kM ? a.rows : a.cols;  // the grouped extent: rows, or padded tokens
  EA_TRY(check_offsets(offsets, T, a.device, a.device_id, "a"));  // E >= 1; on the CPU, the values
  const int64_t E = offsets.size;
  if (kM) {
    const int64_t K = a.cols, KB = ceil_div(K, kTile), NB = ceil_div(N, kTile);
    if (K % 16 != 0)
      return fail(Status::kInvalidArgument, "K = ", K,
                  " (a's columns) is not a multiple of 16 (TMA reads 16-byte rows)");
    if (T > kInt32Max) return fail(Status::kInvalidArgument, "a has ", T, " rows: more than 2^31 - 1");
    EA_TRY(check_dims("b", b.m, N, K, "b is [N, K] per expert, K as a's columns"));
    EA_TRY(check_dims("a_scale", sa, KB, T, "the 1 x 128 row tiles' scales of a [T, K] are [ceil(K / 128), T]"));
    EA_TRY(check_dims("b_scale", sb.m, NB, KB,
                      "the 128 x 128 blocks' scales of b [N, K] are [ceil(N / 128), ceil(K / 128)] per expert"));
    EA_TRY(check_dims("d", d.m, T, N, "d is [T, N]: a's rows, b's rows"));
    if (d.expert_stride != 0)
      return fail(Status::kInvalidArgument, "d expert_stride ", d.expert_stride,
                  " must be 0 for the M-grouped GEMM (d is one [T, N] matrix)");
    EA_TRY(check_expert_stride("b", b.expert_stride, 16));
    if (sb.expert_stride < 0)
      return fail(Status::kInvalidArgument, "b_scale expert_stride ", sb.expert_stride, " is negative");
  } else {
    const int64_t M = a.rows, TB = T / kTile;
    if (T % kTile != 0)
      return fail(Status::kInvalidArgument, "Tp = ", T, " (a's columns, the padded tokens) is not a multiple of 128");
    if (M > kInt32Max) return fail(Status::kInvalidArgument, "a has ", M, " rows: more than 2^31 - 1");
    EA_TRY(check_dims("b", b.m, N, T, "b is [N, Tp], Tp as a's columns"));
    EA_TRY(check_dims("a_scale", sa, TB, M, "the 128 x 1 column tiles' scales of a [M, Tp] are [Tp / 128, M]"));
    EA_TRY(check_dims("b_scale", sb.m, TB, N, "the 128 x 1 column tiles' scales of b [N, Tp] are [Tp / 128, N]"));
    EA_TRY(check_dims("d", d.m, M, N, "d is [M, N] per expert: a's rows, b's rows"));
    if (b.expert_stride != 0 || sb.expert_stride != 0)
      return fail(Status::kInvalidArgument, b.expert_stride != 0 ? "b" : "b_scale", " expert_stride ",
                  b.expert_stride != 0 ? b.expert_stride : sb.expert_stride,
                  " must be 0 for the K-grouped GEMM (one matrix over all experts' tokens)");
    EA_TRY(check_expert_stride("d", d.expert_stride, 8));
    const int64_t span = d.m.rows == 0 || d.m.cols == 0 ? 0 : (d.m.rows - 1) * d.m.row_stride + d.m.cols;
    if (E > 1 && d.expert_stride < span)
      return fail(Status::kInvalidArgument, "d expert_stride ", d.expert_stride, " is less than one expert's [", M,
                  ", ", N, "] matrix (", span, " elements with row stride ", d.m.row_stride,
                  "): the experts' outputs would overlap");
  }
  if (N > kInt32Max) return fail(Status::kInvalidArgument, "b has ", N, " rows: more than 2^31 - 1");
  if (N % 8 != 0)
    return fail(Status::kInvalidArgument, "N = ", N, " (b's rows, d's columns) is not a multiple of 8 (d's rows are "
                "stored in 16-byte units)");
  EA_TRY(check_tma_rows("a", a, 16));
  EA_TRY(check_tma_rows("b", b.m, 16));
  EA_TRY(check_tma_rows("d", d.m, 8));
  EA_TRY(check_scale_span("a_scale", sa));
  EA_TRY(check_scale_span("b_scale", sb.m));

  // d is the only output: it shares no byte with an input or the workspace.
  const Extent ed = extent_of(d, E), ews = workspace_bytes && workspace
                                                ? Extent{reinterpret_cast<uintptr_t>(workspace),
                                                         reinterpret_cast<uintptr_t>(workspace) + workspace_bytes, 0,
                                                         static_cast<int64_t>(workspace_bytes), false}
                                                : Extent{};
  const Named outs[] = {{"d", ed}};
  const Named ins[] = {{"a", detail::extent_of(a)},   {"a_scale", detail::extent_of(sa)},   {"b", extent_of(b, E)},
                       {"b_scale", extent_of(sb, E)}, {"offsets", offsets_extent(offsets)}, {"workspace", ews}};
  EA_TRY(check_apart(outs, ins));
  for (const Named& in : ins)
    if (in.e.begin != ews.begin) EA_TRY(check_no_overlap("workspace", ews, in.name, in.e));
  if (a.device != DeviceType::kCUDA)
    return fail(Status::kUnsupported, "fp8_grouped_gemm_blockwise runs on CUDA tensors (an sm_90 GPU) only; a is on "
                "the CPU (there, dequantise, q * scale, and multiply in float32 or float64)");
  const size_t need = fp8_grouped_gemm_blockwise_workspace_bytes(E);
  if (workspace_bytes < need)
    return fail(Status::kInvalidArgument, "workspace_bytes ", workspace_bytes, " is less than the ", need,
                " bytes a call over ", E, " experts needs (fp8_grouped_gemm_blockwise_workspace_bytes)");
  if (need > 0 && (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0))
    return fail(Status::kInvalidArgument, "workspace ", workspace, " is ", workspace ? "not 256-byte aligned" : "null");
#if EXPERTACT_WITH_CUTLASS
  fp8gemm::Problem p;
  p.grouping = grouping;
  p.E = static_cast<int32_t>(E);
  p.T = T;
  p.M = kM ? 0 : a.rows;
  p.N = N;
  p.K = kM ? a.cols : 0;
  p.a = a.data;
  p.lda = a.rows > 1 ? a.row_stride : a.cols;
  p.sfa = static_cast<const float*>(sa.data);
  p.ld_sfa = sa.rows > 1 ? sa.row_stride : sa.cols;
  p.b = b.m.data;
  p.ldb = b.m.rows > 1 ? b.m.row_stride : b.m.cols;
  p.b_es = b.expert_stride;
  p.sfb = static_cast<const float*>(sb.m.data);
  p.ld_sfb = sb.m.rows > 1 ? sb.m.row_stride : sb.m.cols;
  p.sfb_es = sb.expert_stride;
  p.offsets = offsets.data;
  p.d = d.m.data;
  p.ldd = d.m.rows > 1 ? d.m.row_stride : d.m.cols;
  p.d_es = d.expert_stride;
  p.device = a.device_id;
  // Nothing to write: an empty d.
  if (d.m.rows == 0 || d.m.cols == 0) return Status::kOk;
  return kM ? fp8gemm::run_m_grouped(p, workspace, workspace_bytes, stream)
            : fp8gemm::run_k_grouped(p, workspace, workspace_bytes, stream);
#else
  (void)stream;
  return fail(Status::kUnsupported,
              "this expertact build has no FP8 grouped GEMM: it is built with the CUDA path when the CUTLASS "
              "headers are found (pip install nvidia-cutlass==4.2.0.0 before building, or cmake "
              "-DEXPERTACT_CUTLASS_DIR=<folder holding cutlass/cutlass.h>; -DEXPERTACT_CUTLASS=ON makes it required)");
#endif
}

}  // namespace detail

size_t fp8_grouped_gemm_blockwise_workspace_bytes(int64_t num_experts) {
#if EXPERTACT_WITH_CUTLASS
  if (num_experts < 1) return 0;
  const size_t m = fp8gemm::workspace_bytes_m_grouped(num_experts), k = fp8gemm::workspace_bytes_k_grouped(num_experts);
  return m > k ? m : k;
#else
  (void)num_experts;
  return 0;
#endif
}

bool has_fp8_grouped_gemm() { return EXPERTACT_WITH_CUTLASS != 0; }

Status fp8_grouped_gemm_blockwise(GemmGrouping grouping, const MatrixRef& a, const MatrixRef& a_scale,
                                  const ExpertsRef& b, const ExpertsRef& b_scale, const OffsetsRef& offsets,
                                  const ExpertsRef& d, void* workspace, size_t workspace_bytes, void* stream) {
  return detail::guarded("fp8_grouped_gemm_blockwise", [&] {
    return detail::fp8_grouped_gemm_blockwise_body(grouping, a, a_scale, b, b_scale, offsets, d, workspace,
                                                   workspace_bytes, stream);
  });
}

}  // namespace expertact
