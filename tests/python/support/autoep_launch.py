"""Runs examples/autoep_train.py in this process (for torchrun in test_autoep_example.py), keeping
DeepSpeed's CPU backend from JIT-compiling its shared-memory allreduce op (a C++ build of about
100 s on a cold cache; gloo does the same collectives).
"""
import runpy
import sys

import deepspeed.comm.torch  # noqa: F401

# By sys.modules: the attribute deepspeed.comm.torch is the torch module (`from .comm import *`).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
