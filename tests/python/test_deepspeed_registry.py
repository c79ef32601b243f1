"""expertact inside DeepSpeed's own expert-activation registry (deepspeed.moe.ep_experts, DeepSpeed
0.19.8): enable()/disable(), DeepSpeed's apply_* and GroupedExperts running expertact, checked against
DeepSpeed's eager fn in float64. Skips without deepspeed (CI installs it in scripts/test.sh)."""
import collections
import contextlib
import dataclasses
import math
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from expertact import deepspeed as xds
from conftest import DEVICES, assert_matches, error_scales

try:
    from deepspeed.moe import ep_experts as EP
    _WHY = ""
except ImportError as e:  # a user's own run without deepspeed
    EP, _WHY = None, f"deepspeed is not importable ({e}); scripts/test.sh installs deepspeed==0.19.8"

needs_ds = pytest.mark.skipif(EP is None, reason=_WHY)

FORMS = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PARAMS = ((1.702, 7.0), (1.5, 10.0))  # GPT-OSS / MiniMax-M3's alpha and limit; DeepSeek-V4's limit
BETA = {"swiglu_oai": 1.0}
# DeepSpeed's own entries and their fields, as imported: enable() must leave these objects untouched.
DS_ENTRIES = dict(EP.EXPERT_ACTIVATIONS) if EP is not None else {}
DS_FIELDS = {n: tuple(getattr(e, f.name) for f in dataclasses.fields(e)) for n, e in DS_ENTRIES.items()}


def _registry_is_deepspeeds():
    reg = EP.EXPERT_ACTIVATIONS
    return set(reg) == set(DS_ENTRIES) and all(reg[n] is e for n, e in DS_ENTRIES.items())


@pytest.fixture(autouse=True)
def _restore_registry():
    yield
    if EP is not None:
        xds.disable()
        assert _registry_is_deepspeeds()
        for n, e in DS_ENTRIES.items():
            assert all(a is b for a, b in zip(DS_FIELDS[n], (getattr(e, f.name) for f in dataclasses.fields(e))))


class _OpLog(TorchDispatchMode):
    """Counts the operators that reach the dispatcher below autograd: proof of which kernel ran."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _eager(name):
    """DeepSpeed's entry without fused kernels: apply_* run its eager fn (what fused=False does)."""
    reg = EP.EXPERT_ACTIVATIONS
    before = reg[name]
    reg[name] = dataclasses.replace(DS_ENTRIES[name], fused_fn=None, packed_fused_fn=None)
    try:
        yield
    finally:
        reg[name] = before


def _specials(dtype, limit):
    """NaN, +-Inf, 0, +-1, exactly +-limit and one ulp (of dtype) either side of it, large values."""
    ulp = 2.0 ** math.floor(math.log2(limit)) * torch.finfo(dtype).eps
    vals = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0, -1.0, limit, -limit, limit - ulp, limit + ulp,
                         -limit + ulp, -limit - ulp, 2.5, -2.5, 40.0, -40.0], dtype=torch.float64).to(dtype)
    lim = torch.tensor(limit, dtype=dtype)
    assert vals[8] < lim < vals[9] and -vals[10] < lim < -vals[11], "not one ulp either side of the limit"
    return vals


def _inputs(dtype, limit, seed=0):
    """(gate, up), [22, 16]: every pair of special values, then random rows spread over the limits."""
    vals = _specials(dtype, limit)
    n = vals.numel()
    gen = torch.Generator().manual_seed(seed)
    rand = (torch.randn(2, 6, n, generator=gen, dtype=torch.float64) * 5).to(dtype)
    gate = torch.cat([vals.repeat(n).reshape(n, n), rand[0]])
    up = torch.cat([vals.repeat_interleave(n).reshape(n, n), rand[1]])
    return gate, up


def _ds_reference(name, gate, up, grad_out, alpha, limit):
    """DeepSpeed's own eager fn of the form, in float64 on the upcast inputs, and its gradients."""
    g, u = (t.detach().double().requires_grad_() for t in (gate, up))
    out = DS_ENTRIES[name].fn(g, u, alpha, limit)
    gg, gu = torch.autograd.grad(out, (g, u), grad_out.double())
    return out.detach(), gg, gu


def _check_vs_ds(name, got, want, dtype, scale, gate, up, sign):
    """assert_matches, but for one indeterminate case of geglu_tanh. Eager gelu_tanh computes
    0.5 g (1 + tanh(y)), which cancels to exactly 0 once tanh(y) rounds to -1 (g <= -7.145 in float64);
    times an up of +-Inf that gives NaN. expertact computes it as g * sigmoid(2y) (src/core/math.h),
    nonzero down to g = -10.06 in float32, and so gives +-Inf there. At those positions only (up
    +-Inf, gate finite and negative, DeepSpeed's fn NaN) NaN or an Inf of the product's sign
    (``sign``: +-1 per element, 0 where unknown) is accepted; everywhere else NaN and Inf must match."""
    want = want.detach().to(dtype).double().clone()
    if name == "geglu_tanh":
        mask = want.isnan() & up.isinf() & gate.isfinite() & (gate < 0)
        g = got.detach().double()
        ok = g.isnan() | (g.isinf() & ((sign == 0) | (g.sign() == sign)))
        assert bool(ok[mask].all()), f"geglu_tanh's 0 * Inf positions: got {g[mask & ~ok].tolist()}"
        want[mask] = g[mask]
    assert_matches(got, want, dtype, scale)


def _check_all_vs_ds(name, out, grads, refs, scales, gate, up, grad_out, dtype, packed):
    """The output and the gradients (gate_up's, or gate's and up's) against DeepSpeed's fn."""
    out_ref, gg_ref, gu_ref = refs
    s_out, s_grads = scales
    # Signs of gelu_tanh(g) * up and of gelu_tanh'(g) * up * dy where g << 0 (both factors negative).
    sign_out = -up.double().sign()
    sign_gg = -(up.double() * grad_out.double()).sign()
    _check_vs_ds(name, out, out_ref, dtype, s_out, gate, up, sign_out)
    zeros = torch.zeros_like(gate, dtype=torch.float64)
    if packed:
        wide = [torch.cat([t, zeros], -1) for t in (gate.double(), up.double(), sign_gg)]
        wide[0][..., gate.shape[-1]:] = 1.0  # the up half is never masked (its gate is positive)
        _check_vs_ds(name, grads[0], torch.cat([gg_ref, gu_ref], -1), dtype, s_grads[0], *wide)
    else:
        _check_vs_ds(name, grads[0], gg_ref, dtype, s_grads[0], gate, up, sign_gg)
        _check_vs_ds(name, grads[1], gu_ref, dtype, s_grads[1], gate, up, zeros)


# ---------------------------------------------------------------------------
# The registry entries
# ---------------------------------------------------------------------------


@needs_ds
def test_enable_replaces_only_the_fused_kernels():
    xds.enable()
    reg = EP.EXPERT_ACTIVATIONS
    assert set(reg) == set(DS_ENTRIES) and xds.is_enabled()
    want = {  # (activation, alpha, limit, beta); None: DeepSpeed's value from each call
        "swiglu": ("silu", 1.0, math.inf, 0.0),
        "geglu_tanh": ("gelu_tanh", 1.0, math.inf, 0.0),
        "swiglu_clamped": ("silu", 1.0, None, 0.0),
        "swiglu_oai": ("silu", None, None, 1.0),
    }
    for name in FORMS:
        new, old = reg[name], DS_ENTRIES[name]
        assert new is not old and type(new) is type(old)
        for field in ("fn", "uses_alpha", "uses_limit", "gate_fn"):
            assert getattr(new, field) is getattr(old, field), (name, field)
        for fn in (new.fused_fn, new.packed_fused_fn):
            assert fn.__module__ == "expertact.deepspeed"
            form = fn.expertact_form
            assert (form["name"], form["activation"], form["alpha"], form["limit"], form["beta"]) == (name, *want[name])
            assert form["inplace_backward"] is False
    # DeepSpeed's own: the Triton kernel for swiglu only (checked so a DeepSpeed change is noticed).
    assert DS_ENTRIES["swiglu"].fused_fn is not None and DS_ENTRIES["swiglu"].packed_fused_fn is not None
    assert all(DS_ENTRIES[n].fused_fn is None and DS_ENTRIES[n].packed_fused_fn is None for n in FORMS[1:])


@needs_ds
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("name", FORMS)
def test_deepspeed_apply_runs_expertact(name, packed):
    """DeepSpeed's own apply_expert_activation / apply_packed_expert_activation (fused=True, their
    default) reach expertact's operators, forward and backward, and none of the eager ones."""
    g, u = (t.requires_grad_() for t in _inputs(torch.float32, 7.0)[:2])
    gu = torch.cat([g.detach(), u.detach()], -1).requires_grad_()

    def run(fused=True):
        with _OpLog() as log:
            if packed:
                h = EP.apply_packed_expert_activation(gu, name, 1.702, 7.0, fused=fused)
            else:
                h = EP.apply_expert_activation(g, u, name, 1.702, 7.0, fused=fused)
            h.backward(torch.ones_like(h))
        return log.ops

    xds.enable()
    ops = run()
    assert ops["expertact::glu"] == 1 and ops["expertact::glu_backward"] == 1, ops
    assert not [op for op in ops if op.split("::")[1].split(".")[0] in ("silu", "gelu", "sigmoid", "clamp", "mul")]
    ops = run(fused=False)  # DeepSpeed's eager fn, as its for-loop path calls it
    assert "expertact::glu" not in ops and ops["aten::mul"] >= 1
    xds.disable()
    if name != "swiglu":  # DeepSpeed's swiglu kernel is Triton (CUDA)
        ops = run()
        assert "expertact::glu" not in ops and ops["aten::mul"] >= 1


# ---------------------------------------------------------------------------
# Values: DeepSpeed's eager fn in float64 is the oracle
# ---------------------------------------------------------------------------


@needs_ds
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("name", FORMS)
def test_matches_deepspeed_fn(name, packed, dtype):
    """Forward and gradients of every form through DeepSpeed's apply_*, against DeepSpeed's own fn in
    float64, at NaN, +-Inf, exactly +-limit and one ulp either side, for two (alpha, limit) pairs."""
    xds.enable()
    for alpha, limit in PARAMS:
        gate, up = _inputs(dtype, limit)
        grad_out = torch.randn(gate.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
        out_ref, gg_ref, gu_ref = _ds_reference(name, gate, up, grad_out, alpha, limit)
        if packed:
            inputs, layout = [torch.cat([gate, up], -1).requires_grad_()], "halves"
            out = EP.apply_packed_expert_activation(inputs[0], name, alpha, limit)
        else:
            inputs, layout = [gate.clone().requires_grad_(), up.clone().requires_grad_()], "separate"
            out = EP.apply_expert_activation(*inputs, name, alpha, limit)
        out.backward(grad_out)
        assert out.dtype == dtype and out.shape == gate.shape
        assert all(t.grad.dtype == dtype and t.grad.shape == t.shape for t in inputs)
        _check_all_vs_ds(name, out, [t.grad for t in inputs], (out_ref, gg_ref, gu_ref),
                         error_scales(name, inputs, layout, grad_out), gate, up, grad_out, dtype, packed)
        # The forms that fix alpha/limit ignore the call's values, as DeepSpeed's fn does.
        entry = EP.EXPERT_ACTIVATIONS[name]
        other = EP.apply_packed_expert_activation(torch.cat([gate, up], -1), name,
                                                  alpha if entry.uses_alpha else 3.0,
                                                  limit if entry.uses_limit else 0.5)
        torch.testing.assert_close(other, out.detach(), rtol=0, atol=0, equal_nan=True)


@needs_ds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("name", FORMS)
def test_inplace_backward(name, packed, dtype):
    """enable(inplace_backward=True): the gradients are written over gate_up (or gate and up) and
    handed back as .grad, correct against DeepSpeed's fn in float64."""
    xds.enable(inplace_backward=True)
    assert EP.EXPERT_ACTIVATIONS[name].fused_fn.expertact_form["inplace_backward"] is True
    alpha, limit = PARAMS[0]
    gate, up = _inputs(dtype, limit)
    grad_out = torch.randn(gate.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    out_ref, gg_ref, gu_ref = _ds_reference(name, gate, up, grad_out, alpha, limit)
    if packed:
        inputs, layout = [torch.cat([gate, up], -1).requires_grad_()], "halves"
    else:
        inputs, layout = [gate.clone().requires_grad_(), up.clone().requires_grad_()], "separate"
    scales = error_scales(name, inputs, layout, grad_out)  # before the inputs are overwritten
    ptrs = [t.data_ptr() for t in inputs]
    with _OpLog() as log:
        out = (EP.apply_packed_expert_activation(inputs[0], name, alpha, limit) if packed
               else EP.apply_expert_activation(*inputs, name, alpha, limit))
        out.backward(grad_out)
    assert log.ops["expertact::glu_backward_"] == 1 and "expertact::glu_backward" not in log.ops
    for t, p in zip(inputs, ptrs):
        assert t.grad.data_ptr() == p == t.data_ptr(), "the gradient is not in the input's storage"
    _check_all_vs_ds(name, out, [t.grad for t in inputs], (out_ref, gg_ref, gu_ref), scales, gate, up, grad_out,
                     dtype, packed)
    # A second backward through the same graph would read gradients as inputs: it raises.
    x = torch.cat([gate, up], -1).requires_grad_()
    h = EP.apply_packed_expert_activation(x, name, alpha, limit)
    h.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already ran with inplace_backward=True"):
        h.sum().backward()


# ---------------------------------------------------------------------------
# enable / disable / enabled_scope, register=, refusals
# ---------------------------------------------------------------------------


@needs_ds
def test_enable_twice_and_disable_restore_deepspeeds_entries():
    reg = EP.EXPERT_ACTIVATIONS
    xds.disable()  # nothing enabled: a no-op
    assert _registry_is_deepspeeds() and not xds.is_enabled()
    xds.enable()
    first = {n: reg[n] for n in FORMS}
    xds.enable()  # again: fresh entries, still built on DeepSpeed's (not on the first enable's)
    for n in FORMS:
        assert reg[n] is not first[n] and reg[n].fn is DS_ENTRIES[n].fn
    xds.enable(inplace_backward=True)
    assert all(reg[n].packed_fused_fn.expertact_form["inplace_backward"] for n in FORMS)
    xds.enable(inplace_backward=False)
    assert not any(reg[n].fused_fn.expertact_form["inplace_backward"] for n in FORMS)
    xds.disable()
    assert _registry_is_deepspeeds() and not xds.is_enabled()
    xds.disable()
    assert _registry_is_deepspeeds()
    # An entry someone else replaced after enable() is theirs: disable() leaves it.
    xds.enable()
    theirs = dataclasses.replace(DS_ENTRIES["geglu_tanh"])
    reg["geglu_tanh"] = theirs
    xds.disable()
    assert reg["geglu_tanh"] is theirs and all(reg[n] is DS_ENTRIES[n] for n in FORMS if n != "geglu_tanh")
    reg["geglu_tanh"] = DS_ENTRIES["geglu_tanh"]


@needs_ds
def test_enabled_context_manager():
    reg = EP.EXPERT_ACTIVATIONS
    with xds.enabled_scope():
        assert reg["swiglu_oai"].fused_fn.expertact_form["inplace_backward"] is False
        with xds.enabled_scope(inplace_backward=True):
            assert reg["swiglu_oai"].fused_fn.expertact_form["inplace_backward"] is True
        assert reg["swiglu_oai"].fused_fn.expertact_form["inplace_backward"] is False
    assert _registry_is_deepspeeds()
    with pytest.raises(KeyError):
        with xds.enabled_scope(inplace_backward=True):
            raise KeyError("inside")
    assert _registry_is_deepspeeds() and not xds.is_enabled()


@needs_ds
def test_fused_fn_arguments():
    xds.enable()
    g = torch.randn(4, 8)
    oai, swiglu = EP.EXPERT_ACTIVATIONS["swiglu_oai"], EP.EXPERT_ACTIVATIONS["swiglu"]
    with pytest.raises(TypeError, match="limit must be a number"):
        oai.fused_fn(g, g, 1.702, "7")
    with pytest.raises(TypeError, match="alpha must be a number"):
        oai.packed_fused_fn(g, None, 7.0)
    with pytest.raises(TypeError, match="up must be a torch.Tensor"):
        oai.fused_fn(g, None, 1.702, 7.0)
    with pytest.raises(ValueError, match="odd"):
        oai.packed_fused_fn(torch.randn(4, 7), 1.702, 7.0)
    torch.testing.assert_close(oai.fused_fn(g, g, 2, 3), oai.fused_fn(g, g, 2.0, 3.0), rtol=0, atol=0)
    # A form that does not read alpha and limit ignores whatever comes, as DeepSpeed's fn does.
    torch.testing.assert_close(swiglu.fused_fn(g, g, None, None), swiglu.fn(g, g, None, None))


def _oai_like(gate, up, alpha, limit):  # a form DeepSpeed might add under another name
    g = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1.0) * g * torch.sigmoid(alpha * g)


def _silu_clamp10(gate, up, alpha, limit):  # reads neither alpha nor limit: limit 10 is fixed
    return torch.nn.functional.silu(gate.clamp(max=10.0)) * up.clamp(min=-10.0, max=10.0)


@needs_ds
def test_register_more_names(monkeypatch):
    reg = EP.EXPERT_ACTIVATIONS
    monkeypatch.setitem(reg, "oai_like", EP.ExpertActivation(_oai_like, uses_alpha=True, uses_limit=True))
    monkeypatch.setitem(reg, "clamp10", EP.ExpertActivation(_silu_clamp10))
    ds_oai, ds_c10 = reg["oai_like"], reg["clamp10"]
    xds.enable(register={"oai_like": "swiglu_oai", "clamp10": dict(activation="silu", limit=10.0)})
    assert reg["oai_like"].fn is _oai_like and reg["oai_like"].fused_fn.expertact_form["alpha"] is None
    assert reg["clamp10"].packed_fused_fn.expertact_form["limit"] == 10.0
    assert reg["swiglu"].fused_fn.__module__ == "expertact.deepspeed"  # the four are served too
    gate, up = _inputs(torch.float32, 10.0)
    grad_out = torch.randn(gate.shape, generator=torch.Generator().manual_seed(3))
    for name, fn, preset in (("oai_like", _oai_like, "swiglu_oai"), ("clamp10", _silu_clamp10, "swiglu_clamped")):
        out_ref, gg_ref, gu_ref = (t.detach() for t in _ds_reference_fn(fn, gate, up, grad_out, 1.25, 10.0))
        gu = torch.cat([gate, up], -1).requires_grad_()
        s_out, (s_grad,) = error_scales(preset, [gu], "halves", grad_out)
        with _OpLog() as log:
            out = EP.apply_packed_expert_activation(gu, name, 1.25, 10.0)
            out.backward(grad_out)
        assert log.ops["expertact::glu"] == 1
        assert_matches(out, out_ref, torch.float32, s_out)
        assert_matches(gu.grad, torch.cat([gg_ref, gu_ref], -1), torch.float32, s_grad)
    # A later enable() without them gives them back to DeepSpeed.
    xds.enable()
    assert reg["oai_like"] is ds_oai and reg["clamp10"] is ds_c10
    xds.disable()
    assert reg["oai_like"] is ds_oai and reg["clamp10"] is ds_c10


def _ds_reference_fn(fn, gate, up, grad_out, alpha, limit):
    g, u = (t.detach().double().requires_grad_() for t in (gate, up))
    out = fn(g, u, alpha, limit)
    return (out, *torch.autograd.grad(out, (g, u), grad_out.double()))


@needs_ds
def test_register_refusals(monkeypatch):
    reg = EP.EXPERT_ACTIVATIONS
    monkeypatch.setitem(reg, "oai_like", EP.ExpertActivation(_oai_like, uses_alpha=True, uses_limit=True))
    before = dict(reg)
    cases = [
        ({"nope": "swiglu"}, RuntimeError, "EXPERT_ACTIVATIONS has no 'nope'.*register_expert_activation"),
        ({"oai_like": "swiglu"}, ValueError, "reads alpha from each call.*fixes alpha=1.0"),
        ({"oai_like": dict(alpha=1.702)}, ValueError, "reads alpha from each call"),
        ({"swiglu": dict(limit=None)}, ValueError, "does not read limit"),
        ({"oai_like": "relu"}, ValueError, "'relu' is not a preset"),
        ({"oai_like": dict(activation="relu")}, ValueError, "activation='relu' is not one of"),
        ({"oai_like": dict(gamma=1.0)}, ValueError, "unknown keys \\['gamma'\\]"),
        ({"oai_like": 1.702}, TypeError, "must be a preset name or a dict"),
        # Takes alpha and limit from the call as the entry does, but is another function: the probe
        # against DeepSpeed's fn catches it.
        ({"oai_like": dict(activation="gelu_tanh", beta=1.0)}, ValueError, "differs from DeepSpeed's own fn"),
        ({"oai_like": "swiglu_clamped"}, ValueError, "reads alpha from each call"),
    ]
    for register, exc, match in cases:
        with pytest.raises(exc, match=match):
            xds.enable(register=register)
        assert reg == before and all(reg[n] is e for n, e in before.items()), register
        assert not xds.is_enabled()
    with pytest.raises(TypeError, match="register must be a dict"):
        xds.enable(register=["oai_like"])
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        xds.enable(inplace_backward=1)
    # A failed enable() leaves an earlier one in force, unchanged.
    xds.enable(inplace_backward=True)
    mine = dict(reg)
    with pytest.raises(ValueError):
        xds.enable(register={"oai_like": "swiglu"})
    assert all(reg[n] is e for n, e in mine.items()) and xds.is_enabled()


def test_refuses_without_deepspeed(monkeypatch):
    """Simulated absence: the import of deepspeed fails (runs with or without deepspeed installed)."""
    for mod in ("deepspeed", "deepspeed.moe", "deepspeed.moe.ep_experts"):
        monkeypatch.setitem(sys.modules, mod, None)
    for fn in (xds.enable, xds.disable):
        with pytest.raises(ImportError, match=r"need DeepSpeed's expert-activation registry \(deepspeed\.moe\."):
            fn()
    with pytest.raises(ImportError, match="DS_BUILD_OPS=0 pip install deepspeed"):
        with xds.enabled_scope():
            pass


@needs_ds
def test_refuses_a_registry_without_what_it_replaces(monkeypatch):
    """An older DeepSpeed: no EXPERT_ACTIVATIONS, no ExpertActivation.packed_fused_fn, a missing form."""
    reg = EP.EXPERT_ACTIVATIONS
    with monkeypatch.context() as m:
        m.delattr(EP, "EXPERT_ACTIVATIONS")
        for fn in (xds.enable, xds.disable):
            with pytest.raises(RuntimeError, match=r"deepspeed.moe.ep_experts \(deepspeed [^)]+\) has no "
                                                   "EXPERT_ACTIVATIONS"):
                fn()
    with monkeypatch.context() as m:
        m.delattr(EP, "ExpertActivation")
        with pytest.raises(RuntimeError, match="has no ExpertActivation dataclass"):
            xds.enable()

    @dataclasses.dataclass(frozen=True)
    class Old:  # ExpertActivation before packed_fused_fn
        fn: object
        fused_fn: object = None
        uses_alpha: bool = False
        uses_limit: bool = False

    with monkeypatch.context() as m:
        m.setattr(EP, "ExpertActivation", Old)
        with pytest.raises(RuntimeError, match="ExpertActivation has no field packed_fused_fn; .*>= 0.19.8"):
            xds.enable()
    with monkeypatch.context() as m:
        m.delitem(reg, "swiglu_oai")
        with pytest.raises(RuntimeError, match="EXPERT_ACTIVATIONS has no 'swiglu_oai'"):
            xds.enable()
        assert "swiglu_oai" not in reg and all(reg[n] is DS_ENTRIES[n] for n in FORMS[:3])
    assert _registry_is_deepspeeds()


# ---------------------------------------------------------------------------
# DeepSpeed's GroupedExperts
# ---------------------------------------------------------------------------


def _grouped_experts(name, device, impl, grouped_mm=True, sizes=(32, 48, 4), seed=0):
    """A GroupedExperts of DeepSpeed with weights that put the gate/up values across +-7."""
    dim, hidden, experts = sizes
    m = EP.GroupedExperts(dim, hidden, experts, use_grouped_mm=grouped_mm, disable_triton_grouped_mm=True,
                          activation=name, activation_alpha=1.702, activation_limit=7.0, gate_up_impl=impl)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w, fan_in, scale in ((m.w1, dim, 4.0), (m.w3, dim, 4.0), (m.w2, hidden, 1.0)):
            w.copy_(torch.randn(w.shape, generator=gen) * scale / math.sqrt(fan_in))
    return m.to(device)


def _run(m, x, counts):
    """Output and gradients (x, w1, w2, w3) of one forward+backward, and the operators that ran. The
    output's gradient is the same values for every dtype (drawn in bfloat16, exact in the others)."""
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) / 4
    dy = dy.to(torch.bfloat16).to(x.dtype).to(x.device)
    with _OpLog() as log:
        y = m(x, counts)
        y.backward(dy)
    return [y.detach(), x.grad, m.w1.grad, m.w2.grad, m.w3.grad], log.ops


@needs_ds
@pytest.mark.parametrize("name", FORMS)
def test_grouped_experts_for_loop_path_unchanged(name):
    """use_grouped_mm=False calls apply_expert_activation(fused=False): enable() changes nothing there."""
    m = _grouped_experts(name, "cpu", "separate", grouped_mm=False)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([20, 0, 30, 14])
    want, ops = _run(m, x, counts)
    assert "expertact::glu" not in ops
    xds.enable(inplace_backward=True)
    got, ops = _run(m, x, counts)
    assert "expertact::glu" not in ops
    assert all(torch.equal(a, b) for a, b in zip(got, want))


_CUDA = DEVICES[1].values[0], DEVICES[1].marks
_GE_CASES = [pytest.param("cpu", dt, impl, id=f"cpu-{str(dt)[6:]}-{impl}")
             for dt in (torch.float32, torch.bfloat16) for impl in ("separate", "fused")]
# On the GPU also DeepSpeed's Triton grouped GEMM (its default below sm90), forced on here.
_GE_CASES += [pytest.param(_CUDA[0], torch.bfloat16, impl, marks=_CUDA[1], id=f"cuda-bfloat16-{impl}")
              for impl in ("separate", "fused", "triton")]
# Relative (Frobenius) error against the float64 oracle, of the output and of each gradient:
# expertact's must be within 1.25x of DeepSpeed's eager run at the same dtype plus this floor. A wrong
# form (alpha 1 for 1.702, a missing +1 or clamp) errs by ~1e-1 on these inputs.
_GE_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 2e-3}


@needs_ds
@pytest.mark.parametrize("name", FORMS)
@pytest.mark.parametrize("device,dtype,impl", _GE_CASES)
def test_grouped_experts_grouped_mm(device, dtype, impl, name):
    """GroupedExperts' grouped-GEMM paths (torch._grouped_mm with gate_up_impl "separate", which calls
    apply_expert_activation, or "fused", apply_packed_expert_activation; on the GPU also the Triton
    grouped GEMM, separate; all with fused=True): with expertact enabled each matches its eager run
    (DeepSpeed's fn), output and gradients of x, w1, w2, w3, against a float64 oracle; and the in-place
    backward gives the same gradients."""
    if impl == "triton":
        pytest.importorskip("triton", reason="DeepSpeed's Triton grouped GEMM needs triton")
    # Token groups of whole 16-row multiples (one empty), as AutoEP's permutation pads them.
    if device == "cuda":
        sizes, counts = (256, 512, 8), [256, 0, 384, 208, 256, 0, 512, 432]
    else:
        sizes, counts = (32, 48, 4), [16, 0, 32, 16]
    tokens = sum(counts)
    counts = torch.tensor(counts, device=device)
    m = _grouped_experts(name, device, "separate" if impl == "triton" else impl, sizes=sizes)
    if impl == "triton":
        m.use_triton_grouped_mm = True  # what GroupedExperts picks by itself below sm90
    x = torch.randn(tokens, sizes[0], generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    # The oracle: DeepSpeed's for-loop path (matmul and the eager fn) in float64.
    oracle = _grouped_experts(name, device, "separate", grouped_mm=False, sizes=sizes)
    oracle.load_state_dict(m.state_dict())
    ref, _ = _run(oracle.double(), x.double(), counts)
    with _eager(name):
        eager, ops = _run(m, x, counts)
    assert "expertact::glu" not in ops
    xds.enable()
    got, ops = _run(m, x, counts)
    assert ops["expertact::glu"] == 1 and ops["expertact::glu_backward"] == 1, ops
    assert (ops["aten::_grouped_mm"] == 0) == (impl == "triton"), ops
    xds.enable(inplace_backward=True)
    inplace, ops = _run(m, x, counts)
    assert ops["expertact::glu_backward_"] == 1 and "expertact::glu_backward" not in ops, ops
    for what, r, e, g, i in zip(("y", "x.grad", "w1.grad", "w2.grad", "w3.grad"), ref, eager, got, inplace):
        def rel(t, base=r):
            return ((t.double() - base.double()).norm() / r.norm()).item()
        assert math.isfinite(rel(g)) and rel(g) <= 1.25 * rel(e) + _GE_FLOOR[dtype], (what, rel(g), rel(e))
        # In place or not, the same kernel writes the same gradient; CUDA's GEMMs may pick another
        # algorithm between runs, so there only bfloat16-rounding-level agreement is asked.
        assert torch.equal(i, g) if device == "cpu" else rel(i, g) <= 1e-3, (what, rel(i, g))
