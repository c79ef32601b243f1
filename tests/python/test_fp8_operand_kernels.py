"""bench/fp8_operand_kernels.py on the CPU: its byte counts are those of the blockwise node's table
in docs/notes/fp8-recipes.md (96.3 GB at the busiest rank's shape), the rowwise passes move more
(a second read of dy, the bf16 dgate_up written and read again), and the script runs every pass
of both recipes through expertact.fp8 at a small shape and writes its table, with gate_up's bias
too (--bias: the GLU passes' calls take it)."""
import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fp8_operand_kernels.py"
spec = importlib.util.spec_from_file_location("fp8_operand_kernels", SCRIPT)
ops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ops)


def test_the_bytes_are_the_notes_table():
    t = ops.traffic(4 * 261280, 3072, 3072)
    gb = {k: (b / 1e9, r / 1e9) for k, (b, r) in t.items()}
    assert [round(b, 1) for b, _ in gb.values()] == [9.6, 16.1, 12.8, 16.1, 32.1, 9.6]
    assert round(sum(b for b, _ in gb.values()), 1) == 96.3
    assert round(gb["dy's operands"][1], 1) == 19.3 and round(gb["dgate_up's operands"][1], 1) == 57.8
    assert all(r >= b for b, r in gb.values()) and round(sum(r for _, r in gb.values()), 1) == 128.4


def test_every_pass_runs_on_the_cpu(tmp_path, capsys):
    md = tmp_path / "ops.md"
    assert ops.main(["--shape", "2,256,128,256", "--device", "cpu", "--markdown", str(md)]) == 0
    rows = [line for line in md.read_text().splitlines() if line.startswith("| ") and not line.startswith("| pass")]
    weights = ["gate_up's B (forward)", "y's B (forward)", "dh's B (backward)", "dx's B (backward)", "all four"]
    assert [r.split(" | ")[0][2:] for r in rows] == list(ops.traffic(1, 1, 1)) + ["all six", "the weights' blocks"] \
        + weights
    kinds = [r.split(" | ")[1] for r in rows[-5:-1]]
    assert kinds == ["transposed", "transposed", "rows contiguous", "rows contiguous"]  # as the node reads them
    assert "CPU (reference path" in md.read_text() and md.read_text() in capsys.readouterr().out + "\n"


def test_every_pass_runs_with_a_bias(tmp_path):
    md = tmp_path / "ops.md"
    assert ops.main(["--shape", "2,256,128,256", "--device", "cpu", "--bias", "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "gate_up with a bias" in text and "--shape 2,256,128,256 --bias`" in text
    assert text.count("\n| ") == 14  # the header, six passes and the total; the weights' header, four and total


def test_the_bias_reaches_every_glu_call(monkeypatch):
    """Each call that reads gate_up gets the bias (and its rows where the call needs them); the
    passes on x and dy do not."""
    import torch
    seen = {}

    def spy(name, fn):
        def call(*a, **kw):
            seen.setdefault(name, []).append(kw.get("bias"))
            return fn(*a, **kw)
        return call

    for name in ("glu_rowwise", "glu_row_tiles", "glu_colwise_grouped", "glu_column_tiles_grouped",
                 "glu_backward_rowwise", "glu_backward_tiles", "quantize_rowwise", "quantize_row_tiles",
                 "quantize_column_tiles_grouped", "quantize_colwise_grouped"):
        monkeypatch.setattr(ops.xf, name, spy(name, getattr(ops.xf, name)))
    T, D, F, E = 256, 128, 256, 2
    x, gu, dy, dh = (torch.randn(T, n, dtype=torch.bfloat16) for n in (D, 2 * F, D, F))
    offs = torch.tensor([128, 256], dtype=torch.int32)
    bias = torch.randn(E, 2 * F, dtype=torch.bfloat16)
    for block, row in ops.calls(x, gu, dy, dh, offs, offs.tolist(), bias).values():
        block(), row()
    for name, got in seen.items():
        assert all((b is bias) == name.startswith("glu") for b in got), name
