// The C ABI (expertact_c.h): the DLTensor -> expertact_tensor helpers (compact,
// explicit strides, N-D collapsing to rows, byte_offset, vectors, pinned host
// memory), results through the entries against the oracle, descriptions built by
// hand giving the same bits, every refusal of src/c_api.cpp with its message,
// presets by name, and the small query functions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "expertact/expertact_c.h"
#include "support/buffers.h"
#include "support/harness.h"

namespace eat {
namespace {

// One operand: a backend buffer described by an N-D DLTensor whose leading
// dimensions collapse to a [rows, cols] view with row_stride (elements).
struct Operand {
  std::unique_ptr<DeviceBuffer> buf;
  std::vector<int64_t> shape, strides;
  DLTensor t{};
  int64_t rows = 0, cols = 0, row_stride = 0, es = 4;
  uint64_t byte_offset = 0;
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> before;

  // strides empty: compact (strides == NULL).
  void init(Backend& be, DType d, std::vector<int64_t> shp, std::vector<int64_t> str, int64_t rows_,
            int64_t cols_, int64_t rs, uint64_t off, uint8_t fill) {
    dtype = d;
    es = dtype_size(d);
    shape = std::move(shp);
    strides = std::move(str);
    rows = rows_;
    cols = cols_;
    row_stride = rs;
    byte_offset = off;
    const size_t bytes = off + static_cast<size_t>(((rows - 1) * row_stride + cols) * es) + 256;
    buf = std::make_unique<DeviceBuffer>(be, bytes);
    ASSERT_TRUE(buf->ok());
    std::memset(buf->image.data(), fill, bytes);
    t.data = buf->data();
    t.device = be.dl_device();
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dl_of(d);
    t.shape = shape.data();
    t.strides = strides.empty() ? nullptr : strides.data();
    t.byte_offset = off;
  }
  size_t pos(int64_t r, int64_t c) const { return byte_offset + (r * row_stride + c) * es; }
  void put(const std::vector<float>& v) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) store_elem(dtype, &buf->image[pos(r, c)], v[r * cols + c]);
  }
  void upload() {
    before = buf->image;
    buf->upload();
  }
  // Downloads; reports a byte changed outside the view.
  std::vector<float> get(const char* name) {
    buf->download();
    std::vector<uint8_t> mask(before.size(), 0);
    std::vector<float> v(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        std::memset(&mask[pos(r, c)], 1, es);
        v[r * cols + c] = static_cast<float>(load_elem(dtype, &buf->image[pos(r, c)]));
      }
    for (size_t i = 0; i < mask.size(); ++i)
      if (!mask[i] && buf->image[i] != before[i]) {
        ADD_FAILURE() << name << ": byte " << i << " outside the view changed";
        break;
      }
    return v;
  }
};

// The same view described by hand: a matrix, or a vector as the column [rows, 1].
expertact_tensor by_hand(const Operand& o) {
  return expertact_tensor{o.buf->data() + o.byte_offset, o.rows, o.cols, o.row_stride, o.t.dtype, o.t.device};
}

// The helpers' description of an operand's DLTensor, checked field by field against the view.
expertact_tensor described(const Operand& o, bool vector) {
  expertact_tensor d{};
  const expertact_status s =
      vector ? expertact_vector_from_dlpack(&o.t, &d) : expertact_tensor_from_dlpack(&o.t, &d);
  EXPECT_EQ(s, EXPERTACT_OK) << expertact_last_error();
  const expertact_tensor want = by_hand(o);
  EXPECT_EQ(d.data, want.data);
  EXPECT_EQ(d.rows, want.rows);
  EXPECT_EQ(d.cols, want.cols);
  if (want.rows > 1) {
    EXPECT_EQ(d.row_stride, want.row_stride);
  }
  EXPECT_EQ(d.dtype.code, want.dtype.code);
  EXPECT_EQ(d.device.device_type, want.device.device_type);
  return d;
}

// Bit-identical results (NaN payloads included).
void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

using AbiParam = std::tuple<BackendKind, Layout, DType>;

std::string abi_name(const testing::TestParamInfo<AbiParam>& info) {
  const auto& [be, layout, dtype] = info.param;
  return std::string(backend_name(be)) + "_" + layout_name(layout) + "_" + dtype_name(dtype);
}

class CAbiRun : public testing::TestWithParam<AbiParam> {
 protected:
  // B x S = 2 x 3 = 6 rows of F = 12 (C = F or 2F columns of input).
  static constexpr int64_t B = 2, S = 3, R = 6, F = 12;

  void run(bool strided) {
    const auto& [kind, layout, dtype] = GetParam();
    Backend& be = backend(kind);
    const bool sep = is_separate(layout);
    const int64_t C = sep ? F : 2 * F;
    const int64_t es = dtype_size(dtype);
    Case c;
    c.params = preset("swiglu_oai").params;
    c.layout = layout;
    c.dtype = dtype;
    c.rows = R;
    c.F = F;
    c.specials = true;
    c.seed = 3;
    const Inputs in = make_inputs(c);
    const std::vector<float> xv = sep ? in.gate : pack_layout(layout, R, F, in.gate, in.up);
    expertact_params params;
    ASSERT_EQ(expertact_preset("swiglu_oai", NAN, NAN, &params), EXPERTACT_OK);

    Operand x, up, out, dy, gx, gu, w, gw;
    Operand x2, up2, out2, gx2, gu2, gw2;  // the same views, described by hand
    if (!strided) {
      // Compact N-D tensors, strides NULL.
      x.init(be, dtype, {B, S, C}, {}, R, C, C, 0, 0xFF);
      up.init(be, dtype, {B, S, F}, {}, R, F, F, 0, 0xFF);
      out.init(be, dtype, {B, S, F}, {}, R, F, F, 0, kPoisonA);
      dy.init(be, dtype, {B, S, F}, {}, R, F, F, 0, 0xFF);
      gx.init(be, dtype, {B, S, C}, {}, R, C, C, 0, kPoisonA);
      gu.init(be, dtype, {B, S, F}, {}, R, F, F, 0, kPoisonA);
      w.init(be, DType::kFloat32, {B, S}, {}, R, 1, 1, 0, 0xFF);
      gw.init(be, DType::kFloat32, {R}, {}, R, 1, 1, 0, kPoisonA);
      x2.init(be, dtype, {B, S, C}, {}, R, C, C, 0, 0xFF);
      up2.init(be, dtype, {B, S, F}, {}, R, F, F, 0, 0xFF);
      out2.init(be, dtype, {B, S, F}, {}, R, F, F, 0, kPoisonA);
      gx2.init(be, dtype, {B, S, C}, {}, R, C, C, 0, kPoisonA);
      gu2.init(be, dtype, {B, S, F}, {}, R, F, F, 0, kPoisonA);
      gw2.init(be, DType::kFloat32, {R}, {}, R, 1, 1, 0, kPoisonA);
    } else {
      // Column slices of wider matrices, one element of byte_offset (not
      // 16-byte aligned), size-1 dimensions with arbitrary strides,
      // explicit unit strides, strided weights.
      const int64_t W = C + 5;
      x.init(be, dtype, {B, S, C}, {S * W, W, 1}, R, C, W, es, 0xFF);
      up.init(be, dtype, {B, 1, S, F}, {S * (F + 2), 777, F + 2, 1}, R, F, F + 2, 3 * es, 0xFF);
      out.init(be, dtype, {R, F}, {F + 3, 1}, R, F, F + 3, es, kPoisonA);
      dy.init(be, dtype, {B, S, F}, {S * (F + 1), F + 1, 1}, R, F, F + 1, 0, 0xFF);
      gx.init(be, dtype, {1, R, C}, {999, C + 2, 1}, R, C, C + 2, es, kPoisonA);
      gu.init(be, dtype, {R, F}, {F, 1}, R, F, F, 0, kPoisonA);
      w.init(be, DType::kFloat32, {R}, {2}, R, 1, 2, 4, 0xFF);
      gw.init(be, DType::kFloat32, {B, S}, {9, 3}, R, 1, 3, 0, kPoisonA);
      x2.init(be, dtype, {B, S, C}, {S * W, W, 1}, R, C, W, es, 0xFF);
      up2.init(be, dtype, {B, 1, S, F}, {S * (F + 2), 777, F + 2, 1}, R, F, F + 2, 3 * es, 0xFF);
      out2.init(be, dtype, {R, F}, {F + 3, 1}, R, F, F + 3, es, kPoisonA);
      gx2.init(be, dtype, {1, R, C}, {999, C + 2, 1}, R, C, C + 2, es, kPoisonA);
      gu2.init(be, dtype, {R, F}, {F, 1}, R, F, F, 0, kPoisonA);
      gw2.init(be, DType::kFloat32, {B, S}, {9, 3}, R, 1, 3, 0, kPoisonA);
    }
    x.put(xv);
    x2.put(xv);
    up.put(in.up);
    up2.put(in.up);
    dy.put(in.dy);
    w.put(in.w);
    for (Operand* o : {&x, &up, &out, &dy, &gx, &gu, &w, &gw, &x2, &up2, &out2, &gx2, &gu2, &gw2})
      o->upload();

    // Described by the helpers.
    const expertact_tensor dx = described(x, false), dup = described(up, false), ddy = described(dy, false);
    expertact_tensor dout = described(out, false), dgx = described(gx, false), dgu = described(gu, false);
    const expertact_tensor dw = described(w, true);
    expertact_tensor dgw = described(gw, true);
    // Forward.
    ASSERT_EQ(expertact_glu_forward(&params, static_cast<int32_t>(layout), &dx, sep ? &dup : nullptr, &dw, &dout,
                                    be.stream()),
              EXPERTACT_OK)
        << expertact_last_error();
    be.finish("expertact_glu_forward");
    EXPECT_STREQ(expertact_last_error(), "");
    RunResult f;
    f.out = out.get("out");
    // Backward with the weight gradient.
    ASSERT_EQ(expertact_glu_backward(&params, static_cast<int32_t>(layout), &ddy, &dx, sep ? &dup : nullptr, &dw,
                                     &dgx, sep ? &dgu : nullptr, &dgw, be.stream()),
              EXPERTACT_OK)
        << expertact_last_error();
    be.finish("expertact_glu_backward");
    RunResult b;
    if (sep) {
      b.dgate = gx.get("grad_gate");
      b.dup = gu.get("grad_up");
    } else {
      unpack_layout(layout, R, F, gx.get("grad_gate_up"), b.dgate, b.dup);
    }
    b.dw = gw.get("grad_weights");
    for (Operand* o : {&x, &up, &dy, &w}) o->get("input");  // inputs unchanged
    expect_verdict(verify(c, in, WMode::kWeights, &f, &b, oracle_params(c.params)),
                   "C ABI vs oracle");
    // The same views described by hand: bit-identical results.
    {
      const expertact_tensor mx = by_hand(x2), mup = by_hand(up2), mdy = by_hand(dy);
      expertact_tensor mout = by_hand(out2), mgx = by_hand(gx2), mgu = by_hand(gu2);
      const expertact_tensor vw = by_hand(w);
      expertact_tensor vgw = by_hand(gw2);
      ASSERT_EQ(expertact_glu_forward(&params, static_cast<int32_t>(layout), &mx, sep ? &mup : nullptr, &vw, &mout,
                                      be.stream()),
                EXPERTACT_OK)
          << expertact_last_error();
      ASSERT_EQ(expertact_glu_backward(&params, static_cast<int32_t>(layout), &mdy, &mx, sep ? &mup : nullptr,
                                       &vw, &mgx, sep ? &mgu : nullptr, &vgw, be.stream()),
                EXPERTACT_OK)
          << expertact_last_error();
      be.finish("described by hand");
      expect_same_bits(out2.get("out (by hand)"), f.out, "forward by hand vs helpers");
      expect_same_bits(gx2.get("grad_x (by hand)"), gx.get("grad_x"), "backward by hand grad_x");
      if (sep) expect_same_bits(gu2.get("grad_up (by hand)"), gu.get("grad_up"), "backward by hand grad_up");
      expect_same_bits(gw2.get("grad_weights (by hand)"), b.dw, "backward by hand grad_weights");
      // In place: the input's own description as its gradient.
      ASSERT_EQ(expertact_glu_backward(&params, static_cast<int32_t>(layout), &mdy, &mx, sep ? &mup : nullptr,
                                       &vw, const_cast<expertact_tensor*>(&mx),
                                       sep ? const_cast<expertact_tensor*>(&mup) : nullptr, nullptr, be.stream()),
                EXPERTACT_OK)
          << expertact_last_error();
      be.finish("by hand, in place");
    }
    // In place, the helpers' descriptions of the inputs as gradients.
    ASSERT_EQ(expertact_glu_backward(&params, static_cast<int32_t>(layout), &ddy, &dx, sep ? &dup : nullptr, &dw,
                                     const_cast<expertact_tensor*>(&dx),
                                     sep ? const_cast<expertact_tensor*>(&dup) : nullptr, nullptr, be.stream()),
              EXPERTACT_OK)
        << expertact_last_error();
    be.finish("expertact_glu_backward in place");
    RunResult ip;
    if (sep) {
      ip.dgate = x.get("gate (in place)");
      ip.dup = up.get("up (in place)");
    } else {
      unpack_layout(layout, R, F, x.get("gate_up (in place)"), ip.dgate, ip.dup);
    }
    expect_verdict(verify(c, in, WMode::kWeightsNoGrad, nullptr, &ip, oracle_params(c.params)),
                   "C ABI in place vs oracle");
    expect_same_bits(x2.get("x (by hand, in place)"), x.get("x (in place)"), "by hand in place");
    if (sep) expect_same_bits(up2.get("up (by hand, in place)"), up.get("up (in place)"), "by hand in place up");
  }
};

TEST_P(CAbiRun, CompactNdTensors) {
  EAT_REQUIRE_BACKEND(std::get<0>(GetParam()));
  run(false);
}

TEST_P(CAbiRun, StridedSlicesAndByteOffset) {
  EAT_REQUIRE_BACKEND(std::get<0>(GetParam()));
  run(true);
}

INSTANTIATE_TEST_SUITE_P(All, CAbiRun,
                         testing::Combine(testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                                          testing::ValuesIn(all_layouts()),
                                          testing::ValuesIn(all_dtypes())),
                         abi_name);

// Pinned host memory (kDLCUDAHost) is read by the CPU path directly.
TEST(CAbi, CudaHostMemoryIsTreatedAsCpu) {
  std::vector<float> g(24), u(24), o1(24, NAN), o2(24, NAN);
  for (int i = 0; i < 24; ++i) {
    g[i] = 0.5f * (i - 12);
    u[i] = 0.25f * (7 - i);
  }
  int64_t shape[2] = {4, 6};
  auto tensor = [&](float* data, DLDeviceType dev) {
    DLTensor t{};
    t.data = data;
    t.device = DLDevice{dev, 0};
    t.ndim = 2;
    t.dtype = DLDataType{kDLFloat, 32, 1};
    t.shape = shape;
    return t;
  };
  expertact_params p;
  ASSERT_EQ(expertact_preset("swiglu_clamped", NAN, 2.0f, &p), EXPERTACT_OK);
  // A DLTensor's description by the helper (its dtype and device copied as they are).
  auto desc = [&](float* data, DLDeviceType dev) {
    const DLTensor t = tensor(data, dev);
    expertact_tensor d{};
    EXPECT_EQ(expertact_tensor_from_dlpack(&t, &d), EXPERTACT_OK) << expertact_last_error();
    EXPECT_EQ(d.device.device_type, dev);
    return d;
  };
  expertact_tensor gc = desc(g.data(), kDLCPU), uc = desc(u.data(), kDLCPU), oc = desc(o1.data(), kDLCPU);
  expertact_tensor gh = desc(g.data(), kDLCUDAHost), uh = desc(u.data(), kDLCUDAHost),
                   oh = desc(o2.data(), kDLCUDAHost);
  ASSERT_EQ(expertact_glu_forward(&p, EXPERTACT_LAYOUT_SEPARATE, &gc, &uc, nullptr, &oc, nullptr),
            EXPERTACT_OK);
  ASSERT_EQ(expertact_glu_forward(&p, EXPERTACT_LAYOUT_SEPARATE, &gh, &uh, nullptr, &oh, nullptr),
            EXPERTACT_OK)
      << expertact_last_error();
  for (int i = 0; i < 24; ++i) EXPECT_EQ(o1[i], o2[i]) << i;
  EXPECT_FALSE(std::isnan(o2[5]));
  // CPU and pinned host memory mixed: both are the host.
  ASSERT_EQ(expertact_glu_forward(&p, EXPERTACT_LAYOUT_SEPARATE, &gc, &uh, nullptr, &oc, nullptr),
            EXPERTACT_OK)
      << expertact_last_error();
}

// ---- refusals of the C ABI layer

class CAbiErrors : public testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    EAT_REQUIRE_BACKEND(GetParam());
    be_ = &backend(GetParam());
    buf_ = std::make_unique<DeviceBuffer>(*be_, 16 * 1024);
    ASSERT_TRUE(buf_->ok());
    std::memset(buf_->image.data(), 0, buf_->size());
    buf_->upload();
    ASSERT_EQ(expertact_preset("swiglu_oai", NAN, NAN, &params_), EXPERTACT_OK);
  }
  // A compact float32 [4, cols] tensor in 1 KiB block i.
  DLTensor mat(int i, int64_t* shape) const {
    DLTensor t{};
    t.data = buf_->data() + 1024 * i;
    t.device = be_->dl_device();
    t.ndim = 2;
    t.dtype = DLDataType{kDLFloat, 32, 1};
    t.shape = shape;
    return t;
  }
  void expect_fail(expertact_status got, expertact_status want, const std::vector<std::string>& parts,
                   const std::string& what) {
    be_->finish(what.c_str());
    EXPECT_EQ(got, want) << what;
    const std::string msg = expertact_last_error();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << what << ": message \"" << msg << "\" lacks \"" << p << "\"";
  }
  void expect_ok(expertact_status got, const std::string& what) {
    be_->finish(what.c_str());
    EXPECT_EQ(got, EXPERTACT_OK) << what << ": " << expertact_last_error();
  }
  // DLTensors described by the helpers (a null one stays null), then the entry; a helper's
  // refusal is returned as the call's.
  static expertact_status describe(const DLTensor* t, expertact_tensor* d) {
    return t ? expertact_tensor_from_dlpack(t, d) : EXPERTACT_OK;
  }
  static expertact_status describe_vec(const DLTensor* t, expertact_tensor* d) {
    return t ? expertact_vector_from_dlpack(t, d) : EXPERTACT_OK;
  }
  expertact_status fwd(int32_t layout, const DLTensor* x, const DLTensor* up, const DLTensor* w,
                       DLTensor* out, const expertact_params* p = nullptr) {
    expertact_tensor dx{}, du{}, dw{}, dout{};
    expertact_status s = EXPERTACT_OK;
    if ((s = describe(x, &dx)) || (s = describe(up, &du)) || (s = describe_vec(w, &dw)) ||
        (s = describe(out, &dout)))
      return s;
    return expertact_glu_forward(p ? p : &params_, layout, x ? &dx : nullptr, up ? &du : nullptr,
                                 w ? &dw : nullptr, out ? &dout : nullptr, be_->stream());
  }

  Backend* be_ = nullptr;
  std::unique_ptr<DeviceBuffer> buf_;
  expertact_params params_{};
};

TEST_P(CAbiErrors, ArgumentsAndTensors) {
  const expertact_status kBad = EXPERTACT_INVALID_ARGUMENT;
  int64_t s8[2] = {4, 8}, s16[2] = {4, 16};
  DLTensor g = mat(0, s8), u = mat(1, s8), o = mat(2, s8), x = mat(3, s16), w{};
  int64_t s4[1] = {4};
  w = mat(5, s4);
  w.ndim = 1;
  // The baseline succeeds.
  ASSERT_EQ(fwd(EXPERTACT_LAYOUT_SEPARATE, &g, &u, &w, &o), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(fwd(EXPERTACT_LAYOUT_INTERLEAVED, &x, nullptr, &w, &o), EXPERTACT_OK) << expertact_last_error();
  be_->finish("baseline");

  {
    expertact_tensor dg{}, du{}, dout{};
    ASSERT_EQ(describe(&g, &dg) | describe(&u, &du) | describe(&o, &dout), EXPERTACT_OK);
    expect_fail(expertact_glu_forward(nullptr, 0, &dg, &du, nullptr, &dout, nullptr), kBad, {"params is null"},
                "null params");
  }
  for (int32_t l : {-1, 4, 77})
    expect_fail(fwd(l, &g, &u, nullptr, &o), kBad, {"layout " + std::to_string(l)}, "layout");
  expect_fail(fwd(0, nullptr, &u, nullptr, &o), kBad, {"gate is null"}, "null gate");
  expect_fail(fwd(1, nullptr, nullptr, nullptr, &o), kBad, {"gate_up is null"}, "null gate_up");
  expect_fail(fwd(0, &g, &u, nullptr, nullptr), kBad, {"out is null"}, "null out");
  expect_fail(fwd(0, &g, nullptr, nullptr, &o), kBad, {"up is missing"}, "missing up");
  expect_fail(fwd(2, &x, &u, nullptr, &o), kBad, {"up must be null"}, "extra up");
  {  // 0-d: not a matrix (the vector helper takes it as one element)
    DLTensor t = g;
    t.ndim = 0;
    expect_fail(fwd(1, &t, nullptr, nullptr, &o), kBad, {"expertact_tensor_from_dlpack", "0-dimensional"}, "0-d");
  }
  {  // shape null, a null DLTensor, a null out
    DLTensor t = g;
    t.shape = nullptr;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad, {"expertact_tensor_from_dlpack", "shape null"}, "null shape");
    expertact_tensor d{};
    expect_fail(expertact_tensor_from_dlpack(nullptr, &d), kBad, {"the DLTensor is null"}, "null DLTensor");
    expect_fail(expertact_vector_from_dlpack(&w, nullptr), kBad, {"expertact_vector_from_dlpack", "out is null"},
                "null out");
  }
  // dtypes: code / bits / lanes in the message.
  const struct {
    DLDataType dt;
    const char* text;
  } bad_dtypes[] = {{{kDLInt, 32, 1}, "code 0, bits 32, lanes 1"},
                    {{kDLUInt, 8, 1}, "code 1, bits 8, lanes 1"},
                    {{kDLFloat, 8, 1}, "code 2, bits 8, lanes 1"},
                    {{kDLFloat, 16, 2}, "code 2, bits 16, lanes 2"},
                    {{kDLBfloat, 32, 1}, "code 4, bits 32, lanes 1"},
                    {{kDLFloat, 32, 4}, "code 2, bits 32, lanes 4"}};
  for (const auto& bd : bad_dtypes) {
    DLTensor t = u;
    t.dtype = bd.dt;
    expect_fail(fwd(0, &g, &t, nullptr, &o), EXPERTACT_INVALID_DTYPE, {"up has unsupported DLPack dtype", bd.text}, bd.text);
  }
  {  // device type
    DLTensor t = o;
    t.device = DLDevice{kDLOpenCL, 2};
    expect_fail(fwd(0, &g, &u, nullptr, &t), kBad, {"out is on DLPack device type 4", "(id 2)"}, "device");
    t.device = DLDevice{kDLVulkan, 0};
    expect_fail(fwd(0, &g, &u, nullptr, &t), kBad, {"device type 7"}, "device");
  }
  {  // last dimension not contiguous
    int64_t st[2] = {16, 2};
    DLTensor t = g;
    t.strides = st;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad,
                {"expertact_tensor_from_dlpack: the DLTensor has shape [4, 8] and strides (16, 2)",
                 "last dimension must be contiguous"},
                "inner stride");
  }
  {  // leading dimensions that do not collapse: a slice of the middle dimension
    int64_t sh[3] = {2, 2, 8}, st[3] = {40, 8, 1};
    DLTensor t = g;
    t.ndim = 3;
    t.shape = sh;
    t.strides = st;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad,
                {"the DLTensor has shape [2, 2, 8] and strides (40, 8, 1)", "do not collapse"}, "collapse");
  }
  {  // negative dimension
    int64_t sh[2] = {-1, 8};
    DLTensor t = g;
    t.shape = sh;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad, {"the DLTensor has a negative dimension", "[-1, 8]"}, "neg dim");
  }
  {  // negative and zero row strides: no reversed or broadcast rows
    int64_t st[2] = {-8, 1};
    DLTensor t = g;
    t.strides = st;
    t.data = buf_->data() + 1024 * 0 + 3 * 8 * 4;  // the last row first
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad, {"gate.row_stride -8"}, "reversed rows");
    int64_t sh3[3] = {2, 2, 8}, st3[3] = {16, -8, 1};
    DLTensor t3 = t;
    t3.ndim = 3;
    t3.shape = sh3;
    t3.strides = st3;
    t3.data = buf_->data() + 8 * 4;
    expect_fail(fwd(0, &t3, &u, nullptr, &o), kBad, {"do not collapse"}, "reversed middle dimension");
    int64_t st0[2] = {0, 1};
    DLTensor b = o;
    b.strides = st0;
    expect_fail(fwd(0, &g, &u, nullptr, &b), kBad, {"out.row_stride 0"}, "broadcast rows");
  }
  {  // byte_offset that breaks element alignment
    DLTensor t = g;
    t.byte_offset = 2;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad, {"gate.data", "not aligned"}, "byte_offset");
  }
  // Weights.
  {
    DLTensor t = w;
    t.dtype = DLDataType{kDLFloat, 16, 1};
    expect_fail(fwd(0, &g, &u, &t, &o), EXPERTACT_INVALID_DTYPE, {"weights must be float32", "code 2, bits 16, lanes 1"},
                "weights dtype");
    int64_t sh[2] = {2, 2}, st[2] = {5, 1};
    DLTensor v = w;
    v.ndim = 2;
    v.shape = sh;
    v.strides = st;
    expect_fail(fwd(0, &g, &u, &v, &o), kBad,
                {"expertact_vector_from_dlpack: the DLTensor has shape [2, 2] and strides (5, 1)", "do not collapse"},
                "weights collapse");
    int64_t shn[1] = {-4};
    DLTensor n = w;
    n.shape = shn;
    expect_fail(fwd(0, &g, &u, &n, &o), kBad, {"expertact_vector_from_dlpack", "negative dimension"},
                "weights neg dim");
    int64_t sh3[1] = {3};
    DLTensor m = w;
    m.shape = sh3;
    expect_fail(fwd(0, &g, &u, &m, &o), kBad, {"weights has 3 elements", "4 rows"}, "weights size");
    DLTensor d = w;
    d.device = DLDevice{kDLMetal, 0};
    expect_fail(fwd(0, &g, &u, &d, &o), kBad, {"weights is on DLPack device type 8"}, "weights device");
    // A [4, 1] and a [1, 4] weight tensor are fine.
    int64_t sh41[2] = {4, 1}, sh14[2] = {1, 4};
    DLTensor c41 = w;
    c41.ndim = 2;
    c41.shape = sh41;
    EXPECT_EQ(fwd(0, &g, &u, &c41, &o), EXPERTACT_OK) << expertact_last_error();
    DLTensor c14 = c41;
    c14.shape = sh14;
    EXPECT_EQ(fwd(0, &g, &u, &c14, &o), EXPERTACT_OK) << expertact_last_error();
  }
  // Shape errors travel up from the C++ layer.
  {
    int64_t sh[2] = {4, 7};
    DLTensor t = o;
    t.shape = sh;
    expect_fail(fwd(0, &g, &u, nullptr, &t), kBad, {"out has shape [4, 7]", "[4, 8]"}, "out shape");
    expect_fail(fwd(1, &g, nullptr, nullptr, &o), kBad, {"out has shape [4, 8]", "[4, 4]"}, "packed out");
  }
  be_->finish("errors");
}

TEST_P(CAbiErrors, BackwardArguments) {
  const expertact_status kBad = EXPERTACT_INVALID_ARGUMENT;
  int64_t s8[2] = {4, 8}, s16[2] = {4, 16}, s4[1] = {4};
  DLTensor g = mat(0, s8), u = mat(1, s8), dy = mat(2, s8), gg = mat(3, s8), gu = mat(4, s8);
  DLTensor x = mat(5, s16), gx = mat(6, s16);
  DLTensor w = mat(7, s4), gw = mat(8, s4);
  w.ndim = gw.ndim = 1;
  // The same DLTensor as an input and its gradient gets the same description (in place).
  auto bwd = [&](int32_t l, DLTensor* dyp, DLTensor* xp, DLTensor* up, DLTensor* wp, DLTensor* gxp,
                 DLTensor* gup, DLTensor* gwp) {
    expertact_tensor ddy{}, dx{}, du{}, dw{}, dgx{}, dgu{}, dgw{};
    expertact_status st = EXPERTACT_OK;
    if ((st = describe(dyp, &ddy)) || (st = describe(xp, &dx)) || (st = describe(up, &du)) || (st = describe_vec(wp, &dw)) ||
        (st = describe(gxp, &dgx)) || (st = describe(gup, &dgu)) || (st = describe_vec(gwp, &dgw)))
      return st;
    expertact_tensor* gx_d = gxp == nullptr ? nullptr : gxp == xp ? &dx : &dgx;
    expertact_tensor* gu_d = gup == nullptr ? nullptr : gup == up ? &du : &dgu;
    return expertact_glu_backward(&params_, l, dyp ? &ddy : nullptr, xp ? &dx : nullptr, up ? &du : nullptr,
                                  wp ? &dw : nullptr, gx_d, gu_d, gwp ? &dgw : nullptr, be_->stream());
  };
  ASSERT_EQ(bwd(0, &dy, &g, &u, &w, &gg, &gu, &gw), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(bwd(3, &dy, &x, nullptr, &w, &gx, nullptr, &gw), EXPERTACT_OK) << expertact_last_error();
  be_->finish("baseline");
  {
    expertact_tensor d[5]{};
    ASSERT_EQ(describe(&dy, &d[0]) | describe(&g, &d[1]) | describe(&u, &d[2]) | describe(&gg, &d[3]) |
                  describe(&gu, &d[4]),
              EXPERTACT_OK);
    expect_fail(expertact_glu_backward(nullptr, 0, &d[0], &d[1], &d[2], nullptr, &d[3], &d[4], nullptr, nullptr),
                kBad, {"params is null"}, "params");
  }
  expect_fail(bwd(5, &dy, &g, &u, nullptr, &gg, &gu, nullptr), kBad, {"layout 5"}, "layout");
  expect_fail(bwd(0, nullptr, &g, &u, nullptr, &gg, &gu, nullptr), kBad, {"grad_out is null"}, "grad_out");
  expect_fail(bwd(0, &dy, &g, nullptr, nullptr, &gg, &gu, nullptr), kBad, {"up is missing"}, "up");
  expect_fail(bwd(0, &dy, &g, &u, nullptr, &gg, nullptr, nullptr), kBad, {"grad_up is missing"}, "grad_up");
  expect_fail(bwd(1, &dy, &x, &u, nullptr, &gx, nullptr, nullptr), kBad, {"up and grad_up must be null"},
              "packed up");
  expect_fail(bwd(1, &dy, &x, nullptr, nullptr, &gx, &gu, nullptr), kBad, {"up and grad_up must be null"},
              "packed grad_up");
  expect_fail(bwd(0, &dy, &g, &u, nullptr, nullptr, &gu, nullptr), kBad, {"grad_gate is null"}, "grad_gate");
  expect_fail(bwd(2, &dy, &x, nullptr, nullptr, nullptr, nullptr, nullptr), kBad, {"grad_gate_up is null"},
              "grad_gate_up");
  expect_fail(bwd(0, &dy, &g, &u, nullptr, &gg, &gu, &gw), kBad, {"grad_weights is given but weights is null"},
              "grad_weights without weights");
  DLTensor bad = gw;
  bad.dtype = DLDataType{kDLBfloat, 16, 1};
  expect_fail(bwd(0, &dy, &g, &u, &w, &gg, &gu, &bad), EXPERTACT_INVALID_DTYPE, {"grad_weights must be float32"}, "gw dtype");
  DLTensor bad2 = gu;
  bad2.dtype = DLDataType{kDLFloat, 16, 1};
  expect_fail(bwd(0, &dy, &g, &u, &w, &gg, &bad2, nullptr), EXPERTACT_INVALID_DTYPE, {"grad_up.dtype is float16"}, "gu dtype");
  // In place through the C ABI: the input's own description as its gradient.
  EXPECT_EQ(bwd(0, &dy, &g, &u, &w, &g, &u, &gw), EXPERTACT_OK) << expertact_last_error();
  EXPECT_EQ(bwd(1, &dy, &x, nullptr, &w, &x, nullptr, nullptr), EXPERTACT_OK) << expertact_last_error();
  // A gradient that overlaps its input without being it.
  DLTensor shifted = x;
  shifted.byte_offset = 4;
  expect_fail(bwd(1, &dy, &x, nullptr, &w, &shifted, nullptr, nullptr), kBad,
              {"grad_gate_up overlaps gate_up"}, "partial in place");
  be_->finish("errors");
}

// Descriptions built by hand: the checks of the entries themselves.
TEST_P(CAbiErrors, Descriptions) {
  const expertact_status kBad = EXPERTACT_INVALID_ARGUMENT;
  const DLDataType f32{kDLFloat, 32, 1};
  const DLDevice dev = be_->dl_device();
  auto m = [&](int i, int64_t rows, int64_t cols) {
    return expertact_tensor{buf_->data() + 1024 * i, rows, cols, cols, f32, dev};
  };
  expertact_tensor g = m(0, 4, 8), u = m(1, 4, 8), o = m(2, 4, 8), x = m(3, 4, 16);
  expertact_tensor dy = m(4, 4, 8), gg = m(5, 4, 8), gu = m(6, 4, 8), gx = m(7, 4, 16);
  expertact_tensor w{buf_->data() + 1024 * 8, 4, 1, 1, f32, dev}, gw{buf_->data() + 1024 * 9, 4, 1, 1, f32, dev};
  auto fwd = [&](int32_t l, const expertact_tensor* xp, const expertact_tensor* up, const expertact_tensor* wp,
                 expertact_tensor* op) {
    return expertact_glu_forward(&params_, l, xp, up, wp, op, be_->stream());
  };
  auto bwd = [&](int32_t l, const expertact_tensor* xp, const expertact_tensor* up, expertact_tensor* gxp,
                 expertact_tensor* gup, expertact_tensor* gwp) {
    return expertact_glu_backward(&params_, l, &dy, xp, up, &w, gxp, gup, gwp, be_->stream());
  };
  ASSERT_EQ(fwd(0, &g, &u, &w, &o), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(fwd(3, &x, nullptr, &w, &o), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(bwd(0, &g, &u, &gg, &gu, &gw), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(bwd(1, &x, nullptr, &gx, nullptr, &gw), EXPERTACT_OK) << expertact_last_error();
  be_->finish("baseline");

  expect_fail(expertact_glu_forward(nullptr, 0, &g, &u, nullptr, &o, nullptr), kBad, {"params is null"},
              "null params");
  expect_fail(fwd(9, &g, &u, nullptr, &o), kBad, {"layout 9"}, "layout");
  expect_fail(fwd(0, nullptr, &u, nullptr, &o), kBad, {"gate is null"}, "null gate");
  expect_fail(fwd(0, &g, nullptr, nullptr, &o), kBad, {"up is missing"}, "missing up");
  expect_fail(fwd(1, &x, &u, nullptr, &o), kBad, {"up must be null"}, "extra up");
  expect_fail(fwd(0, &g, &u, nullptr, nullptr), kBad, {"out is null"}, "null out");
  {
    expertact_tensor t = u;
    t.dtype = DLDataType{kDLInt, 16, 1};
    expect_fail(fwd(0, &g, &t, nullptr, &o), EXPERTACT_INVALID_DTYPE, {"up has unsupported DLPack dtype", "code 0, bits 16, lanes 1"},
                "dtype");
    t = o;
    t.device = DLDevice{kDLOpenCL, 2};
    expect_fail(fwd(0, &g, &u, nullptr, &t), kBad, {"out is on DLPack device type 4", "(id 2)"}, "device");
    t = g;
    t.rows = -1;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad, {"gate has a negative size"}, "negative rows");
    t = g;
    t.row_stride = 4;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad, {"gate.row_stride 4 is smaller than its row length 8"},
                "overlapping rows");
    t = g;
    t.data = buf_->data() + 2;
    expect_fail(fwd(0, &t, &u, nullptr, &o), kBad, {"gate.data", "not aligned"}, "misaligned");
    t = u;
    t.cols = 9;
    t.row_stride = 9;
    expect_fail(fwd(0, &g, &t, nullptr, &o), kBad, {"up has shape [4, 9]", "[4, 8]"}, "shape");
    t = x;
    t.cols = 15;
    t.row_stride = 16;
    expect_fail(fwd(3, &t, nullptr, nullptr, &o), kBad, {"gate_up's last dimension is 15", "odd"}, "odd");
  }
  {  // one row: its stride is never read, so any value is accepted
    expertact_tensor g1 = g, u1 = u, o1 = o;
    g1.rows = u1.rows = o1.rows = 1;
    g1.row_stride = 0;
    u1.row_stride = -3;
    expect_ok(fwd(0, &g1, &u1, nullptr, &o1), "one row");
  }
  {  // weights
    expertact_tensor t = w;
    t.dtype = DLDataType{kDLFloat, 16, 1};
    expect_fail(fwd(0, &g, &u, &t, &o), EXPERTACT_INVALID_DTYPE, {"weights must be float32", "code 2, bits 16, lanes 1"},
                "weights dtype");
    t = w;
    t.rows = 3;
    expect_fail(fwd(0, &g, &u, &t, &o), kBad, {"weights has 3 elements", "4 rows"}, "weights size");
    t = w;
    t.row_stride = 0;
    expect_fail(fwd(0, &g, &u, &t, &o), kBad, {"weights.stride is 0"}, "weights stride");
    t = w;
    t.rows = 2;
    t.cols = 2;
    expect_fail(fwd(0, &g, &u, &t, &o), kBad, {"weights has shape [2, 2]", "column [n, 1] or a row [1, n]"},
                "weights not a vector");
    t = w;
    t.cols = -1;
    expect_fail(fwd(0, &g, &u, &t, &o), kBad, {"weights has a negative size"}, "weights negative");
    t = w;  // a row [1, 4]: contiguous, its row_stride not read
    t.rows = 1;
    t.cols = 4;
    t.row_stride = -7;
    expect_ok(fwd(0, &g, &u, &t, &o), "weights as a row");
    t = w;  // a strided column: every second float of block 8
    t.rows = 4;
    t.row_stride = 2;
    expect_ok(fwd(0, &g, &u, &t, &o), "strided weights");
    t = w;
    t.device = DLDevice{kDLMetal, 0};
    expect_fail(fwd(0, &g, &u, &t, &o), kBad, {"weights is on DLPack device type 8"}, "weights device");
  }
  // Backward.
  expect_fail(bwd(0, &g, &u, &gg, nullptr, nullptr), kBad, {"grad_up is missing"}, "grad_up");
  expect_fail(bwd(2, &x, nullptr, nullptr, nullptr, nullptr), kBad, {"grad_gate_up is null"}, "grad_gate_up");
  {
    expertact_tensor t = gw;
    t.dtype = DLDataType{kDLBfloat, 16, 1};
    expect_fail(bwd(0, &g, &u, &gg, &gu, &t), EXPERTACT_INVALID_DTYPE, {"grad_weights must be float32"}, "gw dtype");
  }
  // In place (the input's own description), and a partial overlap that is refused.
  expect_ok(bwd(0, &g, &u, &g, &u, &gw), "in place separate");
  expect_ok(bwd(3, &x, nullptr, &x, nullptr, nullptr), "in place packed");
  expertact_tensor shifted = x;
  shifted.data = static_cast<char*>(x.data) + 4;
  expect_fail(bwd(1, &x, nullptr, &shifted, nullptr, nullptr), kBad, {"grad_gate_up overlaps gate_up"},
              "partial in place");
  be_->finish("errors");
}

INSTANTIATE_TEST_SUITE_P(All, CAbiErrors, testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const testing::TestParamInfo<BackendKind>& i) {
                           return std::string(backend_name(i.param));
                         });

// A CUDA DLTensor in a build without CUDA: kUnsupported (fake, never-read pointers).
TEST(CAbi, CudaTensorInCpuOnlyBuild) {
  if (expertact_has_cuda()) GTEST_SKIP() << "this build has the CUDA path";
  std::vector<float> mem(256);
  int64_t shape[2] = {4, 16};
  DLTensor x{}, o{};
  x.data = mem.data();
  x.device = DLDevice{kDLCUDA, 0};
  x.ndim = 2;
  x.dtype = DLDataType{kDLFloat, 32, 1};
  x.shape = shape;
  o = x;
  int64_t oshape[2] = {4, 8};
  o.shape = oshape;
  o.data = mem.data() + 128;
  expertact_tensor dx{}, dout{};
  ASSERT_EQ(expertact_tensor_from_dlpack(&x, &dx), EXPERTACT_OK);  // the helper reads no memory
  ASSERT_EQ(expertact_tensor_from_dlpack(&o, &dout), EXPERTACT_OK);
  expertact_params p;
  ASSERT_EQ(expertact_preset("swiglu", NAN, NAN, &p), EXPERTACT_OK);
  EXPECT_EQ(expertact_glu_forward(&p, EXPERTACT_LAYOUT_HALVES, &dx, nullptr, nullptr, &dout, nullptr),
            EXPERTACT_UNSUPPORTED);
  EXPECT_NE(std::string(expertact_last_error()).find("no CUDA path"), std::string::npos)
      << expertact_last_error();
}

// ---- the DLTensor helpers' descriptions

DLTensor dl(void* data, std::vector<int64_t>& shape, std::vector<int64_t>* strides, uint64_t offset = 0) {
  DLTensor t{};
  t.data = data;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = DLDataType{kDLBfloat, 16, 1};
  t.shape = shape.data();
  t.strides = strides ? strides->data() : nullptr;
  t.byte_offset = offset;
  return t;
}

TEST(CAbiHelpers, MatrixDescriptions) {
  alignas(16) static char mem[64];
  struct Want {
    std::vector<int64_t> shape, strides;  // strides empty: NULL
    uint64_t offset;
    int64_t rows, cols, row_stride;
  };
  const Want cases[] = {
      {{2, 3, 8}, {}, 0, 6, 8, 8},                 // compact N-D
      {{8}, {}, 0, 1, 8, 8},                       // one row
      {{4, 8}, {20, 1}, 6, 4, 8, 20},              // a column slice of a wider matrix, byte_offset
      {{2, 1, 3, 8}, {72, 5, 24, 1}, 0, 6, 8, 24}, // size-1 dims carry any stride
      {{3, 1}, {7, 3}, 0, 3, 1, 7},                // one column: its stride is not read
      {{0, 8}, {3, 1}, 0, 0, 8, 8},                // empty
      {{5, 0}, {}, 0, 5, 0, 0},
  };
  for (const Want& w : cases) {
    std::vector<int64_t> shape = w.shape, strides = w.strides;
    const DLTensor t = dl(mem, shape, strides.empty() ? nullptr : &strides, w.offset);
    expertact_tensor d{};
    ASSERT_EQ(expertact_tensor_from_dlpack(&t, &d), EXPERTACT_OK) << expertact_last_error();
    EXPECT_EQ(d.data, mem + w.offset);
    EXPECT_EQ(d.rows, w.rows);
    EXPECT_EQ(d.cols, w.cols);
    EXPECT_EQ(d.row_stride, w.row_stride) << d.rows << "x" << d.cols;
    EXPECT_EQ(d.dtype.code, kDLBfloat);
    EXPECT_EQ(d.dtype.bits, 16);
  }
}

TEST(CAbiHelpers, VectorDescriptions) {
  alignas(16) static float mem[64];
  struct Want {
    std::vector<int64_t> shape, strides;
    int64_t rows, row_stride;
  };
  const Want cases[] = {
      {{6}, {}, 6, 1},          {{2, 3}, {}, 6, 1},     {{6}, {4}, 6, 4},  {{2, 3}, {9, 3}, 6, 3},
      {{4, 1}, {1, 99}, 4, 1},  {{}, {}, 1, 1},         {{1}, {5}, 1, 1},  {{0}, {}, 0, 1},
      {{3}, {-2}, 3, -2},
  };
  for (const Want& w : cases) {
    std::vector<int64_t> shape = w.shape, strides = w.strides;
    const DLTensor t = dl(mem, shape, strides.empty() ? nullptr : &strides);
    expertact_tensor d{};
    ASSERT_EQ(expertact_vector_from_dlpack(&t, &d), EXPERTACT_OK) << expertact_last_error();
    EXPECT_EQ(d.rows, w.rows);
    EXPECT_EQ(d.cols, 1);
    EXPECT_EQ(d.row_stride, w.row_stride);
  }
  // Reversed elements reach the entry, whose checks take a negative stride for weights.
}

// ---- presets by name, errors, queries

TEST(CAbi, PresetsByName) {
  expertact_params p{};
  const float inf = std::numeric_limits<float>::infinity();
  ASSERT_EQ(expertact_preset("swiglu", NAN, NAN, &p), EXPERTACT_OK);
  EXPECT_EQ(p.act, EXPERTACT_ACT_SILU);
  EXPECT_EQ(p.alpha, 1.0f);
  EXPECT_EQ(p.limit, inf);
  EXPECT_EQ(p.beta, 0.0f);
  // swiglu takes neither alpha nor limit.
  ASSERT_EQ(expertact_preset("swiglu", 2.0f, 3.0f, &p), EXPERTACT_OK);
  EXPECT_EQ(p.alpha, 1.0f);
  EXPECT_EQ(p.limit, inf);
  ASSERT_EQ(expertact_preset("swiglu_clamped", NAN, NAN, &p), EXPERTACT_OK);
  EXPECT_EQ(p.act, EXPERTACT_ACT_SILU);
  EXPECT_EQ(p.alpha, 1.0f);
  EXPECT_EQ(p.limit, 7.0f);
  EXPECT_EQ(p.beta, 0.0f);
  ASSERT_EQ(expertact_preset("swiglu_clamped", NAN, 10.0f, &p), EXPERTACT_OK);
  EXPECT_EQ(p.limit, 10.0f);
  EXPECT_EQ(p.alpha, 1.0f);
  ASSERT_EQ(expertact_preset("swiglu_oai", NAN, NAN, &p), EXPERTACT_OK);
  EXPECT_EQ(p.act, EXPERTACT_ACT_SILU);
  EXPECT_EQ(p.alpha, 1.702f);
  EXPECT_EQ(p.limit, 7.0f);
  EXPECT_EQ(p.beta, 1.0f);
  ASSERT_EQ(expertact_preset("swiglu_oai", 1.5f, 8.0f, &p), EXPERTACT_OK);
  EXPECT_EQ(p.alpha, 1.5f);
  EXPECT_EQ(p.limit, 8.0f);
  EXPECT_EQ(p.beta, 1.0f);
  ASSERT_EQ(expertact_preset("geglu_tanh", 3.0f, 3.0f, &p), EXPERTACT_OK);
  EXPECT_EQ(p.act, EXPERTACT_ACT_GELU_TANH);
  EXPECT_EQ(p.limit, inf);
  EXPECT_EQ(p.beta, 0.0f);
  // Refusals.
  EXPECT_EQ(expertact_preset("swiglu_foo", NAN, NAN, &p), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("unknown preset 'swiglu_foo'"), std::string::npos)
      << expertact_last_error();
  EXPECT_EQ(expertact_preset("", NAN, NAN, &p), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_EQ(expertact_preset(nullptr, NAN, NAN, &p), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("preset name is null"), std::string::npos);
  EXPECT_EQ(expertact_preset("swiglu", NAN, NAN, nullptr), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("out (params) is null"), std::string::npos);
  // A preset with an invalid limit is refused where it is used, naming it.
  ASSERT_EQ(expertact_preset("swiglu_clamped", NAN, -1.0f, &p), EXPERTACT_OK);
  std::vector<float> mem(64);
  const DLDataType f32{kDLFloat, 32, 1};
  const expertact_tensor t{mem.data(), 2, 8, 8, f32, DLDevice{kDLCPU, 0}};
  expertact_tensor o{mem.data() + 32, 2, 4, 4, f32, DLDevice{kDLCPU, 0}};
  EXPECT_EQ(expertact_glu_forward(&p, EXPERTACT_LAYOUT_HALVES, &t, nullptr, nullptr, &o, nullptr),
            EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("params.limit must be > 0 or +inf (got -1)"),
            std::string::npos)
      << expertact_last_error();
}

TEST(CAbi, LastErrorIsClearedBySuccess) {
  expertact_params p{};
  EXPECT_EQ(expertact_preset("nope", NAN, NAN, &p), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_STRNE(expertact_last_error(), "");
  // The C++ API shares the message.
  EXPECT_STREQ(expertact::last_error(), expertact_last_error());
  EXPECT_EQ(expertact_preset("swiglu", NAN, NAN, &p), EXPERTACT_OK);
  EXPECT_STREQ(expertact_last_error(), "");
  // A failing then a succeeding compute call.
  std::vector<float> mem(64, 1.0f);
  const DLDataType f32{kDLFloat, 32, 1};
  const expertact_tensor x{mem.data(), 2, 8, 8, f32, DLDevice{kDLCPU, 0}};
  expertact_tensor o{mem.data() + 32, 2, 4, 4, f32, DLDevice{kDLCPU, 0}};
  EXPECT_EQ(expertact_glu_forward(&p, 9, &x, nullptr, nullptr, &o, nullptr), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_STRNE(expertact_last_error(), "");
  EXPECT_EQ(expertact_glu_forward(&p, EXPERTACT_LAYOUT_HALVES, &x, nullptr, nullptr, &o, nullptr),
            EXPERTACT_OK);
  EXPECT_STREQ(expertact_last_error(), "");
  EXPECT_STREQ(expertact::last_error(), "");
}

TEST(CAbi, Queries) {
  EXPECT_EQ(expertact_abi_version(), EXPERTACT_ABI_VERSION);
  EXPECT_EQ(expertact_abi_version(), 5);  // 2: dtype error status; 3: biases, FP8; 4: expertact_tensor; 5: FP8 tiles
  EXPECT_EQ(expertact_has_cuda(), EXPERTACT_WITH_CUDA ? 1 : 0);
  EXPECT_EQ(expertact::has_cuda(), EXPERTACT_WITH_CUDA != 0);
  expertact_set_cpu_threads(3);
  EXPECT_EQ(expertact_cpu_threads(), 3);
  EXPECT_EQ(expertact::cpu_threads(), 3);
  expertact_set_cpu_threads(0);
  EXPECT_GE(expertact_cpu_threads(), 1);
  const std::string isa = expertact_cpu_kernel_isa();
  EXPECT_TRUE(isa == "baseline" || isa == "avx2+fma+f16c") << isa;
  // Status and layout values are the C++ enums'.
  EXPECT_EQ(EXPERTACT_INVALID_ARGUMENT, static_cast<int>(Status::kInvalidArgument));
  EXPECT_EQ(EXPERTACT_UNSUPPORTED, static_cast<int>(Status::kUnsupported));
  EXPECT_EQ(EXPERTACT_CUDA_ERROR, static_cast<int>(Status::kCudaError));
  EXPECT_EQ(EXPERTACT_INTERNAL, static_cast<int>(Status::kInternal));
  EXPECT_EQ(EXPERTACT_LAYOUT_HALVES_UP_FIRST, static_cast<int>(Layout::kHalvesUpFirst));
  EXPECT_EQ(EXPERTACT_LAYOUT_INTERLEAVED, static_cast<int>(Layout::kInterleaved));
  EXPECT_EQ(EXPERTACT_ACT_GELU_TANH, static_cast<int>(expertact::Activation::kGeluTanh));
}

}  // namespace
}  // namespace eat
