"""When the eager fast path applies: eager_ok() (no compiler, mode, transform or trace
stands in between) and plain(t) (a plain dense CPU or CUDA tensor).

The eager path calls the kernel bodies without the dispatcher, which is what the
dispatcher would do for plain tensors in eager mode: it skips its two hops into Python
kernels (Autograd, then CPU/CUDA) and the redispatch between them, about half the host
time of a no-grad forward on the CPU and two thirds of a forward with autograd
(docs/notes/perf-notes.md, "Python host path"). Deciding that it applies reads private
torch internals (listed below), so:

- when the running torch lacks one of them, the eager path is off (the operators only);
- EXPERTACT_EAGER=0 (read once, at import) turns it off too: every call then goes through
  the torch.library operators, for a torch release whose internals changed in a way
  these checks do not notice. Results are the same; only the host cost differs.
"""
from __future__ import annotations

import os

import torch

__all__ = ["ENABLED", "eager_ok", "plain"]

# EXPERTACT_EAGER=0 (or false / off / no): the operators only.
_SWITCH = os.environ.get("EXPERTACT_EAGER", "1").strip().lower() not in ("0", "false", "off", "no")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
try:  # the torch internals eager_ok() and plain() read; without one of them: the operators only
    _is_compiling = torch.compiler.is_compiling
    _dispatch_modes = torch._C._len_torch_dispatch_stack
    _functorch_active = torch._C._are_functorch_transforms_active
    _tf_modes_enabled = torch._C._is_torch_function_mode_enabled
    _jit_tracing = torch._C._get_tracing_state
    _keys = torch._C._dispatch_keys
    _keys(torch.empty(0)).raw_repr()
    _tf_stack_len, _tf_stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
    _no_modes = (torch._C.DisableTorchFunction, torch._C._DisableTorchDispatch)
    from torch.utils._device import DeviceContext as _DeviceContext
    _INTERNALS = True
except (AttributeError, TypeError, ImportError):  # pragma: no cover - a torch that lacks one of them
    _INTERNALS = False

#: Whether the eager path is in use at all (the switch is on and torch has the internals).
ENABLED = _SWITCH and _INTERNALS


def _only_device_modes() -> bool:
    # torch.set_default_device / `with torch.device(...)` install a DeviceContext mode, which
    # rewrites factory calls (torch.empty, ...) and passes everything else through: the
    # operator would reach the same kernel, and the eager path allocates with new_empty /
    # empty_like, which it leaves alone.
    return all(type(_tf_stack_at(i)) is _DeviceContext for i in range(_tf_stack_len()))


def eager_ok() -> bool:
    """Whether calling the kernel bodies directly is what the dispatcher would do: not
    compiling or exporting, no TorchDispatchMode (FakeTensorMode, make_fx, FlopCounterMode,
    ...), no functorch transform, no jit trace, and no TorchFunctionMode but DeviceContext.
    Each is one C call, the five together cheaper than one plain(); with plain() of each
    tensor that is the whole price of the eager path's soundness, at most about a fifth of the
    dispatcher hops it saves in a no-grad forward (docs/notes/perf-notes.md, "Python host
    path"). Always False with EXPERTACT_EAGER=0."""
    if not ENABLED or _is_compiling() or _dispatch_modes() or _functorch_active() or _jit_tracing() is not None:
        return False
    return not _tf_modes_enabled() or _only_device_modes()


# Raw dispatch key sets of plain dense tensors (with and without autograd: inference tensors).
_PLAIN_KEYS = set()
_cuda_keys_known = False


def _learn_keys(device) -> None:
    # With modes and subclass dispatch off: the key sets of what torch.empty makes by itself.
    with _no_modes[0](), _no_modes[1]():
        with torch.inference_mode(False):
            t = torch.empty(0, device=device)
        with torch.inference_mode():
            ti = torch.empty(0, device=device)
    _PLAIN_KEYS.update((_keys(t).raw_repr(), _keys(ti).raw_repr()))


if ENABLED:
    _learn_keys("cpu")


def plain(t) -> bool:
    """Whether t is a plain dense CPU or CUDA tensor: torch.Tensor (or nn.Parameter) itself,
    with exactly the dispatch keys such a tensor has. That one comparison excludes
    subclasses with a dispatch key (FakeTensor, DTensor, FunctionalTensor), functorch
    wrappers, negative or conjugate views, ZeroTensors, sparse, nested, mkldnn and meta
    tensors and every other device; the type test excludes __torch_function__ subclasses."""
    tp = type(t)
    if tp is not _Tensor and tp is not _Parameter:
        return False
    return _keys(t).raw_repr() in _PLAIN_KEYS or _learn_cuda_keys(t)


def _learn_cuda_keys(t) -> bool:
    # The CUDA key sets are learned from a fresh tensor the first time a CUDA tensor is
    # seen (creating one at import would initialise CUDA).
    global _cuda_keys_known
    if _cuda_keys_known or not t.is_cuda:
        return False
    _learn_keys(t.device)
    _cuda_keys_known = True
    return _keys(t).raw_repr() in _PLAIN_KEYS
