"""The random problems of the FP8 activation tests (test_fp8_backward.py, test_fp8_glu_colwise.py,
test_fp8_blocks.py): gate_up, the upstream gradient, a per-expert bias and routing weights drawn
from one seed, and gate_up split for the separate layout."""
import torch


def glu_case(T, F, dtype, seed, E, nan_at=()):
    """(z [T, 2F], bias [E, 2F], weights [T]) drawn in that order from ``seed``: z 3 x N(0, 1)
    and the bias 2 x N(0, 1) in ``dtype``, the weights uniform in [0, 1) (float32); z NaN at
    each (row, column) of ``nan_at``."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, 2 * F, generator=g) * 3).to(dtype)
    for r, c in nan_at:
        z[r, c] = float("nan")
    b = (torch.randn(E, 2 * F, generator=g) * 2).to(dtype)
    w = torch.rand(T, generator=g)
    return z, b, w


def backward_case(T, F, dtype, seed, E):
    """(z [T, 2F], dh [T, F], bias [E, 2F], weights [T]) drawn in that order from ``seed``: as
    glu_case, dh N(0, 1) in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, 2 * F, generator=g) * 3).to(dtype)
    dh = torch.randn(T, F, generator=g).to(dtype)
    b = (torch.randn(E, 2 * F, generator=g) * 2).to(dtype)
    w = torch.rand(T, generator=g)
    return z, dh, b, w


def split(z, layout):
    """(gate_up or gate, up or None, the layout name for the calls): the separate layout takes
    z's halves as two contiguous tensors and no layout name."""
    if layout == "separate":
        F = z.shape[1] // 2
        return z[:, :F].contiguous(), z[:, F:].contiguous(), None
    return z, None, layout
