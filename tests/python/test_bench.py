"""The benchmark runs end to end (a tiny CPU table) and its memory columns show what
docs/spec.md section 3 promises: expertact keeps nothing and peaks at 3 tensors, 1 in place;
its --peers mode, likewise, with DeepSpeed's column and the host-cost table."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import requires_cuda
from expertact.bench import activation, cli, common, peers


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_cpu_table(tmp_path, capsys):
    rows, ffn = 256, 64
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    rc = cli.main(["--device", "cpu", "--rows", str(rows), "--ffn", str(ffn), "--presets", "swiglu_oai",
                     "--layouts", "separate,interleaved", "--impls", "eager,compile,expertact,expertact-inplace",
                     "--iters", "2", "--warmup", "1", "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    data = json.loads(js.read_text())
    results = data["results"]
    assert len(results) == 2 * 4
    assert all("error" not in r for r in results), [r for r in results if "error" in r]
    tensor_gib = rows * ffn * 4 / 2 ** 30
    for r in results:
        assert r["ms"] > 0 and r["pct_floor"] > 0 and r["fwd_ms"] > 0 and r["bwd_ms"] > 0
        if r["impl"] == "expertact":
            assert r["kept_gib"] == 0 and r["extra_peak_gib"] == pytest.approx(3 * tensor_gib)
        elif r["impl"] == "expertact-inplace":
            assert r["kept_gib"] == 0 and r["extra_peak_gib"] == pytest.approx(tensor_gib)
        elif r["impl"] == "eager" and r["layout"] == "separate" and r["preset"] == "swiglu_oai":
            assert r["kept_gib"] > 2 * tensor_gib and r["extra_peak_gib"] > 5 * tensor_gib
    text = md.read_text()
    assert "| swiglu_oai | interleaved | expertact-inplace |" in text and "% of floor" in text
    assert data["meta"]["floor_ms"] > 0 and data["meta"]["rows"] == rows
    err = capsys.readouterr().err
    assert "[8/8]" in err  # progress while it runs


def test_bench_rejects_unknown_names():
    with pytest.raises(SystemExit):
        cli.main(["--device", "cpu", "--presets", "relu"])


# ---------------------------------------------------------------------------
# --peers mode (expertact/bench/peers.py)
# ---------------------------------------------------------------------------

PEERS_ARGS = ["--peers", "--rows", "96", "--ffn", "40", "--presets", "swiglu", "--layouts", "separate,halves",
              "--iters", "2", "--warmup", "1", "--repeat", "2", "--host-iters", "5"]


def _ds_expected_status():
    return "needs CUDA/Triton" if importlib.util.find_spec("deepspeed") else "not installed"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_peers_cpu(tmp_path, capfd):
    js, md = tmp_path / "p.json", tmp_path / "p.md"
    rc = cli.main(["--device", "cpu", *PEERS_ARGS, "--impls", "eager,deepspeed,expertact,expertact-inplace",
                     "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    out, err = capfd.readouterr()
    data = json.loads(js.read_text())
    assert set(data) == {"meta", "sizes", "cells", "summary", "host"}
    meta = data["meta"]
    assert meta["mode"] == "peers" and meta["complete"] and meta["repeat"] == 2 and meta["iters"] == 2
    assert meta["command"].startswith("expertact-bench --device cpu --peers")
    for key in ("date", "torch", "triton", "deepspeed", "expertact", "python", "device_name", "wall_s"):
        assert key in meta
    assert meta["deepspeed_status"] == _ds_expected_status()
    assert [(s["rows"], s["ffn"]) for s in data["sizes"]] == [(96, 40)] and data["sizes"][0]["floor_ms"] > 0

    # DeepSpeed's cells are not run on the CPU: 2 layouts x 3 implementations, each repeated twice.
    cells = data["cells"]
    assert sorted((c["layout"], c["impl"]) for c in cells) == sorted(
        (lay, i) for lay in ("separate", "halves") for i in ("eager", "expertact", "expertact-inplace"))
    tensor_gib = 96 * 40 * 4 / 2 ** 30
    for c in cells:
        assert "error" not in c, c
        assert c["check_ok"] and c["check_err"] < 1e-3
        assert len(c["ms_per_repeat"]) == 2 and c["ms_spread"] == [min(c["ms_per_repeat"]), max(c["ms_per_repeat"])]
        assert c["ms_spread"][0] <= c["ms"] <= c["ms_spread"][1] and c["pct_floor"] > 0
        if c["impl"] == "expertact":
            assert c["kept_gib"] == 0 and c["extra_peak_gib"] == pytest.approx(3 * tensor_gib)
        elif c["impl"] == "expertact-inplace":
            assert c["kept_gib"] == 0 and c["extra_peak_gib"] == pytest.approx(tensor_gib)

    assert len(data["summary"]) == 2
    for s in data["summary"]:
        assert s["fastest_peer"] == "eager" and s["winner"] in s["ms"]
        assert s["deepspeed_status"] == _ds_expected_status()
        assert s["expertact_vs_peer_pct"] == pytest.approx((s["ms"]["expertact"] / s["ms"]["eager"] - 1) * 100)
        assert s["target"].startswith(("met", "within noise", "missed"))

    host = {(r["label"], r["layout"]): r for r in data["host"]}
    assert host[("DeepSpeed swiglu", "separate")]["error"] == _ds_expected_status()
    for key in [("expertact", lay) for lay in ("separate", "halves", "up_first", "interleaved")] + [
            ("expertact, weights", "halves"), ("expertact in place", "separate"), ("eager", "halves")]:
        assert host[key]["fwd_us"] > 0 and host[key]["fwd_bwd_us"] > 0 and len(host[key]["fwd_us_spread"]) == 2
    assert not any(r["impl"] == "compile" for r in data["host"])  # not in --impls

    text = md.read_text()
    assert text in out  # the tables on stdout, progress on stderr
    assert "| swiglu | halves | 96 x 40 | expertact in place |" in text and "### host cost" in text
    assert "repeat 2/2" in err and "repeat 2/2" not in out
    assert "USDT" not in out + err  # torch.profiler's markers (the CPU memory columns) are dropped


class _FakeDeepSpeed:
    """DeepSpeed's two kernels on the CPU, for the plumbing: a correct swiglu and a
    swiglu_packed that swaps gate and up (the correctness check must catch it)."""

    def __init__(self, device):
        self.version, self.loaded, self.reason = "0.0-test", "test", None
        self.kernels = {("swiglu", "separate"): lambda g, u: torch.nn.functional.silu(g) * u,
                        ("swiglu", "halves"): lambda gu: torch.nn.functional.silu(gu[..., 40:]) * gu[..., :40]}

    fn = peers.DeepSpeedKernels.fn
    why_not = peers.DeepSpeedKernels.why_not


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_peers_deepspeed_column(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers, "DeepSpeedKernels", _FakeDeepSpeed)
    js = tmp_path / "p.json"
    rc = cli.main(["--device", "cpu", *PEERS_ARGS, "--layouts", "separate,halves,interleaved", "--repeat", "1",
                     "--impls", "deepspeed,expertact", "--host-iters", "0", "--json", str(js)])
    assert rc == 1  # a peer that computes the wrong function fails the run
    data = json.loads(js.read_text())
    ds = {c["layout"]: c for c in data["cells"] if c["impl"] == "deepspeed"}
    assert set(ds) == {"separate", "halves"}  # DeepSpeed has no interleaved kernel
    assert ds["separate"]["check_ok"] and not ds["halves"]["check_ok"] and ds["halves"]["check_err"] > 0.1
    summary = {s["layout"]: s for s in data["summary"]}
    assert summary["separate"]["fastest_peer"] == "deepspeed" and summary["separate"]["deepspeed_status"] is None
    assert summary["halves"]["fastest_peer"] is None and summary["halves"]["target"] == "n/a"  # failed: no peer
    assert summary["interleaved"]["deepspeed_status"] == "n/a" and summary["interleaved"]["target"] == "n/a"
    assert data["host"] == []
    assert "FAILED the correctness check" in capsys.readouterr().err


def test_kineto_markers_dropped_other_lines_kept(capfd):
    with common.without_kineto_markers():
        os.write(2, b"USDT:2026-11-30 09:26:16 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                    b"ERROR: a real message\n"
                    b"USDT:2026-11-30 09:26:16 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    err = capfd.readouterr().err
    assert "profiler_st" not in err and "ERROR: a real message" in err
    # The profiler behind the CPU memory columns (kineto prints the markers on every profile).
    inp = common.Inputs("separate", 8, 16, torch.float32, torch.device("cpu"), 6.0)
    peak, kept = common.cpu_memory(activation.make_fn("eager", "swiglu", "separate", 1.702, 7.0), inp)
    assert peak > 0 and kept > 0
    assert "USDT" not in capfd.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_kernel_file_loads_without_deepspeeds_dependencies():
    """The fallback for a machine that has deepspeed but not everything its __init__ imports:
    the kernel file is loaded alone, and the process is left as it was (no deepspeed entry in
    sys.modules, os.environ unchanged)."""
    script = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("einops", "psutil", "msgpack", "hjson", "pydantic"):
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import os
import torch
from expertact.bench import hostcost, peers
import contextlib
try:  # what DeepSpeed's own __init__ does to os.environ before it fails is DeepSpeed's, not ours
    with contextlib.redirect_stdout(sys.stderr):  # its logger writes to stdout
        import deepspeed
except ImportError:
    pass
env = dict(os.environ)
ds = peers.DeepSpeedKernels(torch.device("cuda"))  # never touches a GPU: loading only
assert ds.loaded.startswith("swiglu_triton.py loaded alone"), ds.loaded
mod = ds.module
assert callable(mod.swiglu) and callable(mod.swiglu_packed)
assert "deepspeed" not in sys.modules and not [m for m in sys.modules if "triton_ops" in m or "_ds_" in m]
assert dict(os.environ) == env  # DS_ACCELERATOR only during the import
# The fallback alone (its imports of torch and triton done above) enters nothing in sys.modules.
before = dict(sys.modules)
again = hostcost.load_deepspeed_kernel_file()
assert callable(again.swiglu) and again is not mod
assert dict(sys.modules) == before
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@requires_cuda
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_bench_peers_cuda_deepspeed(tmp_path):
    """DeepSpeed's Triton kernels pass the check and get timed (no torch.compile: seconds, not minutes)."""
    js = tmp_path / "p.json"
    rc = cli.main(["--device", "cuda", "--peers", "--sizes", "512x256", "--presets", "swiglu",
                     "--layouts", "separate,halves", "--impls", "deepspeed,expertact,expertact-inplace",
                     "--iters", "3", "--host-iters", "20", "--json", str(js)])
    data = json.loads(js.read_text())
    assert rc == 0, data["meta"]["deepspeed_status"]
    ds = [c for c in data["cells"] if c["impl"] == "deepspeed"]
    assert len(ds) == 2 and all(c["check_ok"] and c["ms"] > 0 for c in ds)
    assert all(s["fastest_peer"] == "deepspeed" for s in data["summary"])
    assert all(r["fwd_us"] > 0 for r in data["host"] if r["impl"] == "deepspeed")


def test_python_m_expertact_bench_and_the_console_script_entry():
    """python -m expertact.bench runs expertact.bench.cli.main, the console script's entry point."""
    r = subprocess.run([sys.executable, "-m", "expertact.bench", "--help"], capture_output=True, text=True,
                       timeout=120, cwd="/tmp")
    assert r.returncode == 0 and "--peers" in r.stdout and "--mlp" in r.stdout, r.stderr
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        assert 'expertact-bench = "expertact.bench.cli:main"' in f.read()
    assert callable(cli.main)


def test_trace_summary_of_known_events():
    """expertact.bench.trace.summarise on events whose answer is known: overlapping kernels count
    once in the busy time, a user annotation on the GPU's timeline counts as no kernel, a gap of GAP_US or more is found with the runtime calls inside it (and
    a shorter one is not), GEMMs are told from other kernels, host calls are counted per step,
    and the idle time is the wall time less the busy time."""
    from types import SimpleNamespace as NS

    from expertact.bench import trace

    def ev(kind, name, a, b, annotation=False):
        return NS(device_type=NS(name=kind), name=name, time_range=NS(start=a, end=b), is_user_annotation=annotation)

    events = [ev("CUDA", "sm90_xmma_gemm_e4m3", 0, 100), ev("CUDA", "expertact::tiles_kernel", 50, 150),
              ev("CUDA", "sm90_xmma_gemm_e4m3", 160, 200),   # a 10 us gap: not counted
              ev("CUDA", "elementwise", 400, 500),           # a 200 us gap before it
              ev("CPU", "aten::_scaled_mm", 150, 390), ev("CPU", "cudaLaunchKernel", 250, 260),
              ev("CPU", "cudaStreamSynchronize", 300, 350), ev("CPU", "cudaLaunchKernel", 600, 610),
              ev("CPU", "aten::_scaled_mm", 590, 620),
              ev("CUDA", "Optimizer.step#AdamW.step", 150, 450, annotation=True)]  # a range, not a kernel
    s = trace.summarise(events, wall_s=1.09e-3, steps=2)
    assert s["busy_ms"] == pytest.approx((150 + 40 + 100) / 2e3)
    assert s["kernel_ms"] == pytest.approx((100 + 100 + 40 + 100) / 2e3)
    assert s["gemm_ms"] == pytest.approx(140 / 2e3)
    assert s["idle_ms"] == pytest.approx(0.545 - 290 / 2e3)
    assert s["gaps"]["count"] == 0.5 and s["gaps"]["ms"] == pytest.approx(200 / 2e3)
    assert s["gaps"]["largest"] == [(0.2, "sm90_xmma_gemm_e4m3", "elementwise")]
    assert s["gap_calls"] == pytest.approx({"cudaStreamSynchronize": 50 / 2e3, "cudaLaunchKernel": 10 / 2e3})
    assert s["host"]["torch._scaled_mm"] == pytest.approx([1.0, 270 / 2e3])
    assert s["host"]["kernel launches (cudaLaunchKernel)"] == pytest.approx([1.0, 20 / 2e3])
    assert s["kernels"][0][0] == "sm90_xmma_gemm_e4m3" and s["kernels"][0][2] == 1.0
    text = trace.report(s, "t")
    assert "GPU idle 0.40 ms" in text and "cudaStreamSynchronize 0.03" in text
