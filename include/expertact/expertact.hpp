// expertact public C++ API: the gated activation of MoE expert MLPs, forward and
// backward, over row-strided 2-D views on the CPU or a CUDA device.
//
// Framework-free: raw pointers, sizes, a stream. Every entry point validates its
// arguments once and returns a Status; on failure expertact::last_error() holds a
// message naming the argument and its value. Nothing throws out of these calls.
#pragma once

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
// are the other three, computed in float32.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

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

// The presets of SPEC section 1 (DeepSpeed's registry names).
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

// The expert MLP's grouped GEMMs with the activation fused into their epilogues
// (SPEC section 7; docs/fused-gemm.md): CUTLASS kernels for Hopper (sm_90) GPUs, bfloat16
// operands, float32 accumulation, built when the CUTLASS headers were found
// (has_fused_gemm()); otherwise these return kUnsupported. Rows are sorted by expert:
// expert e owns rows [offsets[e-1], offsets[e]) (offsets[-1] = 0). offsets is int32
// [num_experts] in device memory of the tensors' GPU; it is read on the device only (no
// host sync). It must be non-decreasing and at most T; values that are not are clamped
// into [0, T] (wrong rows, never an access outside the tensors). Rows past the last
// offset are neither read nor written. gate_up is interleaved (gate, up, gate, up, ...).
// Every matrix is bfloat16 with its last dimension contiguous; the tensor-memory-access
// (TMA) operands (x, w13, gate_up; grad_y, w2) need 16-byte aligned data and row strides
// that are multiples of 8 elements.
//
// Forward: gate_up[rows of e] = x[rows of e] @ w13[e]^T and
//          h = act(gate_up) * weights, computed from gate_up rounded to bfloat16 (as the
//          unfused glu_forward reads it back), rounded once.
//   x: [T, D]; w13: [num_experts * 2F, D], expert e's [2F, D] block at rows e * 2F
//   (w13 as [E, 2F, D] with D contiguous, gate and up interleaved along 2F);
//   weights: optional float32 [T]; gate_up: [T, 2F] and h: [T, F], written.
Status moe_fused_forward(const GluParams& params, const MatrixRef& x, const MatrixRef& w13,
                         int32_t num_experts, const int32_t* offsets, const VectorRef* weights,
                         const MatrixRef& gate_up, const MatrixRef& h, void* stream = nullptr);

// Backward: dh[rows of e] = grad_y[rows of e] @ w2[e]^T is computed and rounded to
// bfloat16 (as the unfused path stores it) but never stored: the epilogue turns it into
// grad_gate_up (glu_backward's gradient, interleaved; may be gate_up itself: in place)
// and, when grad_weights is given, the weights' gradient (float32 row sums over the N
// tiles, added with atomics: not bitwise reproducible run to run).
//   grad_y: [T, D]; w2: [num_experts * F, D], expert e's [F, D] block at rows e * F
//   (w2 as [E, F, D], D contiguous); gate_up: [T, 2F] from the forward;
//   grad_weights: float32 [T] (given only with weights).
Status moe_fused_backward(const GluParams& params, const MatrixRef& grad_y, const MatrixRef& w2,
                          int32_t num_experts, const int32_t* offsets, const MatrixRef& gate_up,
                          const VectorRef* weights, const MatrixRef& grad_gate_up,
                          const VectorRef* grad_weights, void* stream = nullptr);

// Whether this build has the fused grouped GEMMs (CUDA and the CUTLASS headers).
bool has_fused_gemm();

// The message of the last failed call on this thread ("" after a success).
const char* last_error();

// Whether this build has the CUDA path, and the number of CPU threads the CPU path uses.
bool has_cuda();
int cpu_threads();
// 0 restores the default (EXPERTACT_NUM_THREADS, else the hardware concurrency).
void set_cpu_threads(int n);

}  // namespace expertact
