// The blockwise FP8 operands (docs/notes/fp8-recipes.md, "The blockwise operand formats"): the
// problems src/api_fp8_tiles.cpp hands to the CPU path (src/cpu/fp8_tiles_cpu.cpp) and the CUDA
// path (src/cuda/fp8_tiles*.cu, fp8_blocks.cu), and the schedule of 128-row tiles both follow.
// Every tile's scale is fp8::scale_of of its amax (NaN ignored), the tile's values quantised with
// fp8::quantize: the rowwise recipe's arithmetic, per tile.
#pragma once

#include <cstdint>

#include "core/bias.h"
#include "core/fp8.h"
#include "core/problem.h"

namespace expertact::detail {

// What a tile kernel writes.
//   Row tiles (q null: none): q [rows, cols] e4m3fn (row stride q_stride); scale float32, the
//   scale of row r's tile k (columns 128 k .. 128 k + 127) at scale[k * scale_stride + r].
//   Column tiles (q_t null: none): expert e's rows [offsets[e - 1], offsets[e]) (from 0 for
//   e = 0) quantised per column and 128-row tile into q_t [cols, out_rows] (row stride
//   qt_stride) from column pends[e - 1] on (0 for e = 0; pends: the ends of the experts' blocks
//   padded to multiples of 128), the rest of the block 0x00; col_scale float32, tile j's scale of
//   column c at col_scale[j * cs_stride + c]. Tiles past pends[E - 1] (out_rows may be larger):
//   0x00 and the scale of an all-zero tile. Rows past offsets[E - 1] have no column tiles.
struct TileOut {
  void* q = nullptr;
  int64_t q_stride = 0;
  float* scale = nullptr;
  int64_t scale_stride = 0;
  void* q_t = nullptr;
  int64_t qt_stride = 0;
  int64_t out_rows = 0;  // Tp, a multiple of 128
  float* col_scale = nullptr;
  int64_t cs_stride = 0;
  const int32_t* offsets = nullptr;
  const int32_t* pends = nullptr;
  int64_t experts = 0;
};

// A plain tensor x [rows, cols] of dtype (row stride x_stride).
struct TileSrc {
  DType dtype = DType::kFloat32;
  int32_t device_id = 0;
  int64_t rows = 0, cols = 0;
  const void* x = nullptr;
  int64_t x_stride = 0;
};

// Weights w [experts, rows, cols] of any element strides -> q [experts * rows, cols] (row stride
// q_stride; expert e's row r at row e * rows + r) and scale float32 [experts * RB, CB] (row
// stride scale_stride; RB = ceil(rows / 128), CB = ceil(cols / 128)), one scale per 128 x 128
// block.
struct BlockProblem {
  DType dtype = DType::kFloat32;
  int32_t device_id = 0;
  int64_t experts = 0, rows = 0, cols = 0;
  const void* w = nullptr;
  int64_t w_estride = 0, w_rstride = 0, w_cstride = 0;
  void* q = nullptr;
  int64_t q_stride = 0;
  float* scale = nullptr;
  int64_t scale_stride = 0;
};

// One tile of up to 128 rows: rows [r0, r0 + n) of the input; ct >= 0: its column tiles go to
// q_t's columns 128 ct .. 128 ct + 127 (padding rows, n .. 127, are 0x00 there), ct < 0: none;
// e: the expert of all its rows (E: none, so no bias), or -1 when its rows may belong to
// several experts (each row's expert is looked up where a bias needs it).
struct TileRows {
  int64_t r0 = 0, n = 0, ct = -1, e = -1;
};

// The schedule of a tile kernel: tiles [0, out_tiles) are the padded tiles of q_t's columns
// (expert tiles: tile b holds the rows of the expert whose padded block holds column 128 b;
// none past pends[E - 1]); then, when row tiles are wanted, the rows past offsets[E - 1]
// (every row when E = 0) in tiles of 128. Offsets that break the rules (not ascending, pends
// not their padding) give wrong tiles, never a row outside [0, rows).
EA_HD int64_t tail_start(const int32_t* offsets, int64_t E, int64_t rows) {
  if (E <= 0) return 0;
  const int64_t t = offsets[E - 1];
  return t < 0 ? 0 : (t > rows ? rows : t);
}

EA_HD int64_t tile_count(int64_t out_tiles, bool tail, int64_t rows, int64_t tail0) {
  return out_tiles + (tail ? (rows - tail0 + fp8::kTile - 1) / fp8::kTile : 0);
}

EA_HD TileRows tile_rows(int64_t b, int64_t out_tiles, int64_t rows, const int32_t* offsets,
                         const int32_t* pends, int64_t E, int64_t tail0) {
  TileRows t;
  if (b >= out_tiles) {
    t.r0 = tail0 + (b - out_tiles) * fp8::kTile;
    const int64_t left = rows - t.r0;
    t.n = left < fp8::kTile ? left : fp8::kTile;
    t.e = E > 0 ? E : -1;
    return t;
  }
  t.ct = b;
  const int64_t p = b * fp8::kTile;
  const int64_t e = expert_of(pends, E, p);  // the first e with pends[e] > p
  t.e = e;
  if (e >= E) return t;  // past the last block: a tile of padding
  const int64_t pstart = e == 0 ? 0 : pends[e - 1], start = e == 0 ? 0 : offsets[e - 1];
  const int64_t end = offsets[e] < rows ? offsets[e] : rows;
  t.r0 = start + (p - pstart);
  if (t.r0 < 0 || t.r0 >= end) {
    t.r0 = 0;
    return t;
  }
  t.n = end - t.r0 < fp8::kTile ? end - t.r0 : fp8::kTile;
  return t;
}

// Launchers (validated problems; src/api_fp8_tiles.cpp says which outputs each form has).
// The plain tensor's row tiles and / or column tiles.
Status cpu_fp8_tiles(const TileSrc& s, const TileOut& o);
Status cpu_fp8_blocks(const BlockProblem& b);
// The activation h = act(gate [+ bias], up [+ bias]) * w of p: row tiles of its float32 values
// (one rounding; bias: its offsets are bias->er's); column tiles of h rounded to p's dtype as
// the activation's forward writes it (bias: its offsets are o's).
Status cpu_fp8_glu_row_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o);
Status cpu_fp8_glu_column_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o);
// The activation's backward (the gradient of gate_up, float32, one rounding): row tiles along
// the packed 2F columns and / or column tiles, with d's optional outputs (d: src/core/problem.h;
// bias: o's offsets).
Status cpu_fp8_glu_backward_tiles(const GluProblem& p, const GluBias* bias, const PackedBwdIO& d, const TileOut& o);
#if EXPERTACT_WITH_CUDA
Status cuda_fp8_tiles(const TileSrc& s, const TileOut& o, void* stream);
Status cuda_fp8_blocks(const BlockProblem& b, void* stream);
Status cuda_fp8_glu_row_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o, void* stream);
Status cuda_fp8_glu_column_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o, void* stream);
Status cuda_fp8_glu_backward_tiles(const GluProblem& p, const GluBias* bias, const PackedBwdIO& d, const TileOut& o,
                                   void* stream);
#endif

}  // namespace expertact::detail
