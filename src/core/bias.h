// Per-expert biases over rows sorted by expert (docs/spec.md section 7): the row -> expert
// map, the chunking of the deterministic bias-gradient sums shared by the CPU and CUDA
// paths, and the validated problems handed to their launchers (src/api_bias.cpp checks).
//
// The bias gradient of expert e is the column sum of e's rows. Both paths cut the rows
// into fixed chunks of R rows (R depends on the row count only); a chunk sums each run
// of one expert's rows in float32 (float64 for float64 tensors) into its own partial row,
// slot chunk + e (unique: along the rows both the chunk and the expert only grow, so
// chunk + e grows by at least one between runs), and a second pass adds an expert's
// slots in chunk order. Nothing depends on thread counts or scheduling: two runs give
// bit-identical gradients.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/math.h"
#include "core/problem.h"

namespace expertact::detail {

// Rows per chunk: about 4096 chunks (enough blocks to fill a GPU several times over),
// a power of two from 8 to 512.
inline int64_t bias_chunk_rows(int64_t rows) {
  const int64_t want = (rows + 4095) / 4096;
  int64_t r = 8;
  while (r < want && r < 512) r *= 2;
  return r;
}
inline int64_t bias_chunks(int64_t rows) {
  const int64_t r = bias_chunk_rows(rows);
  return (rows + r - 1) / r;
}
// A CUDA block covers at most this many packs of a row; more columns go to more blocks
// (column tiles), whose per-row sums (the weights' gradient) are added by a second pass.
constexpr int64_t kBiasTilePacks = 384;
inline int64_t bias_tiles(int64_t packs) { return (packs + kBiasTilePacks - 1) / kBiasTilePacks; }

// Workspace of the CUDA backwards: the partial rows (slots x acc_cols floats, 256-byte
// aligned), then, when a row spans several tiles, tiles x rows floats. Sized for the
// narrowest pack (one element), so the host need not know the pack width.
inline size_t bias_partials_bytes(int64_t rows, int64_t acc_cols, int64_t experts) {
  const size_t b = static_cast<size_t>(bias_chunks(rows) + experts) * acc_cols * sizeof(float);
  return (b + 255) / 256 * 256;
}
inline size_t bias_workspace(int64_t rows, int64_t out_cols, int64_t acc_cols, int64_t experts) {
  if (rows <= 0 || experts < 0) return 0;
  size_t b = bias_partials_bytes(rows, acc_cols, experts);
  const int64_t tiles = bias_tiles(out_cols);
  if (tiles > 1) b += static_cast<size_t>(tiles) * rows * sizeof(float);
  return b;
}

// The expert of row r: the first e with offsets[e] > r, E when r is past the last offset.
EA_HD int64_t expert_of(const int32_t* offs, int64_t E, int64_t r) {
  int64_t lo = 0, hi = E;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (offs[mid] <= r) lo = mid + 1; else hi = mid;
  }
  return lo;
}
// The end of expert e's rows clamped into [r, r1] (r1 for e == E: no expert).
EA_HD int64_t run_end(const int32_t* offs, int64_t E, int64_t e, int64_t r, int64_t r1) {
  if (e >= E) return r1;
  const int64_t o = offs[e];
  return o < r ? r : (o > r1 ? r1 : o);
}
// The first and one-past-last chunk of expert e's rows (an empty range: no rows).
EA_HD void expert_chunks(const int32_t* offs, int64_t e, int64_t rows, int64_t R,
                         int64_t& c0, int64_t& c1) {
  int64_t s = e == 0 ? 0 : offs[e - 1], t = offs[e];
  s = s < 0 ? 0 : (s > rows ? rows : s);
  t = t < s ? s : (t > rows ? rows : t);
  c0 = s / R;
  c1 = t > s ? (t - 1) / R + 1 : c0;
}

struct ExpertRows {
  const int32_t* offsets = nullptr;
  int64_t experts = 0;
  int64_t chunk = 8;  // bias_chunk_rows(rows)
};

// The activation's bias: gate part at bg + e * b_stride + c * step, up part at bu (the
// problem's layout applied to a [E, 2F] row); its gradient likewise (dbg null: none).
struct GluBias {
  ExpertRows er;
  const void* bg = nullptr;
  const void* bu = nullptr;
  int64_t b_stride = 0;
  void* dbg = nullptr;
  void* dbu = nullptr;
  int64_t db_stride = 0;
  void* ws = nullptr;  // CUDA workspace (bias_workspace bytes)
};

// out = x + w[r] * b[e] per row, and its gradients (db, dw: null when not wanted).
struct RowBias {
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
  int64_t rows = 0, cols = 0;
  ExpertRows er;
  const void* b = nullptr;
  int64_t b_stride = 0;
  const float* w = nullptr;
  int64_t w_stride = 1;
  // forward
  const void* x = nullptr;
  int64_t x_stride = 0;
  void* out = nullptr;
  int64_t out_stride = 0;
  // backward
  const void* dy = nullptr;
  int64_t dy_stride = 0;
  void* db = nullptr;
  int64_t db_stride = 0;
  float* dw = nullptr;
  int64_t dw_stride = 1;
  void* ws = nullptr;
};

// Launchers: validated problems, rows > 0 (the bodies zero the gradients of an empty one).
Status cpu_glu_bias_forward(const GluProblem& p, const GluBias& b, const FwdOutput& o);
Status cpu_glu_bias_backward(const GluProblem& p, const GluBias& b, const BwdIO& io);
Status cpu_row_bias_forward(const RowBias& p);
Status cpu_row_bias_backward(const RowBias& p);
#if EXPERTACT_WITH_CUDA
Status cuda_glu_bias_forward(const GluProblem& p, const GluBias& b, const FwdOutput& o, void* stream);
Status cuda_glu_bias_backward(const GluProblem& p, const GluBias& b, const BwdIO& io, void* stream);
Status cuda_row_bias_forward(const RowBias& p, void* stream);
Status cuda_row_bias_backward(const RowBias& p, void* stream);
#endif

}  // namespace expertact::detail
