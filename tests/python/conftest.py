"""Shared pieces of the Python tests: devices, the float64 eager reference, layouts.

CPU tests run everywhere (CI: torch CPU); CUDA cases skip cleanly without a GPU or
without the library's CUDA path.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import expertact

HAS_CUDA = torch.cuda.is_available() and expertact.has_cuda()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of expertact")
requires_2_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PRESETS = ["swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh"]
LAYOUTS = ["separate", "halves", "up_first", "interleaved"]

# Per-dtype tolerances of a result computed in float32 and rounded once, against the
# float64 reference: about one unit in the last place of the dtype (a wrong formula,
# mask or rounding path misses them by orders of magnitude).
TOL = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-4),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-3),
}
# float32 arithmetic error relative to the magnitude of the factors of a result,
# |dy| * |w| * (1 + |g|) * (1 + |u| + beta): where a value is a small difference of
# large terms (gelu_tanh's 1 + tanh near -1, silu' in the tail) its absolute error
# scales with them, for eager float32 PyTorch as for the kernel (measured: ~1e-6 and
# ~2e-6 of |dy * u| for gelu_tanh's gradient). A wrong mask or formula errs by O(1) of it.
FACTOR_TOL = 5e-6


def assert_matches(got, want, dtype, scale=None):
    """got (dtype) against the float64 reference rounded once to dtype: same NaN and Inf
    positions, finite values within TOL[dtype] (+ FACTOR_TOL * scale where given)."""
    got = got.detach().double()
    want = want.detach().to(dtype).double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ"
    inf = got.isinf() | want.isinf()
    assert torch.equal(got[inf], want[inf]), "Inf positions differ"
    fin = ~(inf | want.isnan())
    tol = TOL[dtype]["atol"] + TOL[dtype]["rtol"] * want.abs()
    if scale is not None:
        tol = tol + FACTOR_TOL * scale.double()
    err = (got - want).abs()
    bad = fin & ~(err <= tol)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} of {got.numel()} elements differ; first at {i}: "
                             f"got {got[tuple(i)].item()!r}, want {want[tuple(i)].item()!r}, "
                             f"tolerance {tol[tuple(i)].item() if tol.dim() else tol:.3g}")


def preset_params(preset, alpha=1.702, limit=7.0):
    """(activation, alpha, limit, beta) of a preset, written out from docs/spec.md section 1."""
    return {
        "swiglu": ("silu", 1.0, math.inf, 0.0),
        "swiglu_clamped": ("silu", 1.0, limit, 0.0),
        "swiglu_oai": ("silu", alpha, limit, 1.0),
        "geglu_tanh": ("gelu_tanh", 1.0, math.inf, 0.0),
    }[preset]


def params_of(preset):
    """(activation, alpha, limit, beta): of a preset name, or the general form given as that tuple."""
    return preset_params(preset) if isinstance(preset, str) else tuple(preset)


def preset_kwargs(preset, alpha=1.702, limit=7.0):
    return {"swiglu_oai": dict(alpha=alpha, limit=limit), "swiglu_clamped": dict(limit=limit)}.get(preset, {})


def reference(gate, up, activation, alpha, limit, beta, weights=None):
    """The eager PyTorch expression (docs/spec.md section 1), in whatever dtype its inputs have."""
    if math.isinf(limit):
        g, u = gate, up  # no clamp at all: NaN gets a NaN gradient of its own, as F.silu(g) * u gives it
    else:
        g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if activation == "gelu_tanh":
        a = F.gelu(g, approximate="tanh")
    elif alpha == 1.0:
        a = F.silu(g)  # docs/spec.md section 1: the gradient (incl. its Inf/NaN) of the eager F.silu(g) * u
    else:
        a = g * torch.sigmoid(alpha * g)
    out = a * (u + beta)
    if weights is not None:
        out = out * weights.reshape(weights.shape + (1,) * (out.dim() - weights.dim()))
    return out


def split(gate_up, layout):
    """(gate, up) views of a packed tensor."""
    if layout == "halves":
        return gate_up.chunk(2, dim=-1)
    if layout == "up_first":
        up, gate = gate_up.chunk(2, dim=-1)
        return gate, up
    if layout == "interleaved":
        return gate_up[..., 0::2], gate_up[..., 1::2]
    raise ValueError(layout)


def make_inputs(layout, shape, dtype, device, scale=4.0, seed=0):
    """Leaf tensors (gate, up) or (gate_up,) with values spread over the clamp limits."""
    gen = torch.Generator().manual_seed(seed)
    *lead, f = shape
    shapes = [shape, shape] if layout == "separate" else [(*lead, 2 * f)]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device) for s in shapes]


def call(preset, inputs, layout, **kw):
    fn = getattr(expertact, preset)
    if layout == "separate":
        return fn(inputs[0], inputs[1], **preset_kwargs(preset), **kw)
    return fn(inputs[0], layout=layout, **preset_kwargs(preset), **kw)


def error_scales(preset, inputs, layout, grad_out, weights=None):
    """The factor magnitudes (see FACTOR_TOL) of the output and of each input's gradient.
    preset: a preset name or an (activation, alpha, limit, beta) tuple."""
    beta = abs(params_of(preset)[3])
    xs = [t.detach().double() for t in inputs]
    gate, up = (xs[0], xs[1]) if layout == "separate" else split(xs[0], layout)
    s = (1 + gate.abs()).nan_to_num(posinf=0) * (1 + up.abs() + beta).nan_to_num(posinf=0)
    if weights is not None:
        # nan_to_num as for gate and up: a NaN weight's row is NaN (or, where masked, exactly 0),
        # and a NaN tolerance would fail even that exact 0.
        w = weights.detach().double().abs().nan_to_num(posinf=0)
        s = s * w.reshape(weights.shape + (1,) * (s.dim() - weights.dim()))
    s_grad = s * grad_out.detach().double().abs()
    if layout == "separate":
        return s, [s_grad, s_grad]
    packed = torch.empty_like(xs[0])
    pg, pu = split(packed, layout)
    pg.copy_(s_grad)
    pu.copy_(s_grad)
    return s, [packed]


def reference_grads(preset, inputs, layout, grad_out, weights=None, dtype=torch.float64):
    """Output and gradients of the float64 eager expression on the same inputs (or of the
    expression evaluated in `dtype`). preset: a preset name or an (activation, alpha, limit,
    beta) tuple."""
    act, alpha, limit, beta = params_of(preset)
    xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    w = None if weights is None else weights.detach().to(dtype).requires_grad_()
    gate, up = (xs[0], xs[1]) if layout == "separate" else split(xs[0], layout)
    out = reference(gate, up, act, alpha, limit, beta, w)
    wanted = xs + ([w] if w is not None else [])
    grads = torch.autograd.grad(out, wanted, grad_out.to(dtype))
    return out.detach(), list(grads)


def weight_grad_terms(preset, gate, up, grad_out):
    """sum over the row of |grad_out * act(gc) * (uc + beta)| (float64): the magnitude that the
    float32 accumulation of the weights' gradient errs relative to."""
    act, alpha, limit, beta = params_of(preset)
    a = reference(gate.detach().double(), up.detach().double(), act, alpha, limit, beta)
    return (a * grad_out.detach().double()).abs().sum(-1)


def assert_weight_grad_matches(got, want, terms):
    """The float32 weight gradient against the float64 one: same NaN and Inf positions, finite
    values within 1e-5 of the summed |terms| (+1e-6): a dropped or doubled term of a row fails."""
    assert got.dtype == torch.float32, got.dtype
    got = got.detach().double()
    want = want.detach().double().reshape(got.shape)
    terms = terms.reshape(got.shape)
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions of the weight gradient differ"
    inf = got.isinf() | want.isinf()
    assert torch.equal(got[inf], want[inf]), "Inf positions of the weight gradient differ"
    fin = ~(inf | want.isnan())
    tol = 1e-5 * terms + 1e-6
    bad = fin & ~((got - want).abs() <= tol)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} of {got.numel()} weight gradients differ; first at {i}: "
                             f"got {got[tuple(i)].item()!r}, want {want[tuple(i)].item()!r}, "
                             f"tolerance {tol[tuple(i)].item():.3g}")
