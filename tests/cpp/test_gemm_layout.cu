// Host-side proofs of what the fused grouped GEMMs' epilogues (src/cuda/gemm/moe_gemm_sm90.cuh)
// assume about CUTLASS's register layouts, for the instantiated tiles. CuTe layouts are
// plain host arithmetic, so these run on any machine (CI too), no GPU needed:
// - each thread's accumulator fragment holds (gate, up) pairs of an interleaved gate_up
//   as adjacent elements (2j, 2j + 1) at columns (n, n + 1), n even (the forward's h);
// - an element's coordinate is the thread's first one plus the relative coordinate the
//   collective hands the callbacks (args.tCcD);
// - the backward's row-sum registers hold one row each, and the shuffle tree over
//   row_lanes() leaves each row's full sum in its column-0 lane.
// For both schedules (pingpong: 128 x 128 tiles, one warpgroup's epilogue; cooperative:
// 128 x 256, two warpgroups').
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/gemm/moe_gemm_sm90.cuh"

namespace {

using namespace cute;
using namespace expertact::gemm;

template <class G>
struct EpilogueLayout {
  using TileShape = typename G::TileShape;
  using Epi = typename G::CollectiveEpilogue;
  using EpiTile = typename Epi::EpilogueTile;
  static auto tiled_copy() {
    auto c_atom = make_tiled_copy_C_atom(typename Epi::CopyAtomC{},
                                         typename G::CollectiveMainloop::TiledMma{});
    // What the collective passes as args.tiled_copy (its R2S copy, bf16 smem elements).
    return make_tiled_copy_S(Copy_Atom<typename Epi::CopyOpR2S, Bf16>{}, c_atom);
  }
  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) absolute tile coordinates of one thread's elements.
  static auto coords(int thread) {
    Tensor cD = make_identity_tensor(take<0, 2>(TileShape{}));
    return cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue<true>(
        cD, EpiTile{}, tiled_copy(), thread);
  }
  static constexpr int kThreads = decltype(size(tiled_copy()))::value;
};

// Both schedules, forward (bf16 D) and backward (void D): the types the kernels are built from.
template <class Sched>
struct Kernels {
  using Fwd = EpilogueLayout<GroupedGemm<GluFwdCallbacks<expertact::Activation::kSilu>, Bf16, Sched>>;
  using Bwd = EpilogueLayout<GroupedGemm<GluBwdCallbacks<expertact::Activation::kSilu>, void, Sched>>;
};

template <class Sched>
class GemmLayout : public testing::Test {};
using Schedules = testing::Types<Pingpong, Cooperative>;
class ScheduleNames {
 public:
  template <class T>
  static std::string GetName(int) {
    return std::is_same_v<T, Pingpong> ? "pingpong" : "cooperative";
  }
};
TYPED_TEST_SUITE(GemmLayout, Schedules, ScheduleNames);

// The fragment size the collective visits with (sm90 builder: epilogue tile / threads).
template <class L>
constexpr int fragment_size() {
  return decltype(size(typename L::EpiTile{}))::value / L::kThreads;
}

template <class L>
void expect_tile_covered_once() {
  using TileShape = typename L::TileShape;
  std::map<std::pair<int, int>, int> seen;
  for (int t = 0; t < L::kThreads; ++t) {
    Tensor c = L::coords(t);
    for (int i = 0; i < size(c); ++i) ++seen[{get<0>(c(i)), get<1>(c(i))}];
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(size<0>(TileShape{}) * size<1>(TileShape{})));
  for (const auto& kv : seen) ASSERT_EQ(kv.second, 1) << kv.first.first << "," << kv.first.second;
}

TYPED_TEST(GemmLayout, ForwardFragmentsCoverTheTileOnce) {
  expect_tile_covered_once<typename Kernels<TypeParam>::Fwd>();
}
TYPED_TEST(GemmLayout, BackwardFragmentsCoverTheTileOnce) {
  expect_tile_covered_once<typename Kernels<TypeParam>::Bwd>();
}

TYPED_TEST(GemmLayout, ForwardFragmentsHoldGateUpPairs) {
  using Fwd = typename Kernels<TypeParam>::Fwd;
  using TileShape = typename Fwd::TileShape;
  constexpr int FS = fragment_size<Fwd>();
  static_assert(FS % 2 == 0, "pairs need an even fragment");
  int pairs = 0;
  for (int t = 0; t < Fwd::kThreads; ++t) {
    Tensor c = Fwd::coords(t);
    for (int em = 0; em < size<3>(c); ++em) {
      for (int en = 0; en < size<4>(c); ++en) {
        Tensor s = c(_, _, _, em, en);
        ASSERT_EQ(size(s) % FS, 0);
        for (int v = 0; v < size(s) / FS; ++v) {
          for (int i = 0; i < FS; i += 2) {
            auto g = s(v * FS + i), u = s(v * FS + i + 1);
            ASSERT_EQ(get<1>(g) % 2, 0) << "thread " << t << ": gate at an odd column";
            ASSERT_EQ(get<0>(u), get<0>(g)) << "thread " << t << ": pair split across rows";
            ASSERT_EQ(get<1>(u), get<1>(g) + 1) << "thread " << t << ": pair not adjacent";
            ++pairs;
          }
        }
      }
    }
  }
  EXPECT_EQ(pairs, size<0>(TileShape{}) * size<1>(TileShape{}) / 2);
}

// The callbacks see make_coord_tensor(layout) (coordinates relative to the thread's first
// element) and add the first element's coordinate back: the same as the absolute ones.
TYPED_TEST(GemmLayout, RelativeCoordinatesPlusFirstAreAbsolute) {
  using Fwd = typename Kernels<TypeParam>::Fwd;
  for (int t = 0; t < Fwd::kThreads; ++t) {
    Tensor c = Fwd::coords(t);
    Tensor rel = make_coord_tensor(c.layout());
    for (int i = 0; i < size(c); ++i) {
      ASSERT_EQ(get<0>(rel(i)) + get<0>(c(0)), get<0>(c(i)));
      ASSERT_EQ(get<1>(rel(i)) + get<1>(c(0)), get<1>(c(i)));
    }
  }
}

// The backward's weight gradient: each thread adds element (m, n)'s term into
// tCrDw(_,_,_,em,en)(i); the registers must each see one row only, then the shuffle tree
// must leave in the column-0 lane of each row the sum over the warp's lanes of that row,
// and the warps' column-0 lanes together must hold every row of the tile with its sum
// over all N (the kernel adds those with atomicAdd).
TYPED_TEST(GemmLayout, BackwardRowSumsReachTheColumnZeroLanes) {
  using Bwd = typename Kernels<TypeParam>::Bwd;
  using TileShape = typename Bwd::TileShape;
  auto tc = Bwd::tiled_copy();
  auto lanes = row_lanes<true>(tc);
  const int warps = Bwd::kThreads / 32;
  // Test value of element (m, n): distinct per row and column, exact in float.
  auto value = [](int m, int n) { return static_cast<float>(m * 512 + n + 1); };
  std::map<int, double> total;  // row -> sum of what the column-0 lanes hand to atomicAdd
  for (int w = 0; w < warps; ++w) {
    std::vector<std::vector<float>> regs(32);
    std::vector<std::vector<int>> reg_row(32);
    for (int lane = 0; lane < 32; ++lane) {
      const int t = w * 32 + lane;
      Tensor c = Bwd::coords(t);
      Tensor r = row_sum_registers<true>(TileShape{}, typename Bwd::EpiTile{}, tc, t);
      Tensor flt = filter_zeros(r);
      std::map<float*, int> row_of;  // register -> the row it collects
      for (int em = 0; em < size<3>(c); ++em) {
        for (int en = 0; en < size<4>(c); ++en) {
          Tensor cs = c(_, _, _, em, en);
          Tensor rs = r(_, _, _, em, en);
          for (int i = 0; i < size(cs); ++i) {
            float* reg = &rs(i);
            auto it = row_of.emplace(reg, get<0>(cs(i))).first;
            ASSERT_EQ(it->second, get<0>(cs(i))) << "thread " << t << ": one register, two rows";
            *reg += value(get<0>(cs(i)), get<1>(cs(i)));
          }
        }
      }
      ASSERT_EQ(static_cast<size_t>(size(flt)), row_of.size()) << "filter_zeros keeps one per row";
      // The coordinates the kernel pairs with filter_zeros(registers) in reduce().
      Tensor flt_c = make_tensor(c.data(), make_layout(flt.shape(), c.stride()));
      for (int i = 0; i < size(flt); ++i) {
        regs[lane].push_back(flt(i));
        reg_row[lane].push_back(get<0>(flt_c(i)));
        ASSERT_EQ(row_of.at(&flt(i)), get<0>(flt_c(i))) << "register and coordinate disagree";
      }
    }
    // __shfl_down_sync emulated: a lane past 31 reads its own value.
    for (int cols = size<1>(lanes) / 2; cols > 0; cols /= 2) {
      const int delta = lanes(0, cols);
      auto before = regs;
      for (int lane = 0; lane < 32; ++lane) {
        for (size_t i = 0; i < regs[lane].size(); ++i) {
          const int src = lane + delta < 32 ? lane + delta : lane;
          regs[lane][i] = before[lane][i] + before[src][i];
        }
      }
    }
    for (int lane = 0; lane < 32; ++lane) {
      auto lane_mn = idx2crd(right_inverse(lanes)(lane), shape(lanes));
      if (get<1>(lane_mn) != 0) continue;
      for (size_t i = 0; i < regs[lane].size(); ++i) total[reg_row[lane][i]] += regs[lane][i];
    }
  }
  const int TM = size<0>(TileShape{}), TN = size<1>(TileShape{});
  ASSERT_EQ(total.size(), static_cast<size_t>(TM));
  for (int m = 0; m < TM; ++m) {
    double want = 0;
    for (int n = 0; n < TN; ++n) want += value(m, n);
    EXPECT_EQ(total.at(m), want) << "row " << m;
  }
}

}  // namespace
