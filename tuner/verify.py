"""`tune verify`: evidence that the PDL chain is real and that the correctness gate can fail.

1. Which kernels were launched with PDL: a Triton launch hook records the CUfunction of every launch of
   one stack run; each is mapped to its compiled kernel's ``metadata.launch_pdl`` (what Triton passes to
   cuLaunchKernelEx as CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION).
2. Race detection: a test-only variant of one kernel reads its input before gdc_wait; the check (fresh
   inputs, buffers poisoned with NaN) runs N times and we count how often it catches the race. The
   same config without the defect must pass every time. Where the kernel's predecessor is a GEMM (the Triton or
   the cluster kernel), its odd column tiles hold their stores back (``DecoderStack.slow``) in both runs: a racy
   read then finds poisoned input even where the dependent's CTAs only get SMs as the predecessor's programs retire
   (clustered launches), and the correct kernel must still wait for all of it.
"""

from __future__ import annotations

import collections

import torch
import triton

from tuner.config import GEMMS, DecoderConfig
from tuner.kernels.gemm import NoReduction, NotSlowable
from tuner.layer import REDUCE, SLOW_NS, DecoderStack


def _jit_functions():
    """The Triton kernels of every loaded module of tuner.kernels (a stack can launch no other; a kernel missing here
    would be counted as an unknown launch without PDL)."""
    import sys

    out = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("tuner.kernels.") and mod is not None:
            out += [v for v in vars(mod).values() if isinstance(v, triton.runtime.jit.JITFunction)]
    return out


def launch_pdl_census(stack: DecoderStack) -> dict:
    """Run the stack once (eagerly) and count launches with and without the PDL attribute per kernel."""
    stack.run()  # compile everything first
    torch.cuda.synchronize()
    fn_pdl, no_wait = {}, set()
    for jf in _jit_functions():
        for cache in jf.device_caches.values():
            for k in cache[0].values():
                fn_pdl[k.function] = (k.name, bool(k.metadata.launch_pdl))
                if k.metadata.launch_pdl and not waits(k):
                    no_wait.add(k.function)
    launched = []
    # The CUDA kernel of cluster_gemm.cu is launched through ctypes, not Triton's launcher: its own hook names it
    # and whether it was launched with PDL.
    from tuner.kernels import cluster_gemm, layer_cuda, mlp_cluster, qkv_attn

    old = triton.knobs.runtime.launch_enter_hook
    triton.knobs.runtime.launch_enter_hook = lambda md: launched.append(md.get()["function"])
    cluster_gemm.launch_enter_hook = layer_cuda.launch_enter_hook = mlp_cluster.launch_enter_hook = (
        qkv_attn.launch_enter_hook) = lambda name, pdl: launched.append((name, pdl))
    try:
        stack.run()
    finally:
        triton.knobs.runtime.launch_enter_hook = old
        cluster_gemm.launch_enter_hook = layer_cuda.launch_enter_hook = mlp_cluster.launch_enter_hook = (
            qkv_attn.launch_enter_hook) = None
    torch.cuda.synchronize()
    census = collections.Counter()
    unsynced = sorted({fn_pdl[f][0] for f in launched if f in no_wait})
    for f in launched:
        name, pdl = f if isinstance(f, tuple) else fn_pdl.get(f, ("unknown", False))
        census[(name, pdl)] += 1
    total = len(launched)
    with_pdl = sum(n for (_, p), n in census.items() if p)
    return {"launches": total, "with_pdl": with_pdl,
            "by_kernel": {f"{name} pdl={p}": n for (name, p), n in sorted(census.items())},
            "pdl_without_wait": unsynced}


def waits(kernel) -> bool:
    """Whether a compiled Triton kernel's code holds ``griddepcontrol.wait`` (gdc_wait). Launched with PDL it must:
    it may start before its predecessor ends, and a successor's wait covers only this kernel, so one that never
    waits breaks the chain even where it reads nothing of its predecessor's. (The CUDA kernels wait unconditionally
    in their source.)"""
    return "griddepcontrol.wait" in kernel.asm.get("ptx", "")


def held_predecessor(stack: DecoderStack, layer: int, kernel: str) -> tuple[int, str] | None:
    """The launch that ``kernel`` of ``layer`` waits for, to be held in its race checks; None where the racy kernel is
    no launch of its own (a phase of the one-kernel layer) or is the stack's first. Whether the predecessor has a held
    variant is found when the stack is captured (``NotSlowable``)."""
    try:
        return stack.predecessor(layer, kernel)
    except ValueError:
        return None


def race_detection(stack: DecoderStack, kernel: str, layer: int, trials: int, seed0: int = 1000,
                   slow: bool = True) -> dict:
    """How often the check catches ``kernel``'s racy variant in ``layer`` (``caught`` of ``trials``), and how often
    it fails the same stack without the defect (``false_alarms``). ``slow``: with the predecessor's stores held
    back where it is a GEMM (gemm.linear's Triton or cluster kernel); ``slowed`` names the predecessor held back, or is
    None."""
    pred = held_predecessor(stack, layer, kernel) if slow else None
    stack.slow = pred
    stack.racy = (layer, kernel)
    try:
        try:
            stack.capture()  # (its eager warm-up raises NotSlowable or NoReduction before the graph capture starts)
        except NotSlowable:
            stack.slow = pred = None
            stack.capture()
        caught = sum(stack.check(seed0 + t, layers=[layer]) > stack.tolerance() for t in range(trials))
        stack.racy = None
        stack.capture()
        false_alarms = sum(stack.check(seed0 + t, layers=[layer]) > stack.tolerance() for t in range(trials))
    finally:
        stack.racy = stack.slow = None
    return {"kernel": kernel, "layer": layer, "trials": trials, "caught": caught, "false_alarms": false_alarms,
            "slowed": f"{pred[1]} (layer {pred[0]})" if pred else None}


def run_verify(shape, cfg: DecoderConfig, *, dtype=torch.float16, n_layers: int = 4, race_trials: int = 20,
               racy_kernels=("qkv", "attn", "out", "norm2", "ffn1", "ffn2")) -> dict:
    stack = DecoderStack(shape, cfg, n_layers=n_layers, dtype=dtype)
    if cfg.fused:  # the one-kernel layer's racy variants are phases of its one launch: every phase of the CUDA
        # kernel (fuse 2 on Hopper; layer_cuda.PHASES), the QKV phase of the Triton one (the only read behind gdc_wait)
        from tuner.kernels import layer_cuda

        racy_kernels = layer_cuda.PHASES if stack.bufs[0].fused.cuda else ("qkv",)
    if stack.bufs[0].mlp:  # the feed-forward block is one kernel, launched as FFN1: FFN2 has no launch of its own,
        # nor the out-projection with out.fuse 1, nor the attention with attn.fuse 1
        gone = ("ffn2",) + (("out",) if stack.bufs[0].mlp_out else ()) + (("attn",) if stack.bufs[0].mlp_attn else ())
        racy_kernels = tuple(k for k in racy_kernels if k not in gone) + (() if "ffn1" in racy_kernels else ("ffn1",))
    if stack.bufs[0].qkv_attn:  # the attention computed by QKV's kernel (qkv.fuse 1; from layer 1 on with norm1.fuse 2)
        racy_kernels = tuple(k for k in racy_kernels if k != "attn")
    # and the split-K reduction kernel after each checked GEMM, where the GEMM launches one (split_k > 1 on the
    # Triton kernels): the launch says so when the stack is captured, as NoReduction where it launches none
    racy_kernels = tuple(r for k in racy_kernels for r in ((k, k + REDUCE) if k in GEMMS else (k,)))
    out = {"config": cfg.to_dict(), "census": launch_pdl_census(stack), "races": []}
    for k in racy_kernels:
        try:
            out["races"].append(race_detection(stack, k, layer=1, trials=race_trials))
        except NoReduction:
            continue
    return out


# What each checked configuration of `tune verify` is (cmd_verify's keys; "races": the hand-picked one).
CHECKED = {"races": "hand-picked, norm kernels kept", "clustered": "split-K reduced in clusters (CUDA)",
           "ffn2_split8": "FFN2 in 128x128 tiles split 8 (clusters of 8)", "mlp": "feed-forward block as one kernel",
           "mlp_out": "block with the out-projection", "mlp_attn": "block with the out-projection and the attention",
           "qkv_attn": "QKV and the attention in one kernel", "layer": "the layer as one Triton kernel",
           "layer_cuda": "the layer as one CUDA kernel"}


def format_report(res: dict, title: str) -> str:
    """verify.json's result as markdown: each checked stack's PDL census and its race checks, one row a racy kernel."""
    lines = [f"# {title}", "", "| configuration | launches with PDL | racy kernel (layer) | caught | false alarms | "
             "predecessor held |", "|---|---:|---|---:|---:|---|"]
    missed, held, unsynced = [], False, []
    # every checked configuration, in CHECKED's order; one that CHECKED has no label for yet under its key
    keys = list(CHECKED) + [k for k, v in res.items() if k not in CHECKED and isinstance(v, dict) and "races" in v]
    for key in keys:
        part = res if key == "races" else res.get(key)
        if not part:
            continue
        label = CHECKED.get(key, key)
        held = held or any(r.get("slowed") for r in part["races"])
        c = part["census"]
        pdl = f"{c['with_pdl']} of {c['launches']}"
        unsynced += [f"{label}: {name}" for name in c.get("pdl_without_wait", [])]  # (older verify.json: not counted)
        for i, r in enumerate(part["races"]):
            first = (label, pdl) if i == 0 else ("", "")
            lines.append(f"| {first[0]} | {first[1]} | {r['kernel']} ({r['layer']}) | {r['caught']} of {r['trials']} | "
                         f"{r['false_alarms']} | {r.get('slowed') or '-'} |")
            if r["caught"] < r["trials"] or r["false_alarms"]:
                missed.append(f"{label}: {r['kernel']}")
    lines += ["", "A racy kernel reads its input before `griddepcontrol.wait`; the check runs the stack on fresh "
              "inputs with every buffer poisoned. The same stack without the defect must never fail (false alarms)."
              + (f" A held predecessor (a GEMM) kept its odd column tiles' stores back {SLOW_NS // 1000} us in "
                 "both runs." if held else ""),
              "", "Every check caught its race, with no false alarm." if not missed else
              "Not caught every time, or a false alarm: " + "; ".join(missed) + "."]
    if unsynced:
        lines += ["", "Launched with PDL but never waiting (no `griddepcontrol.wait` in the kernel's code): "
                  + "; ".join(unsynced) + "."]
    return "\n".join(lines) + "\n"
