"""The host-cost measurement (expertact.bench.hostcost) and its CLI (bench/host_cost.py) run end
to end on the CPU and time what they claim to."""
import json
import os
import subprocess
import sys
import time

import torch

from expertact.bench import hostcost

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_cost_us_times_the_calls():
    calls = []

    def fn(x):
        calls.append(x)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 200e-6:  # 200 us of host work per call
            pass

    made = []
    us = hostcost.host_cost_us(fn, lambda: (made.append(1) or len(made),), iters=20, device="cpu", repeats=3,
                                warmup=2)
    assert 190 <= us <= 2000, us
    assert len(calls) == 2 + 3 * 20 and len(made) == len(calls)  # fresh arguments for every call


def test_measure_every_case_on_the_cpu():
    # This thread's CPU time and the median of three rounds: a single wall-clock round of three calls
    # once took 90 us for a forward that takes 15 (the machine was busy), above its forward + backward.
    rows = hostcost.measure("cpu", iters=5, repeats=3, clock=time.thread_time, names=["expertact", "eager"])
    names = [r["case"] for r in rows]
    assert len([n for n in names if n.startswith("expertact")]) == 16  # 4 layouts x weights x in place
    assert any(n.startswith("eager") for n in names)
    for r in rows:
        assert r["fwd_nograd_us"] > 0 and r["fwd_us"] > 0 and r["fwd_bwd_us"] > r["fwd_nograd_us"], r


def test_cli(tmp_path):
    js = tmp_path / "h.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_cost.py"), "--device", "cpu",
                          "--iters", "3", "--repeats", "1", "--only", "interleaved +w", "--json", str(js)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "expertact interleaved +w inplace" in res.stdout
    data = json.loads(js.read_text())
    assert data["env"]["torch"] == torch.__version__ and len(data["rows"]) == 2
