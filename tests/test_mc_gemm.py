"""The multicast CUDA GEMM (kernels/mc_gemm.cu, ``GemmConfig.mc``): its validity rules and the CPU fallback run
everywhere; the kernel itself only on a Hopper GPU (pytest -m gpu)."""

from dataclasses import replace

import pytest
import torch

from tuner.device import DeviceInfo
from tuner.kernels._common import REL_TOLERANCE, rel_error
from tuner.kernels.gemm import GemmConfig, GemmProblem, check, fold_layernorm, linear, linear_ref, stats_parts

MC = GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2, tma=1, mc=2)
HOPPER = DeviceInfo("H200", (9, 0), 132, 60 << 20, 232448)
AMPERE = DeviceInfo("A100", (8, 0), 108, 40 << 20, 166912)


def _inputs(m, n, k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) / k**0.5).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    r = torch.randn(m, n, generator=g).to(dtype).to(device)
    return x, w, b, r


@pytest.mark.parametrize("cfg, problem, needle", [
    (replace(MC, mc=3), GemmProblem(128, 256, 256), "mc=3 must be 0"),
    (replace(MC, block_n=32), GemmProblem(128, 256, 256), "needs 64x64 tiles"),
    (replace(MC, num_stages=1), GemmProblem(128, 256, 256), "needs 2 or more stages"),
    (replace(MC, tma=0), GemmProblem(128, 256, 256), "needs 64x64 tiles"),
    (MC, GemmProblem(128, 256, 256, 4), "16-bit operands"),
    (MC, GemmProblem(128, 192, 256), "does not divide the 3 column tiles"),
    (replace(MC, block_k=128, num_stages=7), GemmProblem(128, 256, 1024), "14 stages"),
])
def test_check_rejects_mc(cfg, problem, needle):
    assert needle in (check(cfg, problem, HOPPER) or "")


def test_check_mc_device():
    p = GemmProblem(128, 256, 256)
    assert check(MC, p, HOPPER) is None
    assert "needs a Hopper GPU" in check(MC, p, AMPERE)
    assert check(replace(MC, mc=0), p, AMPERE) is None


def test_mc_config_runs_the_triton_kernel_off_hopper(device):
    # Where the CUDA kernel cannot run (here: the interpreter), the same config runs on the Triton kernel.
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on Hopper the CUDA kernel runs: the GPU tests below")
    m, k, n = 37, 200, 256
    x, w, b, r = _inputs(m, n, k, torch.float16, device, seed=1)
    out = linear(x, w, b, config=replace(MC, overlap_ratio=0.0, prefetch_ratio=1.0), residual=r, activation="gelu")
    assert rel_error(out, linear_ref(x, w, b, residual=r, activation="gelu")) < REL_TOLERANCE[torch.float16]


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mc", [1, 2, 4])
@pytest.mark.parametrize("stages, knobs", [(2, (-1.0, -1.0)), (3, (0.0, 1.0)), (8, (0.5, 0.5))],
                         ids=["2stages-off", "3stages-pdl", "8stages-half"])
@pytest.mark.parametrize("epilogue", ["plain", "all"])
def test_mc_linear_odd_shapes(dtype, mc, stages, knobs, epilogue):
    # Odd M (37: rows past M zero-filled by TMA, stores masked), odd N (250: the last column stored alone), K not
    # a multiple of 64 (200: the last K tile zero-filled), fewer stages than K tiles (stage reuse across the
    # cluster); outputs poisoned with NaN, so every element must be written.
    m, k, n = 37, 200, 250
    x, w, b, r = _inputs(m, n, k, dtype, "cuda", seed=mc * 10 + stages)
    cfg = replace(MC, mc=mc, num_stages=stages, overlap_ratio=knobs[0], prefetch_ratio=knobs[1])
    assert check(cfg, GemmProblem(m, n, k), DeviceInfo.from_torch()) is None
    kw = dict(activation="gelu", residual=r) if epilogue == "all" else {}
    bias = b if epilogue == "all" else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    linear(x, w, bias, config=cfg, out=out, **kw)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, bias, **kw)) < REL_TOLERANCE[dtype]


@gpu
@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("mc", [1, 2])
def test_mc_linear_split_k(split_k, mc):
    m, k, n = 100, 1000, 256
    x, w, b, r = _inputs(m, n, k, torch.float16, "cuda", seed=split_k)
    cfg = replace(MC, mc=mc, split_k=split_k, overlap_ratio=0.0, prefetch_ratio=1.0)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    linear(x, w, b, config=cfg, activation="gelu", residual=r, out=out)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, activation="gelu", residual=r)) < 1e-2


@gpu
@pytest.mark.parametrize("mc", [1, 2])
def test_mc_layernorm_statistics(mc):
    # The producer writes its rows' sums (stats_out) from the CUDA kernel, the consumer normalises with them.
    m, k1, d, n = 37, 72, 256, 128
    dtype = torch.float16
    x, w1, b1, _ = _inputs(m, d, k1, dtype, "cuda", seed=40)
    r = (torch.randn(m, d, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype).cuda()
    _, w2, b2, _ = _inputs(m, n, d, dtype, "cuda", seed=50)
    g = torch.Generator().manual_seed(6)
    lw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).cuda()
    lb = (0.1 * torch.randn(d, generator=g)).to(dtype).cuda()
    c1 = replace(MC, block_k=64 if k1 >= 64 else 16, mc=mc)
    stats = torch.full((stats_parts(c1, d), m, 2), float("nan"), dtype=torch.float32, device="cuda")
    h = linear(x, w1, b1, config=c1, residual=r, stats_out=stats)
    wf, bf, u = fold_layernorm(w2, b2, lw, lb)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    linear(h, wf, bf, config=replace(MC, mc=mc), out=out, ln_colsum=u, ln_stats=stats, activation="gelu")
    torch.cuda.synchronize()
    torch.testing.assert_close(stats.sum(0)[:, 0], h.float().sum(1), rtol=1e-3, atol=1e-2)
    ref = linear_ref(h, w2, b2, ln_weight=lw, ln_bias=lb, activation="gelu")
    assert rel_error(out, ref) < REL_TOLERANCE[dtype]
    # Without the producer's row sums (a stack's first layer) the Triton kernel gathers them: same result.
    out2 = linear(h, wf, bf, config=replace(MC, mc=mc), ln_colsum=u, activation="gelu")
    assert rel_error(out2, ref) < REL_TOLERANCE[dtype]


@gpu
def test_mc_pdl_chain_in_a_graph():
    # Three dependent GEMMs launched with PDL (trigger right after the wait, weights requested before it) in one
    # CUDA graph; every intermediate poisoned before each replay: a read before the predecessor's writes land
    # would show as NaN or a wrong value.
    m, d = 128, 768
    dtype = torch.float16
    g = torch.Generator().manual_seed(7)
    ws = [(torch.randn(d, d, generator=g) / d**0.5).to(dtype).cuda() for _ in range(3)]
    x = torch.randn(m, d, generator=g).to(dtype).cuda()
    bufs = [torch.empty(m, d, dtype=dtype, device="cuda") for _ in range(3)]
    cfgs = [replace(MC, block_k=128, num_stages=4, mc=mc, overlap_ratio=0.0, prefetch_ratio=1.0) for mc in (2, 4, 1)]
    ref = x.float()
    for w in ws:
        ref = ref @ w.float().T
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up: builds the library, sets the kernels' shared-memory attribute
            linear(x if i == 0 else bufs[i - 1], ws[i], config=cfgs[i], out=bufs[i])
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(3):
            linear(x if i == 0 else bufs[i - 1], ws[i], config=cfgs[i], out=bufs[i])
    for _ in range(20):
        for b in bufs:
            b.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(bufs[2], ref) < 1e-2


@gpu
@pytest.mark.parametrize("mc", [1, 2])
def test_mc_racy_read_is_wrong_somewhere(mc):
    # The test-only defect (the first activation tile loaded before griddepcontrol.wait) behind a slow PDL
    # predecessor that writes x and lets its successor launch at once: the defect must read stale values (what
    # tune verify relies on), the same chain without it must not.
    m, d, k0 = 128, 768, 16384
    g = torch.Generator().manual_seed(8)
    a = (torch.randn(m, k0, generator=g) / k0**0.5).half().cuda()
    w0 = torch.randn(d, k0, generator=g).half().cuda()
    w = (torch.randn(d, d, generator=g) / d**0.5).half().cuda()
    x = torch.empty(m, d, dtype=torch.float16, device="cuda")
    out = torch.empty(m, d, dtype=torch.float16, device="cuda")
    slow = GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=3, overlap_ratio=0.0)
    cfg = replace(MC, block_k=128, num_stages=4, mc=mc, overlap_ratio=0.0, prefetch_ratio=1.0)
    ref = (a.float() @ w0.float().T).half().float() @ w.float().T
    wrong = {}
    for racy in (False, True):
        wrong[racy] = 0
        for _ in range(10):
            x.fill_(float("nan"))
            linear(a, w0, config=slow, out=x)
            linear(x, w, config=cfg, out=out, _racy_read_before_wait=racy)
            torch.cuda.synchronize()
            wrong[racy] += rel_error(out, ref) > 1e-2
    assert wrong == {False: 0, True: wrong[True]} and wrong[True] > 0, wrong
