"""The differential fuzzer (support/fuzz.py) in CI: a fixed number of CPU problems from seed 0
(and a short time-bounded CUDA run where there is a GPU), plus checks that the fuzzer's checks
can fail and that its draws reach every CUDA dispatch path.

The CPU run is a fixed count, so that its coverage does not depend on the machine's load:
1,500 problems (seeds 0..1499) take about 40 s on a CPU shared with other work
(EXPERTACT_FUZZ_PROBLEMS overrides the count). The GPU runs take a time budget
(EXPERTACT_FUZZ_CUDA_SECONDS here; scripts/reliability_gpu.sh for the long ones)."""
import os

import pytest
import torch

from conftest import requires_cuda
from support import fuzz

CPU_PROBLEMS = int(os.environ.get("EXPERTACT_FUZZ_PROBLEMS", "1500"))


def _report(capsys, st):
    with capsys.disabled():
        print("\n" + st.summary())


def test_fuzz_cpu(capsys):
    st = fuzz.run(device="cpu", seed=0, count=CPU_PROBLEMS, log=print)
    _report(capsys, st)
    assert st.problems == CPU_PROBLEMS
    assert st.failed == 0, st.summary()


@requires_cuda
def test_fuzz_cuda(capsys):
    # EXPERTACT_FUZZ_KINDS (comma-separated, e.g. "glu"): only those problem kinds (scripts/sanitize.sh
    # leaves out the expert MLP under the tools that trip over torch's grouped-GEMM kernels).
    kinds = [k for k in os.environ.get("EXPERTACT_FUZZ_KINDS", "").split(",") if k] or None
    st = fuzz.run(device="cuda", seed=1_000_000, seconds=float(os.environ.get("EXPERTACT_FUZZ_CUDA_SECONDS", "20")),
                  kinds=kinds, log=print)
    _report(capsys, st)
    assert st.failed == 0 and not st.aborted, st.summary()


def _run(count, seed=500):
    """A short CPU run; its failures are returned, not asserted."""
    lines = []
    st = fuzz.run(device="cpu", seed=seed, count=count, kinds=["glu"], log=lines.append)
    return st, "\n".join(lines)


def _nonempty(seeds):
    ctx = fuzz.Context("cpu", 1 << 17, 0.0)
    return sum(1 for s in seeds if fuzz.draw_glu(s, ctx).rows * fuzz.draw_glu(s, ctx).F > 0)


def test_catches_a_wrong_parameter(monkeypatch):
    """An oracle with alpha 1% and beta 0.01 off is told apart from the library in every
    problem that has elements, and each failure prints its repro command."""
    real = fuzz.reference_grads

    def off(params, *a, **kw):
        act, alpha, limit, beta = params
        return real((act, alpha * 1.01, limit, beta + 0.01), *a, **kw)

    monkeypatch.setattr(fuzz, "reference_grads", off)
    st, log = _run(12)
    assert st.failed == _nonempty(range(500, 512)) > 0, log
    assert log.count("repro: python tests/python/support/fuzz.py --device cpu --seed") == st.failed


def test_catches_an_unwritten_element(monkeypatch):
    """A forward that leaves the last element of its output alone (the poison stays) fails the
    two-poison check."""
    real = fuzz.Raw.forward

    def skip_last(self, x, up, w, out):
        last = tuple(d - 1 for d in out.shape)
        old = out[last].clone() if out.numel() else None
        real(self, x, up, w, out)
        if old is not None:
            out[last] = old

    monkeypatch.setattr(fuzz.Raw, "forward", skip_last)
    st, log = _run(8)
    assert st.failed == _nonempty(range(500, 508)) > 0 and "every element written" in log, log


def test_catches_a_write_outside_the_output(monkeypatch):
    """A backward that also writes the element before its gradient view fails the guard check."""
    real = fuzz.Raw.backward
    spilled = []

    def spill(self, dy, x, up, w, gx, gu, gw):
        real(self, dy, x, up, w, gx, gu, gw)
        if gx is not x and gx.numel() and gx.storage_offset() > 0:
            gx.as_strided((1,), (1,), gx.storage_offset() - 1).fill_(0)
            spilled.append(1)

    monkeypatch.setattr(fuzz.Raw, "backward", spill)
    st, log = _run(16)
    assert spilled and st.failed >= len(spilled) // 2 > 0 and "nothing written outside the gradients" in log, log


def test_draws_reach_every_cuda_path():
    """Over the draws of a GPU run (big problems included), the mirror of glu_launch.cuh's choice
    counts every kernel family with each launch shape: 16-, 8- and 4-byte packs, the realigning
    kernels, merged rows, column splits, one tile a row, and rows filling the GPU."""
    # EXPERTACT_CUDA_KERNEL=rows: the row kernels take every call they can
    ctx = fuzz.Context(device="cpu", cap=1 << 22, big_fraction=0.0, kernel="rows")
    big = fuzz.Context(device="cpu", cap=1 << 22, big_fraction=1.0, kernel="rows")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensor ops only: torch's threads cost more than they give
    try:
        for s in range(1500):
            fuzz.tally_glu(fuzz.draw_glu(s, ctx), ctx)
        for s in range(30):
            fuzz.tally_glu(fuzz.draw_glu(s, big), ctx)
    finally:
        torch.set_num_threads(threads)
    got = {k for k in ctx.paths if k}
    want = {f"{d} {k} {g}" for d in ("fwd", "bwd") for k in ("pack16B", "pack8B", "pack4B", "realign")
            for g in ("split", "tile", "rows")}
    want |= {f"{d} {k} merged split" for d in ("fwd", "bwd") for k in ("pack16B", "realign")}
    missing = sorted(want - got)
    assert not missing, f"never drawn: {missing}; drawn: {sorted(got)}"
    # EXPERTACT_CUDA_KERNEL=flat (main's launcher): the flat kernels, merged rows or not, and
    # still the row kernels for weight gradients
    flat = fuzz.Context(device="cpu", cap=1 << 22, big_fraction=0.0, kernel="flat")
    torch.set_num_threads(1)
    try:
        for s in range(600):
            fuzz.tally_glu(fuzz.draw_glu(s, flat), flat)
    finally:
        torch.set_num_threads(threads)
    want = {f"{d} flat{m}" for d in ("fwd", "bwd") for m in ("", " merged")} | {"bwd pack16B rows"}
    missing = sorted(want - set(flat.paths))
    assert not missing, f"never drawn: {missing}; drawn: {sorted(k for k in flat.paths if k)}"


def test_repro_is_deterministic():
    a = fuzz.draw_glu(1234, fuzz.Context("cpu", 1 << 17, 0.0))
    b = fuzz.draw_glu(1234, fuzz.Context("cpu", 1 << 17, 0.0))
    assert a.describe() == b.describe()
    da, db = fuzz.make_data(a, "cpu"), fuzz.make_data(b, "cpu")
    assert torch.equal(da.x.nan_to_num(), db.x.nan_to_num()) and torch.equal(da.dy, db.dy)


@pytest.mark.parametrize("dtype", fuzz.DTYPES, ids=str)
def test_special_values_sit_at_the_limit(dtype):
    """+-limit and its neighbours in the dtype: the largest value <= limit, the smallest >= it."""
    p = fuzz.draw_glu(3, fuzz.Context("cpu", 1 << 10, 0.0))
    for limit in (7.0, fuzz.f32(6.1234)):
        p.limit, p.dtype = limit, dtype
        vals = sorted(v for v in fuzz.special_values(p) if v == v and 0 < v < float("inf"))
        lo = max(v for v in vals if v <= limit)
        hi = min(v for v in vals if v >= limit)
        t = torch.tensor([lo, hi], dtype=torch.float64).to(dtype).double().tolist()
        assert t == [lo, hi]  # exact in the dtype
        assert lo <= limit <= hi and (lo == limit) == (hi == limit) or lo < limit < hi
        nxt = fuzz._neighbours(hi * (1 + 1e-7), dtype)[1]
        assert nxt > hi
