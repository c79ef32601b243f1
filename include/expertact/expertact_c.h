/* expertact C ABI: the same operations as expertact.hpp over DLPack tensors
 * (dlpack.h) and an explicit stream. Every call returns an expertact_status
 * (0 = success); on failure expertact_last_error() gives a readable message
 * naming the argument and its value. No exception crosses this boundary and
 * nothing exits the process.
 *
 * Tensors are [..., C] with the last dimension contiguous (stride 1) and the
 * leading dimensions collapsible into one row stride (any contiguous tensor,
 * a row slice, a column slice of a wider matrix). strides == NULL means
 * compact row-major. Weights are float32 with one element per row, any shape
 * whose elements collapse to a single stride.
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

#define EXPERTACT_ABI_VERSION 3 /* 2: dtype errors return EXPERTACT_INVALID_DTYPE; 3: per-expert biases, FP8 */

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

typedef struct expertact_params {
  int32_t act;
  float alpha;
  float limit; /* +inf: no clamp */
  float beta;
} expertact_params;

/* Fills *out with a preset by name: "swiglu", "swiglu_clamped", "swiglu_oai",
 * "geglu_tanh". alpha and limit are used by the presets that take them (NaN
 * keeps the preset's default). */
EXPERTACT_API expertact_status expertact_preset(const char* name, float alpha, float limit,
                                                expertact_params* out);

/* x: gate (separate) or gate_up [..., 2F]; up: NULL unless layout is separate;
 * weights: NULL or float32 [rows]; out: [..., F], written. stream: a
 * cudaStream_t for CUDA tensors (NULL = legacy default stream). */
EXPERTACT_API expertact_status expertact_glu_forward(const expertact_params* params,
                                                     int32_t layout, const DLTensor* x,
                                                     const DLTensor* up, const DLTensor* weights,
                                                     DLTensor* out, void* stream);

/* grad_x has x's shape and layout (it may be x itself: in-place backward);
 * grad_up: NULL unless layout is separate (may be up itself); grad_weights:
 * NULL, or float32 [rows] when weights is given. */
EXPERTACT_API expertact_status expertact_glu_backward(
    const expertact_params* params, int32_t layout, const DLTensor* grad_out, const DLTensor* x,
    const DLTensor* up, const DLTensor* weights, DLTensor* grad_x, DLTensor* grad_up,
    DLTensor* grad_weights, void* stream);

/* The same two operations over plain 2-D descriptions, for bindings that pay
 * per field they fill (expertact's Python binding describes an operand this way
 * in about half the time it takes to fill a DLTensor and its shape and stride
 * arrays). The leading dimensions of a [..., C] tensor are already collapsed
 * into rows and one row stride; everything else is validated exactly as by the
 * DLTensor entry points above, with the same messages (they share the checks).
 * Added in expertact 0.1.0 without changing the ABI version: the DLTensor entry
 * points are unchanged. */

/* A row-strided matrix: element (r, c) at (char*)data + (r * row_stride + c) *
 * element size. row_stride is in elements and is ignored when rows <= 1. */
typedef struct expertact_matrix {
  void* data;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  DLDataType dtype;
  DLDevice device;
} expertact_matrix;

/* Per-row weights (float32): element i at (char*)data + i * stride * 4.
 * stride is in elements and is ignored when size <= 1. */
typedef struct expertact_vector {
  void* data;
  int64_t size;
  int64_t stride;
  DLDataType dtype;
  DLDevice device;
} expertact_vector;

/* expertact_glu_forward over 2-D descriptions; arguments as there (x is
 * [rows, F] or [rows, 2F], out [rows, F]). */
EXPERTACT_API expertact_status expertact_glu_forward_2d(const expertact_params* params,
                                                        int32_t layout, const expertact_matrix* x,
                                                        const expertact_matrix* up,
                                                        const expertact_vector* weights,
                                                        expertact_matrix* out, void* stream);

/* expertact_glu_backward over 2-D descriptions; arguments as there (grad_x may
 * describe the same view as x, grad_up as up: in-place backward). */
EXPERTACT_API expertact_status expertact_glu_backward_2d(
    const expertact_params* params, int32_t layout, const expertact_matrix* grad_out,
    const expertact_matrix* x, const expertact_matrix* up, const expertact_vector* weights,
    expertact_matrix* grad_x, expertact_matrix* grad_up, expertact_vector* grad_weights,
    void* stream);

/* Per-expert biases (added in ABI version 3), over the 2-D descriptions. Rows are sorted
 * by expert: expert e owns rows [offsets[e - 1], offsets[e]) (offsets[-1] = 0), as
 * torch._grouped_mm's offs; rows past offsets[E - 1] get no bias and add to no gradient.
 * offsets: an expertact_vector of dtype int32 (code kDLInt, 32 bits), contiguous (stride
 * 1), E >= 1 elements, on the tensors' device; non-decreasing with offsets[E - 1] <= rows
 * (checked on the CPU; on a GPU the values are not read on the host). Bias gradients are
 * fixed-order float32 sums: bit-identical from run to run.
 *
 * The CUDA backwards take a workspace of device memory, 256-byte aligned, of at least
 * expertact_glu_bias_workspace_bytes (resp. expertact_expert_bias_workspace_bytes) bytes;
 * the CPU takes none (NULL, 0). */
EXPERTACT_API size_t expertact_glu_bias_workspace_bytes(int64_t rows, int64_t F, int64_t num_experts);
EXPERTACT_API size_t expertact_expert_bias_workspace_bytes(int64_t rows, int64_t cols,
                                                           int64_t num_experts);

/* expertact_glu_forward_2d with bias [E, 2F] (x's dtype; columns in the packed layout's
 * order, gate's F then up's for the separate layout) added to gate and up before the
 * activation (the clamp applies after it). x is not changed. */
EXPERTACT_API expertact_status expertact_glu_forward_bias_2d(
    const expertact_params* params, int32_t layout, const expertact_matrix* x,
    const expertact_matrix* up, const expertact_vector* weights, const expertact_matrix* bias,
    const expertact_vector* offsets, expertact_matrix* out, void* stream);

/* Its backward: expertact_glu_backward_2d's outputs (in place allowed as there) and
 * grad_bias [E, 2F] (bias's layout and dtype; NULL: not wanted), each expert's column sums
 * of the input gradient (0 for an expert without rows). */
EXPERTACT_API expertact_status expertact_glu_backward_bias_2d(
    const expertact_params* params, int32_t layout, const expertact_matrix* grad_out,
    const expertact_matrix* x, const expertact_matrix* up, const expertact_vector* weights,
    const expertact_matrix* bias, const expertact_vector* offsets, expertact_matrix* grad_x,
    expertact_matrix* grad_up, expertact_vector* grad_weights, expertact_matrix* grad_bias,
    void* workspace, size_t workspace_bytes, void* stream);

/* out[r] = x[r] + w[r] * bias[e] (w = 1 when weights is NULL); bias [E, cols]; out may
 * describe x itself (in place). */
EXPERTACT_API expertact_status expertact_expert_bias_forward_2d(
    const expertact_matrix* x, const expertact_matrix* bias, const expertact_vector* offsets,
    const expertact_vector* weights, expertact_matrix* out, void* stream);

/* Its backward (x's gradient is grad_out): grad_bias[e] = sum over e's rows of w[r] *
 * grad_out[r] (NULL: not wanted); grad_weights[r] = grad_out[r] . bias[e] (float32 [rows];
 * NULL: not wanted; needs weights). */
EXPERTACT_API expertact_status expertact_expert_bias_backward_2d(
    const expertact_matrix* grad_out, const expertact_matrix* bias,
    const expertact_vector* offsets, const expertact_vector* weights,
    expertact_matrix* grad_bias, expertact_vector* grad_weights, void* workspace,
    size_t workspace_bytes, void* stream);

/* FP8 (added in ABI version 3): rowwise float8 e4m3fn with power-of-two scales, torchao's
 * recipe (expertact.hpp, fp8_quantize_rowwise, says it exactly). q: an expertact_matrix of
 * DLPack dtype code EXPERTACT_DL_FLOAT8_E4M3FN, 8 bits (DLPack 1.1's kDLFloat8_e4m3fn);
 * scale: float32 [rows], the dequantisation scale 1 / s of each row. CPU and CUDA tensors. */
#define EXPERTACT_DL_FLOAT8_E4M3FN 10
/* col_amax_offsets (int32 [E], NULL: none) with col_amax (float32 [E, C], NULL: none; both or
 * neither): also the max |v| (NaN ignored) of each column over each expert's rows, taken in
 * the same read (expertact.hpp, fp8_quantize_rowwise's second form). */
EXPERTACT_API expertact_status expertact_fp8_quantize_rowwise_2d(const expertact_matrix* x,
                                                                 expertact_matrix* q,
                                                                 expertact_vector* scale,
                                                                 const expertact_vector* col_amax_offsets,
                                                                 expertact_matrix* col_amax,
                                                                 void* stream);
/* Per expert (offsets: as for the biases) and column: x [T, C] -> q_t (x quantised and
 * transposed) and scale float32 [E, C]. padded_offsets NULL: q_t [C, T], columns past the last
 * offset written as 0. padded_offsets (int32 [E], cumulative, on x's device): q_t [C, Tp],
 * expert e's rows from column padded_offsets[e - 1] (0 for e = 0) on, the rest of its block
 * and the columns past padded_offsets[E - 1] written as 0 (expertact.hpp,
 * fp8_quantize_colwise_grouped, says it exactly). amax (float32 [E, C], NULL: computed here):
 * the per expert and column amax, e.g. expertact_fp8_quantize_rowwise_2d's col_amax; the
 * scales then come from it and x is read once. */
EXPERTACT_API expertact_status expertact_fp8_quantize_colwise_grouped_2d(
    const expertact_matrix* x, const expertact_vector* offsets,
    const expertact_vector* padded_offsets, expertact_matrix* q_t, expertact_matrix* scale,
    const expertact_matrix* amax, void* stream);
/* The activation of expertact_glu_forward_2d's arguments quantized from its float32 values.
 * col_amax_offsets (int32 [E], NULL: none) with col_amax (float32 [E, F], NULL: none; both or
 * neither): also the max |h| (NaN ignored) of each column over each expert's rows, h as the
 * activation's forward writes it in x's dtype, taken in the same pass (expertact.hpp,
 * fp8_glu_rowwise's column amax forms). */
EXPERTACT_API expertact_status expertact_fp8_glu_rowwise_2d(
    const expertact_params* params, int32_t layout, const expertact_matrix* x,
    const expertact_matrix* up, const expertact_vector* weights, expertact_matrix* q,
    expertact_vector* scale, const expertact_vector* col_amax_offsets, expertact_matrix* col_amax,
    void* stream);
/* The same with expertact_glu_forward_bias_2d's per-expert bias (and offsets) added to gate and
 * up before the activation; col_amax (float32 [E, F], NULL: none): the column amax as above,
 * over the experts of offsets. */
EXPERTACT_API expertact_status expertact_fp8_glu_rowwise_bias_2d(
    const expertact_params* params, int32_t layout, const expertact_matrix* x,
    const expertact_matrix* up, const expertact_vector* weights, const expertact_matrix* bias,
    const expertact_vector* offsets, expertact_matrix* q, expertact_vector* scale,
    expertact_matrix* col_amax, void* stream);
/* The activation of expertact_glu_forward_2d's arguments (with bias: expertact_glu_forward_bias_2d's;
 * NULL: none) quantized per expert and column as expertact_fp8_quantize_colwise_grouped_2d
 * quantizes that forward's output (in x's dtype), without writing it: the same q_t, scale and
 * padding (expertact.hpp, fp8_glu_colwise_grouped, says it exactly). offsets: the experts' end
 * rows (also the bias's); amax (float32 [E, F], required): the per expert and column max |h| of
 * the rounded activation, e.g. expertact_fp8_quantize_rowwise_2d's col_amax of it. */
EXPERTACT_API expertact_status expertact_fp8_glu_colwise_grouped_2d(
    const expertact_params* params, int32_t layout, const expertact_matrix* x,
    const expertact_matrix* up, const expertact_vector* weights, const expertact_matrix* bias,
    const expertact_vector* offsets, const expertact_vector* padded_offsets, expertact_matrix* q_t,
    expertact_matrix* scale, const expertact_matrix* amax, void* stream);
/* The activation's backward quantized rowwise from its float32 values (expertact.hpp,
 * fp8_glu_backward_rowwise, says it exactly): packed layouts only; q float8 [rows, 2F] in
 * gate_up's column layout, scale float32 [rows]. NULL for what is not given or not wanted:
 * weights, bias (with offsets), grad_weights (float32 [rows]), col_amax (float32 [E, 2F], needs
 * offsets), grad_gate_up (the gradient in gate_up's dtype). No bias gradient. */
EXPERTACT_API expertact_status expertact_fp8_glu_backward_rowwise_2d(
    const expertact_params* params, int32_t layout, const expertact_matrix* grad_out,
    const expertact_matrix* gate_up, const expertact_vector* weights, const expertact_matrix* bias,
    const expertact_vector* offsets, expertact_matrix* q, expertact_vector* scale,
    expertact_vector* grad_weights, expertact_matrix* col_amax, expertact_matrix* grad_gate_up,
    void* stream);
/* Message of the last failed call on this thread ("" if the last call succeeded). */
EXPERTACT_API const char* expertact_last_error(void);

/* 1 if built with CUDA, else 0. */
EXPERTACT_API int32_t expertact_has_cuda(void);
EXPERTACT_API int32_t expertact_abi_version(void);
/* CPU worker threads: get, and set (0 = default). */
EXPERTACT_API int32_t expertact_cpu_threads(void);
EXPERTACT_API void expertact_set_cpu_threads(int32_t n);

#ifdef __cplusplus
}
#endif

#endif /* EXPERTACT_C_H_ */
