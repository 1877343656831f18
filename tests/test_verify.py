"""`tune verify`'s report (verify.md) from recorded verify.json files of H200 runs, and its launch census on the GPU
(the race checks themselves need the GPU too: tests/test_cluster_gemm.py, test_mlp_cluster.py, test_qkv_attn.py,
test_fused_layer.py, test_layer_cuda.py)."""

import json
from pathlib import Path

import pytest
import torch

from tuner.bench import hand_picked, hand_picked_fused
from tuner.layer import REDUCE, DecoderStack
from tuner.shapes import DecoderShape, resolve
from tuner.verify import format_report, launch_pdl_census, waits

RESULTS = Path(__file__).resolve().parent.parent / "results" / "verify" / "bert-large"


def _rows(report: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| configuration")]


def test_report_has_a_row_for_every_check_and_names_the_held_predecessor():
    res = json.loads((RESULTS / "20261127-071259" / "verify.json").read_text())  # session 36: 30 trials, held
    report = format_report(res, "tune verify: bert-large")
    rows = _rows(report)
    checks = sum(len((res if k == "races" else res[k])["races"]) for k in res if k not in ("config", "census"))
    assert len(rows) == checks == 10
    assert rows[0][:3] == ["hand-picked, norm kernels kept", "32 of 32", "qkv (1)"]
    held = [r for r in rows if r[2] == "ffn2 (1)"]
    assert len(held) == 3 and all(r[3] == "30 of 30" and r[4] == "0" and r[5] == "ffn1 (layer 1)" for r in held)
    assert "Every check caught its race, with no false alarm." in report and "held predecessor" in report


def test_report_names_what_was_not_caught_every_time():
    res = json.loads((RESULTS / "20261127-042050" / "verify.json").read_text())  # session 35: no hold, 16 and 19 of 30
    report = format_report(res, "tune verify: bert-large")
    assert "| ffn2 (1) | 16 of 30 | 0 | - |" in report and "| ffn2 (1) | 19 of 30 | 0 | - |" in report
    assert report.rstrip().endswith("Not caught every time, or a false alarm: split-K reduced in clusters (CUDA): "
                                    "ffn2; FFN2 in 128x128 tiles split 8 (clusters of 8): ffn2.")
    assert "held predecessor" not in report


def test_report_keeps_a_check_it_has_no_label_for():
    # cmd_verify names its checks; a new one that verify.CHECKED has no label for yet is reported under its key, not
    # dropped from verify.md
    res = json.loads((RESULTS / "20261127-071259" / "verify.json").read_text())
    res["new_check"] = res.pop("ffn2_split8")
    rows = _rows(format_report(res, "tune verify: bert-large"))
    assert len(rows) == 10 and rows[-1][0] == "new_check" and rows[-1][2] == "ffn2 (1)"


def test_held_predecessor_is_the_launch_before_or_none():
    # The stack's launch order decides what a race check holds: the previous launch, across layers; nothing for a
    # phase of the one-kernel layer (its racy variants are phases of one launch) or for the stack's first launch.
    from dataclasses import replace

    import torch

    from tuner.bench import hand_picked
    from tuner.config import DecoderConfig
    from tuner.layer import DecoderStack
    from tuner.shapes import DecoderShape
    from tuner.verify import held_predecessor

    odd = DecoderShape(1, 17, 32, 1, 90, name="odd")
    st = DecoderStack(odd, hand_picked(odd), n_layers=2, dtype=torch.float32, device="cpu", seed=1)
    first = next(st._layer_launches(faults=False))[:2]
    assert held_predecessor(st, *first) is None
    assert held_predecessor(st, 1, "ffn2") == (1, "ffn1") and held_predecessor(st, 1, first[1]) == (0, "ffn2")
    # a split-K reduction kernel waits for its own GEMM's K loops (the same launch of the stack)
    assert held_predecessor(st, 1, "ffn2" + REDUCE) == (1, "ffn2")
    fused = replace(DecoderConfig(), layer=replace(DecoderConfig().layer, fuse=1))
    st = DecoderStack(odd, fused, n_layers=2, dtype=torch.float32, device="cpu", seed=1)
    assert held_predecessor(st, 1, "layer") == (0, "layer") and held_predecessor(st, 1, "qkv") is None


def test_reduction_kernels_are_found_at_launch_where_a_gemm_splits_on_triton(device):
    # run_verify checks "<gemm>.reduce" after each checked GEMM and leaves it out where the launch raises
    # NoReduction: the hand-picked FFN2 (split 4) runs the Triton split-K reduction kernel, a QKV split 2 too; not a
    # GEMM that does not split, nor a phase of the one-kernel layer, nor a name that is no GEMM
    from dataclasses import replace

    from tuner.bench import hand_picked, hand_picked_fused
    from tuner.kernels.gemm import NoReduction
    from tuner.layer import layer_launches

    def launches_reduction(st, kernel):
        st.racy = (1, kernel + REDUCE)
        try:
            st.run()
            return True
        except NoReduction:
            return False
        finally:
            st.racy = None

    small = DecoderShape(1, 24, 64, 2, 256, name="small")
    hp = hand_picked(small)
    hp = replace(hp, ffn2=replace(hp.ffn2, block_k=64, split_k=4))  # (as the presets' hand-picked FFN2)
    st = DecoderStack(small, hp, n_layers=2, dtype=torch.float32, device=device, seed=1)
    assert [k for k in ("qkv", "out", "ffn1", "ffn2") if launches_reduction(st, k)] == ["ffn2"]
    with pytest.raises(NoReduction):  # (no GEMM: run_verify never asks it, layer_launches refuses it all the same)
        layer_launches(small, hp, st.weights[1], st.x, st.bufs[1], racy="attn" + REDUCE)
    st = DecoderStack(small, replace(hp, qkv=replace(hp.qkv, block_k=32, split_k=2)), n_layers=2,
                      dtype=torch.float32, device=device, seed=1)
    assert launches_reduction(st, "qkv")
    st = DecoderStack(small, hand_picked_fused(small), n_layers=2, dtype=torch.float32, device=device, seed=1)
    assert not launches_reduction(st, "ffn2")


@pytest.mark.gpu
def test_census_names_every_launch_and_whether_it_has_pdl():
    # The census maps each launch to its kernel and its PDL attribute: every launch named (a kernel it cannot find
    # would count as "unknown", without PDL), all with PDL at the hand-picked knobs and none with the knobs off; the
    # one-kernel layers as one launch a layer
    shape = resolve("bert-base")
    hp = hand_picked(shape, norms=0)
    for cfg, pdl in ((hp, True), (hp.without_knobs(), False), (hand_picked_fused(shape), True),
                     (hand_picked_fused(shape, cuda=True), True)):
        c = launch_pdl_census(DecoderStack(shape, cfg, n_layers=2, dtype=torch.float16))
        assert c["launches"] >= 2 and c["with_pdl"] == (c["launches"] if pdl else 0), (cfg.layer.fuse, c)
        assert not any(k.startswith("unknown") for k in c["by_kernel"]), c
        assert c["pdl_without_wait"] == [], c  # every Triton kernel launched with PDL has gdc_wait in its code
        if cfg.fused:
            assert c["launches"] == 2


@pytest.mark.gpu
def test_a_kernel_launched_with_pdl_that_never_waits_is_named():
    # The census reads each compiled kernel's PTX: a kernel launched with PDL and no griddepcontrol.wait (the chain
    # broken: its successor's wait covers only it) is named in verify.json and verify.md
    import triton
    import triton.language as tl

    @triton.jit
    def no_wait(x_ptr, USE_PDL: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)

    @triton.jit
    def with_wait(x_ptr, USE_PDL: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)

    x = torch.zeros(1, device="cuda")
    assert not waits(no_wait[(1,)](x, USE_PDL=True, launch_pdl=True))
    assert waits(with_wait[(1,)](x, USE_PDL=True, launch_pdl=True))
    res = json.loads((RESULTS / "20261127-071259" / "verify.json").read_text())
    assert "never waiting" not in format_report(res, "t")
    res["census"]["pdl_without_wait"] = ["no_wait"]
    assert "Launched with PDL but never waiting (no `griddepcontrol.wait` in the kernel's code): " \
           "hand-picked, norm kernels kept: no_wait." in format_report(res, "t")


@pytest.mark.parametrize("source", ["cluster_gemm", "mlp_cluster", "qkv_attn", "layer_kernel"])
def test_every_cuda_kernel_waits_in_its_compiled_code(source, tmp_path):
    # The census reads the Triton kernels' PTX (verify.waits); the CUDA kernels' launchers set the PDL attribute from
    # the knob, and their kernels must wait: every entry of each source's PTX (nvcc, default build) holds a
    # griddepcontrol.wait. Needs nvcc, not a GPU.
    import re
    import subprocess

    from tuner.kernels import _nvcc

    nvcc = _nvcc.nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc (the CUDA toolkit) to compile the kernels to PTX")
    ptx = tmp_path / f"{source}.ptx"
    r = subprocess.run([nvcc, "-ptx", *_nvcc.FLAGS, "-gencode=arch=compute_90a,code=compute_90a", "-o", str(ptx),
                        str(_nvcc.HERE / f"{source}.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    entries = re.split(r"(?m)^(?:\.visible\s+)?\.entry\s+", ptx.read_text())[1:]
    assert entries and all("griddepcontrol.wait" in e for e in entries), [e.split("(")[0] for e in entries]


@pytest.mark.gpu
def test_racy_split_k_reduction_is_caught_behind_its_held_gemm():
    # The hand-picked FFN2 splits K four ways on the Triton kernels: its reduction kernel, reading the partials before
    # its wait, is caught every time while FFN2's odd column tiles hold back their partials; never without the defect
    from tuner.verify import race_detection

    shape = resolve("bert-base")
    st = DecoderStack(shape, hand_picked(shape, norms=0), n_layers=3, dtype=torch.float16)
    r = race_detection(st, "ffn2" + REDUCE, layer=1, trials=10)
    assert r["slowed"] == "ffn2 (layer 1)" and r["false_alarms"] == 0 and r["caught"] == 10, r
    # the out-projection does not split there: its launch says it runs no reduction kernel, and the stack is left as
    # it was (run_verify then leaves that check out)
    from tuner.kernels.gemm import NoReduction

    with pytest.raises(NoReduction):
        race_detection(st, "out" + REDUCE, layer=1, trials=10)
    assert st.racy is None and st.slow is None
