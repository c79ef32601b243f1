// Refusals of the fused grouped GEMMs' boundary (src/api_moe.cpp, src/c_api.cpp): each
// call returns its status with a message naming the argument. Every case fails in the
// checks, before any memory is touched, so the operands are fake CUDA addresses and the
// tests run on any machine and any build (with or without CUTLASS, with or without a GPU).
#include <gtest/gtest.h>

#include <dlpack/dlpack.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "expertact/experimental/fused_gemm.h"
#include "expertact/expertact.hpp"
#include "expertact/expertact_c.h"

namespace {

namespace fused = expertact::experimental;

using expertact::DType;
using expertact::MatrixRef;
using expertact::Status;
using expertact::VectorRef;

// A fake, well-aligned CUDA address per operand (never dereferenced: every case below
// fails validation first).
void* fake(int i) { return reinterpret_cast<void*>(uintptr_t{1} << 40 | uintptr_t(i) << 30); }

MatrixRef cuda_mat(int i, int64_t rows, int64_t cols) {
  MatrixRef m;
  m.data = fake(i);
  m.rows = rows;
  m.cols = cols;
  m.row_stride = cols;
  m.dtype = DType::kBFloat16;
  m.device = expertact::DeviceType::kCUDA;
  return m;
}

// T = 32 rows, D = 64, F = 16, E = 2: the forward's and backward's operands.
struct Fwd {
  expertact::GluParams params = expertact::preset_swiglu_oai();
  MatrixRef x = cuda_mat(1, 32, 64), w13 = cuda_mat(2, 2 * 32, 64), gu = cuda_mat(3, 32, 32),
            h = cuda_mat(4, 32, 16);
  int32_t E = 2;
  const int32_t* offsets = static_cast<const int32_t*>(fake(5));
  Status call() {
    return fused::moe_fused_forward(params, x, w13, E, offsets, nullptr, gu, h);
  }
};

struct Bwd {
  expertact::GluParams params = expertact::preset_swiglu();
  MatrixRef dy = cuda_mat(1, 32, 64), w2 = cuda_mat(2, 2 * 16, 64), gu = cuda_mat(3, 32, 32),
            dgu = cuda_mat(4, 32, 32);
  VectorRef w, dw;
  bool with_w = false, with_dw = false;
  Status call() {
    return fused::moe_fused_backward(params, dy, w2, 2, static_cast<const int32_t*>(fake(5)), gu,
                                      with_w ? &w : nullptr, dgu, with_dw ? &dw : nullptr);
  }
};

void expect_refused(Status got, Status want, const std::string& needle) {
  EXPECT_EQ(got, want) << expertact::last_error();
  EXPECT_NE(std::string(expertact::last_error()).find(needle), std::string::npos)
      << "message: " << expertact::last_error() << "\nexpected it to mention: " << needle;
}

TEST(MoeFusedErrors, DtypeOtherThanBf16IsUnsupported) {
  Fwd f;
  f.x.dtype = DType::kFloat32;
  expect_refused(f.call(), Status::kUnsupported, "x.dtype is float32");
}

TEST(MoeFusedErrors, CpuTensorIsUnsupported) {
  Fwd f;
  f.h.device = expertact::DeviceType::kCPU;
  expect_refused(f.call(), Status::kUnsupported, "h is on cpu");
}

TEST(MoeFusedErrors, OddGateUpWidth) {
  Fwd f;
  f.gu = cuda_mat(3, 32, 31);
  expect_refused(f.call(), Status::kInvalidArgument, "gate_up's last dimension is 31");
}

TEST(MoeFusedErrors, WeightRowsMustBeExpertsTimes2F) {
  Fwd f;
  f.w13 = cuda_mat(2, 3 * 32, 64);
  expect_refused(f.call(), Status::kInvalidArgument, "w13 has shape [96, 64]");
}

TEST(MoeFusedErrors, ExpertsAndOffsets) {
  Fwd f;
  f.E = 0;
  expect_refused(f.call(), Status::kInvalidArgument, "num_experts must be >= 1");
  Fwd g;
  g.offsets = nullptr;
  expect_refused(g.call(), Status::kInvalidArgument, "offsets is null");
}

TEST(MoeFusedErrors, TmaStrideAndAlignment) {
  Fwd f;
  f.x.row_stride = 68;  // 136 bytes: not a multiple of 16
  expect_refused(f.call(), Status::kInvalidArgument, "x.row_stride 68 is not a multiple of 8");
  Fwd g;
  g.gu.data = static_cast<char*>(g.gu.data) + 2;
  expect_refused(g.call(), Status::kInvalidArgument, "is not 16-byte aligned");
}

TEST(MoeFusedErrors, OutputsMayNotOverlap) {
  Fwd f;
  f.h.data = static_cast<char*>(f.gu.data) + 64;
  f.h.row_stride = 32;
  expect_refused(f.call(), Status::kInvalidArgument, "overlaps");
}

TEST(MoeFusedErrors, BackwardChecks) {
  Bwd b;
  b.with_dw = true;
  b.dw.data = static_cast<float*>(fake(6));
  b.dw.size = 32;
  b.dw.device = expertact::DeviceType::kCUDA;
  expect_refused(b.call(), Status::kInvalidArgument, "grad_weights is given but weights is null");
  Bwd c;
  c.gu.row_stride = 33;
  expect_refused(c.call(), Status::kInvalidArgument, "4-byte aligned with an even row stride");
  Bwd d;
  d.dgu.data = static_cast<char*>(d.gu.data) + 2 * 32;  // overlapping, not the same view
  expect_refused(d.call(), Status::kInvalidArgument, "grad_gate_up overlaps gate_up");
}

TEST(MoeFusedErrors, BuildWithoutCutlassSaysSo) {
  if (fused::has_fused_gemm()) GTEST_SKIP() << "this build has the fused GEMMs";
  Fwd f;
  expect_refused(f.call(), Status::kUnsupported, "no fused grouped GEMM");
}

// The C ABI's own conversions: offsets, and the experts' dimension of w13.
struct DL {
  int64_t shape[3] = {0, 0, 0};
  DLTensor t{};
  DL(int i, std::initializer_list<int64_t> dims, DLDataType dt, DLDeviceType dev = kDLCUDA) {
    int n = 0;
    for (int64_t d : dims) shape[n++] = d;
    t.data = fake(i);
    t.device = {dev, 0};
    t.ndim = n;
    t.dtype = dt;
    t.shape = shape;
  }
};

TEST(MoeFusedErrors, CAbiOffsetsAndExperts) {
  EXPECT_EQ(expertact_has_fused_gemm(), fused::has_fused_gemm() ? 1 : 0);
  expertact_params p{};
  ASSERT_EQ(expertact_preset("swiglu", NAN, NAN, &p), 0);
  const DLDataType bf16{kDLBfloat, 16, 1}, i32{kDLInt, 32, 1}, i64{kDLInt, 64, 1};
  DL x(1, {32, 64}, bf16), w13(2, {2, 32, 64}, bf16), gu(3, {32, 32}, bf16), h(4, {32, 16}, bf16);
  DL off64(5, {2}, i64), off(5, {2}, i32), off_cpu(5, {2}, i32, kDLCPU), w13_2d(2, {64, 64}, bf16),
      w13_3(2, {3, 32, 64}, bf16);
  auto fwd = [&](DL& w, DL& o) {
    return expertact_moe_fused_forward(&p, &x.t, &w.t, &o.t, nullptr, &gu.t, &h.t, nullptr);
  };
  expect_refused(static_cast<Status>(fwd(w13, off64)), Status::kInvalidDtype, "offsets must be int32");
  expect_refused(static_cast<Status>(fwd(w13, off_cpu)), Status::kInvalidArgument, "pass a CUDA tensor");
  expect_refused(static_cast<Status>(fwd(w13_2d, off)), Status::kInvalidArgument, "w13 must be 3-D");
  expect_refused(static_cast<Status>(fwd(w13_3, off)), Status::kInvalidArgument,
                 "3 experts but offsets has 2");
}

}  // namespace
