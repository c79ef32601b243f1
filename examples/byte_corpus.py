"""The training text of the examples (autoep_train.py, megatron_moe.py): Python sources as byte
tokens (vocabulary 256), windows sampled from (seed, step) alone, so that every run,
implementation and launch of a config trains on the same batches.

Two corpora (CORPORA), each described by its files, bytes and sha256 in every result:
  stdlib           the standard library's own .py files (about 30 MB): the 300-step runs
  stdlib+packages  the same, then the .py files of the installed packages (site-packages), sorted,
                   cut at the first file that reaches CAP bytes: a text large enough that 1,000
                   steps of 65,536 tokens read it less than twice (the packages installed decide
                   its content: compare runs by its sha256)

A module beside the examples, not a copy in each: both import it from their own folder (each
puts that folder on sys.path first), so either still runs as `torchrun examples/<name>.py` with
nothing installed, and the two trainings read the same text by construction.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

VOCAB = 256  # byte tokens


CORPORA = ("stdlib", "stdlib+packages")
CAP = 128 << 20  # stdlib+packages' size: 1,000 steps x 65,536 tokens read it about 0.5 times


def corpus_files(name="stdlib"):
    """The corpus's files in their order: the standard library's .py files (not site-packages),
    sorted by path; for stdlib+packages then the .py files under the package directories
    (purelib, platlib), sorted by path, each file once."""
    paths = sysconfig.get_paths()
    root = Path(paths["stdlib"])
    skip = {"site-packages", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    if name == "stdlib+packages":
        seen = set()
        for key in ("purelib", "platlib"):
            pkg = Path(paths[key])
            if pkg.is_dir() and pkg not in seen:
                seen.add(pkg)
                files += sorted(pkg.rglob("*.py"))
    elif name != "stdlib":
        raise ValueError(f"byte_corpus.py: corpus {name!r} is not one of {CORPORA}")
    return root, files


def load_corpus(name="stdlib", cap=CAP):
    """The corpus `name` (CORPORA) joined by a NUL byte, stdlib+packages cut after the file that
    reaches `cap` bytes; returns (uint8 tensor, description: name, root, files, bytes, sha256 of
    the bytes)."""
    import torch
    root, files = corpus_files(name)
    parts, size, used = [], 0, 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:  # a broken link among the packages' files
            continue
        parts.append(b)
        size += len(b) + 1
        used += 1
        if name != "stdlib" and size >= cap:
            break
    data = b"\0".join(parts)
    if len(data) < 1 << 20:  # CPython's own sources are ~30 MB; a stripped install ships .pyc only
        raise SystemExit(f"byte_corpus.py: only {len(data)} bytes of .py sources under {root}")
    info = dict(name=name, root=str(root), files=used, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    if name != "stdlib":
        info["cap"] = cap
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
