// Every refusal of the C++ API (src/api.cpp): each call returns the status and
// leaves a last_error() message that names the argument and its value. The
// operands start valid (the unmodified call succeeds), then one thing is broken.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "support/harness.h"

#if EXPERTACT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace eat {
namespace {

using expertact::DeviceType;
using expertact::MatrixRef;
using expertact::VectorRef;

const float kNaNf = std::numeric_limits<float>::quiet_NaN();
const float kInff = std::numeric_limits<float>::infinity();

// The operands of one forward and one backward call, as views into one
// buffer: rows 4, F 8, float32, each operand in its own 256-byte block.
struct Call {
  GluParams params = preset("swiglu_oai").params;
  Layout layout = Layout::kSeparate;
  MatrixRef x, up, out, dy, gx, gu;
  VectorRef w, gw;
  bool with_up = true, with_w = true, with_gu = true, with_gw = true;
  void* stream = nullptr;

  Status forward() const {
    return expertact::glu_forward(params, layout, x, with_up ? &up : nullptr, with_w ? &w : nullptr,
                                  out, stream);
  }
  Status backward() const {
    return expertact::glu_backward(params, layout, dy, x, with_up ? &up : nullptr,
                                   with_w ? &w : nullptr, gx, with_gu ? &gu : nullptr,
                                   with_gw ? &gw : nullptr, stream);
  }
};

class Errors : public testing::TestWithParam<BackendKind> {
 protected:
  static constexpr int64_t R = 4, F = 8, kBlock = 256;
  void SetUp() override {
    EAT_REQUIRE_BACKEND(GetParam());
    be_ = &backend(GetParam());
    buf_ = std::make_unique<DeviceBuffer>(*be_, 16 * kBlock);
    ASSERT_TRUE(buf_->ok());
    for (size_t i = 0; i < buf_->size(); i += 4) store_elem(DType::kFloat32, &buf_->image[i], 0.25);
    buf_->upload();
  }
  char* block(int i) const { return buf_->data() + i * kBlock; }
  MatrixRef mat(int blk, int64_t cols) const {
    MatrixRef m;
    m.data = block(blk);
    m.rows = R;
    m.cols = cols;
    m.row_stride = cols;
    m.dtype = DType::kFloat32;
    m.device = be_->device();
    m.device_id = be_->device_id();
    return m;
  }
  VectorRef vec(int blk) const {
    VectorRef v;
    v.data = reinterpret_cast<float*>(block(blk));
    v.size = R;
    v.stride = 1;
    v.device = be_->device();
    v.device_id = be_->device_id();
    return v;
  }
  // Separate layout: gate, up, out, grad_out, grad_gate, grad_up, weights, grad_weights.
  Call separate() const {
    Call c;
    c.x = mat(0, F);
    c.up = mat(1, F);
    c.out = mat(2, F);
    c.dy = mat(3, F);
    c.gx = mat(4, F);
    c.gu = mat(5, F);
    c.w = vec(6);
    c.gw = vec(7);
    c.stream = be_->stream();
    return c;
  }
  // Halves layout: gate_up [4, 16] in blocks 8-9, its gradient in 10-11.
  Call packed() const {
    Call c = separate();
    c.layout = Layout::kHalves;
    c.x = mat(8, 2 * F);
    c.gx = mat(10, 2 * F);
    c.with_up = c.with_gu = false;
    return c;
  }
  // A device other than the operands' own (the CPU for CUDA operands).
  DeviceType other_device() const {
    return be_->device() == DeviceType::kCPU ? DeviceType::kCUDA : DeviceType::kCPU;
  }
  std::string own_name() const { return be_->device() == DeviceType::kCPU ? "cpu" : "cuda:0"; }
  std::string other_name() const { return be_->device() == DeviceType::kCPU ? "cuda:0" : "cpu"; }

  // The status, and a message holding every part.
  void expect_fail(Status got, Status want, const std::vector<std::string>& parts,
                   const char* what) {
    be_->finish(what);
    EXPECT_EQ(got, want) << what;
    const std::string msg = expertact::last_error();
    EXPECT_FALSE(msg.empty()) << what;
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << what << ": message \"" << msg << "\" lacks \"" << p << "\"";
  }
  void expect_ok(Status got, const char* what) {
    be_->finish(what);
    EXPECT_EQ(got, Status::kOk) << what << ": " << expertact::last_error();
    EXPECT_STREQ(expertact::last_error(), "") << what;
  }

  Backend* be_ = nullptr;
  std::unique_ptr<DeviceBuffer> buf_;
};

#define FWD_FAILS(call, status, ...) expect_fail((call).forward(), status, {__VA_ARGS__}, #call " forward")
#define BWD_FAILS(call, status, ...) expect_fail((call).backward(), status, {__VA_ARGS__}, #call " backward")

TEST_P(Errors, BaselineCallsSucceed) {
  expect_ok(separate().forward(), "separate forward");
  expect_ok(separate().backward(), "separate backward");
  expect_ok(packed().forward(), "packed forward");
  expect_ok(packed().backward(), "packed backward");
}

TEST_P(Errors, Params) {
  const Status kBad = Status::kInvalidArgument;
  for (bool pk : {false, true}) {
    auto fresh = [&] { return pk ? packed() : separate(); };
    Call c = fresh();
    c.params.act = static_cast<expertact::Activation>(7);
    FWD_FAILS(c, kBad, "params.act", "7");
    BWD_FAILS(c, kBad, "params.act", "7");
    c = fresh();
    c.params.alpha = kNaNf;
    FWD_FAILS(c, kBad, "params.alpha", "nan");
    BWD_FAILS(c, kBad, "params.alpha", "nan");
    c.params.alpha = -kInff;
    FWD_FAILS(c, kBad, "params.alpha", "-inf");
    for (float bad : {0.0f, -1.0f, -kInff}) {
      c = fresh();
      c.params.limit = bad;
      const std::string v = bad == 0 ? "got 0" : (std::isinf(bad) ? "-inf" : "-1");
      FWD_FAILS(c, kBad, "params.limit", v);
      BWD_FAILS(c, kBad, "params.limit", v);
    }
    c = fresh();
    c.params.limit = kNaNf;
    FWD_FAILS(c, kBad, "params.limit", "nan");
    c = fresh();
    c.params.beta = kInff;
    FWD_FAILS(c, kBad, "params.beta", "inf");
    c.params.beta = kNaNf;
    BWD_FAILS(c, kBad, "params.beta", "nan");
    for (int l : {-1, 4}) {
      c = fresh();
      c.layout = static_cast<Layout>(l);
      FWD_FAILS(c, kBad, "layout " + std::to_string(l));
      BWD_FAILS(c, kBad, "layout " + std::to_string(l));
    }
  }
  // Valid corner values are accepted: a negative or zero alpha, limit +inf, any finite beta.
  Call c = separate();
  c.params.alpha = -0.5f;
  c.params.beta = -1e30f;
  expect_ok(c.forward(), "negative alpha");
  c.params.alpha = 0.0f;
  c.params.limit = 1e-30f;
  expect_ok(c.backward(), "alpha 0, tiny limit");
}

TEST_P(Errors, MatrixOperand) {
  const Status kBad = Status::kInvalidArgument;
  Call c = separate();
  c.x.dtype = static_cast<DType>(9);
  FWD_FAILS(c, Status::kInvalidDtype, "gate.dtype 9");
  c = packed();
  c.x.dtype = static_cast<DType>(-3);
  BWD_FAILS(c, Status::kInvalidDtype, "gate_up.dtype -3");
  c = separate();
  c.x.device = static_cast<DeviceType>(5);
  FWD_FAILS(c, kBad, "gate.device 5");
  c = separate();
  c.x.rows = -1;
  FWD_FAILS(c, kBad, "gate has a negative size", "[-1, 8]");
  c = packed();
  c.x.cols = -16;
  BWD_FAILS(c, kBad, "gate_up has a negative size", "[4, -16]");
  c = separate();
  c.x.data = nullptr;
  FWD_FAILS(c, kBad, "gate.data is null", "[4, 8]");
  c = separate();
  c.up.data = nullptr;
  BWD_FAILS(c, kBad, "up.data is null");
  c = separate();
  c.x.row_stride = 7;
  FWD_FAILS(c, kBad, "gate.row_stride 7", "row length 8");
  c = separate();
  c.out.row_stride = -8;
  FWD_FAILS(c, kBad, "out.row_stride -8");
  c = separate();
  c.dy.row_stride = 0;
  BWD_FAILS(c, kBad, "grad_out.row_stride 0");
  // Aligned to 2 bytes, not to the 4-byte float32 element.
  c = separate();
  c.x.data = block(0) + 2;
  FWD_FAILS(c, kBad, "gate.data", "not aligned", "4-byte float32");
  c = separate();
  c.gu.data = block(5) + 2;
  BWD_FAILS(c, kBad, "grad_up.data", "not aligned", "4-byte");
  // One byte off for a 2-byte dtype.
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    c = packed();
    for (MatrixRef* m : {&c.x, &c.out, &c.dy, &c.gx}) m->dtype = d;
    c.x.data = block(8) + 1;
    FWD_FAILS(c, kBad, "gate_up.data", "not aligned", std::string("2-byte ") + (d == DType::kFloat16 ? "float16" : "bfloat16"));
    c = packed();
    for (MatrixRef* m : {&c.x, &c.out, &c.dy, &c.gx}) m->dtype = d;
    c.dy.data = block(3) + 1;
    BWD_FAILS(c, kBad, "grad_out.data", "not aligned");
    // Two bytes off is one element: fine.
    c = packed();
    for (MatrixRef* m : {&c.x, &c.out, &c.dy, &c.gx}) m->dtype = d;
    c.x.data = block(8) + 2;
    expect_ok(c.forward(), "2-byte dtype, one element past alignment");
  }
  // More than 2^63 bytes of extent.
  c = separate();
  c.x.rows = int64_t{1} << 40;
  c.x.row_stride = int64_t{1} << 40;
  FWD_FAILS(c, kBad, "gate spans more than 2^63 bytes", "1099511627776");
}

TEST_P(Errors, ShapesAndDtypes) {
  const Status kBad = Status::kInvalidArgument;
  Call c = separate();
  c.up.cols = 9;
  c.up.row_stride = 9;
  FWD_FAILS(c, kBad, "up has shape [4, 9]", "[4, 8] is expected");
  c = separate();
  c.up.rows = 3;
  BWD_FAILS(c, kBad, "up has shape [3, 8]");
  c = separate();
  c.up.dtype = DType::kFloat16;
  FWD_FAILS(c, Status::kInvalidDtype, "up.dtype is float16", "float32 is expected");
  c = separate();
  c.out.cols = 7;
  FWD_FAILS(c, kBad, "out has shape [4, 7]", "[4, 8]");
  c = packed();
  c.out.cols = 16;
  c.out.row_stride = 16;
  FWD_FAILS(c, kBad, "out has shape [4, 16]", "[4, 8]");
  c = separate();
  c.out.dtype = DType::kBFloat16;
  FWD_FAILS(c, Status::kInvalidDtype, "out.dtype is bfloat16", "float32");
  c = separate();
  c.dy.rows = 5;
  BWD_FAILS(c, kBad, "grad_out has shape [5, 8]");
  c = separate();
  c.dy.dtype = DType::kFloat16;
  BWD_FAILS(c, Status::kInvalidDtype, "grad_out.dtype is float16");
  c = separate();
  c.gx.cols = 6;
  BWD_FAILS(c, kBad, "grad_gate has shape [4, 6]");
  c = packed();
  c.gx.cols = 14;
  BWD_FAILS(c, kBad, "grad_gate_up has shape [4, 14]", "[4, 16]");
  c = packed();
  c.gx.dtype = DType::kBFloat16;
  BWD_FAILS(c, Status::kInvalidDtype, "grad_gate_up.dtype is bfloat16");
  c = separate();
  c.gu.rows = 2;
  BWD_FAILS(c, kBad, "grad_up has shape [2, 8]");
  // A packed width must be even.
  for (Layout l : {Layout::kHalves, Layout::kHalvesUpFirst, Layout::kInterleaved}) {
    c = packed();
    c.layout = l;
    c.x.cols = 9;
    c.x.row_stride = 16;
    FWD_FAILS(c, kBad, "gate_up's last dimension is 9", "odd");
    BWD_FAILS(c, kBad, "gate_up's last dimension is 9");
  }
}

TEST_P(Errors, MissingAndExtraOperands) {
  const Status kBad = Status::kInvalidArgument;
  Call c = separate();
  c.with_up = false;
  FWD_FAILS(c, kBad, "up is missing");
  BWD_FAILS(c, kBad, "up is missing");
  c = packed();
  c.with_up = true;
  FWD_FAILS(c, kBad, "up must be null", "halves");
  BWD_FAILS(c, kBad, "up must be null");
  c = separate();
  c.with_gu = false;
  BWD_FAILS(c, kBad, "grad_up is missing");
  c = packed();
  c.with_gu = true;
  BWD_FAILS(c, kBad, "grad_up must be null");
  c = separate();
  c.with_w = false;
  BWD_FAILS(c, kBad, "grad_weights is given but weights is null");
  // Weights without their gradient is fine.
  c = separate();
  c.with_gw = false;
  expect_ok(c.backward(), "weights without grad_weights");
}

TEST_P(Errors, Weights) {
  const Status kBad = Status::kInvalidArgument;
  Call c = separate();
  c.w.size = 3;
  FWD_FAILS(c, kBad, "weights has 3 elements", "4 rows");
  c = separate();
  c.w.size = 5;
  BWD_FAILS(c, kBad, "weights has 5 elements");
  c = separate();
  c.w.data = nullptr;
  FWD_FAILS(c, kBad, "weights.data is null");
  c = separate();
  c.w.stride = 0;
  FWD_FAILS(c, kBad, "weights.stride is 0");
  c = separate();
  c.w.data = reinterpret_cast<float*>(block(6) + 2);
  FWD_FAILS(c, kBad, "weights.data", "not aligned", "4-byte float32");
  c = separate();
  c.w.device = static_cast<DeviceType>(7);
  FWD_FAILS(c, kBad, "weights.device 7");
  c = separate();
  c.gw.size = 8;
  BWD_FAILS(c, kBad, "grad_weights has 8 elements", "4 rows");
  c = separate();
  c.gw.data = nullptr;
  BWD_FAILS(c, kBad, "grad_weights.data is null");
  c = separate();
  c.gw.stride = 0;
  BWD_FAILS(c, kBad, "grad_weights.stride is 0");
  c = separate();
  c.gw.data = reinterpret_cast<float*>(block(7) + 1);
  BWD_FAILS(c, kBad, "grad_weights.data", "not aligned");
}

TEST_P(Errors, Devices) {
  const Status kBad = Status::kInvalidArgument;
  const std::string own = own_name(), other = other_name();
  Call c = separate();
  c.up.device = other_device();
  FWD_FAILS(c, kBad, "up is on " + other, "gate is on " + own, "one device");
  c = separate();
  c.out.device = other_device();
  FWD_FAILS(c, kBad, "out is on " + other, "gate is on " + own);
  c = separate();
  c.w.device = other_device();
  FWD_FAILS(c, kBad, "weights is on " + other, "gate is on " + own);
  c = separate();
  c.dy.device = other_device();
  BWD_FAILS(c, kBad, "grad_out is on " + other);
  c = separate();
  c.gx.device = other_device();
  BWD_FAILS(c, kBad, "grad_gate is on " + other);
  c = packed();
  c.gx.device = other_device();
  BWD_FAILS(c, kBad, "grad_gate_up is on " + other, "gate_up is on " + own);
  c = separate();
  c.gu.device = other_device();
  BWD_FAILS(c, kBad, "grad_up is on " + other);
  c = separate();
  c.gw.device = other_device();
  BWD_FAILS(c, kBad, "grad_weights is on " + other);
  // Two CUDA devices (checked before any memory is touched).
  c = separate();
  for (MatrixRef* m : {&c.x, &c.up, &c.out, &c.dy, &c.gx, &c.gu}) m->device = DeviceType::kCUDA;
  c.w.device = c.gw.device = DeviceType::kCUDA;
  c.up.device_id = 1;
  FWD_FAILS(c, kBad, "up is on cuda:1", "gate is on cuda:0");
  c.up.device_id = 0;
  c.gu.device_id = 3;
  BWD_FAILS(c, kBad, "grad_up is on cuda:3", "gate is on cuda:0");
}

// Outputs may not share memory with inputs or with each other; the only
// aliasing allowed is an in-place gradient that is exactly its input.
TEST_P(Errors, OverlapsInForward) {
  const Status kBad = Status::kInvalidArgument;
  Call c = separate();
  c.out.data = c.x.data;
  FWD_FAILS(c, kBad, "out overlaps gate");
  c = separate();
  c.out.data = block(1) + 4 * 4;  // rows 1..3 of up
  FWD_FAILS(c, kBad, "out overlaps up");
  c = separate();
  c.out.data = block(6);  // the weights
  FWD_FAILS(c, kBad, "out overlaps weights");
  c = packed();
  c.out.data = block(8) + 8 * 4;  // inside gate_up's first row
  FWD_FAILS(c, kBad, "out overlaps gate_up");
  // Interleaved rows of one stride that do not meet are fine: out = the
  // right half of a [4, 16] buffer whose left half is gate.
  c = separate();
  c.x.row_stride = c.out.row_stride = 16;
  c.x.data = block(12);
  c.out.data = block(12) + 8 * 4;
  expect_ok(c.forward(), "out and gate interleaved by rows");
  // Inputs may share memory with each other.
  c = separate();
  c.up = c.x;
  expect_ok(c.forward(), "gate and up the same tensor");
}

TEST_P(Errors, OverlapsInBackward) {
  const Status kBad = Status::kInvalidArgument;
  Call c = separate();
  c.gx.data = c.dy.data;
  BWD_FAILS(c, kBad, "grad_gate overlaps grad_out");
  // Partial overlap with its own input: not in place.
  c = separate();
  c.gx.data = block(0) + 4;
  BWD_FAILS(c, kBad, "grad_gate overlaps gate");
  // Same pointer, different row stride: not exactly the input.
  c = separate();
  c.x.row_stride = 16;
  c.gx = c.x;
  c.gx.row_stride = 12;
  BWD_FAILS(c, kBad, "grad_gate overlaps gate");
  c = separate();
  c.gx.data = c.up.data;
  BWD_FAILS(c, kBad, "grad_gate overlaps up");
  c = separate();
  c.gx.data = block(6);
  BWD_FAILS(c, kBad, "grad_gate overlaps weights");
  c = separate();
  c.gw.data = reinterpret_cast<float*>(block(4) + 8);
  BWD_FAILS(c, kBad, "grad_gate overlaps grad_weights");
  c = separate();
  c.gu.data = c.dy.data;
  BWD_FAILS(c, kBad, "grad_up overlaps grad_out");
  c = separate();
  c.gu.data = c.x.data;
  BWD_FAILS(c, kBad, "grad_up overlaps gate");
  c = separate();
  c.gu.data = block(1) + 8;
  BWD_FAILS(c, kBad, "grad_up overlaps up");
  c = separate();
  c.gu.data = c.gx.data;
  BWD_FAILS(c, kBad, "grad_up overlaps grad_gate");
  c = separate();
  c.gu.data = block(6);
  BWD_FAILS(c, kBad, "grad_up overlaps weights");
  c = separate();
  c.gw.data = reinterpret_cast<float*>(block(5) + 16);
  BWD_FAILS(c, kBad, "grad_up overlaps grad_weights");
  c = separate();
  c.gw.data = reinterpret_cast<float*>(block(3));
  BWD_FAILS(c, kBad, "grad_weights overlaps grad_out");
  c = separate();
  c.gw.data = reinterpret_cast<float*>(block(0) + 4);
  BWD_FAILS(c, kBad, "grad_weights overlaps gate");
  c = separate();
  c.gw.data = reinterpret_cast<float*>(block(1));
  BWD_FAILS(c, kBad, "grad_weights overlaps up");
  c = separate();
  c.gw.data = c.w.data + 2;
  BWD_FAILS(c, kBad, "grad_weights overlaps weights");
  c = packed();
  c.gw.data = reinterpret_cast<float*>(block(8) + 64);
  BWD_FAILS(c, kBad, "grad_weights overlaps gate_up");
  // Packed: in place only as the exact view.
  c = packed();
  c.gx = c.x;
  c.gx.data = block(8) + 8;
  BWD_FAILS(c, kBad, "grad_gate_up overlaps gate_up");
  // Both in place with gate and up sharing memory: writing one would clobber the other.
  c = separate();
  c.up = c.x;
  c.gx = c.x;
  c.gu = c.up;
  BWD_FAILS(c, kBad, "grad_gate overlaps up");
  // The allowed aliasing: exactly the input.
  c = separate();
  c.gx = c.x;
  c.gu = c.up;
  expect_ok(c.backward(), "separate in place");
  c = packed();
  c.gx = c.x;
  expect_ok(c.backward(), "packed in place");
}

INSTANTIATE_TEST_SUITE_P(All, Errors, testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const testing::TestParamInfo<BackendKind>& i) {
                           return std::string(backend_name(i.param));
                         });

// A CUDA tensor in a build without the CUDA path: well-formed, not supported.
// Fake (never dereferenced) aligned device pointers.
TEST(CpuOnlyBuild, CudaTensorsAreUnsupported) {
  if (expertact::has_cuda()) GTEST_SKIP() << "this build has the CUDA path";
  std::vector<float> host(1024);
  auto m = [&](int blk, int64_t cols) {
    MatrixRef r;
    r.data = host.data() + 64 * blk;
    r.rows = 4;
    r.cols = cols;
    r.row_stride = cols;
    r.device = DeviceType::kCUDA;
    return r;
  };
  VectorRef w;
  w.data = host.data() + 900;
  w.size = 4;
  w.device = DeviceType::kCUDA;
  const GluParams p = preset("swiglu").params;
  const MatrixRef x = m(0, 8), up = m(1, 8), out = m(2, 8), dy = m(3, 8), gx = m(4, 8), gu = m(5, 8);
  for (const auto& [st, name] :
       {std::pair<Status, const char*>{expertact::glu_forward(p, Layout::kSeparate, x, &up, &w, out), "forward"},
        {expertact::glu_backward(p, Layout::kSeparate, dy, x, &up, &w, gx, &gu, nullptr), "backward"}}) {
    EXPECT_EQ(st, Status::kUnsupported) << name;
    const std::string msg = expertact::last_error();
    EXPECT_NE(msg.find("gate is a CUDA tensor"), std::string::npos) << msg;
    EXPECT_NE(msg.find("no CUDA path"), std::string::npos) << msg;
  }
  EXPECT_FALSE(expertact::has_cuda());
}

// Every operand position is still checked after the CUDA entry stopped asking
// twice about one pointer (in place) and about up inside a packed gate_up: host
// memory in any position, in place or not, separate or packed, is refused and
// named.
TEST(CudaBuild, HostMemoryInAnyOperandIsRefused) {
  EAT_REQUIRE_BACKEND(BackendKind::kCuda);
  Backend& be = backend(BackendKind::kCuda);
  DeviceBuffer dev(be, 16 * 1024);
  ASSERT_TRUE(dev.ok());
  std::vector<float> host(16 * 256);
  auto m = [&](bool on_host, int i, int64_t cols) {
    MatrixRef r;
    r.data = on_host ? static_cast<void*>(host.data() + 256 * i) : static_cast<void*>(dev.data() + 1024 * i);
    r.rows = 4;
    r.cols = cols;
    r.row_stride = cols;
    r.device = DeviceType::kCUDA;
    return r;
  };
  auto v = [&](bool on_host, int i) {
    VectorRef r;
    r.data = on_host ? host.data() + 256 * i : reinterpret_cast<float*>(dev.data() + 1024 * i);
    r.size = 4;
    r.device = DeviceType::kCUDA;
    return r;
  };
  const GluParams p = preset("swiglu").params;
  auto expect_refused = [&](Status st, const std::string& name, const std::string& what) {
    EXPECT_EQ(st, Status::kInvalidArgument) << what;
    const std::string msg = expertact::last_error();
    EXPECT_EQ(msg.rfind(name + " (", 0), 0u) << what << ": " << msg;
    EXPECT_NE(msg.find("not CUDA device memory"), std::string::npos) << what << ": " << msg;
    be.finish(what.c_str());
  };
  // Forward, separate and packed: operand k on the host.
  for (int k = 0; k < 4; ++k) {
    const MatrixRef g = m(k == 0, 0, 8), u = m(k == 1, 1, 8), o = m(k == 3, 3, 8);
    const VectorRef w = v(k == 2, 2);
    const char* names[] = {"gate", "up", "weights", "out"};
    expect_refused(expertact::glu_forward(p, Layout::kSeparate, g, &u, &w, o, be.stream()), names[k],
                   std::string("forward separate ") + names[k]);
    if (k == 1) continue;
    const MatrixRef x = m(k == 0, 4, 16);
    expect_refused(expertact::glu_forward(p, Layout::kHalves, x, nullptr, &w, o, be.stream()),
                   k == 0 ? "gate_up" : names[k], std::string("forward packed ") + names[k]);
  }
  // Backward, separate: each of the seven operands; then in place (the input's
  // own view as its gradient) with gate or up on the host.
  const char* bnames[] = {"gate", "up", "weights", "grad_out", "grad_gate", "grad_up", "grad_weights"};
  for (int k = 0; k < 7; ++k) {
    const MatrixRef g = m(k == 0, 0, 8), u = m(k == 1, 1, 8), dy = m(k == 3, 3, 8), gg = m(k == 4, 4, 8),
                    gu = m(k == 5, 5, 8);
    const VectorRef w = v(k == 2, 2), gw = v(k == 6, 6);
    expect_refused(expertact::glu_backward(p, Layout::kSeparate, dy, g, &u, &w, gg, &gu, &gw, be.stream()),
                   bnames[k], std::string("backward separate ") + bnames[k]);
  }
  for (int k = 0; k < 2; ++k) {
    const MatrixRef g = m(k == 0, 0, 8), u = m(k == 1, 1, 8), dy = m(false, 3, 8);
    expect_refused(expertact::glu_backward(p, Layout::kSeparate, dy, g, &u, nullptr, g, &u, nullptr, be.stream()),
                   bnames[k], std::string("backward in place ") + bnames[k]);
  }
  {
    const MatrixRef x = m(true, 0, 16), dy = m(false, 3, 8);
    expect_refused(expertact::glu_backward(p, Layout::kInterleaved, dy, x, nullptr, nullptr, x, nullptr, nullptr,
                                           be.stream()),
                   "gate_up", "backward packed in place gate_up");
    const MatrixRef xd = m(false, 0, 16), gx = m(true, 4, 16);
    expect_refused(expertact::glu_backward(p, Layout::kHalvesUpFirst, dy, xd, nullptr, nullptr, gx, nullptr,
                                           nullptr, be.stream()),
                   "grad_gate_up", "backward packed grad_gate_up");
  }
}

// With the CUDA path and a GPU: host memory passed as a CUDA tensor is refused
// before any kernel can fault, and leaves no CUDA error behind.
TEST(CudaBuild, HostMemoryLabelledCudaIsRefused) {
  EAT_REQUIRE_BACKEND(BackendKind::kCuda);
  Backend& be = backend(BackendKind::kCuda);
  DeviceBuffer dev(be, 4096);
  ASSERT_TRUE(dev.ok());
  std::vector<float> host(64);
  auto m = [&](void* data) {
    MatrixRef r;
    r.data = data;
    r.rows = 4;
    r.cols = 8;
    r.row_stride = 8;
    r.device = DeviceType::kCUDA;
    return r;
  };
  const MatrixRef x = m(host.data()), up = m(dev.data()), out = m(dev.data() + 1024);
  EXPECT_EQ(expertact::glu_forward(preset("swiglu").params, Layout::kSeparate, x, &up, nullptr, out,
                                   be.stream()),
            Status::kInvalidArgument);
  const std::string msg = expertact::last_error();
  EXPECT_NE(msg.find("gate"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not CUDA device memory"), std::string::npos) << msg;
  be.finish("host memory labelled cuda");
}

#if EXPERTACT_WITH_CUDA
// A CUDA build on a machine whose driver cannot serve its runtime (here: none at
// all, as on CI, which builds the CUDA path without a GPU): the first CUDA call
// fails with cudaErrorInsufficientDriver, which must come back as a status whose
// message names the driver the build needs, not a crash or the runtime's generic
// words. The too-old-driver wording (a driver that loads but is older than the
// runtime) shares the branch and cannot be produced on any machine at hand.
TEST(CudaBuild, MissingDriverIsAClearError) {
  int driver = -1;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver != 0)
    GTEST_SKIP() << "a CUDA driver is loaded (it supports CUDA " << driver << ")";
  std::vector<float> host(1024);  // fake CUDA pointers: the call fails before using them
  auto m = [&](int blk) {
    MatrixRef r;
    r.data = host.data() + 64 * blk;
    r.rows = 4;
    r.cols = 8;
    r.row_stride = 8;
    r.device = DeviceType::kCUDA;
    return r;
  };
  const GluParams p = preset("swiglu").params;
  const MatrixRef x = m(0), up = m(1), out = m(2), dy = m(3), gx = m(4), gu = m(5);
  for (const auto& [st, name] :
       {std::pair<Status, const char*>{expertact::glu_forward(p, Layout::kSeparate, x, &up, nullptr, out), "forward"},
        {expertact::glu_backward(p, Layout::kSeparate, dy, x, &up, nullptr, gx, &gu, nullptr), "backward"}}) {
    EXPECT_EQ(st, Status::kCudaError) << name;
    const std::string msg = expertact::last_error();
    EXPECT_NE(msg.find("no NVIDIA driver found"), std::string::npos) << msg;
    EXPECT_NE(msg.find("needs driver >= "), std::string::npos) << msg;
#if CUDART_VERSION >= 13000 && CUDART_VERSION < 14000
    EXPECT_NE(msg.find("needs driver >= 580"), std::string::npos) << msg;  // NVIDIA's R580 for 13.x
#endif
    EXPECT_NE(msg.find("cudaErrorInsufficientDriver"), std::string::npos) << msg;
  }
}
#endif

}  // namespace
}  // namespace eat
