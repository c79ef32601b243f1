// The FP8 blockwise grouped GEMM's device-side builder (src/cuda/gemm/fp8_gemm_args.cuh,
// build_expert) run on the host, over the CUTLASS types the kernel reads: every slot's problem
// shape, pointers and strides, and every scale the mainloop would load for a tile, found through
// CuTe's own local_tile of the scale layouts the builder wrote, as the mainloop tiles them
// (TileShape 128 x 128 x 128), with the bound that masks the rows past a group's end. Host code
// only (CuTe layouts are plain arithmetic): built when the CUTLASS headers are, runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/gemm/fp8_gemm_args.cuh"

namespace {

using namespace cute;
namespace fg = expertact::fp8gemm;
using expertact::GemmGrouping;
using ArgsM = fg::GroupArgs<fg::ScalesM::LayoutSFA, fg::ScalesM::LayoutSFB>;
using ArgsK = fg::GroupArgs<fg::ScalesK::LayoutSFA, fg::ScalesK::LayoutSFB>;
using Tile = Shape<_128, _128, _128>;

// Host arrays for E slots and a GroupArgs over them.
template <class Args>
struct HostArgs {
  std::vector<char> mem;
  Args a;
  explicit HostArgs(int64_t E) : mem(Args::bytes(E) + 256) {
    char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(mem.data()) + 255) / 256 * 256);
    a = Args::carve(base, E);
  }
};

// Runs the builder for every expert, in reverse order (each expert's step must not depend on
// another's having run).
template <class Args>
void build(const fg::Problem& p, const std::vector<int32_t>& offs, const Args& a) {
  for (int64_t e = p.E - 1; e >= 0; --e) fg::build_expert(p, offs.data(), e, a);
}

// The scales the mainloop's scale loads read for tile (t, kt) of one group (SFA: m tile t, or
// SFB: n tile t): element [r][c] of the tile's view as an element offset from the group's scale
// pointer, and whether the load's bound lets row r in (CUTLASS's load_auxiliary predicate:
// the coordinate elem_less than the layout's shape).
template <class Layout>
void check_tiles(const Layout& layout, int64_t mn, int64_t k, const float* base, const float* group_ptr,
                 int64_t (*want)(int64_t, int64_t), const char* what) {
  using X = Underscore;
  Tensor m = make_tensor(group_ptr, layout);
  Tensor g = local_tile(m, Tile{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK, BLK_K, tiles, k tiles, l)
  Tensor id = make_identity_tensor(shape(layout));
  Tensor c = local_tile(id, Tile{}, make_coord(_, _, _), Step<_1, X, _1>{});
  const int64_t tiles = fg::ceil_div(mn, 128), ktiles = fg::ceil_div(k, 128);
  ASSERT_EQ(size<2>(g), tiles) << what;
  ASSERT_EQ(size<3>(g), ktiles) << what;
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      for (int r = 0; r < 128; ++r) {
        const int64_t row = t * 128 + r;
        const bool inside = elem_less(c(r, 0, t, kt, 0), shape(layout));
        EXPECT_EQ(inside, row < mn) << what << " tile " << t << ", k tile " << kt << ", row " << r;
        if (!inside) continue;
        for (int col : {0, 1, 77, 127}) {  // one scale over the tile's 128 K elements
          const float* p = &g(r, col, t, kt, 0);
          ASSERT_EQ(p - base, want(row, kt)) << what << " tile " << t << ", k tile " << kt << ", row " << r
                                             << ", col " << col;
        }
      }
    }
  }
}

TEST(Fp8GemmArgs, MGroupedSlotsAndScales) {
  // Experts 1, 3, 4 have rows; 0 and 2 none; rows past 1000 belong to none. K = 2880: a partial
  // last K tile (22.5 tiles); N = 384.
  fg::Problem p;
  p.grouping = GemmGrouping::kM;
  p.E = 5;
  p.T = 1100;
  p.K = 2880;
  p.N = 384;
  const int64_t KB = 23, NB = 3;
  std::vector<cutlass::float_e4m3_t> a(1), b(1);
  std::vector<float> sfa(static_cast<size_t>(KB * 1108)), sfb(5 * 80);
  std::vector<cutlass::bfloat16_t> d(1);
  p.a = a.data();
  p.lda = 2896;
  p.sfa = sfa.data();
  p.ld_sfa = 1108;  // wider than T: a view of a larger buffer
  p.b = b.data();
  p.ldb = 2880;
  p.b_es = 384 * 2880 + 16;
  p.sfb = sfb.data();
  p.ld_sfb = 24;  // rows of the [NB, KB] blocks 24 apart
  p.sfb_es = 80;
  p.d = d.data();
  p.ldd = 392;
  const std::vector<int32_t> offs = {0, 300, 300, 700, 1000};
  HostArgs<ArgsM> h(p.E);
  build(p, offs, h.a);

  const int64_t expert[3] = {1, 3, 4}, begin[3] = {0, 300, 700}, rows[3] = {300, 400, 300};
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE(s);
    EXPECT_EQ(get<0>(h.a.shapes[s]), rows[s]);
    EXPECT_EQ(get<1>(h.a.shapes[s]), 384);
    EXPECT_EQ(get<2>(h.a.shapes[s]), 2880);
    EXPECT_EQ(h.a.ptr_a[s], a.data() + begin[s] * p.lda);
    EXPECT_EQ(h.a.ptr_b[s], b.data() + expert[s] * p.b_es);
    EXPECT_EQ(h.a.ptr_d[s], d.data() + begin[s] * p.ldd);
    EXPECT_EQ(get<0>(h.a.stride_a[s]), p.lda);
    EXPECT_EQ(get<0>(h.a.stride_b[s]), p.ldb);
    EXPECT_EQ(get<0>(h.a.stride_d[s]), p.ldd);
    EXPECT_EQ(h.a.ptr_sfa[s], sfa.data() + begin[s]);
    EXPECT_EQ(h.a.ptr_sfb[s], sfb.data() + expert[s] * p.sfb_es);
    // Scale of A's row m (of the group) and K tile j: sfa[j][begin + m].
    static int64_t sfa_begin, sfb_base;
    sfa_begin = begin[s];
    sfb_base = expert[s] * p.sfb_es;
    check_tiles(h.a.layout_sfa[s], rows[s], p.K, sfa.data(), h.a.ptr_sfa[s],
                [](int64_t m, int64_t j) { return j * 1108 + sfa_begin + m; }, "SFA");
    // Scale of B's row n and K tile j: block (n / 128, j) of the expert's [NB, KB] blocks.
    check_tiles(h.a.layout_sfb[s], p.N, p.K, sfb.data(), h.a.ptr_sfb[s],
                [](int64_t n, int64_t j) { return sfb_base + n / 128 * 24 + j; }, "SFB");
    EXPECT_EQ((size<1, 1>(h.a.layout_sfb[s])), KB);
    EXPECT_EQ((size<0, 1>(h.a.layout_sfb[s])), NB);
  }
  for (int s = 3; s < 5; ++s) {  // no tiles
    EXPECT_EQ(get<0>(h.a.shapes[s]), 0);
    EXPECT_EQ(get<1>(h.a.shapes[s]), 0);
  }
}

TEST(Fp8GemmArgs, KGroupedSlotsAndScales) {
  // dw[e] = A^T[:, tokens of e] B^T[:, tokens of e]^T over Tp = 1024 padded tokens; expert 1
  // has none; M = 320 (a partial M tile), N = 264 (a partial N tile).
  fg::Problem p;
  p.grouping = GemmGrouping::kK;
  p.E = 4;
  p.T = 1024;
  p.M = 320;
  p.N = 264;
  std::vector<cutlass::float_e4m3_t> a(1), b(1);
  std::vector<float> sfa(8 * 330), sfb(8 * 270);
  std::vector<cutlass::bfloat16_t> d(1);
  p.a = a.data();
  p.lda = 1040;
  p.b = b.data();
  p.ldb = 1024;
  p.sfa = sfa.data();
  p.ld_sfa = 330;
  p.sfb = sfb.data();
  p.ld_sfb = 270;
  p.d = d.data();
  p.ldd = 272;
  p.d_es = 320 * 272 + 8;
  const std::vector<int32_t> offs = {256, 256, 640, 1024};
  HostArgs<ArgsK> h(p.E);
  build(p, offs, h.a);

  const int64_t expert[3] = {0, 2, 3}, begin[3] = {0, 256, 640}, tokens[3] = {256, 384, 384};
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE(s);
    EXPECT_EQ(get<0>(h.a.shapes[s]), 320);
    EXPECT_EQ(get<1>(h.a.shapes[s]), 264);
    EXPECT_EQ(get<2>(h.a.shapes[s]), tokens[s]);
    EXPECT_EQ(h.a.ptr_a[s], a.data() + begin[s]);
    EXPECT_EQ(h.a.ptr_b[s], b.data() + begin[s]);
    EXPECT_EQ(h.a.ptr_d[s], d.data() + expert[s] * p.d_es);
    EXPECT_EQ(get<0>(h.a.stride_a[s]), p.lda);
    EXPECT_EQ(get<0>(h.a.stride_b[s]), p.ldb);
    EXPECT_EQ(get<0>(h.a.stride_d[s]), p.ldd);
    static int64_t tile0;
    tile0 = begin[s] / 128;
    // Scale of A^T's row m and the group's token tile j: sfa[tile0 + j][m]; B likewise.
    check_tiles(h.a.layout_sfa[s], p.M, tokens[s], sfa.data(), h.a.ptr_sfa[s],
                [](int64_t m, int64_t j) { return (tile0 + j) * 330 + m; }, "SFA");
    check_tiles(h.a.layout_sfb[s], p.N, tokens[s], sfb.data(), h.a.ptr_sfb[s],
                [](int64_t n, int64_t j) { return (tile0 + j) * 270 + n; }, "SFB");
  }
  EXPECT_EQ(get<0>(h.a.shapes[3]), 0);
}

}  // namespace
