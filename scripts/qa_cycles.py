"""Inside the QKV-and-attention kernel (qkv.fuse 1) in the timed stack, in SM cycles: where its epilogue's time goes.

usage: python3 scripts/qa_cycles.py SHAPE VARIANT [VARIANT ...]   (variants as scripts/timeline.py's, @switches too)

trace_gemms.py stamps the kernel with %globaltimer, whose 0.25 us steps cannot split a 1 us epilogue. Here the kernel
runs with qkv_attn.TRACE_CYCLES: thread 0 of every CTA reads clock64 (its SM's cycle counter, so only differences
within a CTA mean anything) at the same six places, two more inside the epilogue and two inside the attention. Per
role (the Q CTAs of each row tile, the K and the V CTAs), medians over the CTAs of the middle layers, in cycles: the
K loop from the wait; the epilogue's LayerNorm factors (the row sums' parts added, the quad's shuffles, mean and
rstd); its first 8-column group (the folded LayerNorm, the bias, 2 stores); the other 7 groups; then, for a Q CTA,
the wait for K and V and the attention with the store, split into the first warpgroup's share of the keys, its wait
for the second's share (barrier B) and the merge with the store of O; for a K or V CTA, its push (the bulk copies'
issue and read; nothing with st.async).
"""

import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timeline import apply_switches, variant  # noqa: E402

from tuner.device import DeviceInfo  # noqa: E402
from tuner.kernels import qkv_attn  # noqa: E402
from tuner.layer import DecoderStack, random_stack_weights, stack_depth  # noqa: E402
from tuner.shapes import resolve  # noqa: E402
from tuner.timing import time_replay  # noqa: E402

STEPS = [  # (name, from slot, to slot)
    ("loop", 1, 2), ("LN factors", 2, 6), ("group 0", 6, 7), ("groups 1-7", 7, 3), ("wait K/V or push", 3, 4),
    ("attention+store", 4, 5), ("share 0", 4, 8), ("wait share 1", 8, 9), ("merge+store", 9, 5), ("wait to end", 1, 5)]
Q_ONLY = (8, 9)  # slots a K or V CTA does not stamp


def probe(shape, name):
    cfg = variant(shape, apply_switches(name))
    dev = DeviceInfo.from_torch()
    n = stack_depth(shape, 2, dev.l2_bytes)
    weights = random_stack_weights(shape, n, torch.float16, "cuda", 0)
    traces, order, geometry = {}, [], {}
    real = qkv_attn.launch
    qkv_attn.launch, qkv_attn.TRACE_CYCLES = qkv_attn.traced(real, traces, order, geometry), True
    try:
        st = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
        st.capture()
        t = time_replay(st.replay, n, reps=30, warmup=5).median_us
        st.replay()
        torch.cuda.synchronize()
    finally:
        qkv_attn.launch, qkv_attn.TRACE_CYCLES = real, False
    if not order:
        print(f"## {shape.name} {name}: no QKV-and-attention launch (qkv.fuse 0, or not a Hopper GPU)")
        return
    print(f"## {shape.name} {name}: {t:.2f} us/layer traced, {len(order)} launches of the kernel; cycles, medians")
    keys = order[1:-1] if len(order) > 2 else order  # the middle layers
    roles = {}
    for key in keys:
        tr = traces[key].cpu()
        per_rank = geometry[key]
        for prog in range(tr.shape[0]):
            rank = prog // per_rank
            role = "Q" if rank % 3 == 0 else ("K" if rank % 3 == 1 else "V")
            row = tr[prog].tolist()
            roles.setdefault(f"{role} t={rank // 3}", []).append(row)
    print("| CTAs | n | " + " | ".join(s[0] for s in STEPS) + " |")
    print("|---|---:|" + "---:|" * len(STEPS))
    for role in sorted(roles):
        rows = roles[role]
        q_only = lambda a, b: role[0] != "Q" and (a in Q_ONLY or b in Q_ONLY)  # noqa: E731
        cells = ["" if q_only(a, b) else str(statistics.median(r[b] - r[a] for r in rows)) for _, a, b in STEPS]
        print(f"| {role} | {len(rows)} | " + " | ".join(cells) + " |")


def main():
    shape = resolve(sys.argv[1])
    for name in sys.argv[2:]:
        probe(shape, name)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
