// What the blockwise tile kernels take on the host's proof (src/cuda/fp8_tiles_plan.h), checked
// on the host: each vector path's predicate on the layouts the API admits (the four GLU layouts
// as src/api.cpp lays them out, views with storage offsets, row strides that are not multiples
// of 4, one row), so that a check removed from a predicate fails here rather than as a misaligned
// access on a GPU; the backward's order of column tiles; and the column tiles' staging in shared
// memory on every thread of a block: a bijection onto each column's 16 slots, the bytes of q_t
// the direct stores wrote (rows 16 h .. 16 h + 15 at offset 16 h), no bank conflict.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "cuda/fp8_tiles_plan.h"

namespace {

namespace tiles = expertact::cuda::tiles;
using expertact::detail::GluProblem;
using expertact::detail::PackedBwdIO;
using expertact::detail::TileOut;
using expertact::detail::TileSrc;

// Addresses only: the predicates never read through them.
const void* at(uintptr_t byte) { return reinterpret_cast<const void*>(byte); }
constexpr uintptr_t kBase = 0x10000;  // 256-byte aligned, as a fresh allocation

enum class Lay { kSeparate, kHalves, kUpFirst, kInterleaved };

// The problem src/api.cpp builds for gate_up [rows, 2F] (row stride `stride` elements of es
// bytes, first element at byte `base`); separate: gate there, up at `up_base` with `up_stride`.
GluProblem problem(Lay lay, int64_t rows, int64_t F, int64_t stride, int64_t es, uintptr_t base,
                   uintptr_t up_base = kBase, int64_t up_stride = 0) {
  GluProblem p;
  p.rows = rows;
  p.F = F;
  p.g_stride = p.u_stride = stride;
  p.packed = lay != Lay::kSeparate;
  switch (lay) {
    case Lay::kSeparate:
      p.g = at(base), p.u = at(up_base), p.u_stride = up_stride;
      break;
    case Lay::kHalves:
      p.g = at(base), p.u = at(base + F * es);
      break;
    case Lay::kUpFirst:
      p.u = at(base), p.g = at(base + F * es);
      break;
    case Lay::kInterleaved:
      p.g = at(base), p.u = at(base + es), p.step = 2;
      break;
  }
  return p;
}

// The backward's packed description (src/api_fp8_common.h, set_packed_bwd) with dy at `dy_base`.
PackedBwdIO packed(Lay lay, int64_t F, uintptr_t dy_base, int64_t dy_stride) {
  PackedBwdIO d;
  d.dy = at(dy_base);
  d.dy_stride = dy_stride;
  if (lay == Lay::kUpFirst) d.q_g = F, d.q_u = 0;
  else if (lay == Lay::kInterleaved) d.q_g = 0, d.q_u = 1;
  else d.q_g = 0, d.q_u = F;
  return d;
}

TEST(TilesPlan, RowsOn) {
  EXPECT_TRUE(tiles::rows_on(at(kBase), 100, 5, 2, 4));
  EXPECT_FALSE(tiles::rows_on(at(kBase + 2), 100, 5, 2, 4));  // a view one element in
  EXPECT_FALSE(tiles::rows_on(at(kBase), 102, 5, 2, 4));      // rows 102 elements apart
  EXPECT_TRUE(tiles::rows_on(at(kBase), 102, 1, 2, 4));       // one row: its stride unused
  EXPECT_FALSE(tiles::rows_on(at(kBase + 8), 100, 5, 4, 4));  // float32: 16 bytes
  EXPECT_TRUE(tiles::rows_on(at(kBase + 16), -100, 5, 4, 4));
}

TEST(TilesPlan, PlainSourceLoadsFourWhereProven) {
  TileSrc s;
  s.rows = 300;
  for (const int64_t es : {2, 4}) {
    s.x = at(kBase), s.x_stride = 3072;
    EXPECT_TRUE(tiles::plain_vec4(s, es));
    s.x = at(kBase + es);  // x[:, 1:]
    EXPECT_FALSE(tiles::plain_vec4(s, es)) << es;
    s.x = at(kBase), s.x_stride = 3073;
    EXPECT_FALSE(tiles::plain_vec4(s, es)) << es;
    s.x_stride = 3076;  // x[:, :3072] of a wider tensor
    EXPECT_TRUE(tiles::plain_vec4(s, es)) << es;
  }
}

TEST(TilesPlan, GluSourceLoadsFourOnlyOnProvenLayouts) {
  for (const int64_t es : {2, 4}) {
    SCOPED_TRACE(es);
    // halves and up-first: gate and up 4-element aligned when F and the row stride are
    EXPECT_TRUE(tiles::glu_vec4(problem(Lay::kHalves, 9, 100, 200, es, kBase), es));
    EXPECT_TRUE(tiles::glu_vec4(problem(Lay::kUpFirst, 9, 100, 200, es, kBase), es));
    EXPECT_TRUE(tiles::glu_vec4(problem(Lay::kHalves, 9, 3072, 6144, es, kBase), es));
    // F = 98: up (or gate, up first) starts 2 elements past a multiple of 4
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kHalves, 9, 98, 196, es, kBase), es));
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kUpFirst, 9, 98, 196, es, kBase), es));
    // F = 99: rows 198 elements apart; a view with a storage offset of one element
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kHalves, 9, 99, 198, es, kBase), es));
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kHalves, 9, 100, 200, es, kBase + es), es));
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kHalves, 9, 100, 202, es, kBase), es));
    EXPECT_TRUE(tiles::glu_vec4(problem(Lay::kHalves, 1, 100, 202, es, kBase), es));  // one row
    // interleaved: gate and up 2 elements apart, never 4 in one access (step 2 refused even
    // where both pointers happen to be aligned)
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kInterleaved, 9, 100, 200, es, kBase), es));
    GluProblem step2 = problem(Lay::kInterleaved, 9, 100, 200, es, kBase);
    step2.u = at(kBase + 4096);
    EXPECT_FALSE(tiles::glu_vec4(step2, es));
    // separate: each tensor's own pointer and stride
    EXPECT_TRUE(tiles::glu_vec4(problem(Lay::kSeparate, 9, 100, 100, es, kBase, kBase + 4096, 100), es));
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kSeparate, 9, 100, 100, es, kBase, kBase + 4096 + es, 100), es));
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kSeparate, 9, 100, 100, es, kBase, kBase + 4096, 101), es));
    EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kSeparate, 9, 100, 101, es, kBase, kBase + 4096, 100), es));
  }
  // 4 values are 8 bytes of bfloat16, 16 of float32: gate_up 8 bytes past an aligned address
  EXPECT_TRUE(tiles::glu_vec4(problem(Lay::kHalves, 9, 100, 200, 2, kBase + 8), 2));
  EXPECT_FALSE(tiles::glu_vec4(problem(Lay::kHalves, 9, 100, 200, 4, kBase + 8), 4));
}

TEST(TilesPlan, BackwardSourceLoadsFourOnlyOnProvenLayouts) {
  for (const int64_t es : {2, 4}) {
    SCOPED_TRACE(es);
    const uintptr_t dy = kBase + (1 << 20);
    for (const Lay lay : {Lay::kHalves, Lay::kUpFirst}) {
      EXPECT_TRUE(tiles::bwd_vec4(problem(lay, 9, 100, 200, es, kBase), packed(lay, 100, dy, 100), es));
      EXPECT_TRUE(tiles::bwd_vec4(problem(lay, 9, 3072, 6144, es, kBase), packed(lay, 3072, dy, 3072), es));
      // F = 98: a lane's 4 columns may straddle the halves, up's (gate's) start is misaligned
      EXPECT_FALSE(tiles::bwd_vec4(problem(lay, 9, 98, 196, es, kBase), packed(lay, 98, dy, 100), es));
      // gate_up one element in, or rows 202 apart
      EXPECT_FALSE(tiles::bwd_vec4(problem(lay, 9, 100, 200, es, kBase + es), packed(lay, 100, dy, 100), es));
      EXPECT_FALSE(tiles::bwd_vec4(problem(lay, 9, 100, 202, es, kBase), packed(lay, 100, dy, 100), es));
      // dy one element in, or rows 102 apart
      EXPECT_FALSE(tiles::bwd_vec4(problem(lay, 9, 100, 200, es, kBase), packed(lay, 100, dy + es, 100), es));
      EXPECT_FALSE(tiles::bwd_vec4(problem(lay, 9, 100, 200, es, kBase), packed(lay, 100, dy, 102), es));
      EXPECT_TRUE(tiles::bwd_vec4(problem(lay, 1, 100, 202, es, kBase), packed(lay, 100, dy, 102), es));
    }
    EXPECT_FALSE(tiles::bwd_vec4(problem(Lay::kInterleaved, 9, 100, 200, es, kBase),
                                 packed(Lay::kInterleaved, 100, dy, 100), es));
    PackedBwdIO step2 = packed(Lay::kInterleaved, 100, dy, 100);
    step2.q_u = 4;  // aligned columns, still step 2
    EXPECT_FALSE(tiles::bwd_vec4(problem(Lay::kInterleaved, 9, 100, 200, es, kBase), step2, es));
  }
}

TEST(TilesPlan, BackwardPairsColumnTilesOnlyOnWholeHalves) {
  EXPECT_TRUE(tiles::bwd_paired(problem(Lay::kHalves, 9, 3072, 6144, 2, kBase)));
  EXPECT_TRUE(tiles::bwd_paired(problem(Lay::kUpFirst, 9, 128, 256, 2, kBase)));
  EXPECT_FALSE(tiles::bwd_paired(problem(Lay::kHalves, 9, 100, 200, 2, kBase)));
  EXPECT_FALSE(tiles::bwd_paired(problem(Lay::kHalves, 9, 192, 384, 2, kBase)));  // 3 tiles: one straddles
  EXPECT_FALSE(tiles::bwd_paired(problem(Lay::kInterleaved, 9, 3072, 6144, 2, kBase)));
  // The order: a permutation of the KB tiles; the first half's (halves: gate's) ascending at the
  // even steps, each followed by the same tile of the other half.
  for (const int64_t KB : {2, 4, 48}) {
    std::vector<int> seen(KB, 0);
    for (int64_t i = 0; i < KB; ++i) {
      const int64_t k = tiles::paired_column_tile(true, i, KB);
      ASSERT_TRUE(k >= 0 && k < KB) << i;
      ++seen[k];
      EXPECT_EQ(k, i % 2 ? KB / 2 + i / 2 : i / 2);
      EXPECT_EQ(tiles::paired_column_tile(false, i, KB), i);
    }
    for (int64_t k = 0; k < KB; ++k) EXPECT_EQ(seen[k], 1) << k;
  }
}

TEST(TilesPlan, ColumnTilesABlockTakes) {
  // All of them where asked (the backward's row sums), whatever the grid.
  EXPECT_EQ(tiles::tiles_per_block(48, 8165, true, 132), 48);
  EXPECT_EQ(tiles::tiles_per_block(48, 1, true, 132), 48);
  // The busiest rank's shape (8,165 row tiles, F = 3,072): every tile of a row in one block.
  EXPECT_EQ(tiles::tiles_per_block(24, 8165, false, 132), 24);
  // Few rows: one tile a block, every SM still busy.
  EXPECT_EQ(tiles::tiles_per_block(24, 8, false, 132), 1);
  // Between: kBlocksPerSm blocks an SM.
  const int64_t per = tiles::tiles_per_block(24, 200, false, 132);
  EXPECT_EQ(per, 200 * 24 / (132 * tiles::kBlocksPerSm));
  EXPECT_GE(200 * ((24 + per - 1) / per), 132 * tiles::kBlocksPerSm);
  // Grid y within 65,535 however few the rows; no column tiles: one.
  const int64_t KB = 200000;
  EXPECT_LE((KB + tiles::tiles_per_block(KB, 1, false, 132) - 1) / tiles::tiles_per_block(KB, 1, false, 132), 65535);
  EXPECT_EQ(tiles::tiles_per_block(0, 10, false, 132), 1);
  EXPECT_EQ(tiles::tiles_per_block(5, 10, false, 0), 5);
}

TEST(TilesPlan, StoreWidthsOfTheOutputs) {
  TileOut o;
  o.q_t = const_cast<void*>(at(kBase));
  o.qt_stride = 1024;
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 16);
  EXPECT_FALSE(tiles::align_of(o, 300, 100).q4);  // no row tiles
  o.qt_stride = 1032;
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 8);
  o.qt_stride = 1028;
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 4);
  o.qt_stride = 1026;
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 1);
  EXPECT_EQ(tiles::align_of(o, 300, 1).qt, 16);  // one column: one row of q_t
  o.qt_stride = 1024;
  o.q_t = const_cast<void*>(at(kBase + 8));
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 8);
  o.q_t = const_cast<void*>(at(kBase + 4));
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 4);
  o.q_t = const_cast<void*>(at(kBase + 1));
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 1);
  o.q_t = nullptr;
  EXPECT_EQ(tiles::align_of(o, 300, 100).qt, 1);
  o.q = const_cast<void*>(at(kBase));
  o.q_stride = 100;
  EXPECT_TRUE(tiles::align_of(o, 300, 100).q4);
  o.q_stride = 102;
  EXPECT_FALSE(tiles::align_of(o, 300, 100).q4);
  EXPECT_TRUE(tiles::align_of(o, 1, 100).q4);
  o.q = const_cast<void*>(at(kBase + 2));
  o.q_stride = 100;
  EXPECT_FALSE(tiles::align_of(o, 300, 100).q4);
}

TEST(TilesPlan, FullTilePathOnlyOnWholeAlignedLaunches) {
  TileOut o;
  o.q = const_cast<void*>(at(kBase));
  o.q_stride = 256;
  o.q_t = const_cast<void*>(at(kBase));
  o.qt_stride = 1024;
  const tiles::Align al = tiles::align_of(o, 300, 256);
  EXPECT_TRUE(tiles::fast_launch(al, o, 256, true));
  EXPECT_FALSE(tiles::fast_launch(al, o, 256, false));  // the source's loads are not proven
  EXPECT_FALSE(tiles::fast_launch(tiles::align_of(o, 300, 200), o, 200, true));  // a partial column tile
  o.q_stride = 258;                                                           // q's rows take no 4-byte store
  EXPECT_FALSE(tiles::fast_launch(tiles::align_of(o, 300, 256), o, 256, true));
  o.q = nullptr;  // no row tiles: q's alignment does not matter
  EXPECT_TRUE(tiles::fast_launch(tiles::align_of(o, 300, 256), o, 256, true));
  o.qt_stride = 1032;  // q_t's rows take 8-byte stores only
  EXPECT_FALSE(tiles::fast_launch(tiles::align_of(o, 300, 256), o, 256, true));
  o.q_t = nullptr;  // row tiles alone
  o.q = const_cast<void*>(at(kBase));
  o.q_stride = 256;
  EXPECT_TRUE(tiles::fast_launch(tiles::align_of(o, 300, 256), o, 256, true));
}

// The kernel's shape (fp8_tiles.cuh): 512 threads, warp w holding rows 8 w .. 8 w + 7, lane l
// columns 4 l .. 4 l + 3 of a 128 x 128 tile; the read-back loop's thread x (of 1,024 over two
// rounds) takes column x / 8, bytes 16 (x % 8) .. + 15.
constexpr int kThreads = 512, kWarps = 16, kTile = 128;

// The bank pairs 8- or 16-byte accesses at `addrs` (one per thread of a phase) touch: each of
// the 32 banks (4 bytes) by at most one distinct word.
bool conflict_free(const std::vector<int>& addrs, int bytes) {
  std::map<int, std::set<int>> words_of_bank;
  for (const int a : addrs)
    for (int b = 0; b < bytes; b += 4) words_of_bank[((a + b) / 4) % 32].insert((a + b) / 4);
  for (const auto& kv : words_of_bank)
    if (kv.second.size() > 1) return false;
  return true;
}

TEST(TilesPlan, StagingIsABijectionInTheDirectStoresOrder) {
  // stage[c][slot] = the warp whose 8 bytes went there (-1: none)
  std::vector<std::vector<int>> stage(kTile, std::vector<int>(kWarps, -1));
  for (int w = 0; w < kWarps; ++w)
    for (int c = 0; c < kTile; ++c) {
      const int s = tiles::stage_slot(c, w);
      ASSERT_TRUE(s >= 0 && s < kWarps) << c << " " << w;
      ASSERT_EQ(stage[c][s], -1) << "column " << c << " slot " << s << " written twice";
      stage[c][s] = w;
    }
  // Each thread's 16 bytes of the read-back: warps 2 h and 2 h + 1 in that order, the rows the
  // direct stores put at q_t's bytes 16 h .. 16 h + 15 of the column's row (warp w's at 8 w).
  std::vector<std::vector<int>> read(kTile, std::vector<int>(kWarps, 0));
  for (int x = 0; x < kTile * 8; ++x) {
    const int c = x >> 3, h = x & 7, p = tiles::stage_pair(c, h);
    ASSERT_TRUE(p % 2 == 0 && p >= 0 && p < kWarps) << c << " " << h;
    const int lo = stage[c][p + (tiles::stage_swapped(c) ? 1 : 0)];
    const int hi = stage[c][p + (tiles::stage_swapped(c) ? 0 : 1)];
    EXPECT_EQ(lo, 2 * h) << "column " << c << " bytes " << 16 * h;
    EXPECT_EQ(hi, 2 * h + 1) << "column " << c << " bytes " << 16 * h + 8;
    ++read[c][p], ++read[c][p + 1];
  }
  for (int c = 0; c < kTile; ++c)
    for (int s = 0; s < kWarps; ++s) EXPECT_EQ(read[c][s], 1) << "column " << c << " slot " << s;
}

TEST(TilesPlan, StagingHasNoBankConflict) {
  // Writes: warp w's lanes store 8 bytes each of column 4 l + j (one j at a time); a warp's
  // 8-byte accesses go in two phases of 16 lanes.
  for (int w = 0; w < kWarps; ++w)
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        std::vector<int> addrs;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int c = 4 * l + j;
          addrs.push_back(c * kTile + 8 * tiles::stage_slot(c, w));
        }
        EXPECT_TRUE(conflict_free(addrs, 8)) << "warp " << w << " j " << j << " half " << half;
      }
  // The same without the swizzle conflicts 16 ways: the check can fail.
  std::vector<int> plain;
  for (int l = 0; l < 16; ++l) plain.push_back(4 * l * kTile + 8 * 3);
  EXPECT_FALSE(conflict_free(plain, 8));
  // Reads: 16 bytes a thread, in phases of 8 threads (x = threadIdx.x + 512 i).
  for (int i = 0; i < kTile * 8 / kThreads; ++i)
    for (int t0 = 0; t0 < kThreads; t0 += 8) {
      std::vector<int> addrs;
      for (int t = t0; t < t0 + 8; ++t) {
        const int x = t + i * kThreads, c = x >> 3, h = x & 7;
        addrs.push_back(c * kTile + 8 * tiles::stage_pair(c, h));
      }
      EXPECT_TRUE(conflict_free(addrs, 16)) << "round " << i << " threads " << t0;
    }
}

}  // namespace
