// The FP8 entry points (src/core/fp8.h): the input checks of the activation's forward
// (prepare_forward, src/api.cpp) or of one matrix, those of the e4m3fn output and the scales,
// then the CPU or CUDA path.
#include <cstdint>
#include <cstring>

#include "api.h"
#include "api_fp8_common.h"
#include "core/bias.h"
#include "core/checks.h"
#include "core/error.h"
#include "cpu/fp8_cpu.h"
#include "expertact/expertact.hpp"

namespace expertact {
namespace detail {
namespace {

// padded_offsets (the padded cumulative end rows, one per expert) against offsets and q_t's
// padded row count: on the CPU its values are read and checked (non-decreasing, each
// expert's block at least its rows, the last end within q_t); on a GPU they are not read on
// the host (the kernels keep every access in bounds whatever the values).
Status check_padded_offsets(const OffsetsRef& pad, const OffsetsRef& offsets, int64_t out_rows,
                            DeviceType dev, int32_t dev_id, const char* ref_name = "x") {
  EA_TRY(check_padded_described(pad, offsets, dev, dev_id, ref_name));
  if (dev != DeviceType::kCPU) return Status::kOk;
  int64_t prev = 0, prev_end = 0;
  for (int64_t e = 0; e < pad.size; ++e) {
    const int64_t v = pad.data[e], n = offsets.data[e] - prev_end;
    if (v - prev < n)
      return fail(Status::kInvalidArgument, "padded_offsets[", e, "] = ", v, " gives expert ", e,
                  " a block of ", v - prev, " rows (from ", prev, "), fewer than its ", n,
                  " rows in offsets");
    prev = v;
    prev_end = offsets.data[e];
  }
  if (prev > out_rows)
    return fail(Status::kInvalidArgument, "padded_offsets[", pad.size - 1, "] = ", prev,
                " is past q_t's last column (", out_rows, " padded rows)");
  return Status::kOk;
}

}  // namespace

Status fp8_quantize_rowwise_body(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                                 const OffsetsRef* col_amax_offsets, const MatrixRef* col_amax,
                                 void* stream) {
  EA_TRY(check_matrix("x", x));
  EA_TRY(check_fp8_input("x", x.dtype));
  EA_TRY(check_fp8_outputs(q, scale, x.rows, x.cols, x.device, x.device_id, "x", extent_of(x)));
  EA_TRY(check_together(col_amax_offsets, "col_amax_offsets", col_amax, "col_amax"));
  if (col_amax) {
    EA_TRY(check_offsets(*col_amax_offsets, x.rows, x.device, x.device_id, "x", "col_amax_offsets"));
    EA_TRY(check_fp8_output("col_amax", *col_amax, col_amax_offsets->size, x.cols, DType::kFloat32,
                            "one amax per expert (col_amax_offsets) and column", x.device, x.device_id, "x",
                            extent_of(x)));
    const Extent ea = extent_of(*col_amax);
    EA_TRY(check_no_overlap("col_amax", ea, "q", extent_of(q)));
    EA_TRY(check_no_overlap("col_amax", ea, "scale", extent_of(scale)));
    EA_TRY(check_no_overlap("col_amax", ea, "col_amax_offsets", offsets_extent(*col_amax_offsets)));
    EA_TRY(check_no_overlap("q", extent_of(q), "col_amax_offsets", offsets_extent(*col_amax_offsets)));
    EA_TRY(check_no_overlap("scale", extent_of(scale), "col_amax_offsets", offsets_extent(*col_amax_offsets)));
  }
  if (x.rows == 0 && !col_amax) return Status::kOk;
  Fp8Rows p;
  p.device_id = x.device_id;
  p.dtype = x.dtype;
  p.rows = x.rows;
  p.cols = x.cols;
  p.x = x.data;
  p.x_stride = x.row_stride;
  p.q = q.data;
  p.q_stride = q.row_stride;
  p.scale = scale.data;
  p.scale_stride = scale.stride;
  if (col_amax) {
    p.col_amax_offsets = col_amax_offsets->data;
    p.col_amax_experts = col_amax_offsets->size;
    p.col_amax = static_cast<float*>(col_amax->data);
    p.col_amax_stride = col_amax->row_stride;
  }
  if (x.device == DeviceType::kCPU) return cpu_fp8_quantize_rowwise(p);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_quantize_rowwise(p, stream);
#else
  (void)stream;
  return no_fp8_cuda("x");
#endif
}

Status fp8_quantize_colwise_grouped_body(const MatrixRef& x, const OffsetsRef& offsets,
                                        const OffsetsRef* padded, const MatrixRef& q_t,
                                        const MatrixRef& scale, const MatrixRef* amax, void* stream) {
  EA_TRY(check_matrix("x", x));
  EA_TRY(check_fp8_input("x", x.dtype));
  EA_TRY(check_offsets(offsets, x.rows, x.device, x.device_id, "x"));
  const Extent ex = extent_of(x);
  // With padding, q_t's column count is the padded row count (checked against the padded
  // offsets below); without, it is x's.
  const int64_t out_rows = padded ? q_t.cols : x.rows;
  EA_TRY(check_fp8_output("q_t", q_t, x.cols, out_rows, DType::kFloat8E4M3,
                          padded ? "x quantised, transposed, each expert's rows at its padded offset"
                                 : "x quantised, transposed",
                          x.device, x.device_id, "x", ex));
  if (padded) EA_TRY(check_padded_offsets(*padded, offsets, out_rows, x.device, x.device_id));
  EA_TRY(check_fp8_output("scale", scale, offsets.size, x.cols, DType::kFloat32,
                          "one scale per expert and column", x.device, x.device_id, "x", ex));
  const Extent eq = extent_of(q_t), es = extent_of(scale);
  EA_TRY(check_no_overlap("scale", es, "q_t", eq));
  EA_TRY(check_no_overlap("q_t", eq, "offsets", offsets_extent(offsets)));
  EA_TRY(check_no_overlap("scale", es, "offsets", offsets_extent(offsets)));
  if (padded) {
    EA_TRY(check_no_overlap("q_t", eq, "padded_offsets", offsets_extent(*padded)));
    EA_TRY(check_no_overlap("scale", es, "padded_offsets", offsets_extent(*padded)));
  }
  if (amax) {
    // An input: read only; it may alias nothing the call writes.
    EA_TRY(check_operand("amax", *amax, offsets.size, x.cols, DType::kFloat32,
                         "the per expert and column amax, as quantize_rowwise's col_amax", x.device, x.device_id,
                         "x"));
    const Extent ea = extent_of(*amax);
    EA_TRY(check_no_overlap("q_t", eq, "amax", ea));
    EA_TRY(check_no_overlap("scale", es, "amax", ea));
  }
  if (x.cols == 0) return Status::kOk;
  Fp8Cols p;
  p.dtype = x.dtype;
  p.device_id = x.device_id;
  p.rows = x.rows;
  p.cols = x.cols;
  p.x = x.data;
  p.x_stride = x.row_stride;
  p.offsets = offsets.data;
  p.padded = padded ? padded->data : nullptr;
  p.experts = offsets.size;
  p.q_t = q_t.data;
  p.q_stride = q_t.row_stride;
  p.out_rows = out_rows;
  p.scale = static_cast<float*>(scale.data);
  p.scale_stride = scale.row_stride;
  if (amax) {
    p.amax = static_cast<const float*>(amax->data);
    p.amax_stride = amax->row_stride;
  }
  if (x.device == DeviceType::kCPU) return cpu_fp8_quantize_colwise_grouped(p);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_quantize_colwise_grouped(p, stream);
#else
  (void)stream;
  return no_fp8_cuda("x");
#endif
}

Status fp8_glu_rowwise_body(const GluParams& params, Layout layout, const MatrixRef& x,
                            const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                            const OffsetsRef* offsets, const MatrixRef& q, const VectorRef& scale,
                            const OffsetsRef* col_amax_offsets, const MatrixRef* col_amax, void* stream) {
  const char* xname = layout == Layout::kSeparate ? "gate" : "gate_up";
  GluProblem p;
  EA_TRY(prepare_inputs(params, layout, x, up, weights, p));
  EA_TRY(check_fp8_input(xname, p.dtype));
  EA_TRY(check_fp8_outputs(q, scale, p.rows, p.F, p.device, p.device_id, xname, extent_of(x)));
  const Extent eq = extent_of(q), es = extent_of(scale);
  if (up) {
    EA_TRY(check_no_overlap("q", eq, "up", extent_of(*up)));
    EA_TRY(check_no_overlap("scale", es, "up", extent_of(*up)));
  }
  if (weights) {
    EA_TRY(check_no_overlap("q", eq, "weights", extent_of(*weights)));
    EA_TRY(check_no_overlap("scale", es, "weights", extent_of(*weights)));
  }
  GluBias b;
  if (bias) {
    // As glu_forward_bias (src/api_bias.cpp) checks and splits its bias.
    EA_TRY(check_offsets(*offsets, p.rows, p.device, p.device_id, xname));
    EA_TRY(check_glu_bias(*bias, offsets->size, p, xname));
    const Extent eb = extent_of(*bias), eo = offsets_extent(*offsets);
    EA_TRY(check_no_overlap("q", eq, "bias", eb));
    EA_TRY(check_no_overlap("scale", es, "bias", eb));
    EA_TRY(check_no_overlap("q", eq, "offsets", eo));
    EA_TRY(check_no_overlap("scale", es, "offsets", eo));
    split_bias(layout, p, *bias, *offsets, b);
  }
  EA_TRY(check_together(col_amax_offsets, "col_amax_offsets", col_amax, "col_amax"));
  Fp8ColAmax am;
  if (col_amax) {
    // The biased form's rows take their experts from offsets: the column amax's must be those.
    if (bias && (col_amax_offsets->data != offsets->data || col_amax_offsets->size != offsets->size))
      return fail(Status::kInvalidArgument,
                  "col_amax_offsets must be the bias's offsets (the same int32 buffer) when a bias is given");
    if (!bias) EA_TRY(check_offsets(*col_amax_offsets, p.rows, p.device, p.device_id, xname, "col_amax_offsets"));
    EA_TRY(check_fp8_output("col_amax", *col_amax, col_amax_offsets->size, p.F, DType::kFloat32,
                            "one amax of h per expert (col_amax_offsets) and column", p.device, p.device_id, xname,
                            extent_of(x)));
    const Extent ea = extent_of(*col_amax), eo = offsets_extent(*col_amax_offsets);
    EA_TRY(check_no_overlap("col_amax", ea, "q", eq));
    EA_TRY(check_no_overlap("col_amax", ea, "scale", es));
    EA_TRY(check_no_overlap("col_amax", ea, "col_amax_offsets", eo));
    if (up) EA_TRY(check_no_overlap("col_amax", ea, "up", extent_of(*up)));
    if (weights) EA_TRY(check_no_overlap("col_amax", ea, "weights", extent_of(*weights)));
    if (bias) EA_TRY(check_no_overlap("col_amax", ea, "bias", extent_of(*bias)));
    EA_TRY(check_no_overlap("q", eq, "col_amax_offsets", eo));
    EA_TRY(check_no_overlap("scale", es, "col_amax_offsets", eo));
    am.offsets = col_amax_offsets->data;
    am.experts = col_amax_offsets->size;
    am.col_amax = static_cast<float*>(col_amax->data);
    am.stride = col_amax->row_stride;
  }
  if (p.rows == 0 && !col_amax) return Status::kOk;
  Fp8Out o;
  o.q = q.data;
  o.q_stride = q.row_stride;
  o.scale = scale.data;
  o.scale_stride = scale.stride;
  if (p.device == DeviceType::kCPU) return cpu_fp8_glu_rowwise(p, o, bias ? &b : nullptr, col_amax ? &am : nullptr);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_glu_rowwise(p, o, bias ? &b : nullptr, col_amax ? &am : nullptr, stream);
#else
  (void)stream;
  return no_fp8_cuda(xname);
#endif
}

// The activation quantised per expert and column (fp8_glu_colwise_grouped): the checks of
// fp8_glu_rowwise's inputs with those of fp8_quantize_colwise_grouped's offsets, outputs and
// amax (required here: h is computed once, so its scales must be known before).
Status fp8_glu_colwise_grouped_body(const GluParams& params, Layout layout, const MatrixRef& x,
                                    const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                                    const OffsetsRef& offsets, const OffsetsRef* padded, const MatrixRef& q_t,
                                    const MatrixRef& scale, const MatrixRef& amax, void* stream) {
  const char* xname = layout == Layout::kSeparate ? "gate" : "gate_up";
  GluProblem p;
  EA_TRY(prepare_inputs(params, layout, x, up, weights, p));
  EA_TRY(check_fp8_input(xname, p.dtype));
  EA_TRY(check_offsets(offsets, p.rows, p.device, p.device_id, xname));
  const Extent ex = extent_of(x);
  // With padding, q_t's column count is the padded row count (checked against the padded
  // offsets below); without, it is the input's.
  const int64_t E = offsets.size, out_rows = padded ? q_t.cols : p.rows;
  EA_TRY(check_fp8_output("q_t", q_t, p.F, out_rows, DType::kFloat8E4M3,
                          padded ? "the activation quantised, transposed, each expert's rows at its padded offset"
                                 : "the activation quantised, transposed",
                          p.device, p.device_id, xname, ex));
  if (padded) EA_TRY(check_padded_offsets(*padded, offsets, out_rows, p.device, p.device_id, xname));
  EA_TRY(check_fp8_output("scale", scale, E, p.F, DType::kFloat32, "one scale per expert and column", p.device,
                          p.device_id, xname, ex));
  EA_TRY(check_operand("amax", amax, E, p.F, DType::kFloat32,
                       "the per expert and column max |h| of the activation, as fp8_quantize_rowwise's col_amax of "
                       "it",
                       p.device, p.device_id, xname));
  if (bias) EA_TRY(check_glu_bias(*bias, E, p, xname));
  // No output may share a byte with an input or the other output.
  const Named outs[] = {{"q_t", extent_of(q_t)}, {"scale", extent_of(scale)}};
  const Named ins[] = {{xname, ex},
                       {"up", up ? extent_of(*up) : Extent{}},
                       {"weights", weights ? extent_of(*weights) : Extent{}},
                       {"bias", bias ? extent_of(*bias) : Extent{}},
                       {"offsets", offsets_extent(offsets)},
                       {"padded_offsets", padded ? offsets_extent(*padded) : Extent{}},
                       {"amax", extent_of(amax)}};
  EA_TRY(check_apart(outs, ins));
  EA_TRY(check_no_overlap("scale", outs[1].e, "q_t", outs[0].e));
  if (p.F == 0) return Status::kOk;
  GluBias b;
  if (bias) split_bias(layout, p, *bias, offsets, b);
  Fp8Cols c;
  c.dtype = p.dtype;
  c.device_id = p.device_id;
  c.rows = p.rows;
  c.cols = p.F;
  c.offsets = offsets.data;
  c.padded = padded ? padded->data : nullptr;
  c.experts = E;
  c.q_t = q_t.data;
  c.q_stride = q_t.row_stride;
  c.out_rows = out_rows;
  c.scale = static_cast<float*>(scale.data);
  c.scale_stride = scale.row_stride;
  c.amax = static_cast<const float*>(amax.data);
  c.amax_stride = amax.row_stride;
  if (p.device == DeviceType::kCPU) return cpu_fp8_glu_colwise_grouped(p, bias ? &b : nullptr, c);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_glu_colwise_grouped(p, bias ? &b : nullptr, c, stream);
#else
  (void)stream;
  return no_fp8_cuda(xname);
#endif
}

// The fused FP8 activation backward: packed layouts only (gate_up holds both halves; q has
// its column layout).
Status fp8_glu_backward_rowwise_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                                     const MatrixRef& x, const VectorRef* weights, const MatrixRef* bias,
                                     const OffsetsRef* offsets, const MatrixRef& q, const VectorRef& scale,
                                     const VectorRef* grad_weights, const MatrixRef* col_amax,
                                     const MatrixRef* grad_gate_up, void* stream) {
  EA_TRY(check_packed_layout(layout, "fp8_glu_backward_rowwise"));
  GluProblem p;
  EA_TRY(prepare_inputs(params, layout, x, nullptr, weights, p));
  EA_TRY(check_fp8_input("gate_up", p.dtype));
  const int64_t C = 2 * p.F;
  EA_TRY(check_grad_out(grad_out, p));
  EA_TRY(check_fp8_outputs(q, scale, p.rows, C, p.device, p.device_id, "gate_up", extent_of(x)));
  EA_TRY(check_offsets_given(offsets, bias ? "bias" : col_amax ? "col_amax" : nullptr));
  if (offsets) EA_TRY(check_offsets(*offsets, p.rows, p.device, p.device_id, "gate_up"));
  EA_TRY(check_grad_weights(grad_weights, weights, p));
  if (bias)
    EA_TRY(check_operand("bias", *bias, offsets->size, C, p.dtype, "a bias is [E, 2F] of gate_up's dtype", p.device,
                         p.device_id, "gate_up"));
  if (col_amax)
    EA_TRY(check_fp8_output("col_amax", *col_amax, offsets->size, C, DType::kFloat32,
                            "one amax per expert (offsets) and column of gate_up", p.device, p.device_id, "gate_up",
                            extent_of(x)));
  EA_TRY(check_grad_gate_up(grad_gate_up, p));
  // No output may share a byte with an input or another output.
  const Named outs[] = {{"q", extent_of(q)},
                        {"scale", extent_of(scale)},
                        {"grad_weights", grad_weights ? extent_of(*grad_weights) : Extent{}},
                        {"col_amax", col_amax ? extent_of(*col_amax) : Extent{}},
                        {"grad_gate_up", grad_gate_up ? extent_of(*grad_gate_up) : Extent{}}};
  // grad_gate_up may be gate_up itself (same storage and row stride: in place, each element
  // read before it is written, by the thread that writes it); no other sharing.
  const bool in_place = grad_gate_up && grad_gate_up->data == x.data && grad_gate_up->row_stride == x.row_stride;
  const Named ins[] = {{"gate_up", extent_of(x)},
                       {"grad_out", extent_of(grad_out)},
                       {"weights", weights ? extent_of(*weights) : Extent{}},
                       {"bias", bias ? extent_of(*bias) : Extent{}},
                       {"offsets", offsets ? offsets_extent(*offsets) : Extent{}}};
  for (const Named& out : outs) {
    for (const Named& in : ins)
      if (!(in_place && std::strcmp(out.name, "grad_gate_up") == 0 && std::strcmp(in.name, "gate_up") == 0))
        EA_TRY(check_no_overlap(out.name, out.e, in.name, in.e));
    for (const Named* other = outs; other != &out; ++other)
      EA_TRY(check_no_overlap(out.name, out.e, other->name, other->e));
  }
  GluBias b;
  if (bias) split_bias(layout, p, *bias, *offsets, b);
  Fp8BwdOut o;
  o.q = q.data;
  o.q_stride = q.row_stride;
  o.scale = scale.data;
  o.scale_stride = scale.stride;
  set_packed_bwd(layout, p, grad_out, grad_weights, grad_gate_up, o);
  if (col_amax) {
    o.offsets = offsets->data;
    o.experts = offsets->size;
    o.col_amax = static_cast<float*>(col_amax->data);
    o.col_amax_stride = col_amax->row_stride;
  }
  if (p.rows == 0 && !col_amax) return Status::kOk;
  if (p.device == DeviceType::kCPU) return cpu_fp8_glu_backward_rowwise(p, o, bias ? &b : nullptr);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_glu_backward_rowwise(p, o, bias ? &b : nullptr, stream);
#else
  (void)stream;
  return no_fp8_cuda("gate_up");
#endif
}

}  // namespace detail

Status fp8_quantize_rowwise(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                            void* stream) {
  return detail::guarded("fp8_quantize_rowwise", [&] {
    return detail::fp8_quantize_rowwise_body(x, q, scale, nullptr, nullptr, stream);
  });
}

Status fp8_quantize_rowwise(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                            const OffsetsRef& col_amax_offsets, const MatrixRef& col_amax, void* stream) {
  return detail::guarded("fp8_quantize_rowwise", [&] {
    return detail::fp8_quantize_rowwise_body(x, q, scale, &col_amax_offsets, &col_amax, stream);
  });
}

Status fp8_quantize_colwise_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                    const OffsetsRef* padded_offsets, const MatrixRef& q_t,
                                    const MatrixRef& scale, void* stream) {
  return detail::guarded("fp8_quantize_colwise_grouped", [&] {
    return detail::fp8_quantize_colwise_grouped_body(x, offsets, padded_offsets, q_t, scale, nullptr, stream);
  });
}

Status fp8_quantize_colwise_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                    const OffsetsRef* padded_offsets, const MatrixRef& q_t,
                                    const MatrixRef& scale, const MatrixRef& amax, void* stream) {
  return detail::guarded("fp8_quantize_colwise_grouped", [&] {
    return detail::fp8_quantize_colwise_grouped_body(x, offsets, padded_offsets, q_t, scale, &amax, stream);
  });
}

Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& q,
                       const VectorRef& scale, void* stream) {
  return detail::guarded("fp8_glu_rowwise", [&] {
    return detail::fp8_glu_rowwise_body(params, layout, x, up, weights, nullptr, nullptr, q, scale, nullptr, nullptr,
                                        stream);
  });
}

Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& q,
                       const VectorRef& scale, const OffsetsRef& col_amax_offsets, const MatrixRef& col_amax,
                       void* stream) {
  return detail::guarded("fp8_glu_rowwise", [&] {
    return detail::fp8_glu_rowwise_body(params, layout, x, up, weights, nullptr, nullptr, q, scale, &col_amax_offsets,
                                        &col_amax, stream);
  });
}

Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                       const OffsetsRef& offsets, const MatrixRef& q, const VectorRef& scale,
                       void* stream) {
  return detail::guarded("fp8_glu_rowwise", [&] {
    return detail::fp8_glu_rowwise_body(params, layout, x, up, weights, &bias, &offsets, q, scale, nullptr, nullptr,
                                        stream);
  });
}

Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                       const OffsetsRef& offsets, const MatrixRef& q, const VectorRef& scale,
                       const MatrixRef& col_amax, void* stream) {
  return detail::guarded("fp8_glu_rowwise", [&] {
    return detail::fp8_glu_rowwise_body(params, layout, x, up, weights, &bias, &offsets, q, scale, &offsets,
                                        &col_amax, stream);
  });
}

Status fp8_glu_colwise_grouped(const GluParams& params, Layout layout, const MatrixRef& x, const MatrixRef* up,
                               const VectorRef* weights, const MatrixRef* bias, const OffsetsRef& offsets,
                               const OffsetsRef* padded_offsets, const MatrixRef& q_t, const MatrixRef& scale,
                               const MatrixRef& amax, void* stream) {
  return detail::guarded("fp8_glu_colwise_grouped", [&] {
    return detail::fp8_glu_colwise_grouped_body(params, layout, x, up, weights, bias, offsets, padded_offsets, q_t,
                                                scale, amax, stream);
  });
}

Status fp8_glu_backward_rowwise(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                                const MatrixRef& gate_up, const VectorRef* weights, const MatrixRef* bias,
                                const OffsetsRef* offsets, const MatrixRef& q, const VectorRef& scale,
                                const VectorRef* grad_weights, const MatrixRef* col_amax,
                                const MatrixRef* grad_gate_up, void* stream) {
  return detail::guarded("fp8_glu_backward_rowwise", [&] {
    return detail::fp8_glu_backward_rowwise_body(params, layout, grad_out, gate_up, weights, bias, offsets, q, scale,
                                                 grad_weights, col_amax, grad_gate_up, stream);
  });
}

}  // namespace expertact
