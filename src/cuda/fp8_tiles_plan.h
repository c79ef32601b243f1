// What the blockwise tile kernels (fp8_tiles.cuh and its sources) may assume, proven on the host
// before a launch, and the index arithmetic of their column tiles' staging in shared memory:
// plain C++ apart from the kernels, so that the host tests (tests/cpp/test_fp8_tiles_plan.cpp)
// check each predicate on the layouts the API admits and the staging on every thread.
#pragma once

#include <cstdint>

#include "core/fp8_tiles.h"
#include "core/math.h"
#include "core/problem.h"

namespace expertact::cuda::tiles {

// The first of `rows` rows at p and each next one `stride` elements of `es` bytes further lie
// on multiples of n elements (one row: its stride is never used).
inline bool rows_on(const void* p, int64_t stride, int64_t rows, int64_t es, int64_t n) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(n * es) == 0 && (rows <= 1 || stride % n == 0);
}

// How the outputs' rows take stores: q's 4-byte runs (pointer and row stride multiples of 4),
// q_t's 16-byte runs (16, 8, 4 or 1: the widest store its pointer and row stride allow).
struct Align {
  bool q4 = false;
  int qt = 1;
};

inline Align align_of(const detail::TileOut& o, int64_t rows, int64_t cols) {
  Align a;
  a.q4 = o.q != nullptr && rows_on(o.q, o.q_stride, rows, 1, 4);
  if (o.q_t != nullptr) {
    for (const int v : {16, 8, 4}) {
      if (rows_on(o.q_t, o.qt_stride, cols, 1, v)) {
        a.qt = v;
        break;
      }
    }
  }
  return a;
}

// The sources' loads of 4 values in one access (elements of es bytes): x's rows.
inline bool plain_vec4(const detail::TileSrc& s, int64_t es) { return rows_on(s.x, s.x_stride, s.rows, es, 4); }

// Gate's and up's rows (step 1: separate and the halves layouts; interleaved never).
inline bool glu_vec4(const detail::GluProblem& p, int64_t es) {
  return p.step == 1 && rows_on(p.g, p.g_stride, p.rows, es, 4) && rows_on(p.u, p.u_stride, p.rows, es, 4);
}

// The backward's gate, up and dy: a lane's 4 packed columns lie in one half (F a multiple of 4),
// gate_up's rows (from its column 0, q_g's or q_u's) and dy's on multiples of 4 elements.
inline bool bwd_vec4(const detail::GluProblem& p, const detail::PackedBwdIO& d, int64_t es) {
  const void* row0 = d.q_g == 0 ? p.g : p.u;
  return p.step == 1 && p.F % 4 == 0 && d.q_g % 4 == 0 && d.q_u % 4 == 0 && rows_on(row0, p.g_stride, p.rows, es, 4) &&
         rows_on(d.dy, d.dy_stride, p.rows, es, 4);
}

// The backward's column tiles in pairs (gate's k-th, up's k-th): each half a whole number of
// column tiles (step 1, F a multiple of 128).
inline bool bwd_paired(const detail::GluProblem& p) { return p.step == 1 && p.F % fp8::kTile == 0; }

// The i-th column tile of KB that a block takes, paired: gate's and up's k-th in turn (halves:
// 0, KB / 2, 1, KB / 2 + 1, ...; the first half's tiles still ascending), else in order.
EA_HD int64_t paired_column_tile(bool paired, int64_t i, int64_t KB) {
  return paired ? (i % 2 ? KB / 2 + i / 2 : i / 2) : i;
}

// Whether a launch may take the tile engine's full-tile path (fp8_tiles.cuh, column_tiles<true>)
// on its tiles of 128 rows: every column tile whole (cols a multiple of 128), q's rows taking
// 4-byte stores and q_t's 16-byte ones, and the source's loads of a lane's 4 values one access
// each (src_ok: the source's fast_ok()).
inline bool fast_launch(const Align& al, const detail::TileOut& o, int64_t cols, bool src_ok) {
  return src_ok && cols % fp8::kTile == 0 && (o.q == nullptr || al.q4) && (o.q_t == nullptr || al.qt == 16);
}

// Blocks an SM a launch of column tiles shared among blocks should give (tiles_per_block).
constexpr int64_t kBlocksPerSm = 8;

// The column tiles of a row tile each block takes in turn (all_columns: all of them, the
// backward's row sums run over them in a fixed order): as many as leave every SM kBlocksPerSm
// blocks (a block streams its next tile's source while working one: the more it takes, the
// fewer tiles start cold), at least enough that grid y stays within 65,535.
inline int64_t tiles_per_block(int64_t KB, int64_t grid_x, bool all_columns, int64_t sms) {
  if (KB <= 0) return 1;
  const int64_t least = (KB + 65534) / 65535;
  if (all_columns) return KB;
  const int64_t want = grid_x * KB / ((sms > 0 ? sms : 1) * kBlocksPerSm);
  return want < least ? least : (want > KB ? KB : want);
}

// The column tiles' staging (fp8_tiles.cuh, quantize_tile): column c of the tile (one row of
// q_t's tile, its 128 rows as 128 bytes) in 16 slots of 8 bytes; warp w's 8 rows go to slot
// stage_slot(c, w) = w ^ ((c / 4) % 16). The 32 lanes of a warp write columns 4 l + j, 128 bytes
// apart: without the swizzle all in one bank pair; with it lanes 0-15 (and 16-31) take 16
// different slots, every bank once. Read back 16 bytes a thread (logical slots 2 h and 2 h + 1,
// rows 16 h .. 16 h + 15): the physical pair at stage_pair(c, h), its two halves swapped when
// stage_swapped(c).
EA_HD int stage_swizzle(int c) { return (c >> 2) & 15; }
EA_HD int stage_slot(int c, int w) { return w ^ stage_swizzle(c); }
EA_HD int stage_pair(int c, int h) { return 2 * (h ^ (stage_swizzle(c) >> 1)); }
EA_HD bool stage_swapped(int c) { return (stage_swizzle(c) & 1) != 0; }

}  // namespace expertact::cuda::tiles
