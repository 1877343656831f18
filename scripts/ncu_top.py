"""The hottest SASS instructions of an ncu source page (stall samples, with their top reasons).

usage: ncu -i REPORT.ncu-rep --page source --csv --print-source cuda,sass > src.csv
       python3 scripts/ncu_top.py src.csv [N]
(The report from `ncu --section SourceCounters --import-source yes -o REPORT ...` of a -lineinfo build:
PDL_TUNE_NVCC_LINEINFO=1 for the package's CUDA kernels.)
"""
import csv
import sys
if len(sys.argv) < 2:
    sys.exit("usage: python3 scripts/ncu_top.py SRC.csv [N] (ncu's source page as CSV: see this file's docstring)")
try:
    rows = list(csv.reader(open(sys.argv[1])))
except (OSError, UnicodeDecodeError) as e:
    sys.exit(f"ncu_top.py: cannot read {sys.argv[1]} ({getattr(e, 'strerror', None) or type(e).__name__})")
hdr = None; path = None; recs = []
for r in rows:
    if not r: continue
    if r[0] == "File Path": path = r[1]; continue
    if r[0] in ("Function Name",): continue
    if r[0] == "Line No": hdr = r; continue
    if hdr is None: continue
    recs.append((path.split("/")[-1], r[0], r[2], r[3], dict(zip(hdr[4:], r[4:]))))
def num(x):
    try: return float(x)
    except: return 0.0
stall_cols = [c for c in hdr if c.startswith("stall_") and "Not Issued" not in c]
byaddr = {}
for f, ln, addr, sass, d in recs:
    try:
        a = int(addr, 16)
    except ValueError:
        continue
    if a in byaddr: continue
    byaddr[a] = (num(d.get("Warp Stall Sampling (All Samples)")), num(d.get("Instructions Executed")), sass, f, ln,
                 {c[6:]: num(d.get(c)) for c in stall_cols})
tot = sum(v[0] for v in byaddr.values())
print(len(byaddr), "instructions; samples", tot)
N = int(sys.argv[2]) if len(sys.argv) > 2 else 30
for a, (s, ex, sass, f, ln, rs) in sorted(byaddr.items(), key=lambda kv: -kv[1][0])[:N]:
    t = ", ".join(f"{k} {int(v)}" for k, v in sorted(rs.items(), key=lambda kv: -kv[1])[:3] if v)
    print(f"{a:#07x} {int(s):5d} {100*s/tot:4.1f}% exec {int(ex):6d} {sass[:58]:58s} {f}:{ln} [{t}]")
