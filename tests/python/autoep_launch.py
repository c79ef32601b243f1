"""Runs examples/autoep_train.py in this process (for torchrun in test_autoep_example.py), first
giving expertact.deepspeed a LOCAL STAND-IN for enable()/disable() when the installed expertact
has none yet, and keeping DeepSpeed's CPU backend from JIT-compiling its shared-memory allreduce
op (a C++ build of about 100 s on a cold cache; gloo does the same collectives).

STAND-IN: to be removed when expertact.deepspeed.enable()/disable() (branch dsreg) are merged. It
replaces the fused_fn / packed_fused_fn of DeepSpeed's swiglu_oai entry with expertact's
apply_expert_activation / apply_packed_expert_activation (no in-place backward), and disable() puts
the very entry back; nothing else of the real API.
"""
import dataclasses
import runpy
import sys

import expertact.deepspeed as xds

if not hasattr(xds, "enable"):  # STAND-IN, see above
    _saved = {}

    def enable(inplace_backward=False):
        from deepspeed.moe import ep_experts
        reg = ep_experts.EXPERT_ACTIVATIONS
        name = "swiglu_oai"
        _saved.setdefault(name, reg[name])

        def fused_fn(gate, up, alpha, limit):
            return xds.apply_expert_activation(gate, up, name, alpha, limit)

        def packed_fused_fn(gate_up, alpha, limit):
            return xds.apply_packed_expert_activation(gate_up, name, alpha, limit)

        reg[name] = dataclasses.replace(_saved[name], fused_fn=fused_fn, packed_fused_fn=packed_fused_fn)

    def disable():
        from deepspeed.moe import ep_experts
        ep_experts.EXPERT_ACTIVATIONS.update(_saved)
        _saved.clear()

    xds.enable, xds.disable = enable, disable
    print("autoep_launch.py: STAND-IN expertact.deepspeed.enable()/disable() in use", file=sys.stderr)

import deepspeed.comm.torch  # noqa: E402,F401

# By sys.modules: the attribute deepspeed.comm.torch is the torch module (`from .comm import *`).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
