"""The FP8 quantisation of every recipe written in plain torch, the oracle the kernels' tests
compare bytes and scales against (docs/notes/fp8-recipes.md, "The blockwise operand formats").

One scale function for every tile shape: torchao's power-of-two scale of the tile's amax
(NaN ignored), s = 2^floor(log2(float32(448 / float64(max(amax, 1e-12))))), q =
e4m3fn(clamp(v * s, -448, 448)), dequantisation scale 1 / s. A tile is a whole row (rowwise),
1 x 128 (row tiles), 128 x 128 (weight blocks) or 128 x 1 over one expert's rows (column
tiles); partial tiles at the edges take what is there.
"""
import torch

TILE = 128


def pow2_scale(amax):
    """(s, 1 / s) from a float32 amax tensor: s multiplies before the cast, 1 / s dequantises."""
    a = torch.clamp(amax.float(), min=torch.tensor(1e-12, dtype=torch.float32))
    s = (448.0 / a.double()).float()
    # 2^floor(log2(s)) from s's exponent (frexp: s = m 2^e, m in [0.5, 1)); float32 log2 rounds
    # up to the next integer for s within about 2^-24 k of 2^k from below (k >= 4)
    _, e = torch.frexp(s)
    s = torch.where(s > 0, torch.ldexp(torch.ones_like(s), e - 1), s)
    return s, 1.0 / s


def bits(q):
    """q's bytes, NaN written 0x7f: the library does not keep a NaN's sign (src/core/fp8.h)."""
    b = q.view(torch.uint8)
    return torch.where(b == 0xFF, torch.full_like(b, 0x7F), b)


def quantize_tiles(t, tile_rows, tile_cols):
    """t [R, C] (any float dtype) in tiles of tile_rows x tile_cols (None: the whole dim):
    (q float8_e4m3fn [R, C], scale float32 [ceil(R / tile_rows), ceil(C / tile_cols)])."""
    v = t.float()
    R, C = v.shape
    tr, tc = tile_rows or max(R, 1), tile_cols or max(C, 1)
    RB, CB = -(-R // tr), -(-C // tc)
    mag = torch.where(torch.isnan(v), torch.zeros_like(v), v.abs())
    padded = torch.zeros(RB * tr, CB * tc, dtype=torch.float32)
    padded[:R, :C] = mag
    amax = padded.reshape(RB, tr, CB, tc).amax(dim=(1, 3))
    s, inv = pow2_scale(amax)
    s_full = s.repeat_interleave(tr, 0).repeat_interleave(tc, 1)[:R, :C]
    q = torch.clamp(v * s_full, -448.0, 448.0).to(torch.float8_e4m3fn)
    return q, inv


def rowwise(t):
    """torchao's rowwise recipe: t [..., C] -> (q [..., C], scale [...])."""
    flat = t.reshape(-1, t.shape[-1])
    q, inv = quantize_tiles(flat, 1, None)
    return q.reshape(t.shape), inv.reshape(t.shape[:-1])


def row_tiles(t):
    """1 x 128 tiles: t [T, C] -> (q [T, C], scale [T, ceil(C / 128)])."""
    return quantize_tiles(t, 1, TILE)


def blocks(w):
    """128 x 128 blocks per expert: w [E, R, C] -> (q [E, R, C], scale [E, ceil(R/128), ceil(C/128)])."""
    out = [quantize_tiles(w[e], TILE, TILE) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in out]), torch.stack([s for _, s in out])


def padded_ends(ends, pad=TILE):
    """The experts' cumulative end rows once each expert's rows are padded to a multiple of pad."""
    out, prev, acc = [], 0, 0
    for end in ends:
        acc += -(-(end - prev) // pad) * pad
        out.append(acc)
        prev = end
    return out


def column_tiles(t, ends):
    """128 x 1 tiles over each expert's rows (rows sorted by expert, ends: cumulative end rows),
    each expert padded to a multiple of 128 rows with zeros, rows past ends[-1] left out:
    (q_t float8_e4m3fn [C, Tp], scale float32 [Tp / 128, C])."""
    C = t.shape[1]
    qs, ss, start = [], [], 0
    for end in ends:
        n = end - start
        if n:
            npad = -(-n // TILE) * TILE
            blk = torch.zeros(npad, C, dtype=torch.float32)
            blk[:n] = t[start:end].float()
            q, inv = quantize_tiles(blk, TILE, 1)
            qs.append(q)
            ss.append(inv)
        start = end
    if not qs:
        return torch.empty(C, 0, dtype=torch.float8_e4m3fn), torch.empty(0, C)
    return torch.cat(qs).t().contiguous(), torch.cat(ss)


def dequantize(q, scale, tile_rows, tile_cols):
    """q [R, C] with its tile scales -> float64 [R, C] (q * scale exactly)."""
    R, C = q.shape
    tr, tc = tile_rows or max(R, 1), tile_cols or max(C, 1)
    full = scale.double().repeat_interleave(tr, 0).repeat_interleave(tc, 1)[:R, :C]
    return q.double() * full
