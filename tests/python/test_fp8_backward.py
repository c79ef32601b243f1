"""expertact.fp8.glu_backward_rowwise (CPU, and CUDA where a GPU is present): the
activation's gradient quantised rowwise from float32, against torch.autograd in float64
followed by torchao's recipe in torch; its float32 values (dgate_up_out of a float32 call)
against the bytes bit for bit; the weights' gradient, the column amax, NaN and inf, and the
refusals."""

import pytest
import torch

from expertact import fp8
from support.fp8_cases import backward_case
from support.oracle import glu64
from test_fp8 import _bits, _recipe, _torch_col_amax

ACTS = ["swiglu", "swiglu_oai", "geglu_tanh"]
LAYOUTS = ["halves", "up_first", "interleaved"]
ENDS = [20, 20, 61, 90]  # an empty expert, and 7 rows past the last offset (no bias, no amax)


def _case(T, F, dtype, seed, E=len(ENDS)):
    return backward_case(T, F, dtype, seed, E)


def _bias_rows(b, ends, T):
    """[T, 2F] float64: bias[e] on the rows of expert e, 0 past the last offset."""
    out = torch.zeros(T, b.shape[1], dtype=torch.float64)
    start = 0
    for e, stop in enumerate(ends):
        out[start:stop] = b[e].double()
        start = stop
    return out


def _oracle(z, dh, activation, layout, w=None, b=None, ends=None):
    """(dgate_up, dweights or None) in float64 by torch.autograd through the forward oracle."""
    z64 = z.double().requires_grad_(True)
    w64 = None if w is None else w.double().requires_grad_(True)
    x = z64 if b is None else z64 + _bias_rows(b, ends, z.shape[0])
    h = glu64(x, layout, activation)
    if w64 is not None:
        h = h * w64[:, None]
    h.backward(dh.double())
    return z64.grad, None if w64 is None else w64.grad


def _scale_of64(amax):
    """The recipe's scale 1 / s from a float64 amax, as the library takes it from float32."""
    a = torch.clamp(amax.float(), min=1e-12)
    s = (448.0 / a.double()).float()
    s = torch.where(s > 0, torch.exp2(torch.floor(torch.log2(s))), s)
    return 1.0 / s


def _steps(bits):
    """e4m3 bytes as signed step counts (+0 and -0 both 0): neighbours differ by one."""
    b = bits.int()
    return torch.where(b >= 0x80, -(b & 0x7F), b)


def _check_against_float64(q, scale, d64):
    """q's bytes against the recipe of the float64 gradient rounded to float32: at most one
    e4m3 step, on a small share (the library's float32 gradient may round to the other side
    of a step); the scales equal on every row whose amax is not within float32's error of a
    power-of-two boundary of the scale."""
    rq, rs = _recipe(d64.float())
    diff = (_steps(_bits(q)) - _steps(rq)).abs()
    assert diff.max() <= 1
    assert (diff > 0).float().mean() < 2e-3, (diff > 0).float().mean()
    amax = torch.where(torch.isnan(d64), torch.zeros_like(d64), d64.abs()).amax(-1)
    near = (_scale_of64(amax * (1 - 1e-5)) != _scale_of64(amax * (1 + 1e-5)))
    assert near.float().mean() < 0.05
    assert torch.equal(scale[~near], rs[~near])


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_against_float64(activation, layout, dtype, bias, weights):
    T, F = 97, 48
    z, dh, b, w = _case(T, F, dtype, 3)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    kw = {}
    if weights:
        kw.update(weights=w, weights_grad=True)
    if bias:
        kw.update(bias=b, offsets=offs)
    q, scale, dw, amax = fp8.glu_backward_rowwise(dh, z, activation, layout=layout, **kw)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, 2 * F) and scale.shape == (T,) and amax is None
    d64, dw64 = _oracle(z, dh, activation, layout, w if weights else None, b if bias else None, ENDS)
    _check_against_float64(q, scale, d64)
    if weights:
        assert dw.dtype == torch.float32 and dw.shape == (T,)
        torch.testing.assert_close(dw.double(), dw64, rtol=1e-5, atol=1e-5 * dw64.abs().max().item())
    else:
        assert dw is None


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_float32_values_bit_for_bit(activation, layout):
    """A float32 call's dgate_up_out holds the float32 gradient itself: q and scale are the
    recipe of it byte for byte, the column amax torch's amax of it, and it is the float64
    gradient within float32's error."""
    T, F = 97, 48
    z, dh, b, w = _case(T, F, torch.float32, 4)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    d32 = torch.full_like(z, 12345.0)
    q, scale, dw, amax = fp8.glu_backward_rowwise(dh, z, activation, layout=layout, weights=w, bias=b,
                                                  offsets=offs, ends=ENDS, col_amax=True, dgate_up_out=d32)
    rq, rs = _recipe(d32)
    assert torch.equal(_bits(q), rq) and torch.equal(scale, rs)
    assert amax.shape == (len(ENDS), 2 * F) and torch.equal(amax, _torch_col_amax(d32, ENDS))
    d64, _ = _oracle(z, dh, activation, layout, w, b, ENDS)
    torch.testing.assert_close(d32.double(), d64, rtol=1e-5, atol=1e-6 * d64.abs().max().item())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_dgate_up_out_and_amax(layout):
    """The bf16 copy is the float64 gradient rounded to bf16 (at most one bf16 ulp from the
    float32 rounding on a small share); the column amax is that of the copy, exactly (the
    values the column-wise pass quantises, as torchao takes the amax of the bf16 tensor)."""
    T, F = 97, 48
    z, dh, b, w = _case(T, F, torch.bfloat16, 5)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    out = torch.empty_like(z)
    q, scale, dw, amax = fp8.glu_backward_rowwise(dh, z, "swiglu", layout=layout, weights=w, weights_grad=True,
                                                  offsets=offs, col_amax=True, dgate_up_out=out)
    d64, _ = _oracle(z, dh, "swiglu", layout, w)
    ref = d64.float().to(torch.bfloat16)
    ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3
    assert torch.equal(amax, _torch_col_amax(out, ENDS))
    _check_against_float64(q, scale, d64)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("F", [3, 48, 3072])
def test_in_place_over_gate_up(device, layout, F):
    """dgate_up_out=gate_up: the same bytes as a separate output (q, scale, weights' gradient,
    column amax and the bf16 gradient), gate_up overwritten by the gradient; F = 3 takes the
    GPU's scalar kernel, 48 and 3,072 the held rows."""
    T = 97
    z, dh, b, w = _case(T, F, torch.bfloat16, 12)
    z, dh, b, w = z.to(device), dh.to(device), b.to(device), w.to(device)
    offs = torch.tensor(ENDS, dtype=torch.int32, device=device)
    kw = dict(layout=layout, weights=w, weights_grad=True, bias=b, offsets=offs, ends=ENDS, col_amax=True)
    out = torch.full_like(z, 7.0)
    ref = fp8.glu_backward_rowwise(dh, z, "swiglu_oai", dgate_up_out=out, **kw)
    zi = z.clone()
    got = fp8.glu_backward_rowwise(dh, zi, "swiglu_oai", dgate_up_out=zi, **kw)
    for a, r in zip(got, ref):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           r.view(torch.uint8) if r.dtype == torch.float8_e4m3fn else r)
    assert torch.equal(zi.view(torch.int16), out.view(torch.int16))
    with pytest.raises(Exception, match="grad_gate_up"):  # a shifted view of gate_up is not in place
        fp8.glu_backward_rowwise(dh[:-1], z[:-1], "swiglu_oai", layout=layout, dgate_up_out=z[1:])


def test_nan_and_inf():
    """NaN in gate_up or dh: ignored by the amax, written 0x7f; an infinite gradient: scale
    inf and its row's products NaN (0x7f) or 0; all as the recipe of the float32 gradient."""
    T, F = 12, 16
    z, dh, b, w = _case(T, F, torch.float32, 6)
    z[1, 3] = float("nan")
    dh[2, 5] = float("nan")
    dh[3, 0] = float("inf")
    dh[4, 1] = float("-inf")
    z[5, F + 2] = float("inf")  # up = inf: an infinite gate gradient in the halves layout
    offs = torch.tensor([4, 12], dtype=torch.int32)
    d32 = torch.empty_like(z)
    q, scale, dw, amax = fp8.glu_backward_rowwise(dh, z, "swiglu", weights=w, weights_grad=True, offsets=offs,
                                                  col_amax=True, dgate_up_out=d32)
    assert torch.isnan(d32).any() and torch.isinf(d32).any()
    rq, rs = _recipe(d32)
    assert torch.equal(_bits(q), rq) and torch.equal(scale, rs)
    assert torch.isinf(scale[3]) and torch.isinf(scale[5]) and torch.isfinite(scale[1])
    assert (_bits(q)[1] == 0x7F).sum() >= 1
    assert torch.equal(amax, _torch_col_amax(d32, [4, 12], d32.dtype))
    assert not torch.isnan(amax).any()


def test_empty_rows_and_experts():
    z = torch.zeros(0, 32)
    dh = torch.zeros(0, 16)
    offs = torch.tensor([0, 0], dtype=torch.int32)
    q, scale, dw, amax = fp8.glu_backward_rowwise(dh, z, offsets=offs, col_amax=True)
    assert q.shape == (0, 32) and scale.shape == (0,) and torch.equal(amax, torch.zeros(2, 32))


def test_refusals():
    z, dh, b, w = _case(8, 16, torch.float32, 7)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="weights_grad"):
        fp8.glu_backward_rowwise(dh, z, weights_grad=True)
    with pytest.raises(ValueError, match="col_amax"):
        fp8.glu_backward_rowwise(dh, z, col_amax=True)
    with pytest.raises(ValueError, match="offsets"):
        fp8.glu_backward_rowwise(dh, z, bias=b)
    with pytest.raises(ValueError, match="separate|packed|up"):
        fp8.glu_backward_rowwise(dh, z, layout="separate")
    with pytest.raises(Exception, match="grad_out"):
        fp8.glu_backward_rowwise(dh[:, :8], z)
    with pytest.raises(Exception, match="grad_out"):
        fp8.glu_backward_rowwise(dh.to(torch.bfloat16), z)
    with pytest.raises(Exception, match="bias"):
        fp8.glu_backward_rowwise(dh, z, bias=b[:, :8], offsets=offs)
    with pytest.raises(Exception, match="offsets"):
        fp8.glu_backward_rowwise(dh, z, offsets=torch.tensor([4, 9], dtype=torch.int32), col_amax=True)
    with pytest.raises(Exception, match="grad_gate_up"):
        fp8.glu_backward_rowwise(dh, z, dgate_up_out=torch.empty(8, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dgate_up_out"):
        fp8.glu_backward_rowwise(dh, z, dgate_up_out=torch.empty(32, 8).t())
    with pytest.raises(Exception, match="float64"):
        fp8.glu_backward_rowwise(dh.double(), z.double())


CUDA = torch.cuda.is_available()

# On a GPU the activation's exp and division are the hardware's approximate forms
# (src/core/math.h), so its float32 gradient differs from the CPU's in the last bits: the
# GPU is checked against the float64 oracle as the CPU is, and its quantisation and column
# amax bit for bit against the recipe of its own float32 gradient.
# F = 3: the scalar kernel (no 16-byte pack); 48, 1000 and 3072 rows held in registers at
# 32 .. 256 lanes; 8200: longer than the lanes hold (the scalar kernel); 36: interleaved bf16
# rows of dh whose size is not a multiple of 16 bytes (72: the kernel's L2 prefetch skips them).
SHAPES = [3, 36, 48, 1000, 3072, 8200]


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_cuda_against_float64(activation, layout, dtype, F, bias, weights):
    """weights=False: the kernels compiled without the routing weights (the expert MLP's)."""
    T = 97
    z, dh, b, w = _case(T, F, dtype, 8)
    z[7, 1] = float("nan")  # (inf: in test_cuda_float32_values_bit_for_bit, against the GPU's own values)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    kw = dict(offsets=offs.cuda(), ends=ENDS, col_amax=True)
    if weights:
        kw.update(weights=w.cuda(), weights_grad=True)
    if bias:
        kw["bias"] = b.cuda()
    q, scale, dw, amax = fp8.glu_backward_rowwise(dh.cuda(), z.cuda(), activation, layout=layout, **kw)
    d64, dw64 = _oracle(z, dh, activation, layout, w if weights else None, b if bias else None, ENDS)
    _check_against_float64(q.cpu(), scale.cpu(), d64)
    # the amax of the gradient as rounded to dtype: float32's error, then within one ulp of
    # dtype where the GPU's float32 gradient rounds to the other side
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(amax.cpu().double(), _torch_col_amax(d64.to(dtype), ENDS, d64.dtype), rtol=tol,
                               atol=0)
    if not weights:
        assert dw is None
        return
    finite = torch.isfinite(dw64)
    torch.testing.assert_close(dw.cpu().double()[finite], dw64[finite], rtol=1e-5,
                               atol=1e-5 * dw64[finite].abs().max().item())
    assert torch.equal(torch.isfinite(dw.cpu()), finite)


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("F", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_cuda_float32_values_bit_for_bit(layout, F, bias, weights):
    """A float32 call's dgate_up_out is the GPU's float32 gradient: q, scale and the column
    amax are the recipe's and torch's of it, byte for byte (what the CPU path gives for its
    own float32 gradient: the quantisation is fp8.h's on both)."""
    T = 97
    z, dh, b, w = _case(T, F, torch.float32, 10)
    z[7, 1] = float("nan")
    dh[9, 2] = float("inf")
    offs = torch.tensor(ENDS, dtype=torch.int32).cuda()
    d32 = torch.full_like(z, 12345.0).cuda()
    q, scale, _, amax = fp8.glu_backward_rowwise(dh.cuda(), z.cuda(), "swiglu_oai", layout=layout,
                                                 weights=w.cuda() if weights else None,
                                                 bias=b.cuda() if bias else None, offsets=offs,
                                                 col_amax=True, dgate_up_out=d32)
    d32 = d32.cpu()
    rq, rs = _recipe(d32)
    assert torch.equal(_bits(q).cpu(), rq) and torch.equal(scale.cpu(), rs)
    assert torch.equal(amax.cpu(), _torch_col_amax(d32, ENDS))


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("F", SHAPES)
@pytest.mark.parametrize("weights", [False, True])
def test_cuda_bf16_amax_of_the_copy(layout, F, weights):
    """bf16: the column amax is that of dgate_up_out (the gradient as rounded to bf16), exactly,
    in every kernel form (F = 3 and 8200: the scalar kernel; the others the held rows)."""
    T = 97
    z, dh, b, w = _case(T, F, torch.bfloat16, 12)
    z[7, 1] = float("nan")
    offs = torch.tensor(ENDS, dtype=torch.int32).cuda()
    out = torch.full_like(z, 12345.0).cuda()
    _, _, _, amax = fp8.glu_backward_rowwise(dh.cuda(), z.cuda(), "swiglu_oai", layout=layout,
                                             weights=w.cuda() if weights else None, offsets=offs, col_amax=True,
                                             dgate_up_out=out)
    assert torch.equal(amax.cpu(), _torch_col_amax(out.cpu(), ENDS))


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("F", [48, 3072])
def test_cuda_bf16_copy_against_cpu(layout, F):
    """The bf16 dgate_up_out: the CPU's within one bf16 ulp on a small share (the float32
    gradients differ in their last bits)."""
    T = 97
    z, dh, b, w = _case(T, F, torch.bfloat16, 11)
    out = torch.empty_like(z)
    fp8.glu_backward_rowwise(dh, z, "geglu_tanh", layout=layout, weights=w, dgate_up_out=out)
    out_c = torch.empty_like(z).cuda()
    fp8.glu_backward_rowwise(dh.cuda(), z.cuda(), "geglu_tanh", layout=layout, weights=w.cuda(),
                             dgate_up_out=out_c)
    ulps = (out_c.cpu().view(torch.int16).int() - out.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_unaligned_views(layout):
    """Views at an odd element offset (no 16-byte pack: the scalar kernel)."""
    T, F = 33, 64
    z, dh, b, w = _case(T, F + 1, torch.bfloat16, 9)
    zv, dv = z[:, 1:1 + 2 * F], dh[:, 1:1 + F]
    q, scale, dw, _ = fp8.glu_backward_rowwise(dv.cuda(), zv.cuda(), "swiglu_oai", layout=layout,
                                               weights=w.cuda(), weights_grad=True)
    d64, dw64 = _oracle(zv, dv, "swiglu_oai", layout, w)
    _check_against_float64(q.cpu(), scale.cpu(), d64)
    torch.testing.assert_close(dw.cpu().double(), dw64, rtol=1e-5, atol=1e-5 * dw64.abs().max().item())
