// The blockwise FP8 entry points (src/core/fp8_tiles.h): each argument checked once, naming it
// and its value (the inputs as the rowwise entries check them, src/api_fp8.cpp; the tile
// outputs and the 128-padded offsets here), then the CPU or CUDA path.
#include <cstdint>
#include <limits>

#include "api.h"
#include "api_fp8_common.h"
#include "core/bias.h"
#include "core/checks.h"
#include "core/error.h"
#include "core/fp8_tiles.h"
#include "expertact/expertact.hpp"

namespace expertact {
namespace detail {
namespace {

constexpr int64_t kTile = fp8::kTile;

int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }

// Row tiles of a [rows, cols] input: q [rows, cols] float8 and scale float32 [ceil(cols / 128),
// rows], on the input's device, apart from it and from each other.
Status check_row_tiles(const char* qname, const MatrixRef& q, const char* sname, const MatrixRef& scale,
                       int64_t rows, int64_t cols, DeviceType dev, int32_t dev_id, const char* in_name,
                       const Extent& in) {
  EA_TRY(check_fp8_output(qname, q, rows, cols, DType::kFloat8E4M3, "the input quantised in 1 x 128 row tiles",
                          dev, dev_id, in_name, in));
  EA_TRY(check_fp8_output(sname, scale, tiles_of(cols), rows, DType::kFloat32,
                          "one scale per 128-column tile and row: [ceil(C / 128), T], T contiguous", dev, dev_id,
                          in_name, in));
  return check_no_overlap(sname, extent_of(scale), qname, extent_of(q));
}

// padded_offsets against offsets: one per expert, on the device; on the CPU exactly the ends of
// the experts' blocks padded to multiples of 128, the last within q_t's Tp columns.
Status check_tile_padding(const OffsetsRef& pad, const OffsetsRef& offsets, int64_t out_rows, DeviceType dev,
                          int32_t dev_id, const char* ref_name) {
  EA_TRY(check_padded_described(pad, offsets, dev, dev_id, ref_name));
  if (dev != DeviceType::kCPU) return Status::kOk;
  int64_t pend = 0, end = 0;
  for (int64_t e = 0; e < pad.size; ++e) {
    const int64_t n = offsets.data[e] - end, want = pend + tiles_of(n) * kTile;
    if (pad.data[e] != want)
      return fail(Status::kInvalidArgument, "padded_offsets[", e, "] = ", pad.data[e], " but expert ", e,
                  " has ", n, " rows (offsets), so its block padded to a multiple of 128 ends at ", want,
                  " (padded_offsets(offsets, 128))");
    pend = want;
    end = offsets.data[e];
  }
  if (pend > out_rows)
    return fail(Status::kInvalidArgument, "padded_offsets[", pad.size - 1, "] = ", pend,
                " is past q_t's last column (", out_rows, " columns)");
  return Status::kOk;
}

// Column tiles of a [rows, cols] input over its experts: offsets, padded_offsets, q_t [cols,
// Tp] float8 (Tp a multiple of 128) and scale float32 [Tp / 128, cols]; out_rows gets Tp.
Status check_column_tiles(const OffsetsRef& offsets, const OffsetsRef& padded, const MatrixRef& q_t,
                          const char* sname, const MatrixRef& scale, int64_t rows, int64_t cols, DeviceType dev,
                          int32_t dev_id, const char* in_name, const Extent& in, int64_t& out_rows) {
  EA_TRY(check_offsets(offsets, rows, dev, dev_id, in_name));
  out_rows = q_t.cols;
  EA_TRY(check_fp8_output("q_t", q_t, cols, out_rows, DType::kFloat8E4M3,
                          "the input transposed in 128 x 1 column tiles, each expert's rows padded to a multiple "
                          "of 128",
                          dev, dev_id, in_name, in));
  if (out_rows % kTile != 0)
    return fail(Status::kInvalidArgument, "q_t has ", out_rows,
                " columns, not a multiple of 128 (each expert's rows are padded to a multiple of 128)");
  EA_TRY(check_tile_padding(padded, offsets, out_rows, dev, dev_id, in_name));
  EA_TRY(check_fp8_output(sname, scale, out_rows / kTile, cols, DType::kFloat32,
                          "one scale per 128-row tile of q_t's columns and column: [Tp / 128, C]", dev, dev_id,
                          in_name, in));
  const Extent eq = extent_of(q_t), es = extent_of(scale), eo = offsets_extent(offsets), ep = offsets_extent(padded);
  EA_TRY(check_no_overlap(sname, es, "q_t", eq));
  const Named outs[] = {{"q_t", eq}, {sname, es}};
  const Named ins[] = {{"offsets", eo}, {"padded_offsets", ep}};
  return check_apart(outs, ins);
}

void set_row_tiles(const MatrixRef& q, const MatrixRef& scale, TileOut& o) {
  o.q = q.data;
  o.q_stride = q.row_stride;
  o.scale = static_cast<float*>(scale.data);
  o.scale_stride = scale.row_stride;
}

void set_column_tiles(const MatrixRef& q_t, const MatrixRef& scale, const OffsetsRef& offsets,
                      const OffsetsRef& padded, int64_t out_rows, TileOut& o) {
  o.q_t = q_t.data;
  o.qt_stride = q_t.row_stride;
  o.out_rows = out_rows;
  o.col_scale = static_cast<float*>(scale.data);
  o.cs_stride = scale.row_stride;
  o.offsets = offsets.data;
  o.pends = padded.data;
  o.experts = offsets.size;
}

// The bytes a Tensor3Ref spans (by range: its strides may be anything).
Extent extent_of3(const Tensor3Ref& t) {
  Extent e;
  if (t.batch == 0 || t.rows == 0 || t.cols == 0) return e;
  const int64_t es = dtype_size(t.dtype);
  int64_t lo = 0, hi = 0;
  for (const auto& [n, s] : {std::pair<int64_t, int64_t>{t.batch, t.batch_stride}, {t.rows, t.row_stride},
                             {t.cols, t.col_stride}}) {
    const int64_t span = (n - 1) * s;
    if (span < 0) lo += span; else hi += span;
  }
  e.begin = reinterpret_cast<uintptr_t>(t.data) + static_cast<uintptr_t>(lo * es);
  e.end = reinterpret_cast<uintptr_t>(t.data) + static_cast<uintptr_t>((hi + 1) * es);
  e.row_bytes = static_cast<int64_t>(e.end - e.begin);
  e.empty = false;
  return e;
}

Status check_tensor3(const char* name, const Tensor3Ref& t) {
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16)
    return fail(Status::kInvalidDtype, name, ".dtype ", static_cast<int>(t.dtype),
                " is not supported (FP8 quantisation takes float32, float16 or bfloat16)");
  if (t.device != DeviceType::kCPU && t.device != DeviceType::kCUDA)
    return fail(Status::kInvalidArgument, name, ".device ", static_cast<int>(t.device),
                " is not supported (expected cpu or cuda)");
  if (t.batch < 0 || t.rows < 0 || t.cols < 0)
    return fail(Status::kInvalidArgument, name, " has a negative size: [", t.batch, ", ", t.rows, ", ", t.cols, "]");
  if (t.batch == 0 || t.rows == 0 || t.cols == 0) return Status::kOk;
  if (t.data == nullptr)
    return fail(Status::kInvalidArgument, name, ".data is null for a non-empty [", t.batch, ", ", t.rows, ", ",
                t.cols, "] tensor");
  const int64_t es = dtype_size(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % es != 0)
    return fail(Status::kInvalidArgument, name, ".data ", static_cast<const void*>(t.data), " is not aligned to its ",
                es, "-byte ", t.dtype, " element");
  // Every element's offset must fit in int64 (it is computed in 64 bits).
  double span = 0.0;
  for (const auto& [n, s] : {std::pair<int64_t, int64_t>{t.batch, t.batch_stride}, {t.rows, t.row_stride},
                             {t.cols, t.col_stride}})
    span += static_cast<double>(n - 1) * (s < 0 ? -static_cast<double>(s) : static_cast<double>(s));
  if ((span + 1.0) * static_cast<double>(es) > 4.0e18)
    return fail(Status::kInvalidArgument, name, " spans more than 2^62 bytes ([", t.batch, ", ", t.rows, ", ", t.cols,
                "], strides (", t.batch_stride, ", ", t.row_stride, ", ", t.col_stride, "))");
  return Status::kOk;
}

}  // namespace

Status fp8_quantize_row_tiles_body(const MatrixRef& x, const MatrixRef& q, const MatrixRef& scale, void* stream) {
  EA_TRY(check_matrix("x", x));
  EA_TRY(check_fp8_input("x", x.dtype));
  EA_TRY(check_row_tiles("q", q, "scale", scale, x.rows, x.cols, x.device, x.device_id, "x", extent_of(x)));
  if (x.rows == 0 || x.cols == 0) return Status::kOk;
  const TileSrc s{x.dtype, x.device_id, x.rows, x.cols, x.data, x.row_stride};
  TileOut o;
  set_row_tiles(q, scale, o);
  if (x.device == DeviceType::kCPU) return cpu_fp8_tiles(s, o);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_tiles(s, o, stream);
#else
  (void)stream;
  return no_fp8_cuda("x");
#endif
}

Status fp8_quantize_column_tiles_grouped_body(const MatrixRef& x, const OffsetsRef& offsets,
                                              const OffsetsRef& padded_offsets, const MatrixRef& q_t,
                                              const MatrixRef& scale, const MatrixRef* q, const MatrixRef* row_scale,
                                              void* stream) {
  EA_TRY(check_matrix("x", x));
  EA_TRY(check_fp8_input("x", x.dtype));
  const Extent ex = extent_of(x);
  int64_t out_rows = 0;
  EA_TRY(check_column_tiles(offsets, padded_offsets, q_t, "scale", scale, x.rows, x.cols, x.device, x.device_id,
                            "x", ex, out_rows));
  EA_TRY(check_together(q, "q", row_scale, "row_scale"));
  if (q) {
    EA_TRY(check_row_tiles("q", *q, "row_scale", *row_scale, x.rows, x.cols, x.device, x.device_id, "x", ex));
    const Named rows_out[] = {{"q", extent_of(*q)}, {"row_scale", extent_of(*row_scale)}};
    const Named others[] = {{"q_t", extent_of(q_t)},
                            {"scale", extent_of(scale)},
                            {"offsets", offsets_extent(offsets)},
                            {"padded_offsets", offsets_extent(padded_offsets)}};
    EA_TRY(check_apart(rows_out, others));
  }
  if (x.cols == 0) return Status::kOk;
  const TileSrc s{x.dtype, x.device_id, x.rows, x.cols, x.data, x.row_stride};
  TileOut o;
  set_column_tiles(q_t, scale, offsets, padded_offsets, out_rows, o);
  if (q) set_row_tiles(*q, *row_scale, o);
  if (x.device == DeviceType::kCPU) return cpu_fp8_tiles(s, o);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_tiles(s, o, stream);
#else
  (void)stream;
  return no_fp8_cuda("x");
#endif
}

Status fp8_quantize_blocks_body(const Tensor3Ref& w, const MatrixRef& q, const MatrixRef& scale, void* stream) {
  EA_TRY(check_tensor3("w", w));
  const Extent ew = extent_of3(w);
  const int64_t E = w.batch, R = w.rows, C = w.cols;
  EA_TRY(check_fp8_output("q", q, E * R, C, DType::kFloat8E4M3,
                          "w [E, R, C] quantised in 128 x 128 blocks, as [E * R, C] (C contiguous)", w.device,
                          w.device_id, "w", ew));
  EA_TRY(check_fp8_output("scale", scale, E * tiles_of(R), tiles_of(C), DType::kFloat32,
                          "one scale per expert and 128 x 128 block: [E * ceil(R / 128), ceil(C / 128)]", w.device,
                          w.device_id, "w", ew));
  EA_TRY(check_no_overlap("scale", extent_of(scale), "q", extent_of(q)));
  if (E == 0 || R == 0 || C == 0) return Status::kOk;
  BlockProblem b;
  b.dtype = w.dtype;
  b.device_id = w.device_id;
  b.experts = E;
  b.rows = R;
  b.cols = C;
  b.w = w.data;
  b.w_estride = w.batch_stride;
  b.w_rstride = w.row_stride;
  b.w_cstride = w.col_stride;
  b.q = q.data;
  b.q_stride = q.row_stride;
  b.scale = static_cast<float*>(scale.data);
  b.scale_stride = scale.row_stride;
  if (w.device == DeviceType::kCPU) return cpu_fp8_blocks(b);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_blocks(b, stream);
#else
  (void)stream;
  return no_fp8_cuda("w");
#endif
}

Status fp8_glu_row_tiles_body(const GluParams& params, Layout layout, const MatrixRef& x, const MatrixRef* up,
                              const VectorRef* weights, const MatrixRef* bias, const OffsetsRef* offsets,
                              const MatrixRef& q, const MatrixRef& scale, void* stream) {
  const char* xname = layout == Layout::kSeparate ? "gate" : "gate_up";
  GluProblem p;
  EA_TRY(prepare_inputs(params, layout, x, up, weights, p));
  EA_TRY(check_fp8_input(xname, p.dtype));
  EA_TRY(check_together(bias, "bias", offsets, "offsets"));
  if (bias) {
    EA_TRY(check_offsets(*offsets, p.rows, p.device, p.device_id, xname));
    EA_TRY(check_glu_bias(*bias, offsets->size, p, xname));
  }
  EA_TRY(check_row_tiles("q", q, "scale", scale, p.rows, p.F, p.device, p.device_id, xname, extent_of(x)));
  const Named outs[] = {{"q", extent_of(q)}, {"scale", extent_of(scale)}};
  const Named ins[] = {{"up", up ? extent_of(*up) : Extent{}},
                       {"weights", weights ? extent_of(*weights) : Extent{}},
                       {"bias", bias ? extent_of(*bias) : Extent{}},
                       {"offsets", offsets ? offsets_extent(*offsets) : Extent{}}};
  EA_TRY(check_apart(outs, ins));
  if (p.rows == 0 || p.F == 0) return Status::kOk;
  GluBias b;
  if (bias) split_bias(layout, p, *bias, *offsets, b);
  TileOut o;
  set_row_tiles(q, scale, o);
  if (p.device == DeviceType::kCPU) return cpu_fp8_glu_row_tiles(p, bias ? &b : nullptr, o);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_glu_row_tiles(p, bias ? &b : nullptr, o, stream);
#else
  (void)stream;
  return no_fp8_cuda(xname);
#endif
}

Status fp8_glu_column_tiles_grouped_body(const GluParams& params, Layout layout, const MatrixRef& x,
                                         const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                                         const OffsetsRef& offsets, const OffsetsRef& padded_offsets,
                                         const MatrixRef& q_t, const MatrixRef& scale, void* stream) {
  const char* xname = layout == Layout::kSeparate ? "gate" : "gate_up";
  GluProblem p;
  EA_TRY(prepare_inputs(params, layout, x, up, weights, p));
  EA_TRY(check_fp8_input(xname, p.dtype));
  int64_t out_rows = 0;
  EA_TRY(check_column_tiles(offsets, padded_offsets, q_t, "scale", scale, p.rows, p.F, p.device, p.device_id, xname,
                            extent_of(x), out_rows));
  if (bias) EA_TRY(check_glu_bias(*bias, offsets.size, p, xname));
  const Named outs[] = {{"q_t", extent_of(q_t)}, {"scale", extent_of(scale)}};
  const Named ins[] = {{"up", up ? extent_of(*up) : Extent{}},
                       {"weights", weights ? extent_of(*weights) : Extent{}},
                       {"bias", bias ? extent_of(*bias) : Extent{}}};
  EA_TRY(check_apart(outs, ins));
  if (p.F == 0) return Status::kOk;
  GluBias b;
  if (bias) split_bias(layout, p, *bias, offsets, b);
  TileOut o;
  set_column_tiles(q_t, scale, offsets, padded_offsets, out_rows, o);
  if (p.device == DeviceType::kCPU) return cpu_fp8_glu_column_tiles(p, bias ? &b : nullptr, o);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_glu_column_tiles(p, bias ? &b : nullptr, o, stream);
#else
  (void)stream;
  return no_fp8_cuda(xname);
#endif
}

Status fp8_glu_backward_tiles_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                                   const MatrixRef& x, const VectorRef* weights, const MatrixRef* bias,
                                   const OffsetsRef* offsets, const OffsetsRef* padded, const MatrixRef& q,
                                   const MatrixRef& scale, const MatrixRef* q_t, const MatrixRef* col_scale,
                                   const VectorRef* grad_weights, const MatrixRef* grad_gate_up, void* stream) {
  EA_TRY(check_packed_layout(layout, "fp8_glu_backward_tiles"));
  GluProblem p;
  EA_TRY(prepare_inputs(params, layout, x, nullptr, weights, p));
  EA_TRY(check_fp8_input("gate_up", p.dtype));
  const int64_t C = 2 * p.F;
  const Extent ex = extent_of(x);
  EA_TRY(check_grad_out(grad_out, p));
  EA_TRY(check_row_tiles("q", q, "scale", scale, p.rows, C, p.device, p.device_id, "gate_up", ex));
  EA_TRY(check_together(q_t, "q_t", col_scale, "col_scale"));
  EA_TRY(check_offsets_given(offsets, bias ? "bias" : q_t ? "q_t" : nullptr));
  if (q_t && padded == nullptr)
    return fail(Status::kInvalidArgument,
                "padded_offsets is missing: q_t's column tiles start each expert at its 128-padded offset");
  int64_t out_rows = 0;
  if (q_t) {
    EA_TRY(check_column_tiles(*offsets, *padded, *q_t, "col_scale", *col_scale, p.rows, C, p.device, p.device_id,
                              "gate_up", ex, out_rows));
  } else if (offsets) {
    EA_TRY(check_offsets(*offsets, p.rows, p.device, p.device_id, "gate_up"));
  }
  if (bias) EA_TRY(check_glu_bias(*bias, offsets->size, p, "gate_up"));
  EA_TRY(check_grad_weights(grad_weights, weights, p));
  EA_TRY(check_grad_gate_up(grad_gate_up, p));
  // No output may share a byte with an input or another output (not even grad_gate_up with
  // gate_up: an up column's gradient reads its gate value after the gate column's is written).
  const Named outs[] = {{"q", extent_of(q)},
                        {"scale", extent_of(scale)},
                        {"q_t", q_t ? extent_of(*q_t) : Extent{}},
                        {"col_scale", col_scale ? extent_of(*col_scale) : Extent{}},
                        {"grad_weights", grad_weights ? extent_of(*grad_weights) : Extent{}},
                        {"grad_gate_up", grad_gate_up ? extent_of(*grad_gate_up) : Extent{}}};
  const Named ins[] = {{"gate_up", ex},
                       {"grad_out", extent_of(grad_out)},
                       {"weights", weights ? extent_of(*weights) : Extent{}},
                       {"bias", bias ? extent_of(*bias) : Extent{}},
                       {"offsets", offsets ? offsets_extent(*offsets) : Extent{}},
                       {"padded_offsets", padded ? offsets_extent(*padded) : Extent{}}};
  EA_TRY(check_apart(outs, ins));
  for (size_t i = 0; i < sizeof(outs) / sizeof(outs[0]); ++i)
    for (size_t j = 0; j < i; ++j) EA_TRY(check_no_overlap(outs[i].name, outs[i].e, outs[j].name, outs[j].e));
  if (p.F == 0 && !grad_weights) return Status::kOk;
  GluBias b;
  if (bias) split_bias(layout, p, *bias, *offsets, b);
  PackedBwdIO d;
  set_packed_bwd(layout, p, grad_out, grad_weights, grad_gate_up, d);
  TileOut o;
  set_row_tiles(q, scale, o);
  if (q_t) set_column_tiles(*q_t, *col_scale, *offsets, *padded, out_rows, o);
  if (p.device == DeviceType::kCPU) return cpu_fp8_glu_backward_tiles(p, bias ? &b : nullptr, d, o);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_glu_backward_tiles(p, bias ? &b : nullptr, d, o, stream);
#else
  (void)stream;
  return no_fp8_cuda("gate_up");
#endif
}

}  // namespace detail

Status fp8_quantize_row_tiles(const MatrixRef& x, const MatrixRef& q, const MatrixRef& scale, void* stream) {
  return detail::guarded("fp8_quantize_row_tiles",
                         [&] { return detail::fp8_quantize_row_tiles_body(x, q, scale, stream); });
}

Status fp8_quantize_column_tiles_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                         const OffsetsRef& padded_offsets, const MatrixRef& q_t,
                                         const MatrixRef& scale, void* stream) {
  return detail::guarded("fp8_quantize_column_tiles_grouped", [&] {
    return detail::fp8_quantize_column_tiles_grouped_body(x, offsets, padded_offsets, q_t, scale, nullptr, nullptr,
                                                          stream);
  });
}

Status fp8_quantize_column_tiles_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                         const OffsetsRef& padded_offsets, const MatrixRef& q_t,
                                         const MatrixRef& scale, const MatrixRef& q, const MatrixRef& row_scale,
                                         void* stream) {
  return detail::guarded("fp8_quantize_column_tiles_grouped", [&] {
    return detail::fp8_quantize_column_tiles_grouped_body(x, offsets, padded_offsets, q_t, scale, &q, &row_scale,
                                                          stream);
  });
}

Status fp8_quantize_blocks(const Tensor3Ref& w, const MatrixRef& q, const MatrixRef& scale, void* stream) {
  return detail::guarded("fp8_quantize_blocks", [&] { return detail::fp8_quantize_blocks_body(w, q, scale, stream); });
}

Status fp8_glu_row_tiles(const GluParams& params, Layout layout, const MatrixRef& x, const MatrixRef* up,
                         const VectorRef* weights, const MatrixRef* bias, const OffsetsRef* offsets,
                         const MatrixRef& q, const MatrixRef& scale, void* stream) {
  return detail::guarded("fp8_glu_row_tiles", [&] {
    return detail::fp8_glu_row_tiles_body(params, layout, x, up, weights, bias, offsets, q, scale, stream);
  });
}

Status fp8_glu_column_tiles_grouped(const GluParams& params, Layout layout, const MatrixRef& x,
                                    const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                                    const OffsetsRef& offsets, const OffsetsRef& padded_offsets,
                                    const MatrixRef& q_t, const MatrixRef& scale, void* stream) {
  return detail::guarded("fp8_glu_column_tiles_grouped", [&] {
    return detail::fp8_glu_column_tiles_grouped_body(params, layout, x, up, weights, bias, offsets, padded_offsets,
                                                     q_t, scale, stream);
  });
}

Status fp8_glu_backward_tiles(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                              const MatrixRef& gate_up, const VectorRef* weights, const MatrixRef* bias,
                              const OffsetsRef* offsets, const OffsetsRef* padded_offsets, const MatrixRef& q,
                              const MatrixRef& scale, const MatrixRef* q_t, const MatrixRef* col_scale,
                              const VectorRef* grad_weights, const MatrixRef* grad_gate_up, void* stream) {
  return detail::guarded("fp8_glu_backward_tiles", [&] {
    return detail::fp8_glu_backward_tiles_body(params, layout, grad_out, gate_up, weights, bias, offsets,
                                               padded_offsets, q, scale, q_t, col_scale, grad_weights, grad_gate_up,
                                               stream);
  });
}

}  // namespace expertact
