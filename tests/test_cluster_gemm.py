"""The cluster split-K GEMM (kernels/cluster_gemm.cu, ``GemmConfig.cluster``): its validity rules and the fallback
run everywhere; the CUDA kernel itself only on a Hopper GPU (pytest -m gpu)."""

from dataclasses import replace

import pytest
import torch

from tuner.device import DeviceInfo
from tuner.kernels import cluster_gemm
from tuner.kernels._common import rel_error, rel_tolerance
from tuner.kernels.gemm import GemmConfig, GemmProblem, check, fold_layernorm, linear, linear_ref, stats_parts

from devices import A100, H200  # (tests/ is on sys.path under pytest)
from test_gemm import _inputs  # the GEMM tests' inputs

CL = GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, tma=1, split_k=4, cluster=1)


@pytest.mark.parametrize("cfg, problem, needle", [
    (replace(CL, cluster=3), GemmProblem(128, 256, 768), "cluster=3 must be 0"),
    (replace(CL, split_k=3), GemmProblem(128, 256, 768), "needs split_k in (2, 4, 8)"),
    (replace(CL, split_k=1), GemmProblem(128, 256, 768), "needs split_k in (2, 4, 8)"),
    # 8 splits: a CTA stores bm / 8 rows, 16 threads a row, 8 columns or more each
    (replace(CL, split_k=8), GemmProblem(128, 256, 4096), "split_k=8 needs tiles of 128 columns or more, not 64"),
    (replace(CL, block_m=128, num_warps=8, split_k=8), GemmProblem(128, 256, 4096), "needs tiles of 128 columns"),
    (replace(CL, block_n=32), GemmProblem(128, 256, 768), "needs 64- or 128-row"),
    (replace(CL, tma=0), GemmProblem(128, 256, 768), "needs 64- or 128-row"),
    (CL, GemmProblem(128, 256, 768, 4), "16-bit operands"),
    (replace(CL, num_stages=1), GemmProblem(128, 256, 768), "must be in 2..12"),
    (replace(CL, block_k=128, num_stages=7), GemmProblem(128, 256, 4096), "must be in 2..12"),
    # its grid's second axis holds 65535 row tiles (the Triton kernel's grid has every tile on its first)
    (CL, GemmProblem(64 * 65535 + 1, 64, 768), "at most 65535 row tiles (a grid axis), not 65536"),
])
def test_check_rejects_cluster(cfg, problem, needle):
    assert needle in (check(cfg, problem, H200) or "")


def test_launch_refuses_a_split_the_tile_cannot_take():
    # Before any build or GPU call: a one-line error instead of nvcc's static_assert.
    x, w, out = torch.zeros(128, 1024, dtype=torch.float16), torch.zeros(256, 1024, dtype=torch.float16), None
    with pytest.raises(ValueError, match="cluster_gemm: split_k=8 needs tiles of 128 columns or more, not 64"):
        cluster_gemm.launch(x, w, out, split=8, bm=64, bn=64)
    with pytest.raises(ValueError, match=r"cluster_gemm: needs split_k in \(2, 4, 8\), not 3"):
        cluster_gemm.launch(x, w, out, split=3, bn=128)


def test_check_accepts_16_bit_exchange():
    assert check(CL, GemmProblem(64 * 65535, 64, 768), H200) is None  # 65535 row tiles
    assert check(replace(CL, cluster=2), GemmProblem(128, 256, 768), H200) is None
    assert check(replace(CL, cluster=2, split_k=2), GemmProblem(128, 256, 768), H200) is None


@pytest.mark.parametrize("bm, warps, stages", [(64, 4, 3), (128, 8, 4)])
def test_check_accepts_eight_splits_of_128_column_tiles(bm, warps, stages):
    cfg = replace(CL, block_m=bm, block_n=128, num_warps=warps, num_stages=stages, split_k=8, cluster=2)
    assert check(cfg, GemmProblem(128, 1024, 4096), H200) is None


def test_check_cluster_few_rows():
    # Below 64 rows a tile that covers every row runs on the 64-row kernel (rows past M zero-filled, masked).
    assert check(replace(CL, block_m=32), GemmProblem(32, 256, 1024), H200) is None
    assert "needs 64- or 128-row" in check(replace(CL, block_m=32), GemmProblem(48, 256, 1024), H200)


@pytest.mark.parametrize("bm, bn, warps, stages, ok", [
    (64, 128, 4, 3, None), (128, 64, 8, 3, None), (128, 128, 8, 3, None),
    (128, 128, 4, 3, "needs 64- or 128-row"),     # one warpgroup (4 warps) a 64 rows
    (64, 256, 4, 3, "needs 64- or 128-row"),
    (128, 128, 8, 2, "must hold the 67584 B partial"),  # 2 stages of 32 KB cannot hold the fp32 partial
    (128, 128, 8, 6, "B of shared memory"),
])
def test_check_cluster_tiles(bm, bn, warps, stages, ok):
    cfg = replace(CL, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, block_k=64)
    why = check(cfg, GemmProblem(256, 2304, 768), H200)
    assert why is None if ok is None else ok in (why or ""), why


def test_launch_argtypes_match_the_c_signature():
    # The ctypes declaration of cluster_gemm_launch against its C parameter list (a mismatch fails only on the GPU).
    import ctypes

    from tuner.kernels import _nvcc, cluster_gemm

    want = _nvcc.c_argtypes(cluster_gemm.SOURCE.read_text(), "cluster_gemm_launch")
    assert len(want) == 26 and all(t == ctypes.c_void_p for t in want[:9])
    assert cluster_gemm.LAUNCH_ARGTYPES == want


def test_check_cluster_device():
    p = GemmProblem(128, 256, 768)
    assert check(CL, p, H200) is None
    assert "needs a Hopper GPU" in check(CL, p, A100)
    assert check(replace(CL, cluster=0), p, A100) is None


def test_cluster_config_runs_the_triton_kernels_off_hopper(device):
    # Where the CUDA kernel cannot run (here: the interpreter), the same config runs on the Triton GEMM and its
    # split-K reduction kernel.
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on Hopper the CUDA kernel runs: the GPU tests below")
    m, k, n = 37, 200, 90
    x, w, b, r = _inputs(m, n, k, torch.float16, device, seed=1)
    out = linear(x, w, b, config=replace(CL, overlap_ratio=0.0, prefetch_ratio=1.0), residual=r, activation="gelu")
    assert rel_error(out, linear_ref(x, w, b, residual=r, activation="gelu")) < rel_tolerance(torch.float16)


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("stages, knobs", [(2, (-1.0, -1.0)), (3, (0.0, 1.0)), (8, (0.5, 0.5))],
                         ids=["2stages-off", "3stages-pdl", "8stages-half"])
@pytest.mark.parametrize("epilogue", ["plain", "bias-gelu-res-stats", "bias32"])
def test_cluster_linear_odd_shapes(dtype, split, stages, knobs, epilogue):
    # Odd M (37: rows past M zero-filled by TMA, stores masked), odd N (250: a partial column tile, scalar stores),
    # K not a multiple of 64 (456: the last K tile zero-filled, splits of unequal length), stages reused within
    # a split; outputs and row sums poisoned with NaN, so every element must be written.
    m, k, n = 37, 456, 250
    x, w, b, r = _inputs(m, n, k, dtype, "cuda", seed=split * 10 + stages)
    cfg = replace(CL, split_k=split, num_stages=stages, overlap_ratio=knobs[0], prefetch_ratio=knobs[1])
    assert check(cfg, GemmProblem(m, n, k), DeviceInfo.from_torch()) is None
    kw, bias, stats = {}, None, None
    if epilogue == "bias-gelu-res-stats":
        bias = b
        stats = torch.full((stats_parts(cfg, n), m, 2), float("nan"), dtype=torch.float32, device="cuda")
        kw = dict(activation="gelu", residual=r)
    elif epilogue == "bias32":
        bias = b.float()
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    linear(x, w, bias, config=cfg, out=out, stats_out=stats, **kw)
    torch.cuda.synchronize()
    ref = linear_ref(x, w, bias, **kw)
    assert rel_error(out, ref) < rel_tolerance(dtype)
    if stats is not None:
        of = out.float()
        rtol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(stats.sum(0)[:, 0], of.sum(1), rtol=rtol, atol=5e-2)
        torch.testing.assert_close(stats.sum(0)[:, 1], (of * of).sum(1), rtol=rtol * 4, atol=5e-1)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tile, split, epilogue", [
    ((64, 64), 4, "plain"), ((64, 64), 4, "bias-gelu-res-stats"), ((64, 64), 2, "layernorm"),
    ((128, 128), 2, "bias-gelu-res-stats"), ((64, 128), 4, "layernorm"), ((128, 64), 2, "plain"),
    ((128, 128), 8, "bias-gelu-res-stats"), ((64, 128), 8, "layernorm"), ((128, 128), 8, "plain"),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_cluster_linear_16_bit_exchange(dtype, tile, split, epilogue):
    # cluster=2: the partials pushed through distributed shared memory in the operands' 16-bit type. The error stays
    # within the same tolerance as the fp32 exchange (each partial is rounded once, like the output).
    _check_odd_tile(dtype, tile, split, epilogue, cluster=2, seed=split * 1000 + sum(tile))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("epilogue", ["bias-gelu-res-stats", "layernorm"])
def test_cluster_linear_with_cache_hints(dtype, epilogue):
    # GemmConfig.hints 1: the build with L2 eviction hints on its TMA loads, the same results on odd tiles
    _check_odd_tile(dtype, (64, 64), 2, epilogue, 2, seed=17, hints=1)


@gpu
@pytest.mark.parametrize("m, block_m", [(20, 32), (16, 16)])
def test_cluster_linear_few_rows(m, block_m):
    k, n = 1024, 256
    x, w, b, r = _inputs(m, n, k, torch.float16, "cuda", seed=m)
    cfg = replace(CL, block_m=block_m, block_k=256, num_stages=3, overlap_ratio=0.0, prefetch_ratio=1.0)
    assert check(cfg, GemmProblem(m, n, k), DeviceInfo.from_torch()) is None
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    linear(x, w, b, config=cfg, activation="gelu", residual=r, out=out)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, activation="gelu", residual=r)) < 1e-2


def _ln_params(k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A LayerNorm's weight and bias ([k], near 1 and 0) on the GPU."""
    g = torch.Generator().manual_seed(seed)
    return ((1 + 0.1 * torch.randn(k, generator=g)).to(dtype).cuda(),
            (0.1 * torch.randn(k, generator=g)).to(dtype).cuda())


def _row_sums(x: torch.Tensor, parts: int) -> torch.Tensor:
    """[parts, M, 2] fp32: the sums of x and x^2 over `parts` column blocks (what a producer's stats_out holds)."""
    xf = x.float()
    return torch.stack([torch.stack([c.sum(1), (c * c).sum(1)], dim=1) for c in xf.chunk(parts, dim=1)])


@gpu
@pytest.mark.parametrize("tile, split", [((64, 128), 2), ((64, 128), 4), ((64, 128), 8), ((128, 64), 2), ((128, 64), 4),
                                         ((128, 128), 2), ((128, 128), 4), ((128, 128), 8)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("epilogue", ["plain", "bias-gelu-res-stats", "layernorm"])
def test_cluster_linear_tiles(tile, split, epilogue):
    # The wider tiles (128 columns: wgmma m64n128) and the taller ones (two consumer warpgroups); 8 splits (clusters
    # of 8, 8 or 16 rows a CTA reduces) on the 128-column tiles only.
    _check_odd_tile(torch.float16, tile, split, epilogue, cluster=1, seed=split * 100 + sum(tile))


def _check_odd_tile(dtype, tile, split, epilogue, cluster, seed, hints=0):
    """One clustered GEMM on odd shapes against its reference: a partial second row tile (150 rows), a partial
    column tile (N 330), K splits of unequal length (K 456); outputs and row sums poisoned; with ``layernorm``, the
    LayerNorm folded into the weights and applied in the epilogue from the producer's row sums (13 parts)."""
    bm, bn = tile
    m, k, n = 150, 456, 330
    x, w, b, r = _inputs(m, n, k, dtype, "cuda", seed=seed)
    cfg = replace(CL, block_m=bm, block_n=bn, num_warps=4 * bm // 64, split_k=split, num_stages=3, cluster=cluster,
                  overlap_ratio=0.0, prefetch_ratio=1.0, hints=hints)
    assert check(cfg, GemmProblem(m, n, k), DeviceInfo.from_torch()) is None
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    stats = None
    if epilogue == "layernorm":
        lw, lb = _ln_params(k, dtype, bm + bn + split)
        x = x * 3 + 0.5  # rows with a mean and a variance to remove
        wf, bf, u = fold_layernorm(w, b, lw, lb)
        linear(x, wf, bf, config=cfg, out=out, ln_colsum=u, ln_stats=_row_sums(x, 13))
        ref = linear_ref(x, w, b, ln_weight=lw, ln_bias=lb)
    else:
        kw = dict(activation="gelu", residual=r) if epilogue != "plain" else {}
        bias = b if kw else None
        if kw:
            stats = torch.full((stats_parts(cfg, n), m, 2), float("nan"), dtype=torch.float32, device="cuda")
        linear(x, w, bias, config=cfg, out=out, stats_out=stats, **kw)
        ref = linear_ref(x, w, bias, **kw)
    torch.cuda.synchronize()
    fp16 = dtype == torch.float16
    assert rel_error(out, ref) < ((1e-2 if fp16 else 2e-2) if epilogue == "layernorm" else rel_tolerance(dtype))
    if stats is not None:
        of = out.float()
        rtol = 1e-3 if fp16 else 1e-2
        torch.testing.assert_close(stats.sum(0)[:, 0], of.sum(1), rtol=rtol, atol=5e-2)
        torch.testing.assert_close(stats.sum(0)[:, 1], (of * of).sum(1), rtol=4 * rtol, atol=5e-1)


@gpu
def test_cluster_linear_layernorm_bf16_few_rows():
    # bf16, 32 rows on the 64-row kernel, LayerNorm from 32 parts (the most a launch reads).
    m, k, n = 32, 768, 256
    x, w, b, _ = _inputs(m, n, k, torch.bfloat16, "cuda", seed=11)
    lw, lb = _ln_params(k, torch.bfloat16, 12)
    wf, bf, u = fold_layernorm(w, b, lw, lb)
    cfg = replace(CL, block_m=32, split_k=2, num_stages=4, overlap_ratio=0.0, prefetch_ratio=1.0)
    out = linear(x, wf, bf, config=cfg, ln_colsum=u, ln_stats=_row_sums(x, 32), activation="gelu")
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, ln_weight=lw, ln_bias=lb, activation="gelu")) < 2e-2


@gpu
def test_cluster_linear_with_layernorm_runs_the_triton_kernels():
    # A fused LayerNorm that gathers its row sums in the K loop (no ln_stats) is not in the CUDA kernel: the
    # Triton GEMM and its reduction run the config.
    m, k, n = 64, 256, 128
    x, w, b, _ = _inputs(m, n, k, torch.float16, "cuda", seed=5)
    lw, lb = _ln_params(k, torch.float16, 6)
    wf, bf, u = fold_layernorm(w, b, lw, lb)
    out = linear(x, wf, bf, config=replace(CL, split_k=2), ln_colsum=u)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, ln_weight=lw, ln_bias=lb)) < 1e-2


@gpu
def test_cluster_pdl_chain_in_a_graph():
    # Three dependent GEMMs launched with PDL (trigger right after the wait, weights requested before it) in one
    # CUDA graph; every output poisoned before each replay: a read before the predecessor's writes land, or a
    # reduction that sums a slab before it has arrived, would show as NaN or a wrong value.
    m, d = 128, 1024  # (K 1024: 16 K tiles, two for each of 8 splits)
    dtype = torch.float16
    g = torch.Generator().manual_seed(7)
    ws = [(torch.randn(d, d, generator=g) / d**0.5).to(dtype).cuda() for _ in range(3)]
    x = torch.randn(m, d, generator=g).to(dtype).cuda()
    bufs = [torch.empty(m, d, dtype=dtype, device="cuda") for _ in range(3)]
    cfgs = [replace(CL, block_k=bk, num_stages=s, split_k=sk, overlap_ratio=0.0, prefetch_ratio=1.0)
            for bk, s, sk in ((64, 4, 4), (128, 2, 2), (64, 2, 4))]
    cfgs[1] = replace(cfgs[1], cluster=2)  # (one of the three exchanges its partials in 16 bits)
    cfgs[2] = replace(cfgs[2], block_n=128, split_k=8)  # (and one splits 8 ways)
    ref = x.float()
    for w in ws:
        ref = ref @ w.float().T
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up: builds the libraries, sets the kernels' shared-memory attribute
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
@pytest.mark.parametrize("d, n, tiles", [(768, 768, dict(block_k=64, num_stages=4)),
                                         # bert-large's FFN2 seed: 8 stages of 16 KB weight tiles before the wait
                                         (4096, 1024, dict(block_n=128, block_k=128, num_stages=4, cluster=2)),
                                         # the same in 128x128 tiles split 8 (64 CTAs in clusters of 8)
                                         (4096, 1024, dict(block_m=128, block_n=128, num_warps=8, block_k=64,
                                                           num_stages=4, split_k=8, cluster=2))],
                         ids=["64x64", "64x128-long-k", "128x128-split-8"])
def test_cluster_racy_read_is_caught(d, n, tiles):
    # The test-only defect (the early stages' activation tiles loaded before griddepcontrol.wait) behind a slow PDL
    # predecessor that writes x and lets its successor launch at once, replayed in a CUDA graph with x poisoned
    # before the producer: the defect reads the poison (or a partly written x) in some replays, the same chain
    # without it never. In a graph the launches are back to back, as in the timed stack; launched eagerly the
    # consumer could reach the GPU only after its producer had finished, and nothing would race. (The racy tiles are
    # issued before the weight tiles: behind 128 KB of them a racy tile reached memory too late, perf notes 35.3.)
    m, k0 = 128, 16384 if d <= 1024 else 4096
    g = torch.Generator().manual_seed(8)
    a = (torch.randn(m, k0, generator=g) / k0**0.5).half().cuda()
    w0 = torch.randn(d, k0, generator=g).half().cuda()
    w = (torch.randn(n, d, generator=g) / d**0.5).half().cuda()
    x = torch.empty(m, d, dtype=torch.float16, device="cuda")
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    slow = GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=3, overlap_ratio=0.0)
    cfg = replace(CL, **tiles, overlap_ratio=0.0, prefetch_ratio=1.0)
    ref = (a.float() @ w0.float().T).half().float() @ w.float().T
    stream = torch.cuda.Stream()  # PDL needs a stream of its own: the legacy default stream serialises launches

    def chain(racy):
        x.fill_(float("nan"))
        linear(a, w0, config=slow, out=x)
        linear(x, w, config=cfg, out=out, _racy_read_before_wait=racy)

    wrong = {}
    for racy in (False, True):
        with torch.cuda.stream(stream):
            chain(racy)  # warm-up: builds the kernels, sets the shared-memory attribute
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            chain(racy)
        wrong[racy] = 0
        for _ in range(20):
            out.fill_(0.0)
            graph.replay()
            torch.cuda.synchronize()
            wrong[racy] += rel_error(out, ref) > 1e-2
        del graph
    assert wrong[False] == 0 and wrong[True] > 0, wrong

@gpu
@pytest.mark.parametrize("kernel", ["triton", "cluster"])
def test_held_gemm_holds_its_stores_and_stays_exact(kernel):
    # tune verify's held-back predecessor (gemm.linear's _slow_ns): the same output bit for bit, and a launch at
    # least the hold longer; the cluster kernel's held build holds cluster_gemm.SLOW_NS only, and says so.
    from tuner.kernels.gemm import NotSlowable

    x, w, b, r = _inputs(128, 1024, 768, torch.float16, "cuda", seed=3)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=4, tma=1, overlap_ratio=0.0,
                     prefetch_ratio=1.0)
    if kernel == "cluster":
        cfg = replace(CL, overlap_ratio=0.0, prefetch_ratio=1.0)
        with pytest.raises(NotSlowable):
            linear(x, w, b, config=cfg, residual=r, _slow_ns=10_000)
    plain = linear(x, w, b, config=cfg, residual=r)
    slowed = linear(x, w, b, config=cfg, residual=r, _slow_ns=20_000)
    assert torch.equal(plain, slowed)
    # Timed in CUDA graphs: launched eagerly, the host's launch time would hide a 20 us hold.
    from tuner.timing import capture

    times = {}
    for ns in (0, 20_000):
        graph = capture(lambda: linear(x, w, b, config=cfg, residual=r, out=plain, _slow_ns=ns))
        for _ in range(5):  # (a new graph's first replays run slower: session 36 measured 13.6 us on one, 5 after)
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times[ns] = start.elapsed_time(end) * 1e3 / 20
    assert times[20_000] >= 19.5 and times[20_000] > times[0] + 10, times  # (a held launch lasts the hold at least)


@gpu
@pytest.mark.parametrize("square", [False, True], ids=["64x128-split4", "128x128-split8"])
def test_verify_catches_the_clustered_ffn2_behind_a_slowed_ffn1(square):
    # bert-large's clustered FFN2 gets SMs only as FFN1's programs retire together, so its racy variant read
    # FFN1's finished output in about half of tune verify's checks (session 35: 23 and 22 of 40). With FFN1's odd
    # column tiles holding back their stores, a read before the wait finds poison: every check catches it, and the
    # shipped kernel, which waits, never fails.
    from tuner import bench
    from tuner.layer import DecoderStack
    from tuner.shapes import resolve
    from tuner.verify import race_detection

    shape = resolve("bert-large")
    cfg = bench.hand_picked_cluster(shape, norms=0)
    if square:
        cfg = bench.square_split_ffn2(cfg, shape)
    st = DecoderStack(shape, cfg, n_layers=4, dtype=torch.float16, device="cuda", seed=11)
    r = race_detection(st, "ffn2", layer=1, trials=10)
    assert r["slowed"] == "ffn1 (layer 1)" and r["caught"] == 10 and r["false_alarms"] == 0, r


def test_without_nvcc_the_search_leaves_the_cuda_kernels_out():
    # pip's torch and triton bring no CUDA toolkit: on a Hopper GPU without nvcc each trial of a CUDA kernel crashed in
    # its build (the DESIGN audit). The device says whether nvcc is there; the rules then refuse the CUDA kernels and
    # repair_config moves a config to the Triton kernels, as on other GPUs.
    from tuner.bench import hand_picked_cluster
    from tuner.device import DeviceInfo
    from tuner.layer import check_config, repair_config
    from tuner.shapes import resolve

    bare = replace(H200, nvcc=False)
    assert H200.nvcc and DeviceInfo.from_dict(H200.to_dict()) == H200
    assert DeviceInfo.from_dict({k: v for k, v in bare.to_dict().items()}) == bare
    assert DeviceInfo.from_dict({k: v for k, v in H200.to_dict().items() if k != "nvcc"}).nvcc  # (older records)
    assert check(CL, GemmProblem(128, 256, 768), H200) is None
    assert "needs nvcc" in check(CL, GemmProblem(128, 256, 768), bare)
    shape = resolve("bert-base")
    cfg = hand_picked_cluster(shape)
    assert cfg.out.cluster and cfg.qkv.fuse == 1 and check_config(cfg, shape, 2, H200) == {}
    bad = check_config(cfg, shape, 2, bare)
    assert {"qkv", "out", "ffn2"} <= set(bad) and all("needs nvcc" in why for why in bad.values()), bad
    fixed = repair_config(cfg, shape, 2, bare)
    assert check_config(fixed, shape, 2, bare) == {}
    assert fixed.qkv.fuse == 0 and not any(getattr(fixed, g).cluster for g in ("qkv", "out", "ffn1", "ffn2"))
