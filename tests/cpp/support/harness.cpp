// The harness of harness.h: inputs, operand layout in backend memory, runners, checks.
#include "support/harness.h"

#include <gtest/gtest.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>

namespace eat {

using expertact::Activation;
using expertact::MatrixRef;
using expertact::VectorRef;

// ---------------------------------------------------------------- parameters

GluParams make_params(Activation act, float alpha, float limit, float beta) {
  GluParams p;
  p.act = act;
  p.alpha = alpha;
  p.limit = limit;
  p.beta = beta;
  return p;
}

const std::vector<PresetSpec>& presets() {
  const float inf = std::numeric_limits<float>::infinity();
  static const std::vector<PresetSpec> v = {
      {"swiglu", make_params(Activation::kSilu, 1.0f, inf, 0.0f)},
      {"swiglu_clamped7", make_params(Activation::kSilu, 1.0f, 7.0f, 0.0f)},
      {"swiglu_clamped10", make_params(Activation::kSilu, 1.0f, 10.0f, 0.0f)},
      {"swiglu_oai", make_params(Activation::kSilu, 1.702f, 7.0f, 1.0f)},
      {"geglu_tanh", make_params(Activation::kGeluTanh, 1.0f, inf, 0.0f)},
      {"silu_general", make_params(Activation::kSilu, 0.5f, 3.0f, -0.25f)},
      {"gelu_general", make_params(Activation::kGeluTanh, 1.0f, 5.0f, 1.0f)},
  };
  return v;
}

const PresetSpec& preset(const std::string& name) {
  for (const auto& p : presets())
    if (name == p.name) return p;
  throw std::invalid_argument("unknown test preset " + name);
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kSeparate: return "separate";
    case Layout::kHalves: return "halves";
    case Layout::kHalvesUpFirst: return "halves_up_first";
    case Layout::kInterleaved: return "interleaved";
  }
  return "layout?";
}

const std::vector<Layout>& all_layouts() {
  static const std::vector<Layout> v = {Layout::kSeparate, Layout::kHalves, Layout::kHalvesUpFirst,
                                        Layout::kInterleaved};
  return v;
}

const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> v = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  return v;
}

const char* wmode_name(WMode m) {
  switch (m) {
    case WMode::kNone: return "no weights";
    case WMode::kWeights: return "weights+grad";
    case WMode::kWeightsNoGrad: return "weights, no grad_weights";
  }
  return "?";
}

const char* inplace_name(InPlace m) {
  switch (m) {
    case InPlace::kNo: return "out-of-place";
    case InPlace::kGate: return "in-place grad_x";
    case InPlace::kAll: return "in-place";
  }
  return "?";
}

std::string Case::describe() const {
  std::ostringstream s;
  s << (params.act == Activation::kSilu ? "silu" : "gelu_tanh") << "(alpha " << params.alpha
    << ", limit " << params.limit << ", beta " << params.beta << ") " << layout_name(layout) << " "
    << dtype_name(dtype) << " rows " << rows << " F " << F;
  if (x_extra || out_extra || dy_extra) s << " extra " << x_extra << "/" << out_extra << "/" << dy_extra;
  if (offset) s << " offset " << offset;
  if (shared_gate_up) s << " shared gate/up buffer";
  if (zero_stride_single_row) s << " row_stride 0";
  if (w_stride != 1 || gw_stride != 1) s << " w_stride " << w_stride << " gw_stride " << gw_stride;
  if (specials) s << " specials";
  s << " seed " << seed;
  return s.str();
}

// ---------------------------------------------------------------- inputs

std::vector<double> special_values(const Case& c) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> v = {nan, inf, -inf, 0.0, -0.0};
  if (std::isfinite(c.params.limit)) {
    const double L = round_to(c.dtype, c.params.limit);
    for (double x : {L, -L, next_up(c.dtype, L), next_down(c.dtype, L), next_up(c.dtype, -L),
                     next_down(c.dtype, -L), 2 * L, -2 * L})
      v.push_back(x);
  } else {
    for (double x : {40.0, -40.0, 1.0, -1.0}) v.push_back(x);
  }
  return v;
}

Inputs make_inputs(const Case& c) {
  Inputs in;
  in.rows = c.rows;
  in.F = c.F;
  const size_t n = static_cast<size_t>(c.rows * c.F);
  in.gate.resize(n);
  in.up.resize(n);
  in.dy.resize(n);
  in.w.resize(static_cast<size_t>(c.rows));
  std::mt19937_64 rng(c.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(c.rows * 131 + c.F));
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  for (size_t i = 0; i < n; ++i) {
    in.gate[i] = static_cast<float>(round_to(c.dtype, c.scale * normal(rng)));
    in.up[i] = static_cast<float>(round_to(c.dtype, c.scale * normal(rng)));
    in.dy[i] = static_cast<float>(round_to(c.dtype, normal(rng)));
  }
  for (int64_t r = 0; r < c.rows; ++r)
    in.w[r] = r % 7 == 2 ? 0.0f : static_cast<float>(0.05 + 1.95 * unif(rng));
  if (c.specials) {
    // Every fourth row (1, 5, 9, ...) carries special values; the other rows
    // keep finite weight gradients.
    const std::vector<double> sv = special_values(c);
    const double dy_sv[] = {std::numeric_limits<double>::quiet_NaN(),
                            std::numeric_limits<double>::infinity(),
                            -std::numeric_limits<double>::infinity(), 0.0};
    std::uniform_int_distribution<size_t> pick(0, sv.size() - 1);
    std::uniform_int_distribution<size_t> pick_dy(0, 3);
    for (int64_t r = 1; r < c.rows; r += 4) {
      for (int64_t j = 0; j < c.F; ++j) {
        const size_t i = static_cast<size_t>(r * c.F + j);
        if (unif(rng) < 0.4) in.gate[i] = static_cast<float>(sv[pick(rng)]);
        if (unif(rng) < 0.4) in.up[i] = static_cast<float>(sv[pick(rng)]);
        if (unif(rng) < 0.1) in.dy[i] = static_cast<float>(dy_sv[pick_dy(rng)]);
      }
    }
  }
  return in;
}

// ---------------------------------------------------------------- memory layout

namespace {

constexpr int64_t kPad = 256;  // bytes before and after every operand, watched for stray writes

// A view inside a buffer: element (r, c) at byte off + (r * stride + c) * es.
struct Mat {
  int64_t off = 0, rows = 0, cols = 0, stride = 0, es = 4;
  DType dtype = DType::kFloat32;
  int64_t pos(int64_t r, int64_t c) const { return off + (r * stride + c) * es; }
};

// A matrix view `offset` elements past byte kPad.
Mat place(int64_t rows, int64_t cols, int64_t stride, DType d, int64_t offset) {
  Mat m;
  m.es = dtype_size(d);
  m.off = kPad + offset * m.es;
  m.rows = rows;
  m.cols = cols;
  m.stride = stride;
  m.dtype = d;
  return m;
}

// A float32 vector of n elements, stride s (negative: element 0 is the last in memory).
Mat place_vector(int64_t n, int64_t s) {
  Mat m;
  m.es = 4;
  m.dtype = DType::kFloat32;
  m.rows = n;
  m.cols = 1;
  m.stride = s;
  m.off = kPad + (s < 0 && n > 0 ? (n - 1) * -s * 4 : 0);
  return m;
}

size_t bytes_for(const Mat& m) {
  int64_t hi = m.off;
  if (m.rows > 0 && m.cols > 0) {
    hi = std::max(m.pos(0, m.cols), m.pos(m.rows - 1, m.cols));
  }
  return static_cast<size_t>(hi + kPad);
}

void put(std::vector<uint8_t>& img, const Mat& m, const float* vals) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) store_elem(m.dtype, &img[m.pos(r, c)], vals[r * m.cols + c]);
}

std::vector<float> get(const std::vector<uint8_t>& img, const Mat& m) {
  std::vector<float> v(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      v[r * m.cols + c] = static_cast<float>(load_elem(m.dtype, &img[m.pos(r, c)]));
  return v;
}

void mark(std::vector<uint8_t>& mask, const Mat& m) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) std::memset(&mask[m.pos(r, c)], 1, m.es);
}

}  // namespace

std::vector<float> pack_layout(Layout l, int64_t rows, int64_t F, const std::vector<float>& g,
                        const std::vector<float>& u) {
  std::vector<float> x(static_cast<size_t>(rows * 2 * F));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < F; ++j) {
      float* row = &x[r * 2 * F];
      const float gv = g[r * F + j], uv = u[r * F + j];
      switch (l) {
        case Layout::kHalves: row[j] = gv; row[F + j] = uv; break;
        case Layout::kHalvesUpFirst: row[j] = uv; row[F + j] = gv; break;
        case Layout::kInterleaved: row[2 * j] = gv; row[2 * j + 1] = uv; break;
        case Layout::kSeparate: break;
      }
    }
  return x;
}

void unpack_layout(Layout l, int64_t rows, int64_t F, const std::vector<float>& x, std::vector<float>& g,
            std::vector<float>& u) {
  g.assign(static_cast<size_t>(rows * F), 0.0f);
  u.assign(static_cast<size_t>(rows * F), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < F; ++j) {
      const float* row = &x[r * 2 * F];
      float& gv = g[r * F + j];
      float& uv = u[r * F + j];
      switch (l) {
        case Layout::kHalves: gv = row[j]; uv = row[F + j]; break;
        case Layout::kHalvesUpFirst: uv = row[j]; gv = row[F + j]; break;
        case Layout::kInterleaved: gv = row[2 * j]; uv = row[2 * j + 1]; break;
        case Layout::kSeparate: break;
      }
    }
}

namespace {

// One buffer of a run: its contents before the call, and the views the call writes.
struct Slot {
  const char* name;
  std::unique_ptr<DeviceBuffer> buf;
  std::vector<uint8_t> before;
  std::vector<Mat> written;
};

class Arena {
 public:
  explicit Arena(Backend& be) : be_(be) {}
  // A buffer big enough for the views, every byte set to fill.
  Slot* add(const char* name, std::initializer_list<Mat> views, uint8_t fill) {
    size_t bytes = 2 * kPad;
    for (const Mat& m : views) bytes = std::max(bytes, bytes_for(m));
    auto s = std::make_unique<Slot>();
    s->name = name;
    s->buf = std::make_unique<DeviceBuffer>(be_, bytes);
    if (!s->buf->ok()) {
      failed_ = true;
      slots_.push_back(std::move(s));
      return slots_.back().get();
    }
    std::memset(s->buf->image.data(), fill, bytes);
    slots_.push_back(std::move(s));
    return slots_.back().get();
  }
  bool failed() const { return failed_; }
  // Snapshots every buffer and copies it to the backend.
  void upload() {
    for (auto& s : slots_) {
      s->before = s->buf->image;
      s->buf->upload();
    }
  }
  // Copies back and reports any byte changed outside the written views.
  void download(std::vector<std::string>& issues) {
    for (auto& s : slots_) {
      s->buf->download();
      std::vector<uint8_t> mask(s->before.size(), 0);
      for (const Mat& m : s->written) mark(mask, m);
      for (size_t i = 0; i < mask.size(); ++i) {
        if (!mask[i] && s->buf->image[i] != s->before[i]) {
          char msg[200];
          std::snprintf(msg, sizeof msg, "%s: byte %zu (of %zu) changed from 0x%02x to 0x%02x %s",
                        s->name, i, mask.size(), s->before[i], s->buf->image[i],
                        s->written.empty() ? "(an input was modified)"
                                           : "(outside the output views: row gap or padding)");
          issues.push_back(msg);
          break;
        }
      }
    }
  }

 private:
  Backend& be_;
  std::vector<std::unique_ptr<Slot>> slots_;
  bool failed_ = false;
};

MatrixRef mref(const Backend& be, const Slot* s, const Mat& m, bool zero_stride) {
  MatrixRef r;
  r.data = s->buf->data() + m.off;
  r.rows = m.rows;
  r.cols = m.cols;
  r.row_stride = (zero_stride && m.rows == 1) ? 0 : m.stride;
  r.dtype = m.dtype;
  r.device = be.device();
  r.device_id = be.device_id();
  return r;
}

VectorRef vref(const Backend& be, const Slot* s, const Mat& m) {
  VectorRef v;
  v.data = reinterpret_cast<float*>(s->buf->data() + m.off);
  v.size = m.rows;
  v.stride = m.stride;
  v.device = be.device();
  v.device_id = be.device_id();
  return v;
}

// The operands of a case: views and their buffers.
struct Operands {
  Mat gate, up, x;  // separate: gate, up; packed: x
  Slot *sx = nullptr, *su = nullptr, *sw = nullptr;
  Mat w;
};

Operands lay_inputs(Arena& a, const Case& c, const Inputs& in, bool weights) {
  Operands o;
  const int64_t F = c.F, R = c.rows;
  if (is_separate(c.layout)) {
    if (c.shared_gate_up) {
      const int64_t stride = 2 * F + c.x_extra;
      o.gate = place(R, F, stride, c.dtype, c.offset);
      o.up = o.gate;
      o.up.off += F * o.gate.es;
      o.sx = a.add("gate+up", {o.gate, o.up}, 0xFF);
      o.su = o.sx;
    } else {
      o.gate = place(R, F, F + c.x_extra, c.dtype, c.offset);
      o.up = place(R, F, F + c.x_extra, c.dtype, c.offset);
      o.sx = a.add("gate", {o.gate}, 0xFF);
      o.su = a.add("up", {o.up}, 0xFF);
    }
    if (!a.failed()) {
      put(o.sx->buf->image, o.gate, in.gate.data());
      put(o.su->buf->image, o.up, in.up.data());
    }
  } else {
    o.x = place(R, 2 * F, 2 * F + c.x_extra, c.dtype, c.offset);
    o.sx = a.add("gate_up", {o.x}, 0xFF);
    if (!a.failed()) put(o.sx->buf->image, o.x, pack_layout(c.layout, R, F, in.gate, in.up).data());
  }
  if (weights) {
    o.w = place_vector(R, c.w_stride);
    o.sw = a.add("weights", {o.w}, 0xFF);
    if (!a.failed()) put(o.sw->buf->image, o.w, in.w.data());
  }
  return o;
}

}  // namespace

RunResult run_forward(Backend& be, const Case& c, const Inputs& in, WMode wm, uint8_t poison) {
  RunResult res;
  Arena a(be);
  const bool weights = wm != WMode::kNone;
  Operands o = lay_inputs(a, c, in, weights);
  const Mat out = place(c.rows, c.F, c.F + c.out_extra, c.dtype, c.offset);
  Slot* so = a.add("out", {out}, poison);
  if (a.failed()) {
    res.error = "buffer allocation failed";
    res.issues.push_back(res.error);
    return res;
  }
  so->written.push_back(out);
  a.upload();
  const bool z = c.zero_stride_single_row;
  const bool sep = is_separate(c.layout);
  const MatrixRef x = mref(be, o.sx, sep ? o.gate : o.x, z);
  const MatrixRef up = sep ? mref(be, o.su, o.up, z) : MatrixRef{};
  const VectorRef w = weights ? vref(be, o.sw, o.w) : VectorRef{};
  res.status = expertact::glu_forward(c.params, c.layout, x, sep ? &up : nullptr,
                                      weights ? &w : nullptr, mref(be, so, out, z), be.stream());
  res.error = expertact::last_error();
  be.finish("glu_forward");
  a.download(res.issues);
  res.out = get(so->buf->image, out);
  return res;
}

RunResult run_backward(Backend& be, const Case& c, const Inputs& in, WMode wm, InPlace ip,
                       uint8_t poison) {
  RunResult res;
  Arena a(be);
  const bool weights = wm != WMode::kNone;
  const bool want_gw = wm == WMode::kWeights;
  const bool sep = is_separate(c.layout);
  const int64_t F = c.F, R = c.rows;
  Operands o = lay_inputs(a, c, in, weights);
  const Mat dy = place(R, F, F + c.dy_extra, c.dtype, c.offset);
  Slot* sdy = a.add("grad_out", {dy}, 0xFF);
  if (!a.failed()) put(sdy->buf->image, dy, in.dy.data());
  // Gradient views: the inputs themselves in place, else their own poisoned buffers.
  Mat gx, gu;
  Slot *sgx = nullptr, *sgu = nullptr, *sgw = nullptr;
  const int64_t xcols = sep ? F : 2 * F;
  if (ip == InPlace::kNo) {
    gx = place(R, xcols, xcols + c.out_extra, c.dtype, c.offset);
    sgx = a.add(sep ? "grad_gate" : "grad_gate_up", {gx}, poison);
  } else {
    gx = sep ? o.gate : o.x;
    sgx = o.sx;
  }
  if (sep) {
    if (ip == InPlace::kAll) {
      gu = o.up;
      sgu = o.su;
    } else {
      gu = place(R, F, F + c.out_extra, c.dtype, c.offset);
      sgu = a.add("grad_up", {gu}, poison);
    }
  }
  Mat gw;
  if (want_gw) {
    gw = place_vector(R, c.gw_stride);
    sgw = a.add("grad_weights", {gw}, poison);
  }
  if (a.failed()) {
    res.error = "buffer allocation failed";
    res.issues.push_back(res.error);
    return res;
  }
  sgx->written.push_back(gx);
  if (sep) sgu->written.push_back(gu);
  if (want_gw) sgw->written.push_back(gw);
  a.upload();

  const bool z = c.zero_stride_single_row;
  const MatrixRef x = mref(be, o.sx, sep ? o.gate : o.x, z);
  const MatrixRef up = sep ? mref(be, o.su, o.up, z) : MatrixRef{};
  const VectorRef w = weights ? vref(be, o.sw, o.w) : VectorRef{};
  const MatrixRef gxr = mref(be, sgx, gx, z);
  const MatrixRef gur = sep ? mref(be, sgu, gu, z) : MatrixRef{};
  const VectorRef gwr = want_gw ? vref(be, sgw, gw) : VectorRef{};
  res.status = expertact::glu_backward(c.params, c.layout, mref(be, sdy, dy, z), x,
                                       sep ? &up : nullptr, weights ? &w : nullptr, gxr,
                                       sep ? &gur : nullptr, want_gw ? &gwr : nullptr, be.stream());
  res.error = expertact::last_error();
  be.finish("glu_backward");
  a.download(res.issues);
  if (sep) {
    res.dgate = get(sgx->buf->image, gx);
    res.dup = get(sgu->buf->image, gu);
  } else {
    unpack_layout(c.layout, R, F, get(sgx->buf->image, gx), res.dgate, res.dup);
  }
  if (want_gw) res.dw = get(sgw->buf->image, gw);
  return res;
}

// ---------------------------------------------------------------- checks

namespace {
// float32 and bfloat16 results may flush below FLT_MIN (the library's host exp
// returns 0 under e^-87.3, CUDA may flush subnormals): an absolute floor far
// below any value a test produces otherwise. float16's ulp already covers its
// subnormals.
double abs_floor(DType d) { return d == DType::kFloat16 ? 0.0 : 1e-36; }

std::string fmt(double x) {
  char b[40];
  std::snprintf(b, sizeof b, "%.9g", x);
  return b;
}
}  // namespace

bool within(DType d, double K, double got, const Ref& want, double* ratio, std::string* why) {
  *ratio = 0;
  if (want.exact) {
    if (got == want.v) return true;
    *why = "must be exactly " + fmt(want.v) + " (masked gradient)";
    return false;
  }
  if (std::isnan(want.v)) {
    if (std::isnan(got)) return true;
    *why = "must be NaN";
    return false;
  }
  if (std::isinf(want.v)) {
    if (got == want.v || (want.nan_ok && std::isnan(got))) return true;
    *why = std::string("must be ") + (want.v > 0 ? "+inf" : "-inf");
    return false;
  }
  if (!std::isfinite(want.e)) {
    *why = "oracle bound not finite for a finite value (oracle bug)";
    return false;
  }
  // The float32 evaluation is within K e of the exact value; rounding is
  // monotone, so the stored result lies between the roundings of the window's
  // ends: exactly round(v) unless v is within K e of a rounding boundary (then
  // either neighbour). This holds for float32 outputs (got is a float in the
  // window) and for 2-byte ones (got = round(float32 value)).
  const double slack = K * want.e + abs_floor(d);
  const double lo = round_to(d, want.v - slack), hi = round_to(d, want.v + slack);
  const double ref = round_to(d, want.v);
  if (std::isnan(got)) {
    *why = "must be about " + fmt(ref) + ", not NaN";
    return false;
  }
  if (got >= lo && got <= hi) {
    const double span = got >= ref ? hi - ref : ref - lo;
    *ratio = span > 0 ? std::fabs(got - ref) / span : 0.0;
    return true;
  }
  *ratio = std::numeric_limits<double>::infinity();
  *why = "want " + fmt(ref) + " (exact " + fmt(want.v) + "), allowed [" + fmt(lo) + ", " + fmt(hi) + "]";
  return false;
}

void Tally::check(int64_t r, int64_t c, double got, const Ref& want) {
  ++n;
  double ratio = 0;
  std::string why;
  const bool ok = within(dtype, K, got, want, &ratio, &why);
  if (ok) worst = std::max(worst, ratio);
  if (!ok) {
    ++bad;
    if (examples.size() < 6) {
      std::string ctx;
      if (inputs && what != "grad_weights") {
        const size_t i = static_cast<size_t>(r * inputs->F + c);
        ctx = " [gate " + fmt(inputs->gate[i]) + ", up " + fmt(inputs->up[i]) + ", grad_out " +
              fmt(inputs->dy[i]) + ", w " + fmt(inputs->w[r]) + "]";
      }
      examples.push_back(what + "[" + std::to_string(r) + ", " + std::to_string(c) + "] = " +
                         fmt(got) + ": " + why + ctx);
    }
  }
}

void Tally::check_pair(int64_t r, int64_t c, double a, double b, const Ref& want) {
  ++n;
  if (a == b || (std::isnan(a) && std::isnan(b))) return;
  if (want.nan_ok && std::isinf(want.v) && (std::isnan(a) || a == want.v) &&
      (std::isnan(b) || b == want.v))
    return;
  std::string why;
  bool ok = false;
  if (std::isfinite(a) && std::isfinite(b) && !want.exact && std::isfinite(want.e)) {
    const double tol = std::max(ulp_of(dtype, a), ulp_of(dtype, b)) + K * want.e + abs_floor(dtype);
    const double ratio = std::fabs(a - b) / tol;
    worst = std::max(worst, ratio);
    ok = ratio <= 1;
    if (!ok) why = "differ by " + fmt(std::fabs(a - b)) + " > " + fmt(tol);
  } else {
    why = "differ in NaN/Inf/exactness";
  }
  if (!ok) {
    ++bad;
    if (examples.size() < 6)
      examples.push_back(what + "[" + std::to_string(r) + ", " + std::to_string(c) + "]: " +
                         fmt(a) + " vs " + fmt(b) + ": " + why);
  }
}

std::string Tally::report() const {
  std::string s = what + ": " + std::to_string(bad) + " of " + std::to_string(n) +
                  " elements wrong (worst error/tolerance " + fmt(worst) + ")";
  for (const auto& e : examples) s += "\n    " + e;
  return s;
}

namespace {
// Runs the oracle row by row and hands each row's expectations to fn.
template <typename Fn>
void for_each_oracle_row(const Case& c, const Inputs& in, WMode wm, bool fwd, bool bwd,
                         const OracleParams& op, Fn&& fn) {
  const int64_t F = c.F;
  std::vector<Ref> out(F), dg(F), du(F);
  Ref dw;
  for (int64_t r = 0; r < c.rows; ++r) {
    const double w = wm == WMode::kNone ? 1.0 : static_cast<double>(in.w[r]);
    const float* g = in.gate.data() + r * F;
    const float* u = in.up.data() + r * F;
    if (fwd) oracle_forward_row(op, g, u, w, F, out.data());
    if (bwd) oracle_backward_row(op, g, u, in.dy.data() + r * F, w, F, dg.data(), du.data(), &dw);
    fn(r, out, dg, du, dw);
  }
}
}  // namespace

Verdict verify(const Case& c, const Inputs& in, WMode wm, const RunResult* fwd,
               const RunResult* bwd, const OracleParams& op, double K) {
  Verdict v(c.dtype, K);
  for (Tally* t : {&v.out, &v.dg, &v.du, &v.dw}) t->inputs = &in;
  const int64_t F = c.F;
  const bool has_dw = bwd && wm == WMode::kWeights;
  for_each_oracle_row(c, in, wm, fwd != nullptr, bwd != nullptr, op,
                      [&](int64_t r, const std::vector<Ref>& out, const std::vector<Ref>& dg,
                          const std::vector<Ref>& du, const Ref& dw) {
                        for (int64_t j = 0; j < F; ++j) {
                          const size_t i = static_cast<size_t>(r * F + j);
                          if (fwd) v.out.check(r, j, fwd->out[i], out[j]);
                          if (bwd) {
                            v.dg.check(r, j, bwd->dgate[i], dg[j]);
                            v.du.check(r, j, bwd->dup[i], du[j]);
                          }
                        }
                        if (has_dw) v.dw.check(r, 0, bwd->dw[r], dw);
                      });
  return v;
}

Verdict verify_pair(const Case& c, const Inputs& in, WMode wm, const RunResult* fwd_a,
                    const RunResult* fwd_b, const RunResult* bwd_a, const RunResult* bwd_b) {
  Verdict v(c.dtype, kPeerK);
  const int64_t F = c.F;
  const bool fwd = fwd_a && fwd_b, bwd = bwd_a && bwd_b;
  const bool has_dw = bwd && wm == WMode::kWeights;
  for_each_oracle_row(c, in, wm, fwd, bwd, oracle_params(c.params),
                      [&](int64_t r, const std::vector<Ref>& out, const std::vector<Ref>& dg,
                          const std::vector<Ref>& du, const Ref& dw) {
                        for (int64_t j = 0; j < F; ++j) {
                          const size_t i = static_cast<size_t>(r * F + j);
                          if (fwd) v.out.check_pair(r, j, fwd_a->out[i], fwd_b->out[i], out[j]);
                          if (bwd) {
                            v.dg.check_pair(r, j, bwd_a->dgate[i], bwd_b->dgate[i], dg[j]);
                            v.du.check_pair(r, j, bwd_a->dup[i], bwd_b->dup[i], du[j]);
                          }
                        }
                        if (has_dw) v.dw.check_pair(r, 0, bwd_a->dw[r], bwd_b->dw[r], dw);
                      });
  return v;
}

void expect_verdict(const Verdict& v, const std::string& label) {
  for (const Tally* t : {&v.out, &v.dg, &v.du, &v.dw}) {
    EXPECT_TRUE(t->ok()) << label << ": " << t->report();
  }
  if (std::getenv("EAT_VERBOSE")) {
    std::printf("[ratio] %s: out %.3g dg %.3g du %.3g dw %.3g\n", label.c_str(), v.out.worst,
                v.dg.worst, v.du.worst, v.dw.worst);
  }
}

std::string bitwise_diff(const std::vector<float>& a, const std::vector<float>& b,
                         const char* what, int64_t cols) {
  if (a.size() != b.size()) return std::string(what) + ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i) {
    const bool same = std::isnan(a[i]) ? std::isnan(b[i]) : std::memcmp(&a[i], &b[i], 4) == 0;
    if (!same) {
      const int64_t c = cols > 0 ? cols : 1;
      return std::string(what) + "[" + std::to_string(static_cast<int64_t>(i) / c) + ", " +
             std::to_string(static_cast<int64_t>(i) % c) + "]: " + fmt(a[i]) + " vs " + fmt(b[i]) +
             " (an element left unwritten keeps the poison, which differs between the runs)";
    }
  }
  return "";
}

namespace {
void expect_run_ok(const RunResult& r, const std::string& label) {
  EXPECT_EQ(r.status, Status::kOk) << label << ": " << r.error;
  for (const auto& s : r.issues) ADD_FAILURE() << label << ": " << s;
}
}  // namespace

void check_case(BackendKind kind, const Case& c, const Plan& plan) {
  check_case(kind, c, make_inputs(c), plan);
}

void check_case(BackendKind kind, const Case& c, const Inputs& in, const Plan& plan) {
  SCOPED_TRACE(c.describe() + ", " + wmode_name(plan.wmode) + ", " + backend_name(kind));
  Backend& be = backend(kind);
  const OracleParams op = oracle_params(c.params);
  const bool gpu = kind != BackendKind::kCpu;
  if (plan.forward) {
    const RunResult a = run_forward(be, c, in, plan.wmode, kPoisonA);
    const RunResult b = run_forward(be, c, in, plan.wmode, kPoisonB);
    expect_run_ok(a, "forward");
    expect_run_ok(b, "forward (second poison)");
    if (a.status == Status::kOk && b.status == Status::kOk) {
      const std::string d = bitwise_diff(a.out, b.out, "out", c.F);
      EXPECT_EQ(d, "") << "two forward runs differ";
      expect_verdict(verify(c, in, plan.wmode, &a, nullptr, op), "forward vs oracle");
      if (gpu) {
        const RunResult h = run_forward(backend(BackendKind::kCpu), c, in, plan.wmode, kPoisonA);
        expect_run_ok(h, "forward on the CPU path");
        expect_verdict(verify_pair(c, in, plan.wmode, &a, &h, nullptr, nullptr),
                       "forward vs CPU path");
      }
    }
  }
  if (plan.backward) {
    const RunResult a = run_backward(be, c, in, plan.wmode, InPlace::kNo, kPoisonA);
    const RunResult b = run_backward(be, c, in, plan.wmode, InPlace::kNo, kPoisonB);
    expect_run_ok(a, "backward");
    expect_run_ok(b, "backward (second poison)");
    if (a.status == Status::kOk && b.status == Status::kOk) {
      EXPECT_EQ(bitwise_diff(a.dgate, b.dgate, "grad_gate", c.F), "") << "two backward runs differ";
      EXPECT_EQ(bitwise_diff(a.dup, b.dup, "grad_up", c.F), "") << "two backward runs differ";
      EXPECT_EQ(bitwise_diff(a.dw, b.dw, "grad_weights", 1), "") << "two backward runs differ";
      expect_verdict(verify(c, in, plan.wmode, nullptr, &a, op), "backward vs oracle");
      if (gpu) {
        const RunResult h =
            run_backward(backend(BackendKind::kCpu), c, in, plan.wmode, InPlace::kNo, kPoisonA);
        expect_run_ok(h, "backward on the CPU path");
        expect_verdict(verify_pair(c, in, plan.wmode, nullptr, nullptr, &a, &h),
                       "backward vs CPU path");
      }
    }
    if (plan.inplace != InPlace::kNo) {
      const RunResult ip = run_backward(be, c, in, plan.wmode, plan.inplace, kPoisonA);
      const std::string label = std::string(inplace_name(plan.inplace)) + " backward";
      expect_run_ok(ip, label);
      if (ip.status == Status::kOk) {
        expect_verdict(verify(c, in, plan.wmode, nullptr, &ip, op), label + " vs oracle");
        if (a.status == Status::kOk)
          expect_verdict(verify_pair(c, in, plan.wmode, nullptr, nullptr, &ip, &a),
                         label + " vs out-of-place");
      }
    }
  }
}

void check_case_all_modes(BackendKind kind, const Case& c) {
  check_case_all_modes(kind, c, make_inputs(c));
}

void check_case_all_modes(BackendKind kind, const Case& c, const Inputs& in) {
  check_case(kind, c, in, Plan{WMode::kNone, true, true, InPlace::kAll});
  check_case(kind, c, in, Plan{WMode::kWeights, true, true, InPlace::kGate});
  check_case(kind, c, in, Plan{WMode::kWeightsNoGrad, false, true, InPlace::kNo});
}

}  // namespace eat
