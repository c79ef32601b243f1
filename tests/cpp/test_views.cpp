// Views: row-strided inputs and outputs, pointers one element past 16-byte
// alignment, gate and up as the two halves of one buffer, a single row with
// row_stride 0, strided and reversed weights, empty problems, row offsets
// past 2^31 elements, and (with two GPUs) a tensor on a non-current device.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>

#include "support/harness.h"

namespace eat {
namespace {

using expertact::DeviceType;
using expertact::MatrixRef;
using expertact::VectorRef;

using ViewParam = std::tuple<BackendKind, Layout, DType>;

std::string view_name(const testing::TestParamInfo<ViewParam>& info) {
  const auto& [be, layout, dtype] = info.param;
  return std::string(backend_name(be)) + "_" + layout_name(layout) + "_" + dtype_name(dtype);
}

class Views : public testing::TestWithParam<ViewParam> {
 protected:
  Case base(int64_t rows, int64_t F) const {
    Case c;
    c.params = preset("swiglu_oai").params;
    c.layout = std::get<1>(GetParam());
    c.dtype = std::get<2>(GetParam());
    c.rows = rows;
    c.F = F;
    c.seed = 31;
    return c;
  }
  BackendKind kind() const { return std::get<0>(GetParam()); }
};

// Row strides larger than the row (a column slice of a wider matrix); the
// gap after every output row must be left as it was.
TEST_P(Views, RowStrided) {
  EAT_REQUIRE_BACKEND(kind());
  for (int64_t F : {9, 64}) {
    Case c = base(17, F);
    c.x_extra = 5;
    c.out_extra = 3;
    c.dy_extra = 7;
    c.specials = true;
    check_case_all_modes(kind(), c);
  }
}

// Every pointer one element past a 256-byte boundary: aligned to its element,
// not to 16 bytes (the vector paths must not be taken blindly).
TEST_P(Views, OffsetByOneElement) {
  EAT_REQUIRE_BACKEND(kind());
  for (int64_t F : {8, 9, 64, 1408}) {
    Case c = base(5, F);
    c.offset = 1;
    check_case_all_modes(kind(), c);
  }
  // Odd strides too: every row starts at a different alignment.
  Case c = base(9, 16);
  c.offset = 1;
  c.x_extra = 1;
  c.out_extra = 3;
  c.dy_extra = 1;
  check_case_all_modes(kind(), c);
}

// Separate gate and up taken as the two halves of one [rows, 2F] buffer
// (also in place: both gradients then written into that buffer).
TEST_P(Views, GateAndUpHalvesOfOneBuffer) {
  EAT_REQUIRE_BACKEND(kind());
  if (std::get<1>(GetParam()) != Layout::kSeparate) GTEST_SKIP() << "separate layout only";
  for (int64_t extra : {0, 3}) {
    Case c = base(17, 12);
    c.shared_gate_up = true;
    c.x_extra = extra;
    c.offset = extra;
    check_case_all_modes(kind(), c);
  }
}

TEST_P(Views, SingleRowWithRowStrideZero) {
  EAT_REQUIRE_BACKEND(kind());
  Case c = base(1, 33);
  c.zero_stride_single_row = true;
  check_case_all_modes(kind(), c);
}

// Weights and their gradient with strides 3 / 2, reversed (-2 / -1), and
// stride 0 for a single row. Elements between them must not be touched.
TEST_P(Views, StridedWeights) {
  EAT_REQUIRE_BACKEND(kind());
  const struct {
    int64_t rows, ws, gws;
  } cases[] = {{17, 3, 2}, {17, -2, -1}, {1, 0, 0}};
  for (const auto& s : cases) {
    Case c = base(s.rows, 12);
    c.w_stride = s.ws;
    c.gw_stride = s.gws;
    check_case(kind(), c, Plan{WMode::kWeights, true, true, InPlace::kGate});
    check_case(kind(), c, Plan{WMode::kWeightsNoGrad, true, true, InPlace::kNo});
  }
}

INSTANTIATE_TEST_SUITE_P(All, Views,
                         testing::Combine(testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                                          testing::ValuesIn(all_layouts()),
                                          testing::ValuesIn(all_dtypes())),
                         view_name);

// ---- empty problems

class Empty : public testing::TestWithParam<BackendKind> {};

MatrixRef mat(void* data, int64_t rows, int64_t cols, int64_t stride, DType d, const Backend& be) {
  MatrixRef m;
  m.data = data;
  m.rows = rows;
  m.cols = cols;
  m.row_stride = stride;
  m.dtype = d;
  m.device = be.device();
  m.device_id = be.device_id();
  return m;
}

VectorRef vec(float* data, int64_t n, int64_t stride, const Backend& be) {
  VectorRef v;
  v.data = data;
  v.size = n;
  v.stride = stride;
  v.device = be.device();
  v.device_id = be.device_id();
  return v;
}

// rows 0 or F 0: valid no-ops, null data allowed.
TEST_P(Empty, NullDataIsFine) {
  const BackendKind kind = GetParam();
  EAT_REQUIRE_BACKEND(kind);
  Backend& be = backend(kind);
  const GluParams p = preset("swiglu_oai").params;
  const DType d = DType::kBFloat16;
  for (Layout layout : all_layouts()) {
    SCOPED_TRACE(layout_name(layout));
    const bool sep = is_separate(layout);
    for (auto [rows, F] : {std::pair<int64_t, int64_t>{0, 8}, {0, 0}, {5, 0}}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " F " + std::to_string(F));
      const int64_t xc = sep ? F : 2 * F;
      const MatrixRef x = mat(nullptr, rows, xc, xc, d, be);
      const MatrixRef up = mat(nullptr, rows, F, F, d, be);
      const MatrixRef out = mat(nullptr, rows, F, F, d, be);
      EXPECT_EQ(expertact::glu_forward(p, layout, x, sep ? &up : nullptr, nullptr, out, be.stream()),
                Status::kOk)
          << expertact::last_error();
      be.finish("glu_forward");
      EXPECT_STREQ(expertact::last_error(), "");
      const MatrixRef gx = mat(nullptr, rows, xc, xc, d, be);
      const MatrixRef gu = mat(nullptr, rows, F, F, d, be);
      EXPECT_EQ(expertact::glu_backward(p, layout, out, x, sep ? &up : nullptr, nullptr, gx,
                                        sep ? &gu : nullptr, nullptr, be.stream()),
                Status::kOk)
          << expertact::last_error();
      be.finish("glu_backward");
      if (rows == 0) {
        // Empty weights and weight gradient, null too.
        const VectorRef w = vec(nullptr, 0, 1, be);
        const VectorRef gw = vec(nullptr, 0, 1, be);
        EXPECT_EQ(expertact::glu_backward(p, layout, out, x, sep ? &up : nullptr, &w, gx,
                                          sep ? &gu : nullptr, &gw, be.stream()),
                  Status::kOk)
            << expertact::last_error();
        be.finish("glu_backward");
      }
    }
  }
}

// F == 0 with rows > 0: the weight gradient is a sum over nothing, written as
// zeros (and only at its strided positions).
TEST_P(Empty, ZeroWidthRowsGiveZeroWeightGradients) {
  const BackendKind kind = GetParam();
  EAT_REQUIRE_BACKEND(kind);
  Backend& be = backend(kind);
  const int64_t rows = 5;
  for (Layout layout : all_layouts()) {
    SCOPED_TRACE(layout_name(layout));
    const bool sep = is_separate(layout);
    DeviceBuffer wbuf(be, rows * 4), gwbuf(be, 2 * rows * 4);
    ASSERT_TRUE(wbuf.ok() && gwbuf.ok());
    for (int64_t r = 0; r < rows; ++r) store_elem(DType::kFloat32, &wbuf.image[r * 4], 0.5 + r);
    std::memset(gwbuf.image.data(), 0xFF, gwbuf.size());
    wbuf.upload();
    gwbuf.upload();
    const MatrixRef x = mat(nullptr, rows, 0, 0, DType::kFloat16, be);
    const VectorRef w = vec(reinterpret_cast<float*>(wbuf.data()), rows, 1, be);
    const VectorRef gw = vec(reinterpret_cast<float*>(gwbuf.data()), rows, 2, be);
    ASSERT_EQ(expertact::glu_backward(preset("swiglu").params, layout, x, x, sep ? &x : nullptr, &w,
                                      x, sep ? &x : nullptr, &gw, be.stream()),
              Status::kOk)
        << expertact::last_error();
    be.finish("glu_backward");
    gwbuf.download();
    for (int64_t i = 0; i < 2 * rows; ++i) {
      const uint32_t bits = *reinterpret_cast<const uint32_t*>(&gwbuf.image[i * 4]);
      if (i % 2 == 0) {
        EXPECT_EQ(bits, 0u) << "grad_weights[" << i / 2 << "] must be +0";
      } else {
        EXPECT_EQ(bits, 0xFFFFFFFFu) << "element " << i << " between strided entries was written";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, Empty, testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const testing::TestParamInfo<BackendKind>& i) {
                           return std::string(backend_name(i.param));
                         });

// ---- 64-bit row offsets

// A region of `bytes` addressable bytes of which only a few pages are touched:
// on the CPU an anonymous MAP_NORESERVE mapping, on a GPU one cudaMalloc.
class SparseRegion {
 public:
  SparseRegion(Backend& be, size_t bytes) : be_(be), bytes_(bytes) {
    if (be.device() == DeviceType::kCPU) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      ptr_ = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
      mapped_ = ptr_ != nullptr;
    } else {
      ptr_ = static_cast<char*>(be.alloc(bytes));
    }
  }
  ~SparseRegion() {
    if (!ptr_) return;
    if (mapped_) {
      munmap(ptr_, bytes_);
    } else {
      be_.release(ptr_);
    }
  }
  char* data() const { return ptr_; }

 private:
  Backend& be_;
  size_t bytes_;
  char* ptr_ = nullptr;
  bool mapped_ = false;
};

class LargeOffsets : public testing::TestWithParam<BackendKind> {};

// row_stride = 2^31 + 64 elements and 3 rows: rows 1 and 2 start past 2^31
// and 2^32 elements (8.6 GB of addresses for 2-byte dtypes, 17 GB for
// float32), none of it allocated except the pages the rows touch. Every
// operand is a view with that stride into the one region: per row period,
// columns [0, 16) the input, [16, 32) its gradient, [32, 40) grad_out,
// [40, 48) out, [48, 64) an untouched sentinel.
TEST_P(LargeOffsets, RowOffsetsPast2To31Elements) {
  const BackendKind kind = GetParam();
  EAT_REQUIRE_BACKEND(kind);
  Backend& be = backend(kind);
  const int64_t S = (int64_t{1} << 31) + 64;
  const int64_t R = 3, F = 8, kChunk = 64;
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    const int64_t es = dtype_size(dtype);
    const size_t bytes = static_cast<size_t>(((R - 1) * S + kChunk) * es);
    SparseRegion region(be, bytes);
    if (!region.data()) GTEST_SKIP() << "could not reserve " << bytes << " bytes of address space";
    for (Layout layout : all_layouts()) {
      SCOPED_TRACE(std::string(layout_name(layout)) + " " + dtype_name(dtype));
      const bool sep = is_separate(layout);
      Case c;
      c.params = preset("swiglu_oai").params;
      c.layout = layout;
      c.dtype = dtype;
      c.rows = R;
      c.F = F;
      c.specials = true;
      c.seed = 77;
      const Inputs in = make_inputs(c);
      const OracleParams op = oracle_params(c.params);
      auto at = [&](int64_t col) {
        return mat(region.data() + col * es, R, 0, S, dtype, be);
      };
      // Host images of the row chunks.
      std::vector<std::vector<uint8_t>> chunk(R, std::vector<uint8_t>(kChunk * es, 0xFF));
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < F; ++j) {
          const float g = in.gate[r * F + j], u = in.up[r * F + j];
          int64_t gc = j, uc = F + j;  // separate / halves
          if (layout == Layout::kHalvesUpFirst) std::swap(gc, uc);
          if (layout == Layout::kInterleaved) {
            gc = 2 * j;
            uc = 2 * j + 1;
          }
          store_elem(dtype, &chunk[r][gc * es], g);
          store_elem(dtype, &chunk[r][uc * es], u);
          store_elem(dtype, &chunk[r][(32 + j) * es], in.dy[r * F + j]);
        }
      auto upload = [&] {
        for (int64_t r = 0; r < R; ++r) be.upload(region.data() + r * S * es, chunk[r].data(), kChunk * es);
      };
      auto download = [&] {
        std::vector<std::vector<uint8_t>> got(R, std::vector<uint8_t>(kChunk * es));
        for (int64_t r = 0; r < R; ++r) be.download(got[r].data(), region.data() + r * S * es, kChunk * es);
        return got;
      };
      // Reads the gate/up gradient pair of a packed or separate chunk at column base.
      auto read_grads = [&](const std::vector<std::vector<uint8_t>>& got, int64_t base, RunResult& res) {
        res.dgate.assign(R * F, 0);
        res.dup.assign(R * F, 0);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < F; ++j) {
            int64_t gc = j, uc = F + j;
            if (layout == Layout::kHalvesUpFirst) std::swap(gc, uc);
            if (layout == Layout::kInterleaved) {
              gc = 2 * j;
              uc = 2 * j + 1;
            }
            res.dgate[r * F + j] = static_cast<float>(load_elem(dtype, &got[r][(base + gc) * es]));
            res.dup[r * F + j] = static_cast<float>(load_elem(dtype, &got[r][(base + uc) * es]));
          }
      };
      auto expect_untouched = [&](const std::vector<std::vector<uint8_t>>& got,
                                  const std::vector<std::vector<uint8_t>>& want, int64_t from,
                                  int64_t to, const char* what) {
        for (int64_t r = 0; r < R; ++r)
          EXPECT_EQ(std::memcmp(&got[r][from * es], &want[r][from * es], (to - from) * es), 0)
              << what << " of row " << r << " changed";
      };
      // Weights: an ordinary buffer.
      DeviceBuffer wbuf(be, R * 4), gwbuf(be, R * 4);
      ASSERT_TRUE(wbuf.ok() && gwbuf.ok());
      for (int64_t r = 0; r < R; ++r) store_elem(DType::kFloat32, &wbuf.image[r * 4], in.w[r]);
      wbuf.upload();
      const VectorRef w = vec(reinterpret_cast<float*>(wbuf.data()), R, 1, be);
      const VectorRef gw = vec(reinterpret_cast<float*>(gwbuf.data()), R, 1, be);

      MatrixRef x = at(0), up = at(F), gx = at(16), gu = at(16 + F), dy = at(32), out = at(40);
      x.cols = sep ? F : 2 * F;
      up.cols = F;
      gx.cols = x.cols;
      gu.cols = F;
      dy.cols = F;
      out.cols = F;

      // Forward.
      upload();
      ASSERT_EQ(expertact::glu_forward(c.params, layout, x, sep ? &up : nullptr, &w, out, be.stream()),
                Status::kOk)
          << expertact::last_error();
      be.finish("glu_forward");
      auto got = download();
      RunResult f;
      f.out.resize(R * F);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < F; ++j)
          f.out[r * F + j] = static_cast<float>(load_elem(dtype, &got[r][(40 + j) * es]));
      expect_untouched(got, chunk, 0, 40, "input, gradient or grad_out columns");
      expect_untouched(got, chunk, 48, kChunk, "sentinel");

      // Backward, out of place, with the weight gradient.
      upload();
      ASSERT_EQ(expertact::glu_backward(c.params, layout, dy, x, sep ? &up : nullptr, &w, gx,
                                        sep ? &gu : nullptr, &gw, be.stream()),
                Status::kOk)
          << expertact::last_error();
      be.finish("glu_backward");
      got = download();
      RunResult b;
      read_grads(got, 16, b);
      gwbuf.download();
      b.dw.resize(R);
      for (int64_t r = 0; r < R; ++r) b.dw[r] = static_cast<float>(load_elem(DType::kFloat32, &gwbuf.image[r * 4]));
      expect_untouched(got, chunk, 0, 16, "input columns");
      expect_untouched(got, chunk, 32, kChunk, "grad_out, out or sentinel columns");
      expect_verdict(verify(c, in, WMode::kWeights, &f, &b, op), "64-bit offsets vs oracle");

      // In place: the gradient over the input.
      upload();
      ASSERT_EQ(expertact::glu_backward(c.params, layout, dy, x, sep ? &up : nullptr, &w, x,
                                        sep ? &up : nullptr, nullptr, be.stream()),
                Status::kOk)
          << expertact::last_error();
      be.finish("glu_backward in place");
      got = download();
      RunResult ip;
      read_grads(got, 0, ip);
      expect_untouched(got, chunk, 16, kChunk, "columns after the input");
      expect_verdict(verify(c, in, WMode::kWeightsNoGrad, nullptr, &ip, op),
                     "64-bit offsets in place vs oracle");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, LargeOffsets, testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const testing::TestParamInfo<BackendKind>& i) {
                           return std::string(backend_name(i.param));
                         });

// ---- a tensor on a device that is not the current one

TEST(OtherDevice, UsesTheTensorsDevice) {
  EAT_REQUIRE_BACKEND(BackendKind::kCudaOther);
  for (Layout layout : all_layouts()) {
    Case c;
    c.params = preset("swiglu_oai").params;
    c.layout = layout;
    c.dtype = DType::kBFloat16;
    c.rows = 17;
    c.F = 100;
    check_case_all_modes(BackendKind::kCudaOther, c);
  }
}

}  // namespace
}  // namespace eat
