// expertact public C++ API: the gated activation of MoE expert MLPs, forward and
// backward, over row-strided 2-D views on the CPU or a CUDA device.
//
// Framework-free: raw pointers, sizes, a stream. Every entry point validates its
// arguments once and returns a Status; on failure expertact::last_error() holds a
// message naming the argument and its value. Nothing throws out of these calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace expertact {

enum class Status : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // shape, device, stride, alias or parameter error
  kUnsupported = 2,      // well-formed but not built in (e.g. CUDA tensor, CPU-only build)
  kCudaError = 3,        // a CUDA runtime call failed
  kInternal = 4,         // a bug in expertact: please report it
  kInvalidDtype = 5,     // an operand's dtype is not accepted, or differs from its partner's
};

enum class Activation : int32_t {
  kSilu = 0,      // silu_alpha(x) = x * sigmoid(alpha * x)
  kGeluTanh = 1,  // gelu(x, approximate="tanh"); alpha is ignored
};

// Where gate and up live. For the three packed layouts the input is one
// [rows, 2F] tensor and its gradient comes back packed the same way.
enum class Layout : int32_t {
  kSeparate = 0,       // gate [rows, F], up [rows, F]
  kHalves = 1,         // gate_up[:, :F] = gate, gate_up[:, F:] = up
  kHalvesUpFirst = 2,  // gate_up[:, :F] = up,   gate_up[:, F:] = gate
  kInterleaved = 3,    // gate_up[:, 0::2] = gate, gate_up[:, 1::2] = up
};

// float64 is accepted on the CPU only and computed in float64 throughout: it
// exists for gradient checking (torch.autograd.gradcheck); the kernels' dtypes
// are the other three, computed in float32. kFloat8E4M3 (float8 e4m3fn: no infinities,
// 0x7f / 0xff NaN, largest finite 448) is the type of the FP8 outputs below only.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3, kFloat8E4M3 = 4 };

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

// out = act(min(g, limit)) * (clamp(u, -limit, limit) + beta) * w
// limit = +inf means "no clamp at all" (plain swiglu / geglu): a NaN input then
// gets a NaN gradient of its own, as F.silu(g) * u gives it; with a finite
// limit the clamp's mask is false at NaN and that gradient is 0, as
// torch.clamp's backward gives it.
struct GluParams {
  Activation act = Activation::kSilu;
  float alpha = 1.0f;
  float limit = std::numeric_limits<float>::infinity();
  float beta = 0.0f;
};

// The presets of docs/spec.md section 1 (DeepSpeed's registry names).
GluParams preset_swiglu();
GluParams preset_swiglu_clamped(float limit = 7.0f);
GluParams preset_swiglu_oai(float alpha = 1.702f, float limit = 7.0f);
GluParams preset_geglu_tanh();

// A row-strided 2-D view: element (r, c) is at data + r * row_stride + c
// (in elements). Inputs are only read, except by an in-place backward, which
// names the input's memory as its gradient output.
struct MatrixRef {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // elements; may be anything >= cols when rows > 1
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
};

// A float32 vector of per-row weights (or their gradient): element r at data + r * stride.
struct VectorRef {
  float* data = nullptr;
  int64_t size = 0;
  int64_t stride = 1;
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
};

// Forward: out[rows, F] = glu(gate, up) * w.
//   x: gate (kSeparate) or the packed gate_up [rows, 2F].
//   up: the up tensor for kSeparate, nullptr otherwise.
//   weights: optional per-row float32 weights (nullptr = 1).
//   stream: a cudaStream_t for CUDA operands (nullptr = legacy default stream); ignored on the CPU.
Status glu_forward(const GluParams& params, Layout layout, const MatrixRef& x,
                   const MatrixRef* up, const VectorRef* weights, const MatrixRef& out,
                   void* stream = nullptr);

// Backward: gradients of the forward above given grad_out [rows, F].
//   grad_x: gradient of x, same layout and shape as x (for kSeparate, of gate).
//   grad_up: gradient of up for kSeparate, nullptr otherwise.
//   grad_weights: float32 [rows] gradient of the weights, or nullptr when not
//   wanted; must be nullptr when weights is nullptr.
// In-place backward: grad_x may be x itself (same data, same strides), and
// grad_up up itself; every input value is read before its gradient is written.
// Any other overlap between an input and an output is refused.
Status glu_backward(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                    const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                    const MatrixRef& grad_x, const MatrixRef* grad_up,
                    const VectorRef* grad_weights, void* stream = nullptr);

// The message of the last failed call on this thread ("" after a success).
// ---------------------------------------------------------------------------
// Per-expert biases (docs/spec.md section 7): rows sorted by expert, expert e owning
// rows [offsets[e - 1], offsets[e]) (offsets[-1] = 0), as torch._grouped_mm's offs.
// Rows past offsets[E - 1] belong to no expert: they get no bias and add to no bias
// gradient. The bias gradients are deterministic: fixed-order sums in float32 (float64
// for float64 tensors), bit-identical from run to run, independent of thread counts.
// ---------------------------------------------------------------------------

// int32 [E] cumulative end rows, contiguous, on the tensors' device; non-decreasing with
// offsets[E - 1] <= rows. The CPU path checks the values; on a GPU they are not read on
// the host (values out of order give wrong sums there, never an access out of bounds).
struct OffsetsRef {
  const int32_t* data = nullptr;
  int64_t size = 0;  // E
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
};

// Bytes of the workspace the CUDA bias backwards need (below) for `rows` rows of `cols`
// output columns (F for the activation, the columns for expert_bias) and E experts:
// float32 partial sums, (rows / chunk + E) x bias columns, plus the per-row sums of
// column tiles. The CPU path takes no workspace (pass nullptr, 0).
size_t glu_bias_workspace_bytes(int64_t rows, int64_t F, int64_t num_experts);
size_t expert_bias_workspace_bytes(int64_t rows, int64_t cols, int64_t num_experts);

// glu_forward with a per-expert bias on gate and up before the activation (the clamp
// applies after it): out = act(g + bias_g[e]) * (clamp(u + bias_u[e]) + beta) * w.
// bias: [E, 2F] of x's dtype, its columns in the packed layout's order (kSeparate:
// gate's F columns then up's). The input x is not changed: backward adds the bias again.
Status glu_forward_bias(const GluParams& params, Layout layout, const MatrixRef& x,
                        const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                        const OffsetsRef& offsets, const MatrixRef& out, void* stream = nullptr);

// glu_backward of glu_forward_bias. grad_bias: [E, 2F] of bias's layout and dtype, the
// column sums of each expert's rows of the input gradient (zero for an expert without
// rows), or nullptr when not wanted. In place as glu_backward (grad_x may be x).
Status glu_backward_bias(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                         const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                         const MatrixRef& bias, const OffsetsRef& offsets,
                         const MatrixRef& grad_x, const MatrixRef* grad_up,
                         const VectorRef* grad_weights, const MatrixRef* grad_bias,
                         void* workspace, size_t workspace_bytes, void* stream = nullptr);

// out = x + w[r] * bias[e] per row (w = 1 without weights): the output bias of an expert
// MLP whose routing weights scale the whole expert output. out may be x (in place).
Status expert_bias_forward(const MatrixRef& x, const MatrixRef& bias, const OffsetsRef& offsets,
                           const VectorRef* weights, const MatrixRef& out,
                           void* stream = nullptr);

// Gradients of expert_bias_forward (x's gradient is grad_out itself): grad_bias[e] =
// sum over e's rows of w[r] * grad_out[r] (or nullptr), grad_weights[r] =
// grad_out[r] . bias[e] (float32 [rows], or nullptr; needs weights).
Status expert_bias_backward(const MatrixRef& grad_out, const MatrixRef& bias,
                            const OffsetsRef& offsets, const VectorRef* weights,
                            const MatrixRef* grad_bias, const VectorRef* grad_weights,
                            void* workspace, size_t workspace_bytes, void* stream = nullptr);

// ---------------------------------------------------------------------------
// FP8 (docs/spec.md section 10): rowwise float8 e4m3fn with power-of-two scales, as torchao
// computes them for its FP8 grouped GEMMs: amax = max |v| over the row (NaN ignored),
// s = 2^floor(log2(float32(448 / double(max(amax, 1e-12f))))), q = e4m3fn(clamp(v * s,
// -448, 448)) rounded to nearest even, and scale = 1 / s, the dequantisation scale a scaled
// GEMM takes. A NaN element stays NaN in q; an infinite one gives s = 0 (scale = +inf), so the
// row's GEMM output is NaN, never finite. CPU and CUDA; a NaN product is written 0x7f.
// ---------------------------------------------------------------------------

// q [rows, C] (kFloat8E4M3) and scale (float32 [rows]) of x [rows, C] (float32, float16 or
// bfloat16).
Status fp8_quantize_rowwise(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                       void* stream = nullptr);
// The same, also writing col_amax (float32 [E, C]): the max |v| (NaN ignored) of each column
// over each expert's rows (col_amax_offsets: int32 [E], the experts' cumulative end rows, as
// OffsetsRef; rows past the last offset count for no expert; an expert without rows gets 0),
// taken in the same read of x (on a GPU). It is what fp8_quantize_colwise_grouped computes
// first, so passing it there as `amax` spares that call a read of x.
Status fp8_quantize_rowwise(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                            const OffsetsRef& col_amax_offsets, const MatrixRef& col_amax,
                            void* stream = nullptr);

// Per expert and column, for the operands of the weight-gradient GEMMs (whose sums run over
// an expert's rows) and of the weights ([E, K, N] as [E * K, N] with offsets (e + 1) * K):
// the same recipe with amax taken over the rows of expert e in column c. x [T, C]; offsets as
// OffsetsRef (the bias section); q_t (kFloat8E4M3): the quantised x transposed, i.e. x in
// column-major order, as the GEMM reads it; scale float32 [E, C].
// Without padded_offsets (nullptr), q_t is [C, T], row r of x at column r, and the columns
// past the last offset are 0. With padded_offsets (int32 [E], cumulative like offsets, on x's
// device), q_t is [C, Tp] for any Tp >= padded_offsets[E - 1]: expert e's block of columns
// is [padded_offsets[e - 1], padded_offsets[e]) (from 0 for e = 0), its rows first, in order,
// then 0 to the block's end (each block must hold its expert's rows); columns past
// padded_offsets[E - 1] are 0. Blocks padded to a multiple of 16 rows are what
// torch._scaled_grouped_mm's 2d x 2d form needs on sm90. On the CPU the padded offsets' values
// are checked; on a GPU neither offsets are read on the host (values that break these rules
// give wrong output there, never an access out of bounds). CPU and CUDA write the same bytes.
Status fp8_quantize_colwise_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                    const OffsetsRef* padded_offsets, const MatrixRef& q_t,
                                    const MatrixRef& scale, void* stream = nullptr);
// The same with the per expert and column amax given (float32 [E, C], e.g. the col_amax of
// fp8_quantize_rowwise with the same offsets): the scales come from it and x is read once.
// With the amax of x itself the bytes and scales are those of the form above.
Status fp8_quantize_colwise_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                    const OffsetsRef* padded_offsets, const MatrixRef& q_t,
                                    const MatrixRef& scale, const MatrixRef& amax,
                                    void* stream = nullptr);

// The activation (glu_forward's arguments) quantized as above from its float32 values, one
// rounding: q [rows, F] (kFloat8E4M3), scale float32 [rows].
Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& q,
                       const VectorRef& scale, void* stream = nullptr);

// The same, also writing col_amax (float32 [E, F]): the max |h| (NaN ignored) of each column
// over each expert's rows (col_amax_offsets as in fp8_quantize_rowwise: rows past the last
// offset count for no expert, an expert without rows gets 0), h as the activation's forward
// (glu_forward) writes it, in x's dtype: fp8_quantize_rowwise's col_amax of that output, bit
// for bit, taken in the same pass (for fp8_quantize_colwise_grouped's amax of h recomputed in
// x's dtype). q and scale are those of the form above.
Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& q,
                       const VectorRef& scale, const OffsetsRef& col_amax_offsets, const MatrixRef& col_amax,
                       void* stream = nullptr);

// The same with glu_forward_bias's per-expert bias (bias [E, 2F] in x's layout, x's dtype;
// offsets as there) added to gate and up, in float32, before the activation.
Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                       const OffsetsRef& offsets, const MatrixRef& q, const VectorRef& scale,
                       void* stream = nullptr);
// The biased form with the column amax (float32 [E, F]) as above, over offsets' experts, of h
// as glu_forward_bias writes it.
Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                       const OffsetsRef& offsets, const MatrixRef& q, const VectorRef& scale,
                       const MatrixRef& col_amax, void* stream = nullptr);

// The activation h (glu_forward's arguments, or glu_forward_bias's with bias, nullptr: none;
// its offsets are `offsets`) quantised per expert and column as fp8_quantize_colwise_grouped
// quantises a tensor: the same bytes and scales as fp8_quantize_colwise_grouped(h, offsets,
// padded_offsets, q_t, scale, amax) with h the forward's output in x's dtype (q_t
// [F, rows or Tp] kFloat8E4M3, scale float32 [E, F]), without writing h: x is read once and
// only the float8 bytes and scales are written (the weight gradient's operand of the second
// GEMM in an FP8 backward). amax (float32 [E, F]) is required: the max |h| of each column
// over each expert's rows, of h rounded to x's dtype, as fp8_quantize_rowwise's col_amax of h
// with the same offsets computes it (a forward that quantises h rowwise can keep it). The
// bytes depend only on h's bits, so CPU and CUDA agree wherever their forwards do (the GPU's
// exp and division are approximate forms: h may differ in its last bit between them).
Status fp8_glu_colwise_grouped(const GluParams& params, Layout layout, const MatrixRef& x, const MatrixRef* up,
                               const VectorRef* weights, const MatrixRef* bias, const OffsetsRef& offsets,
                               const OffsetsRef* padded_offsets, const MatrixRef& q_t, const MatrixRef& scale,
                               const MatrixRef& amax, void* stream = nullptr);

// The activation's backward (glu_backward's gradient of gate_up, with glu_forward_bias's
// per-expert bias when given) quantized as above from its float32 values, one rounding,
// without writing it in gate_up's dtype: q [rows, 2F] (kFloat8E4M3) in gate_up's column
// layout, scale float32 [rows]. Packed layouts only (gate_up [rows, 2F]; grad_out [rows, F]
// of its dtype). Optional outputs (nullptr: not wanted): grad_weights (float32 [rows], needs
// weights: the row's sum of grad_out * act * (up + beta), as glu_backward computes it);
// col_amax (float32 [E, 2F], needs offsets): the max |gradient| (NaN ignored) of each column
// over each expert's rows, of the gradient rounded to gate_up's dtype (grad_gate_up's values:
// fp8_quantize_rowwise's col_amax of grad_gate_up, bit for bit), for
// fp8_quantize_colwise_grouped's amax when it quantises grad_gate_up; grad_gate_up ([rows, 2F] of gate_up's dtype): the
// gradient rounded to that dtype, as glu_backward writes it. bias (with offsets, as
// fp8_glu_rowwise's): added to gate and up before the activation; its own gradient is not
// computed here (glu_backward_bias computes it). CPU and CUDA quantise alike (the float32
// gradient's bytes are the same function of it on both); the gradient itself differs in its
// last bits between them as the activation's backward does (the GPU's exp and division are
// the hardware's approximate forms), and grad_weights' float32 sums by their order.
Status fp8_glu_backward_rowwise(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                                const MatrixRef& gate_up, const VectorRef* weights, const MatrixRef* bias,
                                const OffsetsRef* offsets, const MatrixRef& q, const VectorRef& scale,
                                const VectorRef* grad_weights, const MatrixRef* col_amax,
                                const MatrixRef* grad_gate_up, void* stream = nullptr);

// ---------------------------------------------------------------------------
// FP8 blockwise operands (DeepSeek-V3's recipe; docs/notes/fp8-recipes.md, "The blockwise
// operand formats"): the rowwise recipe above (torchao's power-of-two scale of the amax, NaN
// ignored; q = e4m3fn(clamp(v * s, -448, 448)), nearest even; scale = 1 / s) applied per tile
// of 128 values: 1 x 128 row tiles (the token-major operands of the forward and input-gradient
// GEMMs), 128 x 128 blocks (the weights), 128 x 1 column tiles over one expert's rows (the
// operands of the weight-gradient GEMMs). A tile at an edge takes what is there. An all-zero
// tile gets scale 2^-48 (s of amax 1e-12); an infinite value gives its tile scale +inf.
// CPU and CUDA write the same bytes and scales for the same values.
// ---------------------------------------------------------------------------

// A 3-D view [batch, rows, cols] of any element strides (in elements; e.g. the transposed view
// [E, D, 2F] of an [E, 2F, D] weight): element (b, r, c) at data + b * batch_stride +
// r * row_stride + c * col_stride. Only read.
struct Tensor3Ref {
  void* data = nullptr;
  int64_t batch = 0, rows = 0, cols = 0;
  int64_t batch_stride = 0, row_stride = 0, col_stride = 1;
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
};

// Row tiles of x [T, C] (float32, float16 or bfloat16): q [T, C] (kFloat8E4M3) and scale
// float32 [KB, T], KB = ceil(C / 128) (a MatrixRef of KB rows of T, row stride >= T: T
// contiguous): scale (k, r) dequantises row r's columns 128 k .. 128 k + 127 (the last tile
// partial when C is not a multiple of 128). Its [T, KB] view with strides (1, T) is the
// "outer-dim-major" 1 x 128 scale torch._scaled_mm reads.
Status fp8_quantize_row_tiles(const MatrixRef& x, const MatrixRef& q, const MatrixRef& scale,
                              void* stream = nullptr);

// Column tiles per expert, for the weight-gradient GEMMs (their reduction runs over an
// expert's rows): x [T, C] with rows sorted by expert (offsets as OffsetsRef: int32 [E], the
// cumulative end rows); padded_offsets: int32 [E] on x's device, the experts' end rows once
// each expert's rows are padded to a multiple of 128 (the sum over e' <= e of ceil(n_e' / 128)
// * 128, n_e the rows of expert e). q_t [C, Tp] (kFloat8E4M3; Tp a multiple of 128, at least
// padded_offsets[E - 1]): expert e's rows, in order, from column padded_offsets[e - 1] (0 for
// e = 0) on, then 0x00 to its block's end; scale float32 [Tp / 128, C]: row j holds the C
// scales of the tile of columns 128 j .. 128 j + 127 of q_t (expert e's tiles: rows
// padded_offsets[e - 1] / 128 .. padded_offsets[e] / 128 - 1). Columns past
// padded_offsets[E - 1] are 0x00 (scale 2^-48); rows past offsets[E - 1] are left out. On the
// CPU both offsets' values are checked (padded_offsets must be exactly that padding); on a GPU
// they are not read on the host (values that break the rules give wrong output there, never an
// access out of bounds).
Status fp8_quantize_column_tiles_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                         const OffsetsRef& padded_offsets, const MatrixRef& q_t,
                                         const MatrixRef& scale, void* stream = nullptr);
// The same, also writing x's row tiles (q [T, C], row_scale float32 [KB, T], as
// fp8_quantize_row_tiles writes them, every row included) from the same read of x: a 128 x 128
// tile of one expert's rows holds what both need.
Status fp8_quantize_column_tiles_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                         const OffsetsRef& padded_offsets, const MatrixRef& q_t,
                                         const MatrixRef& scale, const MatrixRef& q, const MatrixRef& row_scale,
                                         void* stream = nullptr);

// 128 x 128 blocks of the weights w [E, R, C] (any strides): q [E * R, C] (kFloat8E4M3, the
// [E, R, C] tensor with expert e's row r at row e * R + r; C contiguous) and scale float32
// [E * RB, CB] (RB = ceil(R / 128), CB = ceil(C / 128); the [E, RB, CB] tensor): scale
// (e RB + i, j) dequantises rows 128 i .. and columns 128 j .. of expert e. A block's scale is
// the same in both orientations, so the transposed q serves the transposed GEMM operand.
Status fp8_quantize_blocks(const Tensor3Ref& w, const MatrixRef& q, const MatrixRef& scale,
                           void* stream = nullptr);

// The activation (glu_forward's arguments; with bias, not nullptr, glu_forward_bias's: bias
// [E, 2F] in x's layout and dtype with its offsets, both or neither) quantised in row tiles
// from its float32 values (one rounding, as fp8_glu_rowwise): q [rows, F] (kFloat8E4M3),
// scale float32 [ceil(F / 128), rows] as fp8_quantize_row_tiles's.
Status fp8_glu_row_tiles(const GluParams& params, Layout layout, const MatrixRef& x, const MatrixRef* up,
                         const VectorRef* weights, const MatrixRef* bias, const OffsetsRef* offsets,
                         const MatrixRef& q, const MatrixRef& scale, void* stream = nullptr);

// The activation h (glu_forward's arguments, or glu_forward_bias's with bias; nullptr: none),
// rounded to x's dtype as the activation's forward writes it, quantised in column tiles as
// fp8_quantize_column_tiles_grouped quantises a tensor: the same q_t [F, Tp] and scale
// float32 [Tp / 128, F] as fp8_quantize_column_tiles_grouped(h, offsets, padded_offsets, ...)
// with h the forward's output, without writing h (x is read once). offsets group the rows
// and are the bias's. The bytes depend only on h's bits, so CPU and CUDA agree wherever their
// forwards do (the GPU's exp and division are approximate forms: h may differ in its last bit).
Status fp8_glu_column_tiles_grouped(const GluParams& params, Layout layout, const MatrixRef& x,
                                    const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                                    const OffsetsRef& offsets, const OffsetsRef& padded_offsets,
                                    const MatrixRef& q_t, const MatrixRef& scale, void* stream = nullptr);

// The activation's backward (glu_backward's gradient of gate_up, with glu_forward_bias's bias
// when given), computed in float32 and quantised from those values (one rounding each) without
// writing it in gate_up's dtype: row tiles along the packed 2F columns, q [rows, 2F]
// (kFloat8E4M3, gate_up's column layout) with scale float32 [ceil(2F / 128), rows], for the
// input gradient's GEMM; and, with q_t and col_scale (both or neither; they need offsets and
// padded_offsets), column tiles q_t [2F, Tp] with col_scale float32 [Tp / 128, 2F] as
// fp8_quantize_column_tiles_grouped writes them, for the weight gradient's GEMM, from the same
// pass (every row's row tiles; rows past offsets[E - 1] have no column tiles). Packed layouts
// only (gate_up [rows, 2F]; grad_out [rows, F] of its dtype). Optional (nullptr: not wanted):
// bias (with offsets: added to gate and up before the activation; its own gradient is not
// computed here); grad_weights (float32 [rows], needs weights: the row's float32 sum of
// grad_out * act * (up + beta) over its F columns, in a fixed order: the same bits from run to
// run); grad_gate_up ([rows, 2F] of gate_up's dtype, not overlapping gate_up: the gradient
// rounded to that dtype, as glu_backward writes it). CPU and CUDA quantise alike; the float32
// gradient itself differs in its last bits between them as the activation's backward does, and
// grad_weights by its sum's order.
Status fp8_glu_backward_tiles(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                              const MatrixRef& gate_up, const VectorRef* weights, const MatrixRef* bias,
                              const OffsetsRef* offsets, const OffsetsRef* padded_offsets, const MatrixRef& q,
                              const MatrixRef& scale, const MatrixRef* q_t, const MatrixRef* col_scale,
                              const VectorRef* grad_weights, const MatrixRef* grad_gate_up, void* stream = nullptr);

const char* last_error();

// Whether this build has the CUDA path, and the number of CPU threads the CPU path uses.
bool has_cuda();
int cpu_threads();
// 0 restores the default (EXPERTACT_NUM_THREADS, else the hardware concurrency).
void set_cpu_threads(int n);

}  // namespace expertact
