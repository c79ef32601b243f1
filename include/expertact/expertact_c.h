/* expertact C ABI: the operations of expertact.hpp over one tensor description,
 * expertact_tensor (below), with DLPack's dtype and device codes (dlpack.h), and an
 * explicit stream. Every call returns an expertact_status (0 = success); on failure
 * expertact_last_error() gives a readable message naming the argument and its value.
 * No exception crosses this boundary and nothing exits the process.
 */
#ifndef EXPERTACT_C_H_
#define EXPERTACT_C_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define EXPERTACT_API __declspec(dllexport)
#else
#define EXPERTACT_API __attribute__((visibility("default")))
#endif

#define EXPERTACT_ABI_VERSION 5
/* 2: dtype errors return EXPERTACT_INVALID_DTYPE; 3: per-expert biases, FP8;
 * 4: every entry takes expertact_tensor (the DLTensor entries and the _2d suffix are gone;
 *    expertact_tensor_from_dlpack / expertact_vector_from_dlpack convert a DLTensor);
 * 5: the blockwise FP8 operands (row tiles, column tiles, weight blocks; their activation
 *    forms). 5 has no GEMM entry: the grouped GEMMs are torch's (docs/notes/fp8-gemm.md). */

typedef int32_t expertact_status; /* values of expertact::Status */
#define EXPERTACT_OK 0
#define EXPERTACT_INVALID_ARGUMENT 1
#define EXPERTACT_UNSUPPORTED 2
#define EXPERTACT_CUDA_ERROR 3
#define EXPERTACT_INTERNAL 4
#define EXPERTACT_INVALID_DTYPE 5 /* a dtype error: unsupported, or different from its partner's */

/* layout: 0 separate, 1 halves, 2 halves up-first, 3 interleaved */
#define EXPERTACT_LAYOUT_SEPARATE 0
#define EXPERTACT_LAYOUT_HALVES 1
#define EXPERTACT_LAYOUT_HALVES_UP_FIRST 2
#define EXPERTACT_LAYOUT_INTERLEAVED 3

/* act: 0 silu (with alpha), 1 gelu_tanh */
#define EXPERTACT_ACT_SILU 0
#define EXPERTACT_ACT_GELU_TANH 1

/* DLPack 1.1's code of float8_e4m3fn (kDLFloat8_e4m3fn), for the FP8 outputs. */
#define EXPERTACT_DL_FLOAT8_E4M3FN 10

typedef struct expertact_params {
  int32_t act;
  float alpha;
  float limit; /* +inf: no clamp */
  float beta;
} expertact_params;

/* The one tensor description of this ABI: a row-strided 2-D view. Element (r, c) is at
 * (char*)data + (r * row_stride + c) * element size; row_stride is in elements and is not
 * read when rows <= 1. dtype and device are DLPack's codes: float32, float16, bfloat16
 * (float64 on the CPU), int32 for offsets, float8_e4m3fn for the FP8 outputs; kDLCPU,
 * kDLCUDAHost (read by the CPU path) or kDLCUDA.
 *
 * A [..., C] tensor is given as [rows, C], its leading dimensions collapsed into rows and
 * one row stride. A vector (per-row weights and their gradient, per-row scales, offsets) is
 * a column [n, 1], element i at row i (so a strided vector's stride is its row_stride), or
 * a row [1, n] (contiguous).
 *
 * Why not DLTensor* itself: every operand the kernels take is such a view, and this struct
 * states it in four integers that a binding fills in one write, where a DLTensor needs its
 * shape and stride arrays filled on every call and collapsed again here (expertact's Python
 * binding fills an expertact_tensor in about a seventh of the time of a DLTensor with its
 * arrays). A DLPack producer converts with the two helpers below. */
typedef struct expertact_tensor {
  void* data;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  DLDataType dtype;
  DLDevice device;
} expertact_tensor;

/* The description of a DLTensor [..., C]: rows = the product of the leading dimensions,
 * cols = C, the last dimension contiguous (stride 1; strides == NULL: compact row-major)
 * and the leading ones collapsing into one row stride (a contiguous tensor, a row slice,
 * a column slice of a wider matrix); data includes byte_offset. Refused, naming the shape
 * and strides: a 0-dimensional tensor, a negative dimension, a last dimension that is not
 * contiguous, leading dimensions that do not collapse. dtype and device are copied and
 * checked by the entry point that takes the description. */
EXPERTACT_API expertact_status expertact_tensor_from_dlpack(const DLTensor* t, expertact_tensor* out);
/* The description of a DLTensor as a vector: any shape (0-dimensional: one element) whose
 * elements collapse into one stride, as a column [n, 1] with that stride. */
EXPERTACT_API expertact_status expertact_vector_from_dlpack(const DLTensor* t, expertact_tensor* out);

/* Fills *out with a preset by name: "swiglu", "swiglu_clamped", "swiglu_oai",
 * "geglu_tanh". alpha and limit are used by the presets that take them (NaN
 * keeps the preset's default). */
EXPERTACT_API expertact_status expertact_preset(const char* name, float alpha, float limit,
                                                expertact_params* out);

/* x: gate [rows, F] (separate) or gate_up [rows, 2F]; up: NULL unless layout is separate;
 * weights: NULL or float32 [rows]; out: [rows, F], written. stream: a cudaStream_t for
 * CUDA tensors (NULL = legacy default stream). */
EXPERTACT_API expertact_status expertact_glu_forward(const expertact_params* params, int32_t layout,
                                                     const expertact_tensor* x, const expertact_tensor* up,
                                                     const expertact_tensor* weights, expertact_tensor* out,
                                                     void* stream);

/* grad_x has x's shape and layout (it may describe x itself: in-place backward);
 * grad_up: NULL unless layout is separate (may describe up itself); grad_weights:
 * NULL, or float32 [rows] when weights is given. */
EXPERTACT_API expertact_status expertact_glu_backward(
    const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
    const expertact_tensor* x, const expertact_tensor* up, const expertact_tensor* weights,
    expertact_tensor* grad_x, expertact_tensor* grad_up, expertact_tensor* grad_weights, void* stream);

/* Per-expert biases. Rows are sorted by expert: expert e owns rows [offsets[e - 1],
 * offsets[e]) (offsets[-1] = 0), as torch._grouped_mm's offs; rows past offsets[E - 1] get
 * no bias and add to no gradient. offsets: int32, contiguous, E >= 1 elements, on the
 * tensors' device; non-decreasing with offsets[E - 1] <= rows (checked on the CPU; on a
 * GPU the values are not read on the host). Bias gradients are fixed-order float32 sums:
 * bit-identical from run to run.
 *
 * The CUDA backwards take a workspace of device memory, 256-byte aligned, of at least
 * expertact_glu_bias_workspace_bytes (resp. expertact_expert_bias_workspace_bytes) bytes;
 * the CPU takes none (NULL, 0). */
EXPERTACT_API size_t expertact_glu_bias_workspace_bytes(int64_t rows, int64_t F, int64_t num_experts);
EXPERTACT_API size_t expertact_expert_bias_workspace_bytes(int64_t rows, int64_t cols,
                                                           int64_t num_experts);

/* expertact_glu_forward with bias [E, 2F] (x's dtype; columns in the packed layout's
 * order, gate's F then up's for the separate layout) added to gate and up before the
 * activation (the clamp applies after it). x is not changed. */
EXPERTACT_API expertact_status expertact_glu_forward_bias(
    const expertact_params* params, int32_t layout, const expertact_tensor* x,
    const expertact_tensor* up, const expertact_tensor* weights, const expertact_tensor* bias,
    const expertact_tensor* offsets, expertact_tensor* out, void* stream);

/* Its backward: expertact_glu_backward's outputs (in place allowed as there) and
 * grad_bias [E, 2F] (bias's layout and dtype; NULL: not wanted), each expert's column sums
 * of the input gradient (0 for an expert without rows). */
EXPERTACT_API expertact_status expertact_glu_backward_bias(
    const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
    const expertact_tensor* x, const expertact_tensor* up, const expertact_tensor* weights,
    const expertact_tensor* bias, const expertact_tensor* offsets, expertact_tensor* grad_x,
    expertact_tensor* grad_up, expertact_tensor* grad_weights, expertact_tensor* grad_bias,
    void* workspace, size_t workspace_bytes, void* stream);

/* out[r] = x[r] + w[r] * bias[e] (w = 1 when weights is NULL); bias [E, cols]; out may
 * describe x itself (in place). */
EXPERTACT_API expertact_status expertact_expert_bias_forward(
    const expertact_tensor* x, const expertact_tensor* bias, const expertact_tensor* offsets,
    const expertact_tensor* weights, expertact_tensor* out, void* stream);

/* Its backward (x's gradient is grad_out): grad_bias[e] = sum over e's rows of w[r] *
 * grad_out[r] (NULL: not wanted); grad_weights[r] = grad_out[r] . bias[e] (float32 [rows];
 * NULL: not wanted; needs weights). */
EXPERTACT_API expertact_status expertact_expert_bias_backward(
    const expertact_tensor* grad_out, const expertact_tensor* bias, const expertact_tensor* offsets,
    const expertact_tensor* weights, expertact_tensor* grad_bias, expertact_tensor* grad_weights,
    void* workspace, size_t workspace_bytes, void* stream);

/* FP8: rowwise float8 e4m3fn with power-of-two scales, torchao's recipe (expertact.hpp,
 * fp8_quantize_rowwise, says it exactly). q: dtype EXPERTACT_DL_FLOAT8_E4M3FN, 8 bits;
 * scale: float32 [rows], the dequantisation scale 1 / s of each row. CPU and CUDA tensors.
 * col_amax_offsets (int32 [E], NULL: none) with col_amax (float32 [E, C], NULL: none; both or
 * neither): also the max |v| (NaN ignored) of each column over each expert's rows, taken in
 * the same read (expertact.hpp, fp8_quantize_rowwise's second form). */
EXPERTACT_API expertact_status expertact_fp8_quantize_rowwise(const expertact_tensor* x, expertact_tensor* q,
                                                              expertact_tensor* scale,
                                                              const expertact_tensor* col_amax_offsets,
                                                              expertact_tensor* col_amax, void* stream);
/* Per expert (offsets: as for the biases) and column: x [T, C] -> q_t (x quantised and
 * transposed) and scale float32 [E, C]. padded_offsets NULL: q_t [C, T], columns past the last
 * offset written as 0. padded_offsets (int32 [E], cumulative, on x's device): q_t [C, Tp],
 * expert e's rows from column padded_offsets[e - 1] (0 for e = 0) on, the rest of its block
 * and the columns past padded_offsets[E - 1] written as 0 (expertact.hpp,
 * fp8_quantize_colwise_grouped, says it exactly). amax (float32 [E, C], NULL: computed here):
 * the per expert and column amax, e.g. expertact_fp8_quantize_rowwise's col_amax; the
 * scales then come from it and x is read once. */
EXPERTACT_API expertact_status expertact_fp8_quantize_colwise_grouped(
    const expertact_tensor* x, const expertact_tensor* offsets, const expertact_tensor* padded_offsets,
    expertact_tensor* q_t, expertact_tensor* scale, const expertact_tensor* amax, void* stream);
/* The activation of expertact_glu_forward's arguments quantized from its float32 values.
 * col_amax_offsets (int32 [E], NULL: none) with col_amax (float32 [E, F], NULL: none; both or
 * neither): also the max |h| (NaN ignored) of each column over each expert's rows, h as the
 * activation's forward writes it in x's dtype, taken in the same pass (expertact.hpp,
 * fp8_glu_rowwise's column amax forms). */
EXPERTACT_API expertact_status expertact_fp8_glu_rowwise(
    const expertact_params* params, int32_t layout, const expertact_tensor* x, const expertact_tensor* up,
    const expertact_tensor* weights, expertact_tensor* q, expertact_tensor* scale,
    const expertact_tensor* col_amax_offsets, expertact_tensor* col_amax, void* stream);
/* The same with expertact_glu_forward_bias's per-expert bias (and offsets) added to gate and
 * up before the activation; col_amax (float32 [E, F], NULL: none): the column amax as above,
 * over the experts of offsets. */
EXPERTACT_API expertact_status expertact_fp8_glu_rowwise_bias(
    const expertact_params* params, int32_t layout, const expertact_tensor* x, const expertact_tensor* up,
    const expertact_tensor* weights, const expertact_tensor* bias, const expertact_tensor* offsets,
    expertact_tensor* q, expertact_tensor* scale, expertact_tensor* col_amax, void* stream);
/* The activation of expertact_glu_forward's arguments (with bias: expertact_glu_forward_bias's;
 * NULL: none) quantized per expert and column as expertact_fp8_quantize_colwise_grouped
 * quantizes that forward's output (in x's dtype), without writing it: the same q_t, scale and
 * padding (expertact.hpp, fp8_glu_colwise_grouped, says it exactly). offsets: the experts' end
 * rows (also the bias's); amax (float32 [E, F], required): the per expert and column max |h| of
 * the rounded activation, e.g. expertact_fp8_quantize_rowwise's col_amax of it. */
EXPERTACT_API expertact_status expertact_fp8_glu_colwise_grouped(
    const expertact_params* params, int32_t layout, const expertact_tensor* x, const expertact_tensor* up,
    const expertact_tensor* weights, const expertact_tensor* bias, const expertact_tensor* offsets,
    const expertact_tensor* padded_offsets, expertact_tensor* q_t, expertact_tensor* scale,
    const expertact_tensor* amax, void* stream);
/* The activation's backward quantized rowwise from its float32 values (expertact.hpp,
 * fp8_glu_backward_rowwise, says it exactly): packed layouts only; q float8 [rows, 2F] in
 * gate_up's column layout, scale float32 [rows]. NULL for what is not given or not wanted:
 * weights, bias (with offsets), grad_weights (float32 [rows]), col_amax (float32 [E, 2F], needs
 * offsets), grad_gate_up (the gradient in gate_up's dtype). No bias gradient. */
EXPERTACT_API expertact_status expertact_fp8_glu_backward_rowwise(
    const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
    const expertact_tensor* gate_up, const expertact_tensor* weights, const expertact_tensor* bias,
    const expertact_tensor* offsets, expertact_tensor* q, expertact_tensor* scale,
    expertact_tensor* grad_weights, expertact_tensor* col_amax, expertact_tensor* grad_gate_up,
    void* stream);

/* ---- FP8 blockwise operands (DeepSeek-V3's recipe; expertact.hpp, "FP8 blockwise operands",
 * says each format exactly): the rowwise recipe's power-of-two scale per tile of 128 values.
 * Row tiles: q [T, C] float8 with scale float32 [ceil(C / 128), T] (T contiguous). Column tiles:
 * per expert (offsets) and 128-row tile of its rows, each expert padded to a multiple of 128
 * rows (padded_offsets: int32 [E], the padded cumulative ends, on the tensors' device): q_t
 * [C, Tp] float8 (Tp a multiple of 128) with scale float32 [Tp / 128, C]. Weight blocks: 128 x 128.
 * CPU and CUDA write the same bytes. ---- */

/* Row tiles of x [T, C]: q [T, C], scale [ceil(C / 128), T]. */
EXPERTACT_API expertact_status expertact_fp8_quantize_row_tiles(const expertact_tensor* x, expertact_tensor* q,
                                                                expertact_tensor* scale, void* stream);
/* Column tiles of x [T, C] over its experts: q_t [C, Tp], scale [Tp / 128, C]. q with row_scale
 * (both or neither; NULL: not wanted): also x's row tiles, from the same read of x. */
EXPERTACT_API expertact_status expertact_fp8_quantize_column_tiles_grouped(
    const expertact_tensor* x, const expertact_tensor* offsets, const expertact_tensor* padded_offsets,
    expertact_tensor* q_t, expertact_tensor* scale, expertact_tensor* q, expertact_tensor* row_scale, void* stream);
/* 128 x 128 blocks of the weights w, a 3-dimensional DLTensor [E, R, C] of any strides (a
 * weight's transposed view included; float32, float16 or bfloat16): q [E * R, C] float8 (the
 * [E, R, C] tensor, C contiguous), scale float32 [E * ceil(R / 128), ceil(C / 128)]. */
EXPERTACT_API expertact_status expertact_fp8_quantize_blocks(const DLTensor* w, expertact_tensor* q,
                                                             expertact_tensor* scale, void* stream);
/* The activation of expertact_glu_forward's arguments (with bias and offsets, NULL: none,
 * expertact_glu_forward_bias's) in row tiles of its float32 values: q [rows, F] float8, scale
 * [ceil(F / 128), rows]. */
EXPERTACT_API expertact_status expertact_fp8_glu_row_tiles(
    const expertact_params* params, int32_t layout, const expertact_tensor* x, const expertact_tensor* up,
    const expertact_tensor* weights, const expertact_tensor* bias, const expertact_tensor* offsets,
    expertact_tensor* q, expertact_tensor* scale, void* stream);
/* The activation (bias: NULL or with offsets, which also group the rows), rounded to x's dtype
 * as the forward writes it, in column tiles as expertact_fp8_quantize_column_tiles_grouped
 * writes them of that output: q_t [F, Tp], scale [Tp / 128, F]; the activation is not written. */
EXPERTACT_API expertact_status expertact_fp8_glu_column_tiles_grouped(
    const expertact_params* params, int32_t layout, const expertact_tensor* x, const expertact_tensor* up,
    const expertact_tensor* weights, const expertact_tensor* bias, const expertact_tensor* offsets,
    const expertact_tensor* padded_offsets, expertact_tensor* q_t, expertact_tensor* scale, void* stream);
/* The activation's backward quantised from its float32 gradient, packed layouts only: row tiles
 * along the packed 2F columns q [rows, 2F] with scale [ceil(2F / 128), rows]; with q_t and
 * col_scale (both or neither; they need offsets and padded_offsets) its column tiles q_t [2F, Tp]
 * and col_scale [Tp / 128, 2F] from the same pass. NULL for what is not given or not wanted:
 * weights, bias (with offsets), grad_weights (float32 [rows], needs weights; fixed-order sums),
 * grad_gate_up (the gradient in gate_up's dtype, apart from gate_up). No bias gradient. */
EXPERTACT_API expertact_status expertact_fp8_glu_backward_tiles(
    const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
    const expertact_tensor* gate_up, const expertact_tensor* weights, const expertact_tensor* bias,
    const expertact_tensor* offsets, const expertact_tensor* padded_offsets, expertact_tensor* q,
    expertact_tensor* scale, expertact_tensor* q_t, expertact_tensor* col_scale, expertact_tensor* grad_weights,
    expertact_tensor* grad_gate_up, void* stream);
/* ---- end of the FP8 blockwise operands ---- */

/* Message of the last failed call on this thread ("" if the last call succeeded). */
EXPERTACT_API const char* expertact_last_error(void);

/* 1 if built with CUDA, else 0. */
EXPERTACT_API int32_t expertact_has_cuda(void);
EXPERTACT_API int32_t expertact_abi_version(void);
/* CPU worker threads: get, and set (0 = default). */
EXPERTACT_API int32_t expertact_cpu_threads(void);
EXPERTACT_API void expertact_set_cpu_threads(int32_t n);
/* The CPU kernels in use: "avx2+fma+f16c" or "baseline" (EXPERTACT_CPU_ISA=baseline forces
 * the portable ones). */
EXPERTACT_API const char* expertact_cpu_kernel_isa(void);

#ifdef __cplusplus
}
#endif

#endif /* EXPERTACT_C_H_ */
