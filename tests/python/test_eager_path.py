"""The eager path (the functional API calling the kernel bodies without the dispatcher)
against the operator path: bit-identical results and gradients, the same errors, the same
in-place guards; when each path is taken (modes, subclasses, tracing, compile); and
torch.compile(fullgraph=True) of every public function."""
import math
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import expertact
from expertact import _eager
from expertact import deepspeed as ds
from conftest import DEVICES, LAYOUTS, PRESETS, call, make_inputs, preset_params, reference, split

ops = torch.ops.expertact


class OpPath(TorchDispatchMode):
    """A mode that changes nothing: with it active the functional API must take the operators."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _node(out):
    return type(out.grad_fn).__name__


def _run(preset, base, layout, weights, inplace, grad_out, op_path):
    """Output and leaf gradients of one forward+backward on fresh copies of base."""
    leaves = [b.clone().requires_grad_() for b in base]
    wl = None if weights is None else weights.clone().requires_grad_()
    xs = [l * 1 for l in leaves] if inplace else leaves  # in place: non-leaf inputs, as a GEMM's output
    mode = OpPath() if op_path else None
    if mode is not None:
        with mode:
            out = call(preset, xs, layout, weights=wl, inplace_backward=inplace)
            out.backward(grad_out)
        assert any("expertact.glu" in s for s in mode.seen), mode.seen
    else:
        out = call(preset, xs, layout, weights=wl, inplace_backward=inplace)
        assert _node(out) == "_GluEagerBackward"
        out.backward(grad_out)
    return out.detach(), [l.grad for l in leaves] + ([wl.grad] if wl is not None else [])


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eager_and_operator_paths_are_bit_identical(dtype, layout, weighted, inplace, device):
    base = make_inputs(layout, (5, 3, 24), dtype, device, seed=11)
    base[0].view(-1)[:4] = torch.tensor([math.nan, math.inf, -math.inf, 7.0])  # specials too
    w = torch.rand(5, 3, device=device) if weighted else None
    grad_out = torch.randn(5, 3, 24, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    for preset in ("swiglu", "swiglu_oai"):
        out_e, grads_e = _run(preset, base, layout, w, inplace, grad_out, op_path=False)
        out_o, grads_o = _run(preset, base, layout, w, inplace, grad_out, op_path=True)
        _same_bits(out_e, out_o)
        assert len(grads_e) == len(grads_o)
        for a, b in zip(grads_e, grads_o):
            _same_bits(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_path_no_grad_matches_operator(device):
    for layout in LAYOUTS:
        xs = make_inputs(layout, (7, 16), torch.float16, device, seed=3)
        w = torch.rand(7, device=device)
        for preset in PRESETS:
            eager = call(preset, xs, layout, weights=w)
            assert eager.grad_fn is None
            act, alpha, limit, beta = preset_params(preset)
            code = {"separate": 0, "halves": 1, "up_first": 2, "interleaved": 3}[layout]
            op = ops.glu(xs[0], xs[1] if layout == "separate" else None, w, code,
                         expertact.ACTIVATIONS[act], alpha, limit, beta)
            _same_bits(eager, op)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_gradients_on_the_eager_path(layout, device):
    """The per-row weights' gradient (a float32 row sum) against the float64 reference, in
    place and not, with the inputs' gradients not wanted too."""
    for inplace in (False, True):
        base = make_inputs(layout, (9, 33), torch.float32, device, seed=5)
        xs = [b.clone().requires_grad_() for b in base]
        w = (torch.rand(9, device=device) + 0.5).requires_grad_()
        grad_out = torch.randn(9, 33, generator=torch.Generator().manual_seed(4)).to(device)
        out = call("swiglu_oai", [x * 1 for x in xs], layout, weights=w, inplace_backward=inplace)
        assert _node(out) == "_GluEagerBackward"
        out.backward(grad_out)
        act, alpha, limit, beta = preset_params("swiglu_oai")
        xd = [b.double() for b in base]
        gate, up = (xd[0], xd[1]) if layout == "separate" else split(xd[0], layout)
        terms = reference(gate, up, act, alpha, limit, beta) * grad_out.double()
        want = terms.sum(-1)
        assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
        assert ((w.grad.double() - want).abs() <= 1e-5 * terms.abs().sum(-1) + 1e-6).all(), (w.grad, want)
    # Weights alone requiring grad: the inputs are left intact even with inplace_backward.
    base = make_inputs(layout, (9, 33), torch.float32, device, seed=5)
    xs = [b.clone() for b in base]
    w = (torch.rand(9, device=device) + 0.5).requires_grad_()
    call("swiglu_oai", xs, layout, weights=w, inplace_backward=True).sum().backward()
    for x, b in zip(xs, base):
        assert torch.equal(x, b)
    assert w.grad is not None and torch.isfinite(w.grad).all()


# ---------------------------------------------------------------------------
# The same errors on both paths
# ---------------------------------------------------------------------------


def _error_cases(dev, rg):
    def t(*s, dtype=torch.float32):
        return torch.randn(s, dtype=dtype, device=dev).requires_grad_(rg)

    def i16():
        return torch.ones(4, 8, dtype=torch.int16, device=dev)

    g = t(4, 8)
    return [
        lambda: expertact.swiglu(g, t(4, 9)),
        lambda: expertact.swiglu(g, t(5, 8)),
        lambda: expertact.swiglu(i16(), i16()),
        lambda: expertact.swiglu(g, t(4, 8, dtype=torch.bfloat16)),
        lambda: expertact.swiglu(t(4, 7), layout="halves"),
        lambda: expertact.swiglu_oai(t(4, 9), layout="interleaved"),
        lambda: expertact.swiglu(g, g, weights=t(4, dtype=torch.bfloat16)),
        lambda: expertact.swiglu(g, g, weights=t(5)),
        lambda: expertact.swiglu_clamped(g, g, limit=-1.0),
        lambda: expertact.swiglu_oai(g, g, alpha=math.nan),
        lambda: expertact.swiglu_oai(g, g, alpha=1e300),  # past float32: +inf, refused
        lambda: expertact.glu(g, g, beta=math.inf),
        lambda: expertact.swiglu(t(), t()),  # 0-dim: the DLTensor description
        lambda: expertact.swiglu(g, t()),
        lambda: expertact.swiglu(t(2, 4, 8), t(4, 8)),
        lambda: ds.swiglu_backward(t(4, 9), g, g),
        lambda: ds.swiglu_packed_backward(t(4, 8), t(4, 15)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_the_same_errors_on_both_paths(device):
    for rg in (False, True):  # inputs that require grad take the autograd.Function of each path
        for i, case in enumerate(_error_cases(device, rg)):
            with pytest.raises(Exception) as eager:
                case()
            mode = OpPath()
            with pytest.raises(Exception) as op:
                with mode:
                    case()
            assert any(f.startswith("expertact.") for f in mode.seen), (i, mode.seen)  # the operator ran
            assert type(eager.value) is type(op.value), (i, eager.value, op.value)
            assert str(eager.value) == str(op.value), (i, str(eager.value), str(op.value))
            assert str(eager.value).startswith("expertact: "), (i, str(eager.value))


def test_operators_called_directly_still_validate():
    g = torch.randn(4, 8)
    # out-of-int32 codes are saturated, so the library names them out of range
    with pytest.raises(ValueError, match="layout 2147483647 is not one of"):
        ops.glu(g, g, None, 2 ** 40, 0, 1.0, 7.0, 0.0)
    with pytest.raises(ValueError, match=r"params.act must be 0 \(silu\) or 1 \(gelu_tanh\) \(got 2147483647\)"):
        ops.glu(g, g, None, 0, 2 ** 40, 1.0, 7.0, 0.0)
    with pytest.raises(ValueError, match=r"params.alpha must be finite \(got inf\)"):
        ops.glu(g, g, None, 0, 0, 1e300, 7.0, 0.0)


# ---------------------------------------------------------------------------
# In-place guards on the eager path
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["separate", "halves", "interleaved"])
def test_inplace_guards_on_the_eager_path(layout, device):
    xs = [t.requires_grad_() * 1 for t in make_inputs(layout, (4, 8), torch.float32, device)]
    versions = [x._version for x in xs]
    other = sum((x * x).sum() for x in xs)  # another user that saved the inputs
    out = call("swiglu_oai", xs, layout, inplace_backward=True)
    assert _node(out) == "_GluEagerBackward"
    out.sum().backward(retain_graph=True)
    assert all(x._version > v for x, v in zip(xs, versions)), "version counters not bumped"
    with pytest.raises(RuntimeError, match="already ran with inplace_backward=True"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_create_graph_refused_on_the_eager_path(inplace, device):
    xs = [t.requires_grad_() for t in make_inputs("halves", (4, 8), torch.float32, device)]
    out = expertact.swiglu(xs[0], inplace_backward=inplace)
    assert _node(out) == "_GluEagerBackward"
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(out.sum(), xs, create_graph=True)


def test_backward_under_a_mode_takes_the_operators():
    """A node made on the eager path whose backward runs under a mode: the mode sees the
    backward operator (in place: glu_backward_, whose ADInplaceOrView kernel bumps versions)."""
    for inplace, name in ((False, "expertact.glu_backward.default"), (True, "expertact.glu_backward_.default")):
        (gu,) = make_inputs("interleaved", (4, 8), torch.float32, "cpu")
        x = gu.requires_grad_() * 1
        v = x._version
        out = expertact.swiglu_oai(x, layout="interleaved", inplace_backward=inplace)
        assert _node(out) == "_GluEagerBackward"
        ref = gu.detach().clone().requires_grad_()
        expertact.swiglu_oai(ref, layout="interleaved").sum().backward()
        mode = OpPath()
        with mode:
            out.sum().backward()
        assert name in mode.seen, mode.seen
        assert (x._version > v) == inplace
        torch.testing.assert_close(gu.grad, ref.grad, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Which path: the test of eager_ok() and plain()
# ---------------------------------------------------------------------------


def test_eager_path_is_taken_for_plain_tensors():
    g, u = (t.requires_grad_() for t in make_inputs("separate", (4, 8), torch.float32, "cpu"))
    assert _eager.eager_ok() and _eager.plain(g)
    assert _node(expertact.swiglu(g, u)) == "_GluEagerBackward"
    p = torch.nn.Parameter(g.detach().clone())
    assert _node(expertact.swiglu(p, u)) == "_GluEagerBackward"
    with torch.device("cpu"):  # a DeviceContext mode, as torch.set_default_device installs
        assert _eager.eager_ok()
        assert _node(expertact.swiglu(g, u)) == "_GluEagerBackward"
    with torch.inference_mode():
        out = expertact.swiglu(g, u)
        assert out.is_inference() and out.grad_fn is None
    out = expertact.swiglu(g.detach(), u.detach())
    assert out.grad_fn is None


def test_operator_path_whenever_something_stands_between():
    g, u = make_inputs("separate", (4, 8), torch.float32, "cpu")
    ref = expertact.swiglu(g, u)
    # A TorchDispatchMode sees the operator.
    mode = OpPath()
    with mode:
        torch.testing.assert_close(expertact.swiglu(g, u), ref, rtol=0, atol=0)
    assert "expertact.glu.default" in mode.seen
    # A negative view: the operator's Negative fallback materialises it.
    neg = torch._neg_view(g)
    assert not _eager.plain(neg)
    torch.testing.assert_close(expertact.swiglu(neg, u), expertact.swiglu(-g, u), rtol=0, atol=0)
    # Meta tensors: the fake kernel.
    m = expertact.swiglu(torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta"))
    assert m.device.type == "meta" and m.shape == (4, 8)
    # FakeTensorMode.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as fm:
        fg = fm.from_tensor(g)
        assert expertact.swiglu_oai(fg, layout="interleaved").shape == (4, 4)

    # A __torch_function__ subclass sees the operator.
    class Logged(torch.Tensor):
        calls = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    lg = g.as_subclass(Logged)
    assert not _eager.plain(lg)
    expertact.swiglu(lg, u)
    assert ops.glu.default in Logged.calls
    # torch.jit.trace records the operator.
    traced = torch.jit.trace(lambda a, b: expertact.swiglu(a, b), (g, u))
    assert "expertact::glu" in str(traced.graph)
    torch.testing.assert_close(traced(g, u), ref, rtol=0, atol=0)
    # functorch: vmap goes through the operator.
    out = torch.vmap(expertact.swiglu)(g.reshape(2, 2, 8), u.reshape(2, 2, 8))
    torch.testing.assert_close(out.reshape(4, 8), ref, rtol=0, atol=0)
    # make_fx records the operator.
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda a, b: expertact.swiglu(a, b))(g, u)
    assert "expertact.glu" in gm.code


def test_threads_use_their_own_buffers():
    """The 2-D descriptions live in a per-thread buffer: concurrent calls do not mix."""
    results, errors = {}, []
    inputs = {i: make_inputs("separate", (64, 40 + 8 * i), torch.float32, "cpu", seed=i) for i in range(4)}

    def work(i):
        try:
            g, u = (t.clone().requires_grad_() for t in inputs[i])
            for _ in range(200):
                g.grad = None
                out = expertact.swiglu(g, u)
                out.sum().backward()
            results[i] = (out.detach(), g.grad)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for i, (out, gg) in results.items():
        g, u = (t.clone().requires_grad_() for t in inputs[i])
        ref = expertact.swiglu(g, u)
        ref.sum().backward()
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
        torch.testing.assert_close(gg, g.grad, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# torch.compile(fullgraph=True) of every public function
# ---------------------------------------------------------------------------


def _public_functions():
    def packed(fn, **kw):
        return lambda gu, u: fn(gu, **kw)

    return {
        "glu": lambda g, u: expertact.glu(g, u, activation="gelu_tanh", limit=3.0, beta=0.5),
        "swiglu": lambda g, u: expertact.swiglu(g, u),
        "swiglu_clamped": lambda g, u: expertact.swiglu_clamped(g, u, limit=2.0),
        "swiglu_oai interleaved inplace": packed(expertact.swiglu_oai, layout="interleaved", inplace_backward=True),
        "geglu_tanh up_first": packed(expertact.geglu_tanh, layout="up_first"),
        "ds.swiglu_packed": packed(ds.swiglu_packed),
        "ds.apply_expert_activation": lambda g, u: ds.apply_expert_activation(g, u, "swiglu_oai"),
        "ds.apply_packed_expert_activation": packed(ds.apply_packed_expert_activation, activation="geglu_tanh"),
        "ds.swiglu_clamped": lambda g, u: ds.swiglu_clamped(g, u, oai=False),
        "ds.swiglu_clamped_packed": packed(ds.swiglu_clamped_packed),
        "ds.swiglu_backward": lambda g, u: ds.swiglu_backward(g * 0.5, g, u)[1],
        "ds.swiglu_packed_backward": lambda g, u: ds.swiglu_packed_backward(g[:, :8], g),
    }


@pytest.mark.parametrize("name", list(_public_functions()))
def test_torch_compile_fullgraph_of_each_public_function(name):
    """aot_eager: dynamo with fullgraph (a graph break is an error) and AOT autograd over
    the fake kernels, without inductor's compile time (test_autograd runs inductor)."""
    torch._dynamo.reset()
    fn = _public_functions()[name]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(6, 16, generator=gen) * 3 for _ in range(2)]

    def run(f):
        g, u = (b.clone().requires_grad_() for b in base)
        out = f(g * 1, u * 1)
        if out.requires_grad:
            out.square().sum().backward()
        return out.detach(), [None if t.grad is None else t.grad.clone() for t in (g, u)]

    ref_out, ref_grads = run(fn)
    out, grads = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_profiler_names_the_eager_call():
    g, u = make_inputs("separate", (4, 8), torch.float32, "cpu")
    with torch.profiler.profile() as prof:
        expertact.swiglu(g, u)
        expertact.swiglu(g.requires_grad_(), u).sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("expertact::glu") == 2 and "_GluEagerBackward" in names, names


# ---------------------------------------------------------------------------
# EXPERTACT_EAGER=0: the operators only
# ---------------------------------------------------------------------------

# Runs in a fresh process: forward and backward of each public route on fixed inputs, with
# the eager path's entry points replaced by a function that raises, so that any call that
# still took the eager path would fail. Prints whether the gate is open and the nodes' types,
# and saves the results for the parent to compare.
_SWITCH_SCRIPT = r"""
import sys
import torch
import expertact
from expertact import _autograd, _eager
from expertact import deepspeed as ds

def eager_path_taken(*args, **kwargs):
    raise AssertionError("the eager path ran with EXPERTACT_EAGER=0")

if sys.argv[2] == "trap":
    _autograd.glu_eager = _autograd.glu_backward_body = _autograd.glu_backward_inplace_body = eager_path_taken

gen = torch.Generator().manual_seed(5)
base = [torch.randn(6, 16, generator=gen) * 3 for _ in range(2)]
w = torch.rand(6, generator=gen)
results, nodes = [], []
for inplace in (False, True):
    for name, fn in (("swiglu", lambda g, u: expertact.swiglu(g, u, weights=wl, inplace_backward=inplace)),
                     ("swiglu_oai interleaved", lambda g, u: expertact.swiglu_oai(g, layout="interleaved",
                                                                                  inplace_backward=inplace)),
                     ("glu gelu_tanh", lambda g, u: expertact.glu(g, u, activation="gelu_tanh", limit=2.0)),
                     ("ds.swiglu_packed", lambda g, u: ds.swiglu_packed(g))):
        g, u = (b.clone().requires_grad_() for b in base)
        wl = w.clone().requires_grad_()
        out = fn(g * 1, u * 1)
        nodes.append(type(out.grad_fn).__name__)
        out.square().sum().backward()
        results += [out.detach(), g.grad, u.grad if u.grad is not None else torch.zeros(0),
                    wl.grad if wl.grad is not None else torch.zeros(0)]
with torch.no_grad():
    results.append(expertact.swiglu_clamped(base[0], base[1], limit=1.5))
results += list(ds.swiglu_backward(base[0], base[0], base[1]))
torch.save(results, sys.argv[1])
print("ENABLED", _eager.ENABLED, "eager_ok", _eager.eager_ok())
print("NODES", " ".join(sorted(set(nodes))))
"""


def _switch_run(tmp_path, env_value, trap):
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("EXPERTACT_EAGER", None)
    if env_value is not None:
        env["EXPERTACT_EAGER"] = env_value
    path = tmp_path / f"results-{env_value}.pt"
    script = tmp_path / "switch.py"
    script.write_text(_SWITCH_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(path), "trap" if trap else "none"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("ENABLED", "NODES")))
    return lines, torch.load(path)


def test_eager_switch_off_takes_the_operators_with_the_same_results(tmp_path):
    """EXPERTACT_EAGER=0: the gate is closed, every call goes through the operators (the eager
    entry points are booby-trapped and never run; the autograd nodes are the operator's), and
    results and gradients are bit-identical to the eager path's."""
    off, off_results = _switch_run(tmp_path, "0", trap=True)
    assert off["ENABLED"] == "False eager_ok False", off
    assert off["NODES"].split() == ["_GluBackward"], off
    on, on_results = _switch_run(tmp_path, None, trap=False)
    assert on["ENABLED"] == "True eager_ok True", on
    assert on["NODES"].split() == ["_GluEagerBackward"], on
    assert len(off_results) == len(on_results)
    for a, b in zip(off_results, on_results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
