// The activation's backward in blockwise FP8 on CUDA, through the tile engine (fp8_tiles.cuh):
// the gradient of gate_up computed in float32 per element (math::glu_bwd, the backward kernels'
// expression) for each packed column of a tile, quantised in row tiles (the input gradient's
// operand) and, over the experts' padded tiles, in column tiles (the weight gradient's) from the
// same registers: one pass, the gradient never written in gate_up's dtype unless asked for. A
// block takes all of a tile's columns, so the routing weights' gradient (each row's sum over its
// F columns) is each lane's running sum in column order, then a warp's fixed-order reduction:
// the same bits from run to run.
//
// The values of a lane's 4 packed columns: interleaved (step 2), the gate and up of 2 columns of
// gate_up's F, each computed once; halves and up-first, 4 columns of one half (or across the two
// halves at column F): paired (F a multiple of 128), computed once in the pair's first tile for
// both halves, the other half's kept in shared memory for the pair's second (the stash), the
// pair's gate, up and dy streamed into shared memory while the pair before is worked; else each
// computed for the one gradient it needs (the arithmetic of glu_bwd for both taken, the unused
// half dropped).
#include "cuda/device.h"
#include "cuda/fp8_tiles.cuh"

namespace expertact::cuda {
namespace {

__device__ __forceinline__ float warp_sum_tiles(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// kRowExperts: the tile engine gives each row's expert (the tile's, or looked up in offs where
// the schedule knows no experts: row tiles alone, with a bias), once a row and tile. vec: a
// lane's 4 columns of gate, up and dy in one access each (step 1, F, the pointers and row
// strides multiples of 4 elements: fp8_tiles_plan.h's bwd_vec4). paired (step 1, F a multiple of
// 128: bwd_paired): column tiles taken gate's k-th, up's k-th, gate's (k + 1)-th, ..., so that
// the second of a pair reads the gate, up and dy columns the first just read, from the cache (in
// F's order they lie 48 tiles apart, evicted in between at the busiest rank's shape); gate's
// tiles stay in ascending order, so the routing weights' gradient sums its terms in the same
// order.
template <typename T, Activation A>
struct BwdTileSrc {
  static constexpr bool kRowExperts = true;
  static constexpr int kMinBlocks = 1;
  bool vec, paired;
  const T* g;
  const T* u;
  int64_t x_stride;  // gate_up's row stride
  int step;
  int64_t F;
  int64_t q_g, q_u;  // the packed columns of gate's and up's column 0
  const T* dy;
  int64_t dy_stride;
  const float* w;
  int64_t w_stride;
  const T* bg;
  const T* bu;
  int64_t b_stride;
  const int32_t* offs;
  int64_t E;
  math::Coeffs cf;
  float* dw;  // null: not wanted
  int64_t dw_stride;
  T* dgu;  // null: not wanted
  int64_t dgu_stride;
  float part[tiles::kRowsPerWarp];  // the lane's running row sums of the routing weights' gradient

  __device__ __forceinline__ int64_t expert_of_row(int64_t r) const { return bg ? detail::expert_of(offs, E, r) : E; }
  static constexpr bool kRowWeights = true;  // wr: the row's routing weight, read once a tile
  __device__ __forceinline__ float weight_of_row(int64_t r) const { return w ? w[r * w_stride] : 1.0f; }
  __device__ __forceinline__ void begin_tile() {
#pragma unroll
    for (int k = 0; k < tiles::kRowsPerWarp; ++k) part[k] = 0.0f;
  }
  // A term of row k's weights' gradient into the lane's sum, rounded as its own add: left to the
  // compiler, the add may fuse with the term's last product (dy * a * v) into an FMA in one of
  // load's forms and not in another, and the paired, vector and one-at-a-time forms of a row
  // would give sums a rounding apart.
  __device__ __forceinline__ void add_term(int k, float term) { part[k] = __fadd_rn(part[k], term); }
  __device__ __forceinline__ void end_tile(const detail::TileRows& t, int warp, int lane) {
    if (dw == nullptr) return;
#pragma unroll
    for (int k = 0; k < tiles::kRowsPerWarp; ++k) {
      const int i = tiles::kRowsPerWarp * warp + k;
      if (i >= t.n) continue;  // the same in the whole warp
      const float s = warp_sum_tiles(part[k]);
      if (lane == 0) dw[(t.r0 + i) * dw_stride] = s;
    }
  }
  __device__ __forceinline__ int64_t column_tile(int64_t i, int64_t KB) const {
    return tiles::paired_column_tile(paired, i, KB);
  }
  // Streaming (fp8_tiles.cuh), one buffer beside the stash: paired with 4-value loads, a pair's
  // gate, up and dy columns, copied while the pair before is worked (after its first tile's
  // loads); the second tile of a pair reads the stash, nothing else.
  using PackT = Pack<T, 4>;
  static constexpr int kPacks = 3;
  static constexpr bool kTwoBuffers = false;
  __device__ __forceinline__ int64_t stream_next(int64_t i, int64_t kb1) const {
    return paired && vec && i % 2 == 0 && i + 2 < kb1 ? i + 2 : -1;
  }
  __device__ __forceinline__ bool streams(int64_t c, int nv) const {
    return step != 2 && vec && nv == 4 && !(paired && c >= F);
  }
  // The full-tile path (fp8_tiles.cuh's column_tiles<true>): paired with 4-value loads, every
  // first tile of a pair streamed, no bias (its rows' loads would be the path's largest cost).
  __device__ __forceinline__ bool streams_full(int64_t c) const { return c < F; }
  bool fast_ok() const { return vec && paired && bg == nullptr; }
  // Pack j (gate's, up's, dy's) of the F columns under packed columns c .. c + 3 (one half).
  __device__ __forceinline__ const PackT* pack_src(int j, int64_t row, int64_t c) const {
    const int64_t j0 = c - (c >= q_u && c < q_u + F ? q_u : q_g);
    if (j == 2) return reinterpret_cast<const PackT*>(dy + row * dy_stride + j0);
    return reinterpret_cast<const PackT*>((q_g == 0 ? g : u) + row * x_stride + (j == 0 ? q_g : q_u) + j0);
  }
  // The gradient of gate_up's F column j of the row: (dg, du), and its term of the weights'
  // gradient.
  __device__ __forceinline__ void grad(const T* gr, const T* dyr, const T* bgr, const T* bur, float wr, int64_t j,
                                       float& dg, float& du, float& term) const {
    const int64_t o = j * step;
    grad_of(to_f(gr[q_g + o]), to_f(gr[q_u + o]), to_f(dyr[j]), bgr, bur, wr, o, dg, du, term);
  }
  // The same from the values of gate, up and dy (o: the column's offset in the bias rows).
  __device__ __forceinline__ void grad_of(float gv, float uv, float dyv, const T* bgr, const T* bur, float wr,
                                          int64_t o, float& dg, float& du, float& term) const {
    if (bgr) gv += to_f(bgr[o]), uv += to_f(bur[o]);
    math::glu_bwd<A>(gv, uv, dyv, wr, cf, dg, du, term);
  }
  // Paired with 4-value loads, a pair's first tile computes each element's gradient of both halves
  // (glu_bwd gives both) and leaves the other half's here for the pair's second tile: thread t's
  // 4 values of its k-th row in slot (k, t), written and read by t alone (no barrier), float32 as
  // computed, so the second tile quantises the same values the recomputation gave.
  static constexpr int kStashBytes = tiles::kRowsPerWarp * tiles::kThreads * sizeof(float4);
  __device__ __forceinline__ float4* stash_slot(int k) const {
    extern __shared__ float4 bwd_stash[];
    return bwd_stash + k * tiles::kThreads + threadIdx.x;
  }
  // The full-tile path (fp8_tiles.cuh's column_tiles<true>; paired and vec without a bias,
  // fast_ok): a warp's 8 rows from row0 at packed columns c .. c + 3, a pair's first tile from the
  // streamed packs (row k's j-th at s[(3 k + j) kThreads]) with wr the rows' weights, its second
  // from the stash; one branch a tile. A first tile lies in the first half, so its columns are
  // up's where up comes first (q_u == 0) and its F column is c.
  __device__ __forceinline__ void load_full(int64_t row0, int64_t c, const float* wr, const PackT* s,
                                            float (&v)[tiles::kRowsPerWarp][4]) {
    if (c >= F) {
#pragma unroll
      for (int k = 0; k < tiles::kRowsPerWarp; ++k) {
        const float4 o = *stash_slot(k);
        v[k][0] = o.x, v[k][1] = o.y, v[k][2] = o.z, v[k][3] = o.w;
      }
    } else {
      const bool up = q_u == 0;
#pragma unroll
      for (int k = 0; k < tiles::kRowsPerWarp; ++k)
        pair_values(k, up, c, wr[k], nullptr, nullptr, s[3 * k * tiles::kThreads], s[(3 * k + 1) * tiles::kThreads],
                    s[(3 * k + 2) * tiles::kThreads], v[k]);
    }
    if (dgu) {
#pragma unroll
      for (int k = 0; k < tiles::kRowsPerWarp; ++k) store_dgu(row0 + k, c, 4, v[k]);
    }
  }
  __device__ __forceinline__ void load(int k, int64_t row, int64_t c, int nv, int64_t e, float wr, const PackT* s,
                                       float (&v)[4]) {
    const T* gr = (q_g == 0 ? g : u) + row * x_stride;  // gate_up's row (its column 0 is gate's or up's)
    const T* dyr = dy + row * dy_stride;
    const bool has_b = bg != nullptr && e >= 0 && e < E;
    const T* bgr = has_b ? bg + e * b_stride : nullptr;
    const T* bur = has_b ? bu + e * b_stride : nullptr;
    float dg, du, term;
    if (step == 2) {  // packed columns c, c + 1 are gate and up of column c / 2 (c is even)
#pragma unroll
      for (int jj = 0; jj < 4; jj += 2) {
        if (jj >= nv) break;  // (unrolled: v's indices stay constants, v in registers)
        grad(gr, dyr, bgr, bur, wr, (c + jj) / 2, dg, du, term);
        v[jj] = dg;
        v[jj + 1] = du;
        add_term(k, term);
      }
    } else if (vec && nv == 4) {  // c .. c + 3 in one half (F and c multiples of 4; paired: always)
      if (paired && c >= F) {  // a pair's second tile: what its first left
        const float4 o = *stash_slot(k);
        v[0] = o.x, v[1] = o.y, v[2] = o.z, v[3] = o.w;
      } else if (paired) {
        first_of_pair(k, c, wr, bgr, bur, s ? s[0] : *pack_src(0, row, c),
                      s ? s[tiles::kThreads] : *pack_src(1, row, c), s ? s[2 * tiles::kThreads] : *pack_src(2, row, c),
                      v);
      } else {
        const bool up = c >= q_u && c < q_u + F;
        const int64_t j0 = c - (up ? q_u : q_g);
        const PackT gp = s ? s[0] : *pack_src(0, row, c);
        const PackT upk = s ? s[tiles::kThreads] : *pack_src(1, row, c);
        const PackT dp = s ? s[2 * tiles::kThreads] : *pack_src(2, row, c);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          grad_of(pack_f(gp, jj), pack_f(upk, jj), pack_f(dp, jj), bgr, bur, wr, j0 + jj, dg, du, term);
          v[jj] = up ? du : dg;
          if (!up) add_term(k, term);
        }
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        if (jj >= nv) break;
        const int64_t pc = c + jj;
        const bool up = pc >= q_u && pc < q_u + F;
        grad(gr, dyr, bgr, bur, wr, pc - (up ? q_u : q_g), dg, du, term);
        v[jj] = up ? du : dg;
        if (!up) add_term(k, term);
      }
    }
    store_dgu(row, c, nv, v);
  }
  // Paired, a pair's first tile (packed columns c .. c + 3 of the first half, q_g's or q_u's):
  // the gradient of both halves from the lane's packs of gate, up and dy (bgr, bur: the row's
  // bias rows, null for none), v the first half's, the other's left in the stash; the terms of
  // the weights' gradient in column order.
  __device__ __forceinline__ void first_of_pair(int k, int64_t c, float wr, const T* bgr, const T* bur, const PackT& gp,
                                                const PackT& upk, const PackT& dp, float (&v)[4]) {
    const bool up = c >= q_u && c < q_u + F;
    pair_values(k, up, c - (up ? q_u : q_g), wr, bgr, bur, gp, upk, dp, v);
  }
  // first_of_pair's arithmetic, up (the first half is up's) and j0 (the F column of c) given.
  __device__ __forceinline__ void pair_values(int k, bool up, int64_t j0, float wr, const T* bgr, const T* bur,
                                              const PackT& gp, const PackT& upk, const PackT& dp, float (&v)[4]) {
    float other[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      float dg, du, term;
      grad_of(pack_f(gp, jj), pack_f(upk, jj), pack_f(dp, jj), bgr, bur, wr, j0 + jj, dg, du, term);
      v[jj] = up ? du : dg;
      other[jj] = up ? dg : du;
      add_term(k, term);  // gate's tiles ascend in either half's order: the same order
    }
    *stash_slot(k) = make_float4(other[0], other[1], other[2], other[3]);
  }
  __device__ __forceinline__ void store_dgu(int64_t row, int64_t c, int nv, const float (&v)[4]) const {
    if (dgu) {
      T* d = dgu + row * dgu_stride + c;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        if (jj < nv) d[jj] = from_f<T>(v[jj]);
    }
  }
};

// bf16 and fp16: the stash and one buffer of gate, up and dy (160 KiB); float32's would not fit.
static_assert(tiles::Stream<BwdTileSrc<__nv_bfloat16, Activation::kSilu>>::kSmem == 160 * 1024);
static_assert(tiles::Stream<BwdTileSrc<float, Activation::kSilu>>::kBuffers == 0);

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {

// Blocks for the rows past the last offset, at most this many an SM (they loop over the rest).
constexpr int64_t kBwdTailBlocksPerSm = 4;

Status cuda_fp8_glu_backward_tiles(const GluProblem& p, const GluBias* bias, const PackedBwdIO& d, const TileOut& o,
                                   void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"gate_up", p.g}, {"grad_out", d.dy}, {"weights", p.w}, {"bias", bias ? bias->bg : nullptr},
                         {"offsets", bias ? bias->er.offsets : o.offsets}, {"padded_offsets", o.pends}, {"q", o.q},
                         {"scale", o.scale}, {"q_t", o.q_t}, {"col_scale", o.col_scale}, {"grad_weights", d.dw},
                         {"grad_gate_up", d.dgu}}));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const math::Coeffs cf{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  const int64_t grid_x = cuda::tiles::schedule_blocks(o, p.rows, kBwdTailBlocksPerSm * cuda::sm_count(p.device_id));
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) -> Status {
      constexpr Activation A = decltype(act)::value;
      const cuda::BwdTileSrc<T, A> src{cuda::tiles::bwd_vec4(p, d, sizeof(T)),
                                       cuda::tiles::bwd_paired(p),
                                       static_cast<const T*>(p.g),
                                       static_cast<const T*>(p.u),
                                       p.g_stride,
                                       p.step,
                                       p.F,
                                       d.q_g,
                                       d.q_u,
                                       static_cast<const T*>(d.dy),
                                       d.dy_stride,
                                       p.w,
                                       p.w_stride,
                                       bias ? static_cast<const T*>(bias->bg) : nullptr,
                                       bias ? static_cast<const T*>(bias->bu) : nullptr,
                                       bias ? bias->b_stride : 0,
                                       bias ? bias->er.offsets : nullptr,
                                       bias ? bias->er.experts : 0,
                                       cf,
                                       d.dw,
                                       d.dw_stride,
                                       static_cast<T*>(d.dgu),
                                       d.dgu_stride,
                                       {}};
      return cuda::tiles::launch_tiles(src, o, p.rows, 2 * p.F, grid_x, true, p.device_id, st,
                                       "fp8 glu backward tiles kernel launch");
    });
  });
}

}  // namespace expertact::detail
