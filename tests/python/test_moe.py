"""expertact.moe: expert_mlp against a float64 per-expert loop of the eager expression
(forward and the gradients of x, w13, w2 and weights) for every preset x layout, with and
without weights, in each memory mode, with empty experts, padding rows, E = 1, odd D and F;
the tolerances shown to fail a wrong activation; what each mode keeps; the guards; bad
input; GroupedExperts (with and without GPT-OSS's expert biases) and the state dicts it loads
(DeepSpeed's, GPT-OSS's).
CPU everywhere; the CUDA cases skip without a GPU."""
import math

import pytest
import torch

from expertact import moe
from conftest import DEVICES, PRESETS, preset_params, reference, requires_cuda, split

PACKED = ["halves", "up_first", "interleaved"]
MODES = {
    "plain": {},
    "recompute": dict(recompute=True),
    "inplace": dict(inplace_backward=True),
    "recompute+inplace": dict(recompute=True, inplace_backward=True),
}

# Largest error per row (of y and x's gradient), per expert (of the weights' gradients) or
# per element (of the routing weights' gradient), relative to the float64 reference's norm
# there. What legitimately differs: the storage roundings of h, dh and dgate_up (relative
# 2^-9 in bf16, 2^-12 in fp16, 2^-25 in fp32; gate_up's is in the reference too) and fp32
# accumulation. Measured over every preset x layout, with weights: bf16 0.0063, fp16 0.00083,
# fp32 1.2e-6, float64 1.2e-8 (the library takes alpha as a float32: 1.702 -> 1.70200002):
# about 1/5 of these bounds or less. Gate and up swapped errs by 0.94 or more
# (test_a_wrong_activation_fails shows every dtype failing it).
TOL = {torch.float64: 1e-7, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# Shapes: counts per expert (an empty expert among them) and padding rows after the last.
SHAPES = {
    # odd D and F: the per-expert loop everywhere (torch._grouped_mm needs 16-byte strides)
    "odd": dict(counts=[5, 0, 9, 3], pad=2, D=11, F=9),
    # D, F multiples of 8: torch._grouped_mm on CUDA in bf16 (on sm90/sm100)
    "aligned": dict(counts=[40, 0, 72, 9], pad=7, D=64, F=48),
}


def _params(preset):
    """expert_mlp's alpha / limit keywords of a preset (the defaults written out; DeepSpeed's
    GroupedExperts passes both to every form, ours takes them only for the forms that read them)."""
    return {"swiglu_oai": dict(alpha=1.702, limit=7.0), "swiglu_clamped": dict(limit=7.0)}.get(preset, {})


def make_case(counts, pad, D, F, dtype, device, layout="halves", weighted=False, seed=0):
    """Leaves x [T, D], w13 [E, D, 2F], w2 [E, F, D], weights [T] (or None), dy [T, D] and
    int32 offsets; gate_up ~ 4 x N(0, 1) so that the clamps at 7 are crossed."""
    gen = torch.Generator().manual_seed(seed)
    E, T = len(counts), sum(counts) + pad

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)

    c = dict(
        x=rnd(T, D).requires_grad_(),
        w13=rnd(E, D, 2 * F, scale=4 / math.sqrt(D)).requires_grad_(),
        w2=rnd(E, F, D, scale=1 / math.sqrt(F)).requires_grad_(),
        weights=(torch.rand(T, generator=gen) + 0.5).to(device).requires_grad_() if weighted else None,
        dy=rnd(T, D),
        offsets=torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device),
        counts=counts, layout=layout,
    )
    return c


def run(c, preset, mode="plain", **kw):
    """y and the gradients (x, w13, w2[, weights]) of expert_mlp on a case."""
    args = [c["x"], c["w13"], c["w2"]] + ([c["weights"]] if c["weights"] is not None else [])
    y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], preset, layout=kw.pop("layout", c["layout"]),
                       weights=c["weights"], **_params(preset), **MODES[mode], **kw)
    grads = torch.autograd.grad(y, args, c["dy"])
    return y, list(grads)


def reference_mlp(c, preset):
    """float64 per-expert loop of the eager expression on gate_up rounded to the dtype (as it
    is stored): y, the gradients, and the scale of the routing weights' gradient per row (the
    norm of its terms dh * act(gate) * (up + beta))."""
    act, alpha, limit, beta = preset_params(preset)
    X, W13, W2 = (c[k].detach().double().requires_grad_() for k in ("x", "w13", "w2"))
    W = None if c["weights"] is None else c["weights"].detach().double().requires_grad_()
    dy = c["dy"].double()
    T, D = X.shape
    pieces, start = [], 0
    gw_scale = torch.zeros(T, dtype=torch.float64)
    for e, n in enumerate(c["counts"]):
        rows = slice(start, start + n)
        gu = X[rows] @ W13[e]
        # gate_up is stored in the dtype before the activation reads it: rounded here too
        # (straight through: the gradient stays float64), else a value rounded across a
        # clamp limit flips a gradient mask, an O(1) difference that is the dtype's, not an error.
        gu = gu + (gu.detach().to(c["x"].dtype).double() - gu.detach())
        gate, up = split(gu, c["layout"])
        h = reference(gate, up, act, alpha, limit, beta, None if W is None else W[rows])
        pieces.append(h @ W2[e])
        with torch.no_grad():
            terms = (dy[rows].cpu() @ W2[e].t().cpu()) * reference(gate, up, act, alpha, limit, beta).cpu()
            gw_scale[rows] = terms.norm(dim=-1)
        start += n
    pieces.append(X.new_zeros(T - start, D))
    y = torch.cat(pieces)
    inputs = [X, W13, W2] + ([W] if W is not None else [])
    grads = torch.autograd.grad(y, inputs, dy, allow_unused=True)
    grads = [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads)]
    return y.detach(), grads, gw_scale


def assert_close(name, got, want, dtype, scale=None):
    """Per row (the first dim): ||got - want|| <= TOL[dtype] * ||want|| (or * scale); rows
    whose reference is exactly 0 (padding, empty experts) must be exactly 0; no NaN."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    g, w = (t.detach().double().cpu() for t in (got, want))
    g, w = (t.flatten(1) if t.dim() > 1 else t.unsqueeze(1) for t in (g, w))
    assert not g.isnan().any(), f"{name}: NaN"
    err = (g - w).norm(dim=1)
    s = w.norm(dim=1) if scale is None else scale.double().cpu()
    zero = w.abs().amax(dim=1) == 0
    if (err[zero] != 0).any():
        r = int(zero.nonzero()[(err[zero] != 0).nonzero()[0]])
        raise AssertionError(f"{name}: row {r} should be exactly 0 (padding or empty expert), got {g[r][:4].tolist()}")
    rel = torch.where(zero, torch.zeros_like(err), err / s.clamp_min(1e-300))
    if rel.numel() == 0:
        return 0.0
    worst = int(rel.argmax())
    assert rel[worst] <= TOL[dtype], (
        f"{name}: row {worst} relative error {rel[worst].item():.3g} > {TOL[dtype]:g} ({dtype})")
    return rel.max().item()


def check_case(c, preset, dtype, mode="plain", **kw):
    y, grads = run(c, preset, mode, **kw)
    ry, rgrads, gw_scale = reference_mlp(c, preset)
    assert y.dtype == dtype and y.shape == ry.shape
    assert_close("y", y, ry, dtype)
    for name, g, r in zip(("dx", "dw13", "dw2"), grads, rgrads):
        assert g.dtype == dtype
        assert_close(name, g, r, dtype)
    if c["weights"] is not None:
        assert grads[3].dtype == torch.float32
        # float32 whatever the dtype: a float64 run is held to float32's bound here
        assert_close("dweights", grads[3], rgrads[3], torch.float32 if dtype == torch.float64 else dtype,
                     scale=gw_scale)
    return y, grads


# ---------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------


# The CPU takes the per-expert loop for any shape: the odd one covers it. CUDA takes
# torch._grouped_mm for the aligned shape, the loop for the odd one.
DEVICE_SHAPES = [("cpu", "odd"), pytest.param("cuda", "odd", marks=requires_cuda),
                 pytest.param("cuda", "aligned", marks=requires_cuda)]


@pytest.mark.parametrize("device,shape", DEVICE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True], ids=["noweights", "weights"])
@pytest.mark.parametrize("layout", PACKED)
@pytest.mark.parametrize("preset", PRESETS)
def test_matches_reference(preset, layout, weighted, dtype, shape, device):
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 is CPU-only")
    c = make_case(**SHAPES[shape], dtype=dtype, device=device, layout=layout, weighted=weighted)
    check_case(c, preset, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("preset,layout", [("swiglu_oai", "interleaved"), ("swiglu", "halves"),
                                           ("geglu_tanh", "up_first"), ("swiglu_clamped", "interleaved")])
def test_memory_modes_match_reference_and_each_other(preset, layout, mode, dtype, device):
    """Each mode against the reference, and bit for bit against the plain mode: the same
    kernels run on the same values (recompute runs the forward kernel again; the in-place
    backward writes the same gradient over gate_up)."""
    shape = SHAPES["aligned" if device == "cuda" else "odd"]
    c = make_case(**shape, dtype=dtype, device=device, layout=layout, weighted=True)
    y, grads = check_case(c, preset, dtype, mode)
    y0, grads0 = run(c, preset, "plain")
    assert torch.equal(y, y0)
    for g, g0 in zip(grads, grads0):
        assert torch.equal(g, g0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("counts,pad", [([23], 0), ([23], 4), ([0, 0, 0], 5), ([0], 0), ([0, 6, 0], 0), ([1, 1], 1)],
                         ids=["E1", "E1-pad", "all-empty", "T0", "empty-ends", "one-row"])
@pytest.mark.parametrize("mode", list(MODES))
def test_edge_shapes(counts, pad, mode, device):
    """E = 1, no rows at all (T = 0), every expert empty (all rows padding), empty experts at
    both ends, single rows."""
    # CUDA: bf16 with D, F multiples of 8, so that torch._grouped_mm gets these shapes too
    dtype, D, F = (torch.bfloat16, 16, 8) if device == "cuda" else (torch.float32, 13, 7)
    c = make_case(counts, pad, D=D, F=F, dtype=dtype, device=device, layout="interleaved", weighted=True)
    y, grads = check_case(c, "swiglu_oai", dtype, mode)
    assert y.shape == (sum(counts) + pad, D)


@pytest.mark.parametrize("mode", ["plain", "recompute"])
@pytest.mark.parametrize("layout", PACKED)
def test_gradcheck_float64(layout, mode):
    """float64 on the CPU runs in float64 throughout: torch.autograd.gradcheck of x, w13 and
    w2 (the float32 routing weights enter as a constant; their gradient is checked against
    the reference above). The in-place modes backward once per graph, which gradcheck cannot."""
    c = make_case([3, 0, 4], 1, D=5, F=3, dtype=torch.float64, device="cpu", layout=layout, seed=2)
    # limit 2: the clamps are crossed, but no value sits within gradcheck's step of a kink
    w = (torch.rand(8, generator=torch.Generator().manual_seed(1)) + 0.5)

    def f(x, w13, w2):
        return moe.expert_mlp(x, w13, w2, c["offsets"], "swiglu_oai", alpha=1.702, limit=2.0, layout=layout,
                              weights=w, **MODES[mode])

    assert torch.autograd.gradcheck(f, (c["x"], c["w13"], c["w2"]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_a_wrong_activation_fails(dtype, device):
    """The tolerances reject a wrong activation in every dtype: gate and up swapped (the
    kernel reading the layout the other way round) and, in float32/64, alpha 1.75 for 1.702."""
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 is CPU-only")
    c = make_case(**SHAPES["odd"], dtype=dtype, device=device, layout="halves", weighted=True)
    ry, rgrads, _ = reference_mlp(c, "swiglu_oai")
    y, grads = run(c, "swiglu_oai", layout="up_first")
    for name, got, want in (("y", y, ry), ("dx", grads[0], rgrads[0]), ("dw13", grads[1], rgrads[1])):
        with pytest.raises(AssertionError, match="relative error"):
            assert_close(name, got, want, dtype)
    if dtype in (torch.float32, torch.float64):
        y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], "swiglu_oai", alpha=1.75, limit=7.0,
                           weights=c["weights"])
        with pytest.raises(AssertionError, match="relative error"):
            assert_close("y", y, ry, dtype)


def test_tolerances_hold_with_margin():
    """The measured error of a correct run stays well inside TOL (a tolerance sized to the
    noise, not to hide errors): at most half of it on the aligned shape in every dtype."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        c = make_case(**SHAPES["aligned"], dtype=dtype, device="cpu", layout="interleaved", weighted=True)
        y, grads = run(c, "swiglu_oai")
        ry, rgrads, gw_scale = reference_mlp(c, "swiglu_oai")
        worst = max(assert_close("y", y, ry, dtype), assert_close("dx", grads[0], rgrads[0], dtype),
                    assert_close("dw13", grads[1], rgrads[1], dtype), assert_close("dw2", grads[2], rgrads[2], dtype),
                    assert_close("dweights", grads[3], rgrads[3], dtype, scale=gw_scale))
        assert worst <= TOL[dtype] / 2, (dtype, worst)


# ---------------------------------------------------------------------------
# The torch._grouped_mm path, run on the CPU (torch's CPU build has torch._grouped_mm)
# ---------------------------------------------------------------------------

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")


@needs_grouped_mm
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_on_cpu(dtype, mode, monkeypatch):
    """The CUDA code path (torch._grouped_mm for the four GEMMs, transposed operands, padding
    rows zeroed, empty experts) runs here too: torch's CPU build has the operator. Forced on,
    it matches the reference and the per-expert loop."""
    c = make_case(**SHAPES["aligned"], dtype=dtype, device="cpu", layout="interleaved", weighted=True)
    loop_y, loop_grads = run(c, "swiglu_oai", mode)
    calls = []
    real = torch._grouped_mm

    def spy(a, b, offs=None):
        # The operand layouts for which the CUDA kernel takes any group sizes, empty groups
        # included (see moe.py): 2-D x 3-D with A row-major; 2-D x 2-D with A column-major and
        # B row-major. The CPU build does not check them; this does.
        if b.dim() == 3:
            assert a.stride(-1) == 1, ("2d x 3d: A must be row-major", a.shape, a.stride())
        else:
            assert a.stride(-2) == 1 and b.stride(-1) == 1, ("2d x 2d: A col-major, B row-major", a.stride(), b.stride())
        for t in (a, b):
            assert t.data_ptr() % 16 == 0 and max(t.stride()[-2:]) % (16 // t.element_size()) == 0
        calls.append(1)
        return real(a, b, offs=offs)

    monkeypatch.setattr(moe, "use_grouped_mm", lambda x, D, F: True)
    monkeypatch.setattr(torch, "_grouped_mm", spy)
    y, grads = check_case(c, "swiglu_oai", dtype, mode)
    assert len(calls) >= 2 + 4  # this run's forward and backward went through it
    torch.testing.assert_close(y, loop_y, rtol=TOL[dtype], atol=TOL[dtype])
    for g, g0 in zip(grads, loop_grads):
        torch.testing.assert_close(g, g0, rtol=TOL[dtype], atol=TOL[dtype] * g0.abs().max().item())


@needs_grouped_mm
def test_grouped_mm_path_with_transposed_weights_and_odd_strides(monkeypatch):
    """Weights as DeepSpeed holds them ([E, N, K] seen through .transpose(-2, -1)) and x a
    column slice of a wider buffer are read as they are; a non-contiguous upstream gradient
    (expanded, stride 0), a column-major x and a misaligned x are copied once."""
    monkeypatch.setattr(moe, "use_grouped_mm", lambda x, D, F: True)
    c = make_case(**SHAPES["aligned"], dtype=torch.float32, device="cpu", layout="halves")
    layouts = []
    real = torch._grouped_mm

    def spy(a, b, offs=None):
        layouts.append((a.stride(), b.stride()))
        return real(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    w13_t = c["w13"].detach().transpose(-2, -1).contiguous().requires_grad_()
    w2_t = c["w2"].detach().transpose(-2, -1).contiguous().requires_grad_()
    wide = torch.zeros(c["x"].shape[0], 80)
    wide[:, 8:72] = c["x"].detach()
    wide.requires_grad_()
    x = wide[:, 8:72]
    y = moe.expert_mlp(x, w13_t.transpose(-2, -1), w2_t.transpose(-2, -1), c["offsets"], "swiglu")
    y.sum().backward()
    c["dy"] = torch.ones_like(c["dy"])
    ry, rgrads, _ = reference_mlp(c, "swiglu")
    assert_close("y", y, ry, torch.float32)
    assert_close("dx", wide.grad[:, 8:72], rgrads[0], torch.float32)
    assert wide.grad[:, :8].abs().max() == 0
    assert_close("dw13", w13_t.grad.transpose(-2, -1), rgrads[1], torch.float32)
    assert_close("dw2", w2_t.grad.transpose(-2, -1), rgrads[2], torch.float32)
    # x (a column slice at a 32-byte offset, row stride 80) and the transposed weights were read
    # as they are
    D, F = 64, 48
    assert layouts[0] == ((80, 1), (2 * F * D, 1, D)) and layouts[1] == ((F, 1), (D * F, 1, F))
    # a column-major x, and a start off the 16-byte grid, are copied to row-major
    for x in (c["x"].detach().t().contiguous().t(), wide.detach()[:, 1:65]):
        layouts.clear()
        moe.expert_mlp(x, c["w13"].detach(), c["w2"].detach(), c["offsets"])
        assert layouts[0][0] == (D, 1)


@needs_grouped_mm
@pytest.mark.parametrize("layout", PACKED)
def test_against_torch_grouped_mm_composition(layout):
    """A second reference: torch._grouped_mm with torch's own backward and the eager
    activation, in bf16 (the unfused composition DeepSpeed and TorchTitan run). Its error
    against float64 and ours are of one size."""
    c = make_case(**SHAPES["aligned"], dtype=torch.bfloat16, device="cpu", layout=layout, weighted=True)
    act, alpha, limit, beta = preset_params("swiglu_oai")
    y, grads = run(c, "swiglu_oai")
    x, w13, w2, w = (c[k].detach().clone().requires_grad_() for k in ("x", "w13", "w2", "weights"))
    end = sum(c["counts"])
    gate, up = split(torch._grouped_mm(x, w13, offs=c["offsets"]), layout)
    h = reference(gate, up, act, alpha, limit, beta, w).to(torch.bfloat16)  # float32 weights promote it
    ty = torch._grouped_mm(h, w2, offs=c["offsets"])[:end]  # rows past the end are unwritten
    tgrads = torch.autograd.grad(ty, (x, w13, w2, w), c["dy"][:end])
    ry, rgrads, _ = reference_mlp(c, "swiglu_oai")
    for name, got, theirs, want in (("y", y[:end], ty, ry[:end]), ("dx", grads[0][:end], tgrads[0][:end], rgrads[0][:end]),
                                    ("dw13", grads[1], tgrads[1], rgrads[1]), ("dw2", grads[2], tgrads[2], rgrads[2])):
        ours = assert_close(name, got, want, torch.bfloat16)
        torch_err = assert_close(name + " (torch)", theirs, want, torch.bfloat16)
        assert ours <= 2 * torch_err + 1e-3, (name, ours, torch_err)


# ---------------------------------------------------------------------------
# What each mode keeps; the guards
# ---------------------------------------------------------------------------


class _Inputs:
    """bench.py's measuring helpers call fn(*args) then out.backward(grad)."""

    def __init__(self, c):
        self.args = [c["x"], c["w13"], c["w2"]]
        self.grad = c["dy"]


def _mlp_fn(c, mode):
    def fn(x, w13, w2):
        return moe.expert_mlp(x, w13, w2, c["offsets"], "swiglu_oai", alpha=1.702, limit=7.0, layout="interleaved",
                              **MODES[mode])
    return fn


def _memory(c, measure):
    out = {}
    for mode in MODES:
        for k in ("x", "w13", "w2"):
            c[k].grad = None  # each mode's backward allocates its gradients afresh
        out[mode] = measure(_mlp_fn(c, mode), _Inputs(c))
    return out


def _check_memory(mem, T, D, F, esize):
    tf = T * F * esize
    kept = {m: k for m, (p, k) in mem.items()}
    peak = {m: p for m, (p, k) in mem.items()}
    # Kept after forward: gate_up and h; with recompute gate_up only.
    assert kept["plain"] == kept["inplace"] == 3 * tf, kept
    assert kept["recompute"] == kept["recompute+inplace"] == 2 * tf, kept
    # The peaks in [T, F] units (D = F here), small weight gradients aside: plain's backward
    # holds gate_up, y, dh and dgate_up together; in place 2 less, its peak the forward's
    # own (gate_up, h, y: 4) since h is freed before dh exists.
    assert peak["plain"] - peak["inplace"] >= 2 * tf - tf // 8, peak
    assert peak["recompute"] <= peak["plain"], peak
    # Backward drops h once w2's gradient is computed, kept or recomputed: dh and dgate_up
    # never meet it, so keeping h costs no peak (a saved h alive until backward returns
    # raised plain's and in-place's peaks by one [T, F] tensor).
    assert peak["plain"] <= peak["recompute"] + tf // 16, (peak, tf)
    assert peak["inplace"] <= peak["recompute+inplace"] + tf // 16, (peak, tf)
    weights_grads = 3 * D * F * esize * 4  # dw13 + dw2 of the 4 experts
    # (+ 1/16: room for the few KiB of argument buffers torch._grouped_mm allocates on CUDA)
    assert peak["recompute+inplace"] <= 4 * tf + weights_grads + tf // 16, (peak, tf)


def test_kept_memory_cpu():
    """On the CPU, from the allocations torch's allocator reports to the profiler."""
    from expertact.bench import cpu_memory

    T, D, F = 1024, 64, 64
    c = make_case([300, 0, 500, 224], 0, D=D, F=F, dtype=torch.float32, device="cpu", layout="interleaved")
    _check_memory(_memory(c, cpu_memory), T, D, F, 4)


@requires_cuda
def test_kept_memory_cuda():
    """On CUDA (torch._grouped_mm), from torch.cuda.memory_allocated: recompute keeps one
    [T, F] tensor less, and recompute + in-place peaks at the forward's own peak."""
    from expertact.bench import cuda_memory

    T, D, F = 8192, 512, 512
    c = make_case([3000, 0, 4000, 1192], 0, D=D, F=F, dtype=torch.bfloat16, device="cuda", layout="interleaved")
    _check_memory(_memory(c, cuda_memory), T, D, F, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_second_backward_after_inplace_raises(device):
    c = make_case(**SHAPES["odd"], dtype=torch.float32, device=device)
    y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], inplace_backward=True)
    y.backward(c["dy"], retain_graph=True)
    with pytest.raises(RuntimeError, match="already ran with inplace_backward=True"):
        y.backward(c["dy"])
    # Without in-place, twice is fine and gives the same gradient twice.
    c["x"].grad = None
    y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], recompute=True)
    y.backward(c["dy"], retain_graph=True)
    first = c["x"].grad.clone()
    y.backward(c["dy"])
    torch.testing.assert_close(c["x"].grad, 2 * first)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_second_backward_recomputes_h(device):
    """Plain mode hands its kept h to the first backward, which drops it after w2's gradient;
    a second backward (retain_graph=True) recomputes h and gives the same gradients."""
    c = make_case(**SHAPES["odd"], dtype=torch.float32, device=device, weighted=True)
    y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], weights=c["weights"])
    first = torch.autograd.grad(y, [c["x"], c["w13"], c["w2"], c["weights"]], c["dy"], retain_graph=True)
    second = torch.autograd.grad(y, [c["x"], c["w13"], c["w2"], c["weights"]], c["dy"])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["plain", "recompute"])
def test_saved_tensor_hooks_see_what_is_kept(mode, device):
    """Under saved-tensor hooks (activation offloading, checkpointing) every kept tensor goes
    through them, h included when kept; the gradients are those of the plain run."""
    c = make_case(**SHAPES["odd"], dtype=torch.float32, device=device)
    args = [c["x"], c["w13"], c["w2"]]
    ref = torch.autograd.grad(moe.expert_mlp(*args, c["offsets"]), args, c["dy"])
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe.expert_mlp(*args, c["offsets"], **MODES[mode])
    T, F = c["x"].shape[0], c["w2"].shape[-2]
    assert packed.count((T, F)) == (1 if mode == "plain" else 0), packed
    for a, b in zip(ref, torch.autograd.grad(y, args, c["dy"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_create_graph_is_rejected(mode, device):
    c = make_case(**SHAPES["odd"], dtype=torch.float32, device=device)
    y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], **MODES[mode])
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(y.sum(), c["x"], create_graph=True)


@pytest.mark.parametrize("device", DEVICES)
def test_partial_gradients_and_no_grad(device):
    """Only the inputs that want a gradient get one; under no_grad no graph is built; with
    inplace_backward and only the routing weights wanting a gradient, gate_up is not
    overwritten (its gradient is not needed), so a second backward still works."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # torch._grouped_mm on CUDA
    c = make_case(**SHAPES["aligned" if device == "cuda" else "odd"], dtype=dtype, device=device, weighted=True)
    ry, rgrads, gw_scale = reference_mlp(c, "swiglu")
    x, w13, w2, w = (c[k].detach() for k in ("x", "w13", "w2", "weights"))
    w.requires_grad_()
    y = moe.expert_mlp(x, w13, w2, c["offsets"], weights=w, inplace_backward=True)
    y.backward(c["dy"], retain_graph=True)
    first = w.grad.clone()
    assert_close("dweights", first, rgrads[3], dtype, scale=gw_scale)
    y.backward(c["dy"])
    torch.testing.assert_close(w.grad, 2 * first)
    w2 = w2.clone().requires_grad_()
    y = moe.expert_mlp(x, w13, w2, c["offsets"], weights=w.detach(), recompute=True)
    (g2,) = torch.autograd.grad(y, w2, c["dy"])
    assert_close("dw2", g2, rgrads[2], dtype)
    with torch.no_grad():
        y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], weights=c["weights"])
    assert y.grad_fn is None
    assert_close("y", y, ry, dtype)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def _bad_cases():
    yield "x 3-D", lambda a: a.update(x=a["x"].reshape(2, 3, 6)), ValueError, r"x must be 2-D \[T, D\]; got shape \(2, 3, 6\)"
    yield "w13 2-D", lambda a: a.update(w13=a["w13"][0]), ValueError, r"w13 must be 3-D"
    yield "w2 2-D", lambda a: a.update(w2=a["w2"][0]), ValueError, r"w2 must be 3-D"
    yield "D mismatch", lambda a: a.update(w13=a["w13"][:, :5]), ValueError, r"its D = 5 does not match x's D = 6"
    yield "odd 2F", lambda a: a.update(w13=a["w13"][..., :7]), ValueError, r"must be even and > 0, got 7"
    yield "F mismatch", lambda a: a.update(w2=a["w2"][:, :3]), ValueError, r"w2 has shape \(2, 3, 6\); expected \[E, F, D\] = \(2, 4, 6\)"
    yield "E mismatch", lambda a: a.update(w2=a["w2"][:1]), ValueError, r"w2 has shape \(1, 4, 6\)"
    yield "dtype mix", lambda a: a.update(w2=a["w2"].double()), TypeError, r"w2 has dtype torch.float64 but x has torch.float32"
    yield "int x", lambda a: a.update(x=a["x"].long()), TypeError, r"x has dtype torch.int64"
    yield "int64 offsets", lambda a: a.update(offsets=a["offsets"].long()), TypeError, r"offsets has dtype torch.int64; it must be int32"
    yield "offsets length", lambda a: a.update(offsets=a["offsets"][:1]), ValueError, r"offsets has shape \(1,\); expected \[E\] = \(2,\)"
    yield "offsets 2-D", lambda a: a.update(offsets=a["offsets"].reshape(1, 2)), ValueError, r"offsets has shape \(1, 2\)"
    yield "decreasing", lambda a: a.update(offsets=torch.tensor([4, 3], dtype=torch.int32)), ValueError, r"non-decreasing.*offsets\[1\] = 3 < offsets\[0\] = 4"
    yield "negative", lambda a: a.update(offsets=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, r"offsets\[0\] = -1 is negative"
    yield "past T", lambda a: a.update(offsets=torch.tensor([3, 7], dtype=torch.int32)), ValueError, r"offsets\[-1\] = 7 is past T = 6"
    yield "weights dtype", lambda a: a.update(weights=torch.ones(6, dtype=torch.float64)), TypeError, r"weights has dtype torch.float64; routing weights are float32"
    yield "weights shape", lambda a: a.update(weights=torch.ones(6, 1)), ValueError, r"weights has shape \(6, 1\); expected \[T\] = \(6,\)"
    yield "x not a tensor", lambda a: a.update(x=[[1.0]]), TypeError, r"x must be a torch.Tensor \(got list\)"
    yield "layout separate", lambda a: a.update(layout="separate"), ValueError, r"layout='separate' is not one of"
    yield "unknown activation", lambda a: a.update(activation="relu"), ValueError, r"activation='relu' is not one of"
    yield "alpha on swiglu", lambda a: a.update(alpha=1.702), ValueError, r"activation='swiglu' has no alpha"
    yield "limit on swiglu", lambda a: a.update(limit=7.0), ValueError, r"activation='swiglu' has no clamp"
    yield "limit not a number", lambda a: a.update(activation="swiglu_oai", limit="7"), TypeError, r"limit must be a number"
    yield "bad limit value", lambda a: a.update(activation="swiglu_oai", limit=-1.0), ValueError, r"limit"


@pytest.mark.parametrize("name,edit,exc,msg", list(_bad_cases()), ids=[b[0] for b in _bad_cases()])
def test_bad_input(name, edit, exc, msg):
    c = make_case([3, 2], 1, D=6, F=4, dtype=torch.float32, device="cpu")
    a = dict(x=c["x"], w13=c["w13"], w2=c["w2"], offsets=c["offsets"], activation="swiglu", layout="halves",
             weights=None, alpha=None, limit=None)
    edit(a)
    with pytest.raises(exc, match=msg):
        y = moe.expert_mlp(a.pop("x"), a.pop("w13"), a.pop("w2"), a.pop("offsets"), a.pop("activation"), **a)
        y.sum().backward()


@requires_cuda
def test_bad_devices():
    c = make_case([3, 2], 1, D=8, F=8, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match=r"w2 is on cpu but x is on cuda:0"):
        moe.expert_mlp(c["x"], c["w13"], c["w2"].cpu(), c["offsets"])
    with pytest.raises(ValueError, match=r"weights is on cpu but x is on cuda:0"):
        moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], weights=torch.ones(6))
    with pytest.raises(TypeError, match=r"x has dtype torch.float64"):
        moe.expert_mlp(c["x"].double(), c["w13"].double(), c["w2"].double(), c["offsets"])
    # offsets on the CPU are accepted for CUDA tensors (no device-to-host read then)
    y = moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"].cpu())
    torch.testing.assert_close(y, moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"]))


def test_cpu_tensors_with_cuda_offsets_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    c = make_case([3, 2], 1, D=8, F=8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"offsets is on cuda:0 but x is on cpu"):
        moe.expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"].cuda())


# ---------------------------------------------------------------------------
# GroupedExperts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused_w13,layout", [(False, "halves"), (True, "halves"), (True, "interleaved"),
                                              (False, "up_first")])
@pytest.mark.parametrize("preset", PRESETS)
def test_loads_deepspeed_state_dict(preset, fused_w13, layout):
    """DeepSpeed's GroupedExperts (its per-expert loop, use_grouped_mm=False, on the CPU)
    and ours with its state dict: the same outputs and gradients, padding rows included."""
    ep = pytest.importorskip("deepspeed.moe.ep_experts")
    D, F, E = 12, 10, 3
    torch.manual_seed(0)
    ds = ep.GroupedExperts(D, F, E, use_grouped_mm=False, activation=preset)
    with torch.no_grad():
        for p in ds.parameters():
            p.normal_(0, 0.5)
    ours = moe.GroupedExperts(D, F, E, activation=preset, layout=layout, fused_w13=fused_w13, **_params(preset))
    ours.load_state_dict(ds.state_dict())
    counts = torch.tensor([4, 0, 7])
    x = (torch.randn(13, D) * 2).requires_grad_()  # 2 padding rows
    dy = torch.randn(13, D)
    want = ds(x, counts)
    wg = torch.autograd.grad(want, [x, ds.w1, ds.w2, ds.w3], dy)
    got = ours(x, counts)
    params = [ours.w13] if fused_w13 else [ours.w1, ours.w3]
    gg = torch.autograd.grad(got, [x, ours.w2] + params, dy)
    # Both in float32: DeepSpeed's autograd of the eager expression, ours the kernel's own
    # float32 math (gelu_tanh's gradient differs by ~5e-5 relative); a wrong weight mapping errs by O(1).
    tol = dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(got, want, **tol)
    assert got[11:].abs().max() == 0
    torch.testing.assert_close(gg[0], wg[0], **tol)
    torch.testing.assert_close(gg[1], wg[2], **tol)
    if fused_w13:
        # the fused weight's gradient is DeepSpeed's w1 and w3 gradients packed in the layout
        torch.testing.assert_close(gg[2], moe._pack(wg[1], wg[3], layout, dim=1), **tol)
    else:
        torch.testing.assert_close(gg[2], wg[1], **tol)
        torch.testing.assert_close(gg[3], wg[3], **tol)
    # and back: our state dict (converted to the other form) loads into DeepSpeed's module
    other = moe.GroupedExperts(D, F, E, activation=preset, layout=layout, fused_w13=not fused_w13, **_params(preset))
    other.load_state_dict(ours.state_dict())
    torch.testing.assert_close(other(x, counts), got, rtol=0, atol=0)
    if not fused_w13:
        ds2 = ep.GroupedExperts(D, F, E, use_grouped_mm=False, activation=preset)
        ds2.load_state_dict(ours.state_dict())
        torch.testing.assert_close(ds2(x, counts), want, rtol=0, atol=0)


def _gpt_oss_experts(x, counts, gate_up_proj, gate_up_bias, down_proj, down_bias, routing):
    """GPT-OSS's expert computation as HF transformers writes it (per expert: gate_up with its
    bias, gate/up interleaved, clamped, (up + 1) * glu, down with its bias, times the routing
    weight), here over rows sorted by expert."""
    out, start = [], 0
    for e, n in enumerate(counts):
        gu = x[start:start + n] @ gate_up_proj[e] + gate_up_bias[e]
        gate, up = gu[..., ::2], gu[..., 1::2]
        gate = gate.clamp(min=None, max=7.0)
        up = up.clamp(min=-7.0, max=7.0)
        glu = gate * torch.sigmoid(gate * 1.702)
        out.append(((up + 1) * glu @ down_proj[e] + down_bias[e]) * routing[start:start + n, None])
        start += n
    return torch.cat(out + [x.new_zeros(x.shape[0] - start, x.shape[1])])


def _gpt_oss_state(D, F, E, gen, biases=True):
    return {
        "gate_up_proj": torch.randn(E, D, 2 * F, generator=gen) * 0.5,
        "gate_up_proj_bias": torch.randn(E, 2 * F, generator=gen) if biases else torch.zeros(E, 2 * F),
        "down_proj": torch.randn(E, F, D, generator=gen) * 0.5,
        "down_proj_bias": torch.randn(E, D, generator=gen) if biases else torch.zeros(E, D),
    }


GPT_OSS_FORMS = [(True, "interleaved"), (True, "halves"), (False, "halves"), (False, "up_first")]


@pytest.mark.parametrize("fused_w13,layout", GPT_OSS_FORMS)
def test_loads_gpt_oss_state_dict_without_biases(fused_w13, layout):
    """All-zero GPT-OSS biases load into a module without biases (and are dropped); non-zero
    ones raise, naming bias=True."""
    D, F, E = 16, 12, 4
    gen = torch.Generator().manual_seed(5)
    sd = _gpt_oss_state(D, F, E, gen, biases=False)
    ours = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout=layout, fused_w13=fused_w13)
    ours.load_state_dict(dict(sd))
    counts = [5, 3, 0, 9]
    x = torch.randn(19, D, generator=gen) * 3
    routing = torch.rand(19, generator=gen)
    want = _gpt_oss_experts(x, counts, sd["gate_up_proj"], sd["gate_up_proj_bias"], sd["down_proj"],
                            sd["down_proj_bias"], routing)
    got = ours(x, torch.tensor(counts), weights=routing)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if fused_w13 and layout == "interleaved":  # GPT-OSS's own layout: the weights load as they are
        torch.testing.assert_close(ours.w13, sd["gate_up_proj"].transpose(-2, -1), rtol=0, atol=0)
    for key in ("down_proj_bias", "gate_up_proj_bias"):
        bad = dict(sd)
        bad[key] = sd[key].clone()
        bad[key][2, 3] = 0.5
        with pytest.raises(ValueError, match=rf"{key} has non-zero values but this GroupedExperts has no biases: "
                                             r"construct it with bias=True"):
            ours.load_state_dict(bad)


def _max_rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("fused_w13,layout", GPT_OSS_FORMS)
def test_gpt_oss_biases(fused_w13, layout):
    """A bias=True module loaded from a GPT-OSS state dict with non-zero biases: output and every
    gradient (x, the routing weights, the weights, b13, b2) against GPT-OSS's own expression in
    float64 autograd on the checkpoint's tensors; b13 is the checkpoint's bias reordered to the
    module's layout. Padding rows give 0. Float32 (the module) against float64: the same
    roundings as expert_mlp's float32 bound (TOL), relative to the largest magnitude; measured
    2.7e-7 or less (CPU, torch 2.13). b13 left interleaved in a "halves" module errs by 0.25
    on y."""
    D, F, E = 16, 12, 4
    gen = torch.Generator().manual_seed(7)
    sd = _gpt_oss_state(D, F, E, gen)
    ours = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout=layout, fused_w13=fused_w13, bias=True)
    ours.load_state_dict(dict(sd))
    gate, up = sd["gate_up_proj_bias"][:, 0::2], sd["gate_up_proj_bias"][:, 1::2]
    assert torch.equal(ours.b13, moe._pack(gate, up, layout, dim=1)) and torch.equal(ours.b2, sd["down_proj_bias"])
    counts = [5, 3, 0, 9]
    T = sum(counts) + 2  # 2 padding rows
    x = (torch.randn(T, D, generator=gen) * 3).requires_grad_()
    routing = torch.rand(T, generator=gen).requires_grad_()
    dy = torch.randn(T, D, generator=gen)
    ref = {k: v.double().requires_grad_() for k, v in sd.items()}
    xr, rr = x.detach().double().requires_grad_(), routing.detach().double().requires_grad_()
    want = _gpt_oss_experts(xr, counts, ref["gate_up_proj"], ref["gate_up_proj_bias"], ref["down_proj"],
                            ref["down_proj_bias"], rr)
    want.backward(dy.double())
    got = ours(x, torch.tensor(counts), weights=routing)
    w13 = [ours.w13] if fused_w13 else [ours.w1, ours.w3]
    grads = torch.autograd.grad(got, [x, routing, ours.w2, ours.b13, ours.b2] + w13, dy)
    dx, dr, dw2, db13, db2 = grads[:5]
    # the module's gradients in the checkpoint's layout
    bg, bu = moe._unpack(db13, layout, dim=1)
    if fused_w13:
        wg, wu = moe._unpack(grads[5], layout, dim=1)
    else:
        wg, wu = grads[5], grads[6]
    pairs = {
        "y": (got, want), "dx": (dx, xr.grad), "d routing": (dr, rr.grad),
        "d gate_up_proj": (moe._pack(wg, wu, "interleaved", dim=1).transpose(-2, -1), ref["gate_up_proj"].grad),
        "d down_proj": (dw2.transpose(-2, -1), ref["down_proj"].grad),
        "d gate_up_proj_bias": (moe._pack(bg, bu, "interleaved", dim=1), ref["gate_up_proj_bias"].grad),
        "d down_proj_bias": (db2, ref["down_proj_bias"].grad),
    }
    for what, (g, w) in pairs.items():
        assert g.shape == w.shape, what
        assert torch.isfinite(g).all() and w.abs().max() > 0, what
        assert _max_rel(g, w) <= TOL[torch.float32], f"{what}: {_max_rel(g, w):.3g}"
    assert got[-2:].abs().max() == 0 and dx[-2:].abs().max() == 0
    # a state dict of the module's own form (b13, b2) round-trips into the other weight form
    other = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout=layout, fused_w13=not fused_w13, bias=True)
    other.load_state_dict(ours.state_dict())
    assert torch.equal(other(x, torch.tensor(counts), weights=routing), got)


def test_bias_parameters():
    D, F, E = 8, 6, 3
    m = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout="interleaved", fused_w13=True, bias=True)
    assert m.b13.shape == (E, 2 * F) and m.b2.shape == (E, D) and not m.b13.any() and not m.b2.any()
    assert list(m.state_dict()) == ["w13", "w2", "b13", "b2"] and "bias=True" in repr(m)
    assert m.w13.abs().max() > 0  # the weights are drawn, the biases zero
    # zero biases: the same function as the module without biases
    plain = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout="interleaved", fused_w13=True)
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if k not in ("b13", "b2")})
    x, counts = torch.randn(7, D), torch.tensor([2, 0, 4])
    torch.testing.assert_close(m(x, counts), plain(x, counts), rtol=1e-6, atol=1e-6)
    # a GPT-OSS state dict without biases does not fill a module that has them
    gen = torch.Generator().manual_seed(0)
    sd = _gpt_oss_state(D, F, E, gen)
    del sd["gate_up_proj_bias"], sd["down_proj_bias"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*b13.*b2"):
        m.load_state_dict(sd)
    # bf16 activations with float32 parameters: the biases are cast with the weights
    m.b13.data.normal_()
    m.b2.data.normal_()
    xb = x.to(torch.bfloat16).requires_grad_()
    y = m(xb, counts)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and m.b13.grad.dtype == torch.float32 and m.b2.grad.abs().max() > 0


def test_grouped_experts_modes_and_casting():
    """recompute / inplace_backward as constructor arguments; float32 weights with bfloat16
    activations (cast per call, as DeepSpeed does); bad counts named."""
    D, F, E = 16, 8, 2
    base = moe.GroupedExperts(D, F, E, activation="swiglu_clamped", limit=10.0)
    x = torch.randn(10, D).to(torch.bfloat16).requires_grad_()
    counts = torch.tensor([6, 4])
    y0 = base(x, counts)
    g0 = torch.autograd.grad(y0.float().sum(), [x, base.w1, base.w2, base.w3])
    for kw in (dict(recompute=True), dict(inplace_backward=True), dict(recompute=True, inplace_backward=True)):
        m = moe.GroupedExperts(D, F, E, activation="swiglu_clamped", limit=10.0, **kw)
        m.load_state_dict(base.state_dict())
        assert "recompute" in repr(m) or "inplace" in repr(m)
        y = m(x, counts)
        assert torch.equal(y, y0)
        for a, b in zip(torch.autograd.grad(y.float().sum(), [x, m.w1, m.w2, m.w3]), g0):
            assert torch.equal(a, b)
    assert base.w1.dtype == torch.float32 and g0[1].dtype == torch.float32
    with pytest.raises(ValueError, match="num_tokens_per_expert must be a 1-D integer tensor"):
        base(x, torch.tensor([6.0, 4.0]))
    with pytest.raises(ValueError, match="has no alpha"):
        moe.GroupedExperts(D, F, E, activation="swiglu", alpha=1.0)
    with pytest.raises(ValueError, match="layout='separate'"):
        moe.GroupedExperts(D, F, E, layout="separate")


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-bf16-wgrad", "rowwise-promoted-wgrad", "blockwise"])
def test_grouped_experts_fp8(recipe):
    """GroupedExperts(fp8=recipe) reaches expert_mlp's FP8 node (on the CPU, its emulation): the
    recipe's FP8 GEMMs run (ScaledGemmLog.check), the output and every gradient are
    expert_mlp(fp8=recipe)'s on the same packed weights bit for bit (test_fp8_mlp holds that node
    to the recipe's oracle), and differ from the bf16 module's as FP8 must; fp8=True selects the
    default recipe, an unknown name is refused."""
    from support.fp8_oracle import ScaledGemmLog, rel
    D, F, E = 32, 16, 3
    kw = dict(activation="swiglu_oai", layout="interleaved", init_std=0.2)
    base = moe.GroupedExperts(D, F, E, **kw)
    m = moe.GroupedExperts(D, F, E, fp8=recipe, **kw)
    m.load_state_dict(base.state_dict())
    assert m.fp8 == recipe and f"fp8='{recipe}'" in repr(m) and base.fp8 is None
    assert moe.GroupedExperts(D, F, E, fp8=False).fp8 is None
    counts, offsets = torch.tensor([20, 0, 27]), torch.tensor([20, 20, 47], dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(50, D, generator=gen).to(torch.bfloat16)  # 3 padding rows
    w = torch.rand(50, generator=gen)
    dy = torch.randn(50, D, generator=gen).to(torch.bfloat16)

    def run(module):
        xr = x.clone().requires_grad_()
        y = module(xr, counts, weights=w)
        return (y, *torch.autograd.grad(y, [xr, module.w1, module.w2, module.w3], dy))

    with ScaledGemmLog() as log:
        got = run(m)
    log.check(recipe)
    w1, w2, w3 = (p.detach().clone().requires_grad_() for p in (m.w1, m.w2, m.w3))
    xr = x.clone().requires_grad_()
    w13 = torch.stack((w1, w3), dim=2).flatten(1, 2)  # [E, 2F, D], gate and up interleaved
    y = moe.expert_mlp(xr, w13.to(torch.bfloat16).transpose(-2, -1),
                       w2.to(torch.bfloat16).transpose(-2, -1), offsets, "swiglu_oai",
                       layout="interleaved", weights=w, fp8=recipe)
    want = (y, *torch.autograd.grad(y, [xr, w1, w2, w3], dy))
    bf16 = run(base)
    for name, g, r, b in zip(("y", "x", "w1", "w2", "w3"), got, want, bf16):
        assert torch.equal(g, r), name
        assert rel(g, b) > 2e-2, (name, rel(g, b))
    assert moe.GroupedExperts(D, F, E, fp8=True).fp8 == "blockwise"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "DEFAULT_FP8_RECIPE", None)
        with pytest.raises(ValueError, match="expertact.moe.GroupedExperts: fp8=True asks for the default FP8 recipe"):
            moe.GroupedExperts(D, F, E, fp8=True)
    with pytest.raises(ValueError, match="expertact.moe.GroupedExperts: fp8='e5m2' is not an FP8 recipe"):
        moe.GroupedExperts(D, F, E, fp8="e5m2")


@requires_cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_grouped_experts_cuda_bf16(mode):
    """The module on CUDA in bf16 (torch._grouped_mm), float32 master weights, an empty
    expert and counts that are not multiples of 8, against the same module on the CPU in bf16
    (the per-expert loop: the same roundings of the cast weights and of gate_up, so no clamp
    mask flips between the two)."""
    D, F, E = 64, 40, 4
    cpu = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout="interleaved", fused_w13=True, init_std=0.2)
    gpu = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout="interleaved", fused_w13=True,
                             **MODES[mode]).cuda()
    gpu.load_state_dict(cpu.state_dict())
    counts = torch.tensor([37, 0, 101, 5])
    x = (torch.randn(150, D) * 2).to(torch.bfloat16)  # 7 padding rows
    w = torch.rand(150)
    dy = torch.randn(150, D).to(torch.bfloat16)
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    want = cpu(xc, counts, weights=w)
    got = gpu(xg, counts.cuda(), weights=w.cuda())
    wg = torch.autograd.grad(want, [xc, cpu.w13, cpu.w2], dy)
    gg = torch.autograd.grad(got, [xg, gpu.w13, gpu.w2], dy.cuda())
    for name, g, r in (("y", got, want), ("dx", gg[0], wg[0]), ("dw13", gg[1], wg[1]), ("dw2", gg[2], wg[2])):
        assert_close(name, g, r, torch.bfloat16)
    assert got[143:].abs().max() == 0 and gg[0][143:].abs().max() == 0
    assert gg[1].dtype == torch.float32  # the master weights' gradient


def test_weight_gradients_come_in_the_weights_layout_without_a_copy():
    """Expert weights held [E, N, K] and read through .transpose(-2, -1): their gradients are
    computed in that storage's layout, so nothing copies a weight-sized tensor in backward
    (autograd would otherwise transpose each gradient into the leaf's strides)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    E, R, D, F = 3, 5, 8, 6
    x = torch.randn(E * R, D, dtype=torch.float64, requires_grad=True)
    w13 = torch.randn(E, 2 * F, D, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(E, D, F, dtype=torch.float64, requires_grad=True)
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * R
    y = moe.expert_mlp(x, w13.transpose(-2, -1), w2.transpose(-2, -1), offsets, "swiglu")
    dy = torch.randn_like(y)

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default):
                self.sizes.append(args[0].numel())
            return out

    with Copies() as c:
        y.backward(dy)
    assert w13.numel() not in c.sizes and w2.numel() not in c.sizes, c.sizes
    assert w13.grad.is_contiguous() and w2.grad.is_contiguous()
    # the values: against float64 autograd of the same composition
    xr, w13r, w2r = (t.detach().clone().requires_grad_() for t in (x, w13, w2))
    gu = torch.cat([xr[e * R:(e + 1) * R] @ w13r[e].t() for e in range(E)])
    h = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    yr = torch.cat([h[e * R:(e + 1) * R] @ w2r[e].t() for e in range(E)])
    yr.backward(dy)
    for got, ref in ((x.grad, xr.grad), (w13.grad, w13r.grad), (w2.grad, w2r.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
