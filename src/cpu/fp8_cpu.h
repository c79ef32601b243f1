// The FP8 rowwise problems handed from src/api_fp8.cpp to the CPU path (src/cpu/fp8_cpu.cpp).
#pragma once

#include <cstdint>

#include "core/bias.h"
#include "core/problem.h"

namespace expertact::detail {

// The outputs: q (e4m3fn bytes, row-strided) and the per-row dequantisation scale.
struct Fp8Out {
  void* q = nullptr;
  int64_t q_stride = 0;
  float* scale = nullptr;
  int64_t scale_stride = 1;
};

// x [rows, cols] -> q, scale.
struct Fp8Rows : Fp8Out {
  DType dtype = DType::kFloat32;
  int32_t device_id = 0;
  int64_t rows = 0, cols = 0;
  const void* x = nullptr;
  int64_t x_stride = 0;
  // Optional, with col_amax_experts > 0: also the per expert and column max |v| (NaN ignored)
  // of x into col_amax [E, cols] (row stride col_amax_stride), expert e's rows
  // [col_amax_offsets[e - 1], col_amax_offsets[e]) (from 0 for e = 0); rows past the last
  // offset contribute nothing. Overwritten (no need to zero it first).
  const int32_t* col_amax_offsets = nullptr;
  int64_t col_amax_experts = 0;
  float* col_amax = nullptr;
  int64_t col_amax_stride = 0;
};

Status cpu_fp8_quantize_rowwise(const Fp8Rows& p);

// x [rows, cols] -> q_t [cols, out_rows] and scale [E, cols], per expert and column. Expert
// e's rows [start_e, end_e) (start_e = offsets[e - 1], 0 for e = 0) land in q_t's columns
// from pstart_e = padded[e - 1] (0 for e = 0) on; the rest of its block [pstart_e,
// padded[e]) and q_t's columns past padded[E - 1] are 0. Without padding (padded null),
// padded = offsets and out_rows = rows.
struct Fp8Cols {
  DType dtype = DType::kFloat32;
  int32_t device_id = 0;
  int64_t rows = 0, cols = 0;
  const void* x = nullptr;
  int64_t x_stride = 0;
  const int32_t* offsets = nullptr;
  const int32_t* padded = nullptr;  // null: no padding
  int64_t experts = 0;
  void* q_t = nullptr;
  int64_t q_stride = 0;  // q_t's row stride (one row per column of x)
  int64_t out_rows = 0;  // q_t's columns (Tp)
  float* scale = nullptr;
  int64_t scale_stride = 0;
  // Optional: the per expert and column amax [E, cols] (row stride amax_stride), e.g. from
  // quantize_rowwise's col_amax; then the scales come from it and x is read once.
  const float* amax = nullptr;
  int64_t amax_stride = 0;
};
Status cpu_fp8_quantize_colwise_grouped(const Fp8Cols& p);
// The activation h = act(gate, up [+ bias[e]]) * w of problem p, rounded to p.dtype as the
// activation's forward writes it (glu_forward, or glu_forward_bias with bias), quantised per
// expert and column into c.q_t and c.scale as cpu_fp8_quantize_colwise_grouped does for h:
// c.x is unused (h is computed from the problem), c.rows = p.rows, c.cols = p.F, and c.amax
// is required (the per expert and column max |h| of the rounded h, e.g. fp8_quantize_rowwise's
// col_amax of it). bias (or nullptr): as in cpu_fp8_glu_rowwise, its offsets those of c.
Status cpu_fp8_glu_colwise_grouped(const GluProblem& p, const GluBias* bias, const Fp8Cols& c);

// The GLU form's optional column amax: col_amax [E, F] (float32, row stride stride), the max
// over each expert's rows (offsets, experts: cumulative end rows; rows past the last offset
// count for none; an expert without rows gets 0) of |h| as the activation's forward writes h
// (in the problem's dtype), NaN ignored. Overwritten (no need to zero it first). With a bias,
// offsets are the bias's offsets.
struct Fp8ColAmax {
  const int32_t* offsets = nullptr;
  int64_t experts = 0;
  float* col_amax = nullptr;
  int64_t stride = 0;
};

// bias (or nullptr): the per-expert bias added to gate and up before the activation (its
// offsets, gate and up parts in the problem's layout; no bias on rows past the last offset).
// amax (or nullptr): also the column amax (Fp8ColAmax); p.rows may then be 0.
Status cpu_fp8_glu_rowwise(const GluProblem& p, const Fp8Out& o, const GluBias* bias = nullptr,
                           const Fp8ColAmax* amax = nullptr);

// The activation's forward over rows [r0, r1), all columns, on the calling thread, with the
// kernels cpu_forward picks (src/cpu/glu_cpu.cpp), into o: the forward's exact bytes of those
// rows (fp8 glu_rowwise's column amax takes them; the AVX2 kernels' float32 values can differ
// in their last bit from the scalar math's, which FMA contraction leaves alone).
Status cpu_forward_rows(const GluProblem& p, const FwdOutput& o, int64_t r0, int64_t r1);

// The activation's forward of rows [r0, r0 + n) of p into h ([n, F] contiguous, p's dtype) by
// its own CPU kernels, threaded (cpu_forward, or cpu_glu_bias_forward with a bias, whose
// offsets are shifted to the rows in `offsets`, E int32): the bytes glu_forward /
// glu_forward_bias write, whichever instruction set they run on. The column forms of h
// (cpu_fp8_glu_colwise_grouped, cpu_fp8_glu_column_tiles) quantise those bytes run by run.
Status cpu_forward_run(const GluProblem& p, const GluBias* bias, int64_t r0, int64_t n, void* h, int32_t* offsets);
// The elements of such a run: about max(2^18, threads x 2^17) (each of the forward's threads
// gets at least 2^17), at most 2^22.
int64_t forward_run_elements();

// The fused FP8 activation backward (fp8_glu_backward_rowwise): the gradient of gate_up,
// computed in float32 from dy and gate_up (PackedBwdIO, src/core/problem.h: dy, the packed
// columns, the optional dw and dgu), written only as e4m3fn rowwise q [rows, 2F] in gate_up's
// column layout (the packed columns; the same in dgu and col_amax) with the scale of each row.
// Optional: col_amax [E, 2F] (float32, row stride col_amax_stride), the max |dgate_up| (NaN
// ignored) of each column over each expert's rows (offsets, experts; rows past the last offset
// count for none; overwritten).
struct Fp8BwdOut : Fp8Out, PackedBwdIO {
  const int32_t* offsets = nullptr;
  int64_t experts = 0;
  float* col_amax = nullptr;
  int64_t col_amax_stride = 0;
};
// bias (or nullptr): the per-expert bias added to gate and up before the activation, as in
// cpu_fp8_glu_rowwise.
Status cpu_fp8_glu_backward_rowwise(const GluProblem& p, const Fp8BwdOut& o, const GluBias* bias);
#if EXPERTACT_WITH_CUDA
Status cuda_fp8_glu_backward_rowwise(const GluProblem& p, const Fp8BwdOut& o, const GluBias* bias, void* stream);
Status cuda_fp8_quantize_rowwise(const Fp8Rows& p, void* stream);
Status cuda_fp8_glu_rowwise(const GluProblem& p, const Fp8Out& o, const GluBias* bias, const Fp8ColAmax* amax,
                            void* stream);
Status cuda_fp8_quantize_colwise_grouped(const Fp8Cols& p, void* stream);
Status cuda_fp8_glu_colwise_grouped(const GluProblem& p, const GluBias* bias, const Fp8Cols& c, void* stream);
#endif

}  // namespace expertact::detail
