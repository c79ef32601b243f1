// Host-side proofs of what the fused grouped GEMMs' epilogues (src/cuda/gemm/moe_gemm_sm90.cuh)
// assume about CUTLASS's register layouts, for the instantiated tiles. CuTe layouts are
// plain host arithmetic, so these run on any machine (CI too), no GPU needed:
// - each thread's accumulator fragment holds (gate, up) pairs of an interleaved gate_up
//   as adjacent elements (2j, 2j + 1) at columns (n, n + 1), n even (the forward's h; the
//   backward's 8-byte accesses);
// - the forward's quad transpose hands each lane 4 contiguous h values of one row;
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
using Schedules = testing::Types<Pingpong, Cooperative, Pingpong64>;
class ScheduleNames {
 public:
  template <class T>
  static std::string GetName(int) {
    return std::is_same_v<T, Pingpong> ? "pingpong" : std::is_same_v<T, Pingpong64> ? "pingpong64" : "cooperative";
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

template <class Fwd>
void expect_adjacent_pairs() {
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

TYPED_TEST(GemmLayout, ForwardFragmentsHoldGateUpPairs) {
  expect_adjacent_pairs<typename Kernels<TypeParam>::Fwd>();
}
// The backward reads and writes elements (2k, 2k + 1) as one 8-byte access: the same property.
TYPED_TEST(GemmLayout, BackwardFragmentsHoldAdjacentColumnPairs) {
  expect_adjacent_pairs<typename Kernels<TypeParam>::Bwd>();
}

// The forward's 8-byte h stores: the kernel's quad transpose (quad_send1 / quad_send2 /
// quad_final, the same functions) run for every warp and fragment with the shuffles
// emulated, each lane's h value standing for its coordinates. Every lane must end with
// 4 h values of one row at h columns c .. c + 3, c where the kernel stores them (the
// chunk's gate_up column n + 6t of its row-r element, halved), and the stores must cover
// each (row, h column) of the tile exactly once.
TYPED_TEST(GemmLayout, ForwardQuadTransposeGivesContiguousHRows) {
  using Fwd = typename Kernels<TypeParam>::Fwd;
  using TileShape = typename Fwd::TileShape;
  constexpr int FS = fragment_size<Fwd>();
  static_assert(FS == 16, "the kernel's 8-byte path is written for fragments of 16");
  const int TM = size<0>(TileShape{}), TN = size<1>(TileShape{});
  // A value names its (row, h column) in 16 bits: row < 128, h column < 128.
  ASSERT_LE(TM, 128);
  ASSERT_LE(TN / 2, 128);
  auto code = [](int m, int hc) { return static_cast<uint16_t>(m * 128 + hc); };
  std::map<std::pair<int, int>, int> stored;
  for (int w = 0; w < Fwd::kThreads / 32; ++w) {
    Tensor c0 = Fwd::coords(w * 32);
    for (int em = 0; em < size<3>(c0); ++em) {
      for (int en = 0; en < size<4>(c0); ++en) {
        for (int v = 0; v < size(c0(_, _, _, em, en)) / FS; ++v) {
          for (int r = 0; r < 2; ++r) {
            uint16_t a[32][4];
            int row[32], col0[32];  // the row-r element (group 0) of each lane
            for (int lane = 0; lane < 32; ++lane) {
              Tensor s = Fwd::coords(w * 32 + lane)(_, _, _, em, en);
              for (int g = 0; g < 4; ++g) {  // pair j = r + 2g: elements 2j, 2j + 1
                auto e = s(v * FS + 2 * (r + 2 * g));
                a[lane][g] = code(get<0>(e), get<1>(e) / 2);
              }
              row[lane] = get<0>(s(v * FS + 2 * r));
              col0[lane] = get<1>(s(v * FS + 2 * r));
            }
            uint32_t send1[32], recv1[32], send2[32], own[32];
            for (int lane = 0; lane < 32; ++lane) send1[lane] = quad_send1(a[lane], lane & 3);
            for (int lane = 0; lane < 32; ++lane) recv1[lane] = send1[lane ^ 1];
            for (int lane = 0; lane < 32; ++lane)
              send2[lane] = quad_send2(a[lane], lane & 3, recv1[lane], &own[lane]);
            for (int lane = 0; lane < 32; ++lane) {
              const int t = lane & 3;
              uint32_t lo, hi;
              quad_final(t, own[lane], send2[lane ^ 2], &lo, &hi);
              const uint16_t got[4] = {static_cast<uint16_t>(lo & 0xffff), static_cast<uint16_t>(lo >> 16),
                                       static_cast<uint16_t>(hi & 0xffff), static_cast<uint16_t>(hi >> 16)};
              const int hc = col0[lane] / 2 + 3 * t;  // where the kernel stores the 8 bytes
              ASSERT_EQ((col0[lane] + 6 * t) % 8, 0) << "chunk not on 8 gate_up columns";
              for (int k = 0; k < 4; ++k) {
                ASSERT_EQ(got[k], code(row[lane], hc + k))
                    << "warp " << w << " lane " << lane << " fragment " << v << " row " << r << " value " << k;
                ++stored[{row[lane], hc + k}];
              }
            }
          }
        }
      }
    }
  }
  ASSERT_EQ(stored.size(), static_cast<size_t>(TM * TN / 2));
  for (const auto& kv : stored) ASSERT_EQ(kv.second, 1) << kv.first.first << "," << kv.first.second;
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
