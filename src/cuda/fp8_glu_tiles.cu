// The activation's blockwise FP8 operands on CUDA, through the tile engine (fp8_tiles.cuh): h =
// act(gate [+ bias], up [+ bias]) * w computed per element (math::glu_fwd, the forward kernels'
// expression), in row tiles of its float32 values (the forward's h operand), or rounded to the
// input's dtype first, as the activation's forward writes it, in column tiles over the experts
// (h recomputed in backward for the second weight gradient), never written itself.
#include "cuda/device.h"
#include "cuda/fp8_tiles.cuh"

namespace expertact::cuda {
namespace {

// h of 4 columns from c of one row. round_to_t: rounded to T first (the column tiles' values, as
// glu_col_quant_kernel's: the bytes of the forward's output; a flag, not a template argument:
// one kernel for both forms). bg null: no bias; else expert e's bias row (e outside [0, E): none,
// a row past the last offset). kRowExperts: the row-tile schedule knows no experts, so a tile's
// rows may belong to several and each row's expert is looked up (a binary search of offs, once
// a row and tile; the column tiles' schedule gives the tile's expert).
// vec: gate's and up's 4 values of a row in one access each (step 1, pointers and row strides
// multiples of 4 elements: fp8_tiles_plan.h's glu_vec4), else one by one.
template <typename T, Activation A>
struct GluTileSrc : tiles::NoTileState {
  static constexpr bool kRowExperts = true;
  static constexpr bool kRowWeights = true;  // wr: the row's routing weight, read once a tile
  bool round_to_t;
  bool vec;
  const T* g;
  const T* u;
  int64_t g_stride, u_stride;
  int step;
  const float* w;
  int64_t w_stride;
  const T* bg;
  const T* bu;
  int64_t b_stride;
  const int32_t* offs;
  int64_t E;
  math::Coeffs cf;
  __device__ __forceinline__ int64_t expert_of_row(int64_t r) const { return bg ? detail::expert_of(offs, E, r) : E; }
  __device__ __forceinline__ float weight_of_row(int64_t r) const { return w ? w[r * w_stride] : 1.0f; }
  // Streaming (fp8_tiles.cuh): a lane's 4 columns of gate and of up where they take one access.
  using PackT = Pack<T, 4>;
  static constexpr int kPacks = 2;
  __device__ __forceinline__ bool streams(int64_t, int nv) const { return vec && nv == 4; }
  __device__ __forceinline__ bool streams_full(int64_t) const { return true; }
  bool fast_ok() const { return vec && bg == nullptr; }  // (a bias's loads: the generic path)
  __device__ __forceinline__ const PackT* pack_src(int j, int64_t row, int64_t c) const {
    return reinterpret_cast<const PackT*>(j == 0 ? g + row * g_stride + c : u + row * u_stride + c);
  }
  // The full-tile path (fp8_tiles.cuh's column_tiles<true>): a warp's 8 rows from their streamed
  // packs (row k's gate at s[2 k kThreads], up at s[(2 k + 1) kThreads]), wr their weights; no bias.
  __device__ __forceinline__ void load_full(int64_t, int64_t, const float* wr, const PackT* s,
                                            float (&v)[tiles::kRowsPerWarp][4]) const {
#pragma unroll
    for (int k = 0; k < tiles::kRowsPerWarp; ++k) {
      const PackT gp = s[2 * k * tiles::kThreads];
      const PackT up = s[(2 * k + 1) * tiles::kThreads];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) value(pack_f(gp, jj), pack_f(up, jj), wr[k], false, 0, 0, v[k][jj]);
    }
  }
  __device__ __forceinline__ void load(int, int64_t row, int64_t c, int nv, int64_t e, float wr, const PackT* s,
                                       float (&v)[4]) const {
    const bool has_b = bg != nullptr && e >= 0 && e < E;
    if (vec && nv == 4) {
      const PackT gp = s ? s[0] : *pack_src(0, row, c);
      const PackT up = s ? s[tiles::kThreads] : *pack_src(1, row, c);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) value(pack_f(gp, jj), pack_f(up, jj), wr, has_b, e, c + jj, v[jj]);
      return;
    }
    const T* gr = g + row * g_stride;
    const T* ur = u + row * u_stride;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if (jj >= nv) break;  // (an unrolled loop: v's indices stay constants, v in registers)
      const int64_t j = (c + jj) * step;
      value(to_f(gr[j]), to_f(ur[j]), wr, has_b, e, j, v[jj]);
    }
  }
  // h of one column j (gate_up's index of it, step included) from its gate and up values.
  __device__ __forceinline__ void value(float gv, float uv, float wr, bool has_b, int64_t e, int64_t j,
                                        float& out) const {
    if (has_b) gv += to_f(bg[e * b_stride + j]), uv += to_f(bu[e * b_stride + j]);
    const float h = math::glu_fwd<A>(gv, uv, wr, cf);
    out = round_to_t ? to_f(from_f<T>(h)) : h;
  }
};

// bf16 and fp16: two buffers of gate and up (128 KiB); float32: one.
static_assert(tiles::Stream<GluTileSrc<__nv_bfloat16, Activation::kSilu>>::kBuffers == 2);
static_assert(tiles::Stream<GluTileSrc<float, Activation::kSilu>>::kBuffers == 1);

Status launch_glu_tiles(bool round_to_t, const detail::GluProblem& p, const detail::GluBias* bias,
                        const detail::TileOut& o, int64_t grid_x, cudaStream_t st, const char* what) {
  const math::Coeffs cf{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  return dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    return detail::dispatch_act(p.params.act, [&](auto act) -> Status {
      constexpr Activation A = decltype(act)::value;
      // The bias's experts: its own offsets for row tiles, o's (the same) for column tiles.
      const GluTileSrc<T, A> src{{},
                                 round_to_t,
                                 tiles::glu_vec4(p, sizeof(T)),
                                 static_cast<const T*>(p.g),
                                 static_cast<const T*>(p.u),
                                 p.g_stride,
                                 p.u_stride,
                                 p.step,
                                 p.w,
                                 p.w_stride,
                                 bias ? static_cast<const T*>(bias->bg) : nullptr,
                                 bias ? static_cast<const T*>(bias->bu) : nullptr,
                                 bias ? bias->b_stride : 0,
                                 bias ? bias->er.offsets : nullptr,
                                 bias ? bias->er.experts : 0,
                                 cf};
      return tiles::launch_tiles(src, o, p.rows, p.F, grid_x, false, p.device_id, st, what);
    });
  });
}

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {

Status cuda_fp8_glu_row_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", bias ? bias->er.offsets : nullptr},
                         {"q", o.q}, {"scale", o.scale}}));
  return cuda::launch_glu_tiles(false, p, bias, o, cuda::tiles::schedule_blocks(o, p.rows, 0),
                                static_cast<cudaStream_t>(stream), "fp8 glu row tiles kernel launch");
}

Status cuda_fp8_glu_column_tiles(const GluProblem& p, const GluBias* bias, const TileOut& o, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", o.offsets}, {"padded_offsets", o.pends},
                         {"q_t", o.q_t}, {"scale", o.col_scale}}));
  return cuda::launch_glu_tiles(true, p, bias, o, cuda::tiles::schedule_blocks(o, p.rows, 0),
                                static_cast<cudaStream_t>(stream), "fp8 glu column tiles kernel launch");
}

}  // namespace expertact::detail
