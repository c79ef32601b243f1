# Summarise `ncu --page source --print-source sass --csv` output: per opcode, hottest instructions.
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hdr_i = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
hdr = [c.strip() for c in rows[hdr_i]]
src = hdr.index("Source")
def col(*names):
    for n in names:
        for i, h in enumerate(hdr):
            if h.startswith(n):
                return i
    return None
ex = col("Instructions Executed", "Warp Instructions Executed")
st = col("Warp Stall Sampling (All Samples)", "Warp Stall Sampling")
print("columns:", [h for h in hdr][:40])
def num(x):
    try: return float(x.replace(",", ""))
    except Exception: return 0.0
ops = collections.Counter(); stalls = collections.Counter(); tot_e = tot_s = 0; body = []
for r in rows[hdr_i + 1:]:
    if len(r) <= max(src, ex or 0, st or 0): continue
    s = r[src].strip(); toks = s.split()
    if not toks: continue
    op = toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]
    op = op.split(".")[0]
    e = num(r[ex]) if ex is not None else 0; k = num(r[st]) if st is not None else 0
    ops[op] += e; stalls[op] += k; tot_e += e; tot_s += k; body.append((k, e, s))
print(f"{tot_e:.0f} warp instructions, {tot_s:.0f} stall samples")
for op, e in ops.most_common(25):
    print(f"  {op:10s} {100*e/max(tot_e,1):5.1f}% of instructions {100*stalls[op]/max(tot_s,1):5.1f}% of stall samples")
print("hottest:")
for k, e, s in sorted(body, reverse=True)[:30]:
    print(f"  {100*k/max(tot_s,1):5.1f}%  exec {e:10.0f}  {s}")
