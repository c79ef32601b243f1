"""Bad input: a ValueError or TypeError naming the argument and its value, never a crash,
and on CUDA never a sticky error (the device keeps working after the exception)."""
import math

import pytest
import torch

import expertact
from conftest import DEVICES, HAS_CUDA, requires_cuda

ops = torch.ops.expertact


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, dtype=dtype, device=device)


def _cases(dev):
    t = lambda *s, dtype=torch.float32: _t(*s, dtype=dtype, device=dev)  # noqa: E731
    g = t(4, 8)
    return [
        # (call, exception, message fragments)
        (lambda: expertact.swiglu(g, t(4, 9)), ValueError, ["up", "[4, 9]", "[4, 8]"]),
        (lambda: expertact.swiglu(g, t(5, 8)), ValueError, ["up", "[5, 8]"]),
        (lambda: expertact.swiglu(torch.ones(4, 8, dtype=torch.int16, device=dev),
                                  torch.ones(4, 8, dtype=torch.int16, device=dev)), TypeError,
         ["gate", "dtype", "bits 16"]),
        (lambda: expertact.swiglu(g, t(4, 8, dtype=torch.bfloat16)), TypeError, ["up", "bfloat16", "float32"]),
        (lambda: expertact.swiglu(torch.ones(4, 8, dtype=torch.int32, device=dev), t(4, 8)), TypeError, ["gate"]),
        (lambda: expertact.swiglu(t(4, 7), layout="halves"), ValueError, ["gate_up", "7", "odd"]),
        (lambda: expertact.swiglu_oai(t(4, 9), layout="interleaved"), ValueError, ["gate_up", "9", "odd"]),
        (lambda: expertact.swiglu(g, g, weights=t(4, dtype=torch.bfloat16)), TypeError, ["weights", "float32"]),
        (lambda: expertact.swiglu(g, g, weights=t(5)), ValueError, ["weights", "5", "4 rows"]),
        (lambda: expertact.swiglu_clamped(g, g, limit=-1.0), ValueError, ["limit", "-1"]),
        (lambda: expertact.swiglu_clamped(g, g, limit=0.0), ValueError, ["limit", "0"]),
        (lambda: expertact.swiglu_oai(g, g, alpha=math.nan), ValueError, ["alpha", "nan"]),
        (lambda: expertact.glu(g, g, beta=math.inf), ValueError, ["beta", "inf"]),
        (lambda: expertact.glu(g, g, limit=math.nan), ValueError, ["limit", "nan"]),
        (lambda: expertact.swiglu(t(), t()), ValueError, ["gate", "0-dimensional"]),
        (lambda: expertact.swiglu("gate", g), TypeError, ["gate", "str"]),
        (lambda: expertact.swiglu(g, [1.0]), TypeError, ["up", "list"]),
        (lambda: expertact.swiglu(g, g, weights=[1.0]), TypeError, ["weights", "list"]),
        (lambda: expertact.swiglu_oai(g, g, alpha="1.7"), TypeError, ["alpha", "str"]),
        (lambda: expertact.swiglu(g, layout="bogus"), ValueError, ["layout", "bogus"]),
        (lambda: expertact.swiglu(g, g, layout="interleaved"), ValueError, ["layout", "interleaved", "up"]),
        (lambda: expertact.swiglu(g, layout="separate"), ValueError, ["layout", "separate", "up is missing"]),
        (lambda: expertact.glu(g, g, activation="relu"), ValueError, ["activation", "relu"]),
        (lambda: expertact.glu(g, g, activation=None), ValueError, ["activation", "None"]),
        # straight to the operators: the library still names the problem
        (lambda: ops.glu(g, None, None, 7, 0, 1.0, 7.0, 0.0), ValueError, ["layout", "7"]),
        (lambda: ops.glu(g, None, None, 0, 0, 1.0, 7.0, 0.0), ValueError, ["up is missing"]),
        (lambda: ops.glu(g, g, None, 1, 0, 1.0, 7.0, 0.0), ValueError, ["up must be null"]),
        (lambda: ops.glu(g, g, None, 0, 5, 1.0, 7.0, 0.0), ValueError, ["act", "5"]),
        (lambda: ops.glu_backward(t(4, 8), g, g, None, True, 0, 0, 1.0, 7.0, 0.0), ValueError,
         ["grad_weights", "weights"]),
        (lambda: ops.glu_backward(t(4, 9), g, g, None, False, 0, 0, 1.0, 7.0, 0.0), ValueError,
         ["grad_out", "[4, 9]"]),
        (lambda: ops.glu_backward(t(4, 8, dtype=torch.float16), g, g, None, False, 0, 0, 1.0, 7.0, 0.0), TypeError,
         ["grad_out", "float16"]),
        (lambda: ops.glu_backward_(t(4, 8), g, g[:, :8], None, None, 0, 0, 1.0, 7.0, 0.0), ValueError,
         ["overlap"]),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_argument(device):
    for i, (fn, exc, fragments) in enumerate(_cases(device)):
        with pytest.raises(exc) as info:
            fn()
        msg = str(info.value)
        assert all(f in msg for f in fragments), (i, msg, fragments)
    if device == "cuda":
        torch.cuda.synchronize()  # no sticky error: the device still works
        x = torch.ones(8, device="cuda")
        assert (x + 1).sum().item() == 16


def test_empty_inputs_are_fine():
    out = expertact.swiglu(torch.empty(0, 8), torch.empty(0, 8))
    assert out.shape == (0, 8)
    out = expertact.swiglu_oai(torch.empty(3, 0), layout="interleaved")
    assert out.shape == (3, 0)


@requires_cuda
def test_cuda_mixed_devices_and_no_sticky_error():
    g = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="up is on cpu but gate is on cuda"):
        expertact.swiglu(g, torch.randn(4, 8))
    with pytest.raises(ValueError, match="weights is on cpu"):
        expertact.swiglu(g, g, weights=torch.rand(4))
    with pytest.raises(ValueError, match="gate is on cpu"):
        expertact.swiglu(torch.randn(4, 8), g)
    torch.cuda.synchronize()
    # The CUDA path uses the device's fast exp/division: equal to the CPU path
    # within float32 rounding, not bit for bit.
    torch.testing.assert_close(expertact.swiglu(g, g).cpu(), expertact.swiglu(g.cpu(), g.cpu()),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(HAS_CUDA or not torch.cuda.is_available(), reason="only for a CPU-only build on a GPU machine")
def test_cuda_tensor_without_cuda_path():
    with pytest.raises(NotImplementedError, match="no CUDA path"):
        expertact.swiglu(torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda"))
