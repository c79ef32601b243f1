"""The float64 oracle of the gated activations that several test files compare against."""
import torch


def glu64(z, layout, activation, alpha=1.702, limit=7.0):
    """The preset ``activation`` of gate_up z [..., 2F] in ``layout``, as torch computes it
    (alpha and limit read by the forms that take them)."""
    F = z.shape[-1] // 2
    if layout == "interleaved":
        g, u = z[..., 0::2], z[..., 1::2]
    elif layout == "up_first":
        u, g = z[..., :F], z[..., F:]
    else:
        g, u = z[..., :F], z[..., F:]
    if activation == "swiglu":
        return torch.nn.functional.silu(g) * u
    if activation == "geglu_tanh":
        return torch.nn.functional.gelu(g, approximate="tanh") * u
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    if activation == "swiglu_clamped":
        return torch.nn.functional.silu(g) * u
    return g * torch.sigmoid(alpha * g) * (u + 1)
