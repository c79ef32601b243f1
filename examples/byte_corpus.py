"""The training text of the examples (autoep_train.py, megatron_moe.py): the Python standard
library's own .py files as byte tokens (vocabulary 256), windows sampled from (seed, step) alone,
so that every run, implementation and launch of a config trains on the same batches.

A module beside the examples, not a copy in each: both import it from their own folder (each
puts that folder on sys.path first), so either still runs as `torchrun examples/<name>.py` with
nothing installed, and the two trainings read the same text by construction.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

VOCAB = 256  # byte tokens


def load_corpus():
    """All .py files under the standard library (not site-packages), sorted by path, joined by
    a NUL byte; returns (uint8 tensor, description: root, files, bytes, sha256 of the bytes)."""
    import torch
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    data = b"\0".join(p.read_bytes() for p in files)
    if len(data) < 1 << 20:  # CPython's own sources are ~30 MB; a stripped install ships .pyc only
        raise SystemExit(f"byte_corpus.py: only {len(data)} bytes of .py sources under {root}")
    info = dict(root=str(root), files=len(files), bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), info


def window_starts(n_bytes, step, seed, count, seq):
    """The offsets of step `step`'s `count` windows of `seq` bytes: drawn from (seed, step) alone."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_bytes - seq, (count, ), generator=g)


def make_batch(corpus, step, seed, rank, world, micro_batch, seq):
    """This rank's [micro_batch, seq] token ids of step `step`: the global batch of world x
    micro_batch windows at random offsets drawn from (seed, step) alone, so every run and every
    impl sees the same batches; rank r takes rows r*micro_batch .. (r+1)*micro_batch."""
    import torch
    starts = window_starts(corpus.numel(), step, seed, world * micro_batch, seq)
    mine = starts[rank * micro_batch:(rank + 1) * micro_batch]
    return corpus[mine[:, None] + torch.arange(seq)].long()


def batches_sha256(n_bytes, steps, seed, count, seq):
    """sha256 of every window offset of steps 0 .. steps-1 (count windows of seq bytes a step):
    with the corpus's sha256, what a rerun must match to train on the same batches."""
    h = hashlib.sha256()
    for step in range(steps):
        h.update(window_starts(n_bytes, step, seed, count, seq).numpy().tobytes())
    return h.hexdigest()
