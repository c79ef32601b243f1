"""expertact: fused gated activations (SwiGLU variants, GeGLU) of Mixture-of-Experts
expert MLPs, forward and backward, for CPU and CUDA tensors.

    import expertact
    h = expertact.swiglu_oai(gate_up, layout="interleaved")      # GPT-OSS
    h = expertact.swiglu(gate, up, inplace_backward=True)         # 3x less extra memory
    h = expertact.glu(gate, up, activation="silu", alpha=1.0, limit=10.0, beta=0.0)

The tensor API needs torch (an optional dependency); the C library's information
(has_cuda, cpu_threads, ...) is available without it. DeepSpeed's names and
signatures (swiglu_packed, apply_expert_activation, its swiglu_clamped that defaults to the
GPT-OSS form, ...) are in ``expertact.deepspeed`` only; the grouped expert MLP around the
activation (with memory modes) and a GroupedExperts module are in ``expertact.moe``.

EXPERTACT_EAGER=0 in the environment (read at import) sends every call through the
torch.library operators instead of the eager fast path (docs/python.md, "The binding").
"""
from __future__ import annotations

from ._capi import (
    LIBRARY_PATH,
    DTypeError,
    ExpertactError,
    abi_version,
    cpu_kernel_isa,
    cpu_threads,
    has_cuda,
    set_cpu_threads,
)

__version__ = "0.2.0"

_TORCH_NAMES = (
    "glu", "swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh", "expert_bias", "LAYOUTS", "ACTIVATIONS", "PRESETS",
    "deepspeed", "ops", "moe",
)

# DeepSpeed's names, which live in expertact.deepspeed (expertact.swiglu_clamped is the silu
# form; DeepSpeed's swiglu_clamped defaults to the GPT-OSS one); these three were top-level
# names in 0.1.0 and still resolve there, with a FutureWarning, for one release.
_DEEPSPEED_ONLY = ("swiglu_packed", "apply_expert_activation", "apply_packed_expert_activation")

try:
    import torch as _torch  # noqa: F401
except ImportError:  # the C library alone
    _torch = None

if _torch is not None:
    from . import _autograd  # noqa: F401  (registers the torch.ops.expertact operators, autograd included)
    from . import deepspeed, moe
    from .functional import (ACTIVATIONS, LAYOUTS, PRESETS, expert_bias, geglu_tanh, glu, swiglu, swiglu_clamped,
                             swiglu_oai)

    ops = _torch.ops.expertact


def __getattr__(name):
    if name in _DEEPSPEED_ONLY and _torch is not None:
        # Top-level names of 0.1.0, kept one more release: they warn and give DeepSpeed's.
        import warnings
        warnings.warn(f"expertact.{name} is deprecated: DeepSpeed's names are in expertact.deepspeed "
                      f"(expertact.deepspeed.{name}); the top-level name goes in the next release",
                      FutureWarning, stacklevel=2)
        return getattr(deepspeed, name)
    if _torch is None and name in _TORCH_NAMES:
        raise ImportError(f"expertact.{name} needs torch (pip install torch); it is not installed")
    raise AttributeError(f"module 'expertact' has no attribute {name!r}")


__all__ = [
    "LIBRARY_PATH", "DTypeError", "ExpertactError", "abi_version", "cpu_kernel_isa", "cpu_threads", "has_cuda",
    "set_cpu_threads",
    "__version__", *_TORCH_NAMES,
]
