// The experimental fused grouped GEMMs (expertact/experimental/fused_gemm.h) on a
// Hopper GPU against float64 references: odd expert sizes (empty experts, one row),
// D and F not multiples of the 128 x 256 x 64 tile, padding rows past the last offset,
// every activation form, with and without weights, in place and not. Skips without a
// GPU, without a Hopper GPU, or in a build without CUTLASS.
//
// Tolerances (each a window a wrong kernel cannot reach: a wrong row, expert, column
// pair or a dropped K block moves values by O(1) of their size):
// - gate_up: the exact dot product rounded once to bfloat16, within a float32
//   accumulation bound n 2^-22 sum |a b| (4x the textbook n 2^-24: the tensor cores'
//   adder keeps a little less than float32);
// - h: the oracle of the activation (tests/cpp/support/oracle.h) evaluated on the
//   kernel's own gate_up values, as the unfused path would read them back;
// - dgate_up, grad_weights: the oracle with the exact dh, plus the kernel's rounding of
//   dh to bfloat16 (half an ulp) and its accumulation bound, propagated linearly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "expertact/experimental/fused_gemm.h"
#include "support/harness.h"

namespace eat {
namespace {

namespace fused = expertact::experimental;

using expertact::MatrixRef;
using expertact::VectorRef;

constexpr DType kBf16 = DType::kBFloat16;

struct MoeCase {
  std::string preset;
  std::vector<int> counts;  // rows per expert
  int64_t pad = 0;          // rows past the last offset
  int64_t D = 0, F = 0;
  bool weights = false, inplace = false;
  bool specials = false;  // NaN and +inf in a few rows of x and dy
  // h and grad_gate_up with 2 more elements per row: row strides not multiples of 4, so the
  // epilogues take their 2- and 4-byte paths instead of the 8-byte ones (the gap columns
  // must stay untouched).
  bool padded = false;
};

std::string case_name(const testing::TestParamInfo<MoeCase>& info) {
  const MoeCase& c = info.param;
  std::string s = c.preset + "_E" + std::to_string(c.counts.size()) + "_D" + std::to_string(c.D) +
                  "_F" + std::to_string(c.F) + (c.weights ? "_w" : "") + (c.inplace ? "_inplace" : "") +
                  (c.specials ? "_nan" : "") + (c.padded ? "_padded" : "");
  return s + "_" + std::to_string(info.index);
}

// Host values exact in bfloat16, drawn as scale * N(0, 1).
std::vector<float> draw(std::mt19937_64& rng, size_t n, double scale) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(round_to(kBf16, scale * nd(rng)));
  return v;
}

std::vector<uint8_t> to_bf16_image(const std::vector<float>& v) {
  std::vector<uint8_t> img(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) store_elem(kBf16, &img[2 * i], v[i]);
  return img;
}

struct Buf {
  DeviceBuffer b;
  Buf(Backend& be, size_t bytes) : b(be, bytes < 256 ? 256 : bytes) {}
  void put(const std::vector<uint8_t>& img) {
    std::memcpy(b.image.data(), img.data(), img.size());
    b.upload();
  }
  void poison() { b.backend().fill(b.data(), kPoisonA, b.size()); }
  double bf16(size_t i) const { return load_elem(kBf16, &b.image[2 * i]); }
  float f32(size_t i) const {
    float v;
    std::memcpy(&v, &b.image[4 * i], 4);
    return v;
  }
  uint16_t bits16(size_t i) const { return static_cast<uint16_t>(b.image[2 * i] | (b.image[2 * i + 1] << 8)); }
};

MatrixRef mat(Buf& b, int64_t rows, int64_t cols, DType d = kBf16, int64_t row_stride = 0) {
  MatrixRef m;
  m.data = b.b.data();
  m.rows = rows;
  m.cols = cols;
  m.row_stride = row_stride > 0 ? row_stride : cols;
  m.dtype = d;
  m.device = expertact::DeviceType::kCUDA;
  m.device_id = b.b.backend().device_id();
  return m;
}

VectorRef vec(Buf& b, int64_t n) {
  VectorRef v;
  v.data = reinterpret_cast<float*>(b.b.data());
  v.size = n;
  v.device = expertact::DeviceType::kCUDA;
  v.device_id = b.b.backend().device_id();
  return v;
}

class MoeFused : public testing::TestWithParam<MoeCase> {};

TEST_P(MoeFused, MatchesFloat64References) {
  EAT_REQUIRE_BACKEND(BackendKind::kCuda);
  if (!fused::has_fused_gemm()) GTEST_SKIP() << "built without the fused GEMMs (no CUTLASS)";
  const MoeCase& mc = GetParam();
  Backend& be = backend(BackendKind::kCuda);
  const GluParams params = preset(mc.preset).params;
  const OracleParams op = oracle_params(params);
  const int E = static_cast<int>(mc.counts.size());
  const int64_t D = mc.D, F = mc.F, N2 = 2 * F;
  std::vector<int32_t> offsets(E);
  int64_t end = 0;
  for (int e = 0; e < E; ++e) offsets[e] = static_cast<int32_t>(end += mc.counts[e]);
  const int64_t T = end + mc.pad;
  // The exact dot product of two D-vectors (float64 holds every bf16 product exactly) and
  // the sum of its terms' magnitudes (the scale of a float32 accumulation's error).
  auto dot = [&](const float* a, const float* b) {
    double s = 0, sa = 0;
    for (int64_t k = 0; k < D; ++k) {
      const double p = double(a[k]) * b[k];
      s += p;
      sa += std::fabs(p);
    }
    return std::pair<double, double>(s, sa);
  };
  auto expert_of = [&](int64_t r) {
    int e = 0;
    while (offsets[e] <= r) ++e;
    return e;
  };

  std::mt19937_64 rng(1234 + D * 7 + F * 13 + E);
  // gate_up ~ 4 N(0, 1): most clamped forms see values past limit 7 in every row.
  auto x = draw(rng, T * D, 1.0);
  const auto w13 = draw(rng, E * N2 * D, 4.0 / std::sqrt(double(D)));
  auto dy = draw(rng, T * D, 1.0);
  const auto w2 = draw(rng, E * F * D, 1.0 / std::sqrt(double(D)));
  if (mc.specials && end > 6) {
    // NaN propagates through the GEMM to whole rows of gate_up and h; an infinity gives
    // +-inf or NaN (inf - inf) per column: the references compute the same in float64.
    x[2 * D + D / 2] = std::numeric_limits<float>::quiet_NaN();
    x[5 * D + 1] = std::numeric_limits<float>::infinity();
    dy[3 * D + D - 1] = std::numeric_limits<float>::quiet_NaN();
  }
  std::vector<float> wts(T);
  for (auto& v : wts) v = static_cast<float>(std::uniform_real_distribution<double>(0.1, 1.0)(rng));

  const int64_t ldh = mc.padded ? F + 2 : F;
  const int64_t ldo = mc.padded && !mc.inplace ? N2 + 2 : N2;  // grad_gate_up's row stride
  Buf bx(be, T * D * 2), bw13(be, E * N2 * D * 2), bgu(be, T * N2 * 2), bh(be, T * ldh * 2);
  Buf bdy(be, T * D * 2), bw2(be, E * F * D * 2), bdgu(be, T * ldo * 2), bw(be, T * 4),
      bdw(be, T * 4), boff(be, E * 4);
  bx.put(to_bf16_image(x));
  bw13.put(to_bf16_image(w13));
  bdy.put(to_bf16_image(dy));
  bw2.put(to_bf16_image(w2));
  std::memcpy(bw.b.image.data(), wts.data(), T * 4);
  bw.b.upload();
  std::memcpy(boff.b.image.data(), offsets.data(), E * 4);
  boff.b.upload();
  bgu.poison();
  bh.poison();
  bdgu.poison();
  bdw.poison();

  VectorRef vw = vec(bw, T), vdw = vec(bdw, T);
  const int32_t* offs = reinterpret_cast<const int32_t*>(boff.b.data());
  Status st = fused::moe_fused_forward(params, mat(bx, T, D), mat(bw13, E * N2, D), E, offs,
                                       mc.weights ? &vw : nullptr, mat(bgu, T, N2),
                                       mat(bh, T, F, kBf16, ldh), be.stream());
  be.finish("moe_fused_forward");
  if (st == Status::kUnsupported) GTEST_SKIP() << expertact::last_error();
  ASSERT_EQ(st, Status::kOk) << expertact::last_error();
  bgu.b.download();
  bh.b.download();

  // gate_up against the exact GEMM; h against the oracle on the kernel's gate_up.
  Tally t_gu("gate_up", kBf16, 1.0), t_h("h", kBf16, kOracleK);
  for (int64_t r = 0; r < end; ++r) {
    const int e = expert_of(r);
    for (int64_t j = 0; j < N2; ++j) {
      const auto [s, sa] = dot(&x[r * D], &w13[(e * N2 + j) * D]);
      t_gu.check(r, j, bgu.bf16(r * N2 + j), Ref{s, D * std::ldexp(sa, -22)});
    }
    for (int64_t f = 0; f < F; ++f) {
      const float g = static_cast<float>(bgu.bf16(r * N2 + 2 * f));
      const float u = static_cast<float>(bgu.bf16(r * N2 + 2 * f + 1));
      Ref want;
      oracle_forward_row(op, &g, &u, mc.weights ? wts[r] : 1.0, 1, &want);
      t_h.check(r, f, bh.bf16(r * ldh + f), want);
    }
  }
  EXPECT_TRUE(t_gu.ok()) << t_gu.report();
  EXPECT_TRUE(t_h.ok()) << t_h.report();
  // Padding rows are neither read nor written: still the poison.
  int64_t touched = 0;
  for (int64_t i = end * N2; i < T * N2; ++i) touched += bgu.bits16(i) != 0xFFFF;
  for (int64_t i = end * ldh; i < T * ldh; ++i) touched += bh.bits16(i) != 0xFFFF;
  EXPECT_EQ(touched, 0) << "padding rows past the last offset were written";
  for (int64_t r = 0; r < end; ++r)
    for (int64_t f = F; f < ldh; ++f) EXPECT_EQ(bh.bits16(r * ldh + f), 0xFFFF) << "h gap, row " << r;

  // Backward. gate_up as the forward left it (in place: overwritten by its gradient).
  std::vector<double> gu_host(T * N2);
  for (int64_t i = 0; i < T * N2; ++i) gu_host[i] = bgu.bf16(i);
  Buf& out = mc.inplace ? bgu : bdgu;
  const int64_t ld_out = mc.inplace ? N2 : ldo;
  st = fused::moe_fused_backward(params, mat(bdy, T, D), mat(bw2, E * F, D), E, offs,
                                 mat(bgu, T, N2), mc.weights ? &vw : nullptr,
                                 mat(out, T, N2, kBf16, ld_out), mc.weights ? &vdw : nullptr,
                                 be.stream());
  be.finish("moe_fused_backward");
  ASSERT_EQ(st, Status::kOk) << expertact::last_error();
  out.b.download();
  bdw.b.download();
  Tally t_dg("grad_gate", kBf16, kOracleK), t_du("grad_up", kBf16, kOracleK),
      t_dw("grad_weights", DType::kFloat32, kOracleK);
  for (int64_t r = 0; r < end; ++r) {
    const int e = expert_of(r);
    const double wt = mc.weights ? wts[r] : 1.0;
    double dw_v = 0, dw_e = 0;
    for (int64_t f = 0; f < F; ++f) {
      const std::pair<double, double> d = dot(&dy[r * D], &w2[(e * F + f) * D]);
      const double s = d.first, sa = d.second;  // named: the lambda below captures them
      // The kernel's dh: s rounded to bfloat16 after a float32 accumulation.
      const double dh_err = 0.5 * ulp_of(kBf16, s) + D * std::ldexp(sa, -22);
      const float g = static_cast<float>(gu_host[r * N2 + 2 * f]);
      const float u = static_cast<float>(gu_host[r * N2 + 2 * f + 1]);
      const float dhf = static_cast<float>(s), one = 1.0f;
      Ref dg, du, term, dg1, du1, term1;
      oracle_backward_row(op, &g, &u, &dhf, wt, 1, &dg, &du, &term);
      oracle_backward_row(op, &g, &u, &one, wt, 1, &dg1, &du1, &term1);  // d/d(dh), linear
      // The oracle took dh as the float s; its own exact value differs from s by < 2^-24 |s|.
      auto widen = [&](Ref& ref, const Ref& slope) {
        if (!ref.exact) ref.e += std::fabs(slope.v) * (dh_err + std::ldexp(std::fabs(s), -24));
      };
      widen(dg, dg1);
      widen(du, du1);
      t_dg.check(r, f, out.bf16(r * ld_out + 2 * f), dg);
      t_du.check(r, f, out.bf16(r * ld_out + 2 * f + 1), du);
      dw_v += term.v;
      dw_e += term.e + std::fabs(term1.v) * (dh_err + std::ldexp(std::fabs(s), -24)) +
              F * std::ldexp(std::fabs(term.v), -24);
    }
    if (mc.weights) t_dw.check(r, 0, bdw.f32(r), Ref{dw_v, dw_e});
  }
  EXPECT_TRUE(t_dg.ok()) << t_dg.report();
  EXPECT_TRUE(t_du.ok()) << t_du.report();
  EXPECT_TRUE(t_dw.ok()) << t_dw.report();
  touched = 0;
  for (int64_t i = end * ld_out; i < T * ld_out; ++i) touched += out.bits16(i) != 0xFFFF;
  EXPECT_EQ(touched, 0) << "padding rows of grad_gate_up were written";
  for (int64_t r = 0; r < end; ++r)
    for (int64_t j = N2; j < ld_out; ++j)
      EXPECT_EQ(out.bits16(r * ld_out + j), 0xFFFF) << "grad_gate_up gap, row " << r;
  if (mc.weights) {
    for (int64_t r = end; r < T; ++r) EXPECT_EQ(bdw.f32(r), 0.0f) << "grad_weights row " << r;
  }
}

// Tile 128 x 256 x 64: D = 200 is 3 K blocks + 8, 2F = 360 one N tile + 104, F = 180 (the
// backward's N) under one tile; D = 64, F = 256: exact tiles; D = 8, F = 4: one tiny block.
std::vector<MoeCase> moe_cases() {
  std::vector<MoeCase> v;
  const std::vector<int> odd = {37, 0, 129, 1, 200};
  for (const char* p : {"swiglu", "swiglu_clamped7", "swiglu_oai", "geglu_tanh", "silu_general"}) {
    v.push_back({p, odd, 3, 200, 180, false, false, true});
    v.push_back({p, odd, 3, 200, 180, true, true});
  }
  v.push_back({"swiglu_oai", {0, 0, 300}, 0, 64, 256, true, false});
  v.push_back({"geglu_tanh", {0, 300, 0}, 5, 64, 256, false, true});
  v.push_back({"swiglu_oai", {1}, 0, 8, 4, true, true});
  v.push_back({"swiglu", {0, 0}, 4, 16, 8, true, false});  // every expert empty
  v.push_back({"swiglu_oai", odd, 3, 200, 180, true, false, true, true});  // 2- and 4-byte paths
  v.push_back({"swiglu_clamped7", odd, 3, 64, 256, false, false, false, true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(All, MoeFused, testing::ValuesIn(moe_cases()), case_name);

}  // namespace
}  // namespace eat
