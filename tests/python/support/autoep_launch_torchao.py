"""Runs examples/autoep_train.py's main (for torchrun in test_autoep_example.py) with torchao's FP8
grouped GEMM replaced by torch._grouped_mm on the same operands and the Hopper check lifted: the
wiring of torchao's conversion into AutoEP's experts, tested on the CPU, where torchao's Triton
kernels cannot run. A run so made must train exactly as DeepSpeed's own (the same GEMMs), with
every expert GEMM passing through torchao's dispatch, and every expert's token group a multiple
of 16 rows as torchao's FP8 GEMMs need on the GPU (the stand-in asserts it); each rank writes
the operands' shapes and the groups' row counts of the GEMMs torchao received to
$TORCHAO_CALLS.rank<r>.json.
"""
import importlib.util
import json
import os
import sys

import deepspeed.comm.torch  # noqa: F401
import torch
import torchao.prototype.moe_training as moe_training

# As autoep_launch.py: no JIT build of DeepSpeed's shared-memory allreduce (gloo does the same).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

calls = []


def stand_in(A, B_t, offs, out_dtype=None, float8_dtype=None, pad_token_groups_for_grouped_mm=True):
    """torchao's _to_fp8_rowwise_then_scaled_grouped_mm's place: the same GEMM without FP8, on
    the token groups its GPU kernels take (ATen's FP8 grouped GEMM asserts them on the device)."""
    assert type(B_t) is torch.Tensor, type(B_t)  # torchao hands over its weight's data
    rows = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    assert all(n % 16 == 0 for n in rows) and offs[-1] <= A.shape[0], (rows, A.shape)
    calls.append([list(A.shape), list(B_t.shape), rows])
    return torch._grouped_mm(A, B_t, offs=offs)


moe_training._to_fp8_rowwise_then_scaled_grouped_mm = stand_in

spec = importlib.util.spec_from_file_location("autoep_train", sys.argv[1])
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)
train.autoep_fp8.torchao_unavailable = lambda device, args: None
train.main(sys.argv[2:])
with open(f"{os.environ['TORCHAO_CALLS']}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump(calls, f)
