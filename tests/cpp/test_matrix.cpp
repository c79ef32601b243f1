// Coverage matrix (every combination, so that no pair of options goes untested):
// every preset x layout x dtype at a few sizes, forward / backward / in-place
// backward, with and without weights; then every size of the boundary list, on
// each layout and dtype, for a clamped preset with an offset (swiglu_oai) and an
// unclamped one (geglu_tanh).
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "support/harness.h"

namespace eat {
namespace {

using MatrixParam = std::tuple<BackendKind, int, Layout, DType>;

std::string matrix_name(const testing::TestParamInfo<MatrixParam>& info) {
  const auto& [be, pi, layout, dtype] = info.param;
  return std::string(backend_name(be)) + "_" + presets()[pi].name + "_" + layout_name(layout) + "_" +
         dtype_name(dtype);
}

class PresetMatrix : public testing::TestWithParam<MatrixParam> {};

// Sizes: one element past a vector width (F 7, rows 1), a medium odd F with
// specials in every fourth row, a typical expert width with few rows, and a
// long odd row with few rows (on the GPU: realigned 16-byte accesses, each row
// split over several blocks, in place).
TEST_P(PresetMatrix, ForwardBackwardInPlace) {
  const auto& [kind, pi, layout, dtype] = GetParam();
  EAT_REQUIRE_BACKEND(kind);
  const struct {
    int64_t rows, F;
    bool specials;
  } sizes[] = {{1, 7, false}, {17, 100, true}, {3, 1408, false}, {3, 11001, false}};
  for (const auto& s : sizes) {
    Case c;
    c.params = presets()[pi].params;
    c.layout = layout;
    c.dtype = dtype;
    c.rows = s.rows;
    c.F = s.F;
    c.specials = s.specials;
    c.seed = 1000 + pi;
    check_case_all_modes(kind, c);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, PresetMatrix,
    testing::Combine(testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                     testing::Range(0, 7), testing::ValuesIn(all_layouts()),
                     testing::ValuesIn(all_dtypes())),
    matrix_name);

// ---- every boundary size

using SizeParam = std::tuple<BackendKind, const char*, Layout, DType>;

std::string size_name(const testing::TestParamInfo<SizeParam>& info) {
  const auto& [be, preset_name, layout, dtype] = info.param;
  return std::string(backend_name(be)) + "_" + preset_name + "_" + layout_name(layout) + "_" +
         dtype_name(dtype);
}

class SizeSweep : public testing::TestWithParam<SizeParam> {};

// F in {0, 1, 7, 8, 9, 12, 100, 1408, 3072} x rows in {0, 1, 17, 4097} where
// rows * F stays under ~0.5M elements (the float64 oracle is the cost), plus
// F 11008 and 14336 at 1 and 3 rows, and more than 65535 rows (a CUDA grid's
// y/z limit) at small F.
TEST_P(SizeSweep, AllSizes) {
  const auto& [kind, preset_name, layout, dtype] = GetParam();
  EAT_REQUIRE_BACKEND(kind);
  std::vector<std::pair<int64_t, int64_t>> sizes;
  for (int64_t rows : {0, 1, 17, 4097})
    for (int64_t F : {0, 1, 7, 8, 9, 12, 100, 1408, 3072})
      if (rows * F <= 600000) sizes.emplace_back(rows, F);
  for (int64_t F : {11008, 14336})
    for (int64_t rows : {1, 3}) sizes.emplace_back(rows, F);
  if (std::string(preset_name) == "swiglu_oai") {
    sizes.emplace_back(65537, 1);
    sizes.emplace_back(70001, 8);
  }
  for (const auto& [rows, F] : sizes) {
    Case c;
    c.params = preset(preset_name).params;
    c.layout = layout;
    c.dtype = dtype;
    c.rows = rows;
    c.F = F;
    c.seed = 7;
    // Forward with weights, backward with weights and their gradient; the
    // in-place and unweighted runs (same kernels otherwise) where cheaper.
    const bool big = rows * F > 100000;
    check_case(kind, c, Plan{WMode::kWeights, true, true, big ? InPlace::kNo : InPlace::kAll});
    if (rows * F <= 20000) check_case(kind, c, Plan{WMode::kNone, true, true, InPlace::kNo});
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SizeSweep,
    testing::Combine(testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                     testing::Values("swiglu_oai", "geglu_tanh"), testing::ValuesIn(all_layouts()),
                     testing::ValuesIn(all_dtypes())),
    size_name);

}  // namespace
}  // namespace eat
