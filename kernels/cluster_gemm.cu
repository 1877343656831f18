// Split-K GEMM whose K splits of a tile form one thread-block cluster and reduce through distributed shared
// memory: no workspace in global memory, no second kernel.
//
//   out = act(x @ w.T + bias) + residual       (x [M, K], w [N, K], 16-bit; fp32 accumulation)
//
// Why (docs/perf-notes.md, section 14): a 64x64 program's K loop is bound by the bytes its SM receives (its A and
// B tiles, ~190 KB at K = 768) and its MMAs; splitting K over SC programs divides both, but the split-K reduction
// kernel adds ~1.6 us a layer, and a reduction through L2 (a cluster barrier after a fenced store, then a reload)
// costs as much. Here the reduction is a reduce-scatter inside the cluster: each CTA stores its fp32 partial tile
// in its own shared memory, pushes row slab q of it to CTA q with one bulk copy (cp.async.bulk shared::cluster,
// completing on CTA q's mbarrier), and CTA q sums the SC slabs of its 64/SC rows and applies the epilogue to them.
// With XCHG16 (GemmConfig.cluster 2) the partial is stored and pushed in the operands' 16-bit type: half the bytes,
// which is what the exchange costs (cluster epilogues 1.25 -> 0.75 us on bert-base, perf notes 22).
//
// A CTA: one consumer warpgroup (warps 0-3: wgmma m64n64k16 from 128-byte-swizzled shared memory) and one
// producer warp (warp 4: one thread issues the TMA loads; the weight tiles of the first stages before
// griddepcontrol.wait, which the weights never need). K is consumed in 64-wide tiles, STAGES of them in flight.
//
// Built at run time by kernels/cluster_gemm.py with nvcc (sm_90a), one library per variant (operand dtype, SC,
// epilogue), and called through ctypes. The Triton GEMM (gemm.py) stays the reference and the CPU-tested path.

#include "hopper.cuh"

namespace {

// The tile is BM x BN (BM 64 or 128: one consumer warpgroup per 64 rows; BN 64 or 128), K in 64-wide tiles.
constexpr int MAX_STAGES = 12;
constexpr int MAX_LN_PARTS = 32;  // LN_IN: the producer's row-sum parts a launch may read

template <int BM, int BN>
struct Tile {
  static constexpr int WG = BM / 64;                  // consumer warpgroups
  static constexpr int CONSUMERS = 128 * WG;
  static constexpr int THREADS = CONSUMERS + 32;      // + the producer warp
  static constexpr int A_BYTES = BM * BK * 2;         // one stage's A tile (16-bit)
  static constexpr int B_BYTES = BN * BK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int SROW = BN + 4;                 // fp32 row pitch of the partial tiles (fewer bank conflicts)
  static constexpr int PART_BYTES = BM * SROW * 4;    // one partial tile
};

// Epilogue (compile time; the activation in bits 6-7).
// XCHG16: the split-K partials are exchanged in the operand type (16-bit) instead of fp32: half the bytes through
// distributed shared memory, which costs ~60 ns per KB a CTA pushes (perf notes 16.1); each partial is rounded once.
enum Epi { HAS_BIAS = 1, BIAS_F32 = 2, HAS_RES = 4, LN_IN = 8, STATS_OUT = 16, XCHG16 = 32 };
// The trace's stamps and the test-only defect are build variants (CG_DIAG, as qkv_attn.cu's QA_DIAG: no branch of
// theirs in the production build): bit 0 the trace (%globaltimer, 4 a program), bit 2 racy (the activation tiles
// of the stages whose weights go before griddepcontrol.wait, loaded before it too), bit 3 held (tune verify: the CTAs
// of odd column tiles hold their stores back SLOW_NS after the exchange, so that a racy dependent meets poison).
#ifndef CG_DIAG
#define CG_DIAG 0
#endif
constexpr bool TRACED = (CG_DIAG & 1) != 0, RACY = (CG_DIAG & 4) != 0, HELD = (CG_DIAG & 8) != 0;
constexpr long long SLOW_NS = 20000;  // cluster_gemm.py's SLOW_NS, checked at load
constexpr int TRACE_SLOTS = 4;  // a program's stamps (cluster_gemm.py's TRACE_SLOTS, checked at load)
// CG_EVEN 1: M and N are multiples of the tile and the output's rows 16-byte aligned (the launcher checks), so the
// epilogue has no bounds checks and one store path (perf notes 34)
#ifndef CG_EVEN
#define CG_EVEN 0
#endif
constexpr bool EVEN = CG_EVEN != 0;
// Runtime flags.
enum Flags {
  USE_PDL = 64,
  // bits 8-11: 1 + the most weight tiles loaded into shared memory before griddepcontrol.wait (0: every stage's);
  // the rest of the prefetch goes to L2 only
  EARLY_SHIFT = 8,
  NO_SPREAD = 4096,  // A/B only: request just the shared memory the kernel uses (two CTAs may share an SM)
  ALL_SLABS = 16384,  // A/B only: push every row slab, also those whose rows all lie past M
};

struct Params {
  CUtensorMap a_map;  // x [M, K]: box {BK, BM}
  CUtensorMap b_map;  // w [N, K]: box {BK, BN}
  const void* bias;
  const void* res;
  void* out;
  float* stats_out;   // this GEMM's row sums for the next LayerNorm [64-column parts of N, M, 2]
  // LN_IN: LayerNorm folded into the weights (gemm.fold_layernorm), applied in the epilogue from the row sums of x
  // written by x's producer: out = rstd * (acc - mean * colsum) + ...
  const float* ln_stats;  // [ln_parts, M, 2]: sums of x and x^2 over column tiles
  const float* ln_colsum; // [N]: colsum of the folded weights
  float ln_eps;
  int ln_parts;
  long long* trace;   // diagnostics: %globaltimer [programs, 4]
  int M, N, K;
  int res_stride, out_stride;
  int per_split;      // 64-wide K tiles per split
  int k_tiles;        // 64-wide K tiles of K
  int stages;
  int trigger_k;      // launch_dependents after this many K tiles (-1: never early)
  int n_pref;         // weight tiles requested before griddepcontrol.wait
  int flags;
};


template <bool BF16, int SC, int EPI, int BM, int BN>
__global__ void __launch_bounds__(Tile<BM, BN>::THREADS, 1) cluster_gemm_kernel(const __grid_constant__ Params p) {
  static_assert(SC == 2 || SC == 4 || SC == 8, "the K splits of a tile: 2, 4 or 8 CTAs a cluster");
  static_assert(BN >= 16 * SC, "8 splits need 128-column tiles (a thread's columns: 16-byte stores)");
  static_assert((BM == 64 || BM == 128) && (BN == 64 || BN == 128), "tiles: 64 or 128 rows and columns");
  using TL = Tile<BM, BN>;
  using E = Elem<BF16>;
  using T = typename E::T;
  using BT = std::conditional_t<(EPI & BIAS_F32) != 0, float, T>;
  constexpr int ACT = (EPI >> 6) & 3;
  constexpr bool LN = (EPI & LN_IN) != 0;
  constexpr int CONSUMERS = TL::CONSUMERS, SROW = TL::SROW;
  constexpr int NACC = BN / 2;           // accumulator registers a thread (wgmma m64nBN, fp32)
  constexpr int R = BM / SC;             // rows of the tile this CTA reduces and stores
  constexpr int TPR = CONSUMERS / R;     // consumer threads a row (adjacent lanes)
  constexpr int CPT = BN / TPR;          // columns a thread
  constexpr bool X16 = (EPI & XCHG16) != 0;
  // A partial's row pitch in its elements: fp32 BN + 4, or 16-bit BN + 8 (rows 16-byte aligned for the bulk copies).
  constexpr int XROW = X16 ? BN + 8 : SROW;
  constexpr int SLAB = R * XROW * (X16 ? 2 : 4);  // bytes of one row slab of a partial tile
  constexpr int LNP = MAX_LN_PARTS / TPR;  // LN_IN: row-sum parts a thread loads
  static_assert(TPR <= 32 && 32 % TPR == 0 && CPT % 8 == 0, "epilogue mapping");

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const int S = p.stages;
  const uint32_t a_smem = base;
  const uint32_t b_smem = base + S * TL::A_BYTES;
  const uint32_t recv = b_smem + S * TL::B_BYTES;  // SC row slabs pushed here by the cluster (slot = source rank)
  const uint32_t full = recv + TL::PART_BYTES;     // S mbarriers: the stage's bytes have landed
  const uint32_t empty = full + 8 * S;             // S mbarriers: the consumers are done with the stage
  const uint32_t red = empty + 8 * S;              // 1 mbarrier: the other CTAs' slabs have landed
  // This CTA's partial after the loop, over the idle A and B stages (the host checks that they hold it).
  float* const part = reinterpret_cast<float*>(smem_raw + (a_smem - raw));
  const float* const slabs = reinterpret_cast<const float*>(smem_raw + (recv - raw));
  T* const part16 = reinterpret_cast<T*>(part);  // (XCHG16: the same places, 16-bit)
  const T* const slabs16 = reinterpret_cast<const T*>(slabs);

  const int tid = threadIdx.x;
  const int prog = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const auto stamp = [&](int slot) { trace_stamp<TRACED>(p.trace, prog * TRACE_SLOTS, slot); };  // (thread 0)
  stamp(0);
  const int n_tile = blockIdx.x, m_tile = blockIdx.y;
  const int rank = blockIdx.z;  // the cluster spans the SC splits of this tile: rank = split
  const int m0 = m_tile * BM, n0 = n_tile * BN;
  const int k_first = rank * p.per_split;
  const int n_iters = max(0, min(p.per_split, p.k_tiles - k_first));
  const bool pdl = (p.flags & USE_PDL) != 0;
  // Whether row slab q of the tile is exchanged: not when all its rows lie past M (nobody stores them).
  auto pushed = [&](int q) { return EVEN || m0 + q * R < p.M || (p.flags & ALL_SLABS) != 0; };

  if (tid == CONSUMERS) {
    prefetch_tensormap(&p.a_map);
    prefetch_tensormap(&p.b_map);
    for (int s = 0; s < S; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS / 32);  // one arrival per consumer warp
    }
    mbar_init(red, 1);
    // The one arrival of `red`'s phase, with the bytes the SC-1 other CTAs will push (their complete_tx may
    // come first: the phase cannot complete before this arrival). A slab whose rows all lie past M is pushed by
    // nobody (tiny's 32 tokens on 64-row tiles: half the exchange): its CTA waits for nothing and stores nothing.
    mbar_expect_tx(red, pushed(rank) ? (SC - 1) * SLAB : 0);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Every CTA's barriers must be initialised before any CTA of the cluster pushes into them.
  cluster_sync();

  if (tid >= CONSUMERS) {
    // Producer warp: one thread issues the loads.
    if (tid == CONSUMERS) {
      int early = p.n_pref > 0 ? min(S, n_iters) : 0;  // stages whose weight tile goes before the wait
      const int cap = (p.flags >> EARLY_SHIFT) & 15;
      if (cap > 0) early = min(early, cap - 1);
      if (RACY && early == 0 && n_iters > 0) early = 1;
      // (the racy activation tiles first, as qkv_attn.cu's: queued behind the weight tiles they reached memory after
      // the predecessor had finished, and bert-large's 64x128 tiles, 128 KB of them, hid the race: perf notes 35.3;
      // every early stage's, not only the first: each comes from another of the predecessor's column tiles, and
      // one that is still being written is enough to catch)
      if (RACY)
        for (int i = 0; i < early; ++i)
          tma_load<HINT_ACT>(a_smem + i * TL::A_BYTES, &p.a_map, full + 8 * i, (k_first + i) * BK, m0);
      for (int i = 0; i < early; ++i) {
        mbar_expect_tx(full + 8 * i, TL::STAGE_BYTES);
        tma_load<HINT_WEIGHT>(b_smem + i * TL::B_BYTES, &p.b_map, full + 8 * i, (k_first + i) * BK, n0);
      }
      for (int i = early; i < min(p.n_pref, n_iters); ++i) tma_prefetch_l2(&p.b_map, (k_first + i) * BK, n0);
      gdc_wait();
      if (p.trigger_k == 0) gdc_launch();
      int s = 0;
      uint32_t phase = 0;  // of the stage's empty barrier, from the second round on
      for (int i = 0; i < n_iters; ++i) {
        const uint32_t bar = full + 8 * s;
        if (i >= S) mbar_wait(empty + 8 * s, phase);
        if (i >= early) {
          mbar_expect_tx(bar, TL::STAGE_BYTES);
          tma_load<HINT_WEIGHT>(b_smem + s * TL::B_BYTES, &p.b_map, bar, (k_first + i) * BK, n0);
        }
        if (!(RACY && i < early)) tma_load<HINT_ACT>(a_smem + s * TL::A_BYTES, &p.a_map, bar, (k_first + i) * BK, m0);
        if (++s == S) {
          s = 0;
          if (i >= S) phase ^= 1;
        }
      }
    } else {
      gdc_wait();
    }
    return;
  }

  // Consumer warpgroups: warpgroup wg multiplies rows 64*wg.. of the tile.
  const int warp = tid / 32, lane = tid % 32, wg = tid / 128;
  gdc_wait();
  stamp(1);
  if (p.trigger_k == 0) gdc_launch();

  // The epilogue's inputs for this thread's row and columns of the CTA's slab, loaded now (clamped addresses,
  // no branches, no conversion) so that all are in flight before the K loop and waited for only after it.
  const int lr = tid / TPR;                  // row within the slab
  const int row = m0 + rank * R + lr;        // global row
  const int c0 = n0 + (tid % TPR) * CPT;     // first global column
  const int rrow = min(row, p.M - 1);
  BT bias_raw[CPT];
  T res_raw[CPT];
  float ln_u[LN ? CPT : 1];
  float2 ln_st[LN ? LNP : 1];  // this thread's share of the row's parts (summed over the TPR lanes after the loop)
#pragma unroll
  for (int e = 0; e < CPT; ++e) {
    const int c = min(c0 + e, p.N - 1);
    if constexpr ((EPI & HAS_BIAS) != 0) bias_raw[e] = static_cast<const BT*>(p.bias)[c];
    if constexpr ((EPI & HAS_RES) != 0)
      res_raw[e] = static_cast<const T*>(p.res)[static_cast<long long>(rrow) * p.res_stride + c];
    if constexpr (LN) ln_u[e] = p.ln_colsum[c];
  }
  if constexpr (LN) {
#pragma unroll
    for (int i = 0; i < LNP; ++i) {
      const int q = min((tid % TPR) + TPR * i, p.ln_parts - 1);
      ln_st[i] = *reinterpret_cast<const float2*>(p.ln_stats + (static_cast<long long>(q) * p.M + rrow) * 2);
    }
  }

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  int s = 0, prev = 0;  // this tile's stage and the previous one's
  uint32_t phase = 0;
  for (int i = 0; i < n_iters; ++i) {
    mbar_wait(full + 8 * s, phase);
    const uint64_t da = smem_desc(a_smem + s * TL::A_BYTES + wg * (64 * BK * 2));
    const uint64_t db = smem_desc(b_smem + s * TL::B_BYTES);
    fence_acc<NACC>(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) wgmma_64xNx16<BF16, BN>(acc, da + 2 * kk, db + 2 * kk);
    wgmma_commit();
    fence_acc<NACC>(acc);
    // Keep this tile's MMAs in flight while the next tile is awaited, and hand the previous tile's stage back
    // to the producer (the host requires 2 stages or more).
    wgmma_wait<1>();
    if (i >= 1 && i - 1 + S < n_iters) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * prev);
    }
    if (pdl && p.trigger_k > 0 && i + 1 == p.trigger_k) gdc_launch();
    prev = s;
    if (++s == S) {
      s = 0;
      phase ^= 1;
    }
  }
  wgmma_wait<0>();
  stamp(2);

  // Reduce-scatter. Every MMA of the warpgroups is done (the barrier), so the stages hold this CTA's partial.
  consumer_sync<CONSUMERS>();
  {
    const int r_lo = warp * 16 + lane / 4, c_lo = (lane % 4) * 2;  // (warp counts over the warpgroups: 64*wg + ..)
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (X16) {
          alignas(4) T pk[2] = {E::one(acc[4 * j + 2 * h]), E::one(acc[4 * j + 2 * h + 1])};
          *reinterpret_cast<uint32_t*>(part16 + (r_lo + 8 * h) * XROW + c_lo + 8 * j) =
              *reinterpret_cast<const uint32_t*>(pk);
        } else {
          *reinterpret_cast<float2*>(part + (r_lo + 8 * h) * SROW + c_lo + 8 * j) =
              make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
      }
  }
  // The bulk copies read the partial through the async proxy: order the stores before them.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  consumer_sync<CONSUMERS>();
  if (tid == 0) {
#pragma unroll
    for (int q = 1; q < SC; ++q) {
      const int dst = (rank + q) % SC;
      if (pushed(dst))
        bulk_push(map_to_cta(recv + rank * SLAB, dst), a_smem + dst * SLAB, SLAB, map_to_cta(red, dst));
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  mbar_wait(red, 0);
  if constexpr (HELD) {  // (the exchange has landed: holding one cluster's CTAs keeps nobody else waiting)
    if (n_tile & 1) {
      const long long t0 = globaltimer();
      while (globaltimer() - t0 < SLOW_NS) {
      }
    }
  }

  // This CTA's slab: its own partial's rows plus the SC-1 pushed ones.
  float y[CPT];
  if constexpr (X16) {
    // 8 16-bit elements a 16-byte load
    auto add8 = [&](const T* src, int e, bool first) {
      const uint4 v = *reinterpret_cast<const uint4*>(src + e);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = E::f2(w[k]);
        y[e + 2 * k] = first ? f.x : y[e + 2 * k] + f.x;
        y[e + 2 * k + 1] = first ? f.y : y[e + 2 * k + 1] + f.y;
      }
    };
    const T* own = part16 + (rank * R + lr) * XROW + (tid % TPR) * CPT;
#pragma unroll
    for (int e = 0; e < CPT; e += 8) add8(own, e, true);
#pragma unroll
    for (int q = 0; q < SC; ++q) {
      if (q == rank) continue;
      const T* o = slabs16 + q * (SLAB / 2) + lr * XROW + (tid % TPR) * CPT;
#pragma unroll
      for (int e = 0; e < CPT; e += 8) add8(o, e, false);
    }
  } else {
    const float* own = part + (rank * R + lr) * SROW + (tid % TPR) * CPT;
#pragma unroll
    for (int e = 0; e < CPT; e += 4) {
      float4 v = *reinterpret_cast<const float4*>(own + e);
      y[e] = v.x, y[e + 1] = v.y, y[e + 2] = v.z, y[e + 3] = v.w;
    }
#pragma unroll
    for (int q = 0; q < SC; ++q) {
      if (q == rank) continue;
      const float* o = slabs + q * (SLAB / 4) + lr * SROW + (tid % TPR) * CPT;
#pragma unroll
      for (int e = 0; e < CPT; e += 4) {
        float4 v = *reinterpret_cast<const float4*>(o + e);
        y[e] += v.x, y[e + 1] += v.y, y[e + 2] += v.z, y[e + 3] += v.w;
      }
    }
  }
  float ln_rstd = 1.f, ln_mr = 0.f;
  if constexpr (LN) {
    // The row's sums of x and x^2: this thread's parts (those past ln_parts were clamped to the last: not counted),
    // then the row's TPR lanes.
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < LNP; ++i) {
      if ((tid % TPR) + TPR * i < p.ln_parts) s1 += ln_st[i].x, s2 += ln_st[i].y;
    }
    lane_sum2<TPR>(s1, s2);
    const float2 f = ln_factors(s1, s2, p.K, p.ln_eps);
    ln_rstd = f.x;
    ln_mr = f.y;
  }
  float rs1 = 0.f, rs2 = 0.f;
#pragma unroll
  for (int e = 0; e < CPT; ++e) {
    float v = y[e];
    if constexpr (LN) v = ln_rstd * v - ln_mr * ln_u[e];
    if constexpr ((EPI & HAS_BIAS) != 0) {
      if constexpr ((EPI & BIAS_F32) != 0) {
        v += bias_raw[e];
      } else {
        v += E::f(bias_raw[e]);
      }
    }
    v = activate<ACT>(v);
    if constexpr ((EPI & HAS_RES) != 0) v += E::f(res_raw[e]);
    y[e] = (EVEN || c0 + e < p.N) ? v : 0.f;
    rs1 += y[e];
    rs2 += y[e] * y[e];
  }
  if (EVEN || row < p.M) {
    T* op = static_cast<T*>(p.out) + static_cast<long long>(row) * p.out_stride + c0;
    if (EVEN || (c0 + CPT <= p.N && (p.out_stride % 8) == 0 && (reinterpret_cast<uintptr_t>(p.out) % 16) == 0)) {
#pragma unroll
      for (int e = 0; e < CPT; e += 8) {
        alignas(16) T pk[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) pk[k] = E::one(y[e + k]);
        *reinterpret_cast<uint4*>(op + e) = *reinterpret_cast<const uint4*>(pk);
      }
    } else {
#pragma unroll
      for (int e = 0; e < CPT; ++e)
        if (c0 + e < p.N) op[e] = E::one(y[e]);
    }
  }
  if constexpr ((EPI & STATS_OUT) != 0) {
    // One part per 64 columns, whatever BN (gemm.stats_parts: the Triton split-K reduction's parts): the TPH
    // threads of a row's 64 columns are adjacent lanes.
    constexpr int TPH = TPR / (BN / 64);
    static_assert(TPH >= 1 && CPT <= 64, "a thread's columns lie in one 64-column part");
    lane_sum2<TPH>(rs1, rs2);
    const int part = n_tile * (BN / 64) + (tid % TPR) / TPH;
    if ((tid % TPH) == 0 && (EVEN || (row < p.M && part * 64 < p.N)))
      *reinterpret_cast<float2*>(p.stats_out + (static_cast<long long>(part) * p.M + row) * 2) =
          make_float2(rs1, rs2);
  }
  if (tid == 0) {
    // The partial must stay, and this CTA must not exit, until its pushes have completed.
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    stamp(3);
  }
}

}  // namespace

// One library per variant (dtype, cluster size, epilogue, tile), chosen at build time: cluster_gemm.py compiles
// each variant a process asks for, once per machine.
#ifndef CG_BF16
#define CG_BF16 0
#endif
#ifndef CG_SC
#define CG_SC 4
#endif
#ifndef CG_EPI
#define CG_EPI 0
#endif
#ifndef CG_BM
#define CG_BM 64
#endif
#ifndef CG_BN
#define CG_BN 64
#endif

using TV = Tile<CG_BM, CG_BN>;

extern "C" int cluster_gemm_variant() {
  return CG_BF16 | (CG_SC << 1) | (CG_EPI << 8) | ((CG_BM / 64) << 16) | ((CG_BN / 64) << 20) | (CG_DIAG << 24) |
         (CG_EVEN << 28);
}

extern "C" int cluster_gemm_trace_slots() { return TRACE_SLOTS; }

extern "C" long long cluster_gemm_slow_ns() { return SLOW_NS; }

extern "C" int cluster_gemm_smem_bytes(int stages) {
  return 1024 + stages * TV::STAGE_BYTES + TV::PART_BYTES + 16 * stages + 8;
}

extern "C" int cluster_gemm_launch(void* x, void* w, const void* bias, const void* res, void* out, float* stats_out,
                                   long long* trace, const float* ln_stats, const float* ln_colsum, int M, int N,
                                   int K, int x_stride, int w_stride, int res_stride, int out_stride, int per_split,
                                   int stages, int trigger_k, int n_pref, int flags, int ln_parts, float ln_eps,
                                   void* stream, char* err, int errlen) {
  constexpr int SC = CG_SC, BM = CG_BM, BN = CG_BN;
  const int n_tiles = (N + BN - 1) / BN, m_tiles = (M + BM - 1) / BM;
  if (stages < 2 || stages > MAX_STAGES || stages * TV::STAGE_BYTES < TV::PART_BYTES) {
    // (the stages hold the fp32 partial after the loop)
    snprintf(err, errlen, "stages=%d must be in 2..%d and hold the %d B partial tile (%d B a stage)", stages,
             MAX_STAGES, TV::PART_BYTES, TV::STAGE_BYTES);
    return 1;
  }
  if ((CG_EPI & LN_IN) != 0 && (ln_parts < 1 || ln_parts > MAX_LN_PARTS)) {
    snprintf(err, errlen, "ln_parts=%d must be in 1..%d", ln_parts, MAX_LN_PARTS);
    return 1;
  }
  Params p;
  memset(&p, 0, sizeof(p));
  if (encode(&p.a_map, CG_BF16, x, M, K, x_stride, BM, err, errlen) ||
      encode(&p.b_map, CG_BF16, w, N, K, w_stride, BN, err, errlen))
    return 1;
  p.bias = bias;
  p.res = res;
  p.out = out;
  p.stats_out = stats_out;
  p.trace = trace;
  p.ln_stats = ln_stats;
  p.ln_colsum = ln_colsum;
  p.ln_eps = ln_eps;
  p.ln_parts = ln_parts;
  p.M = M;
  p.N = N;
  p.K = K;
  p.res_stride = res_stride;
  p.out_stride = out_stride;
  p.k_tiles = (K + BK - 1) / BK;
  p.per_split = per_split;
  p.stages = stages;
  p.trigger_k = trigger_k;
  p.n_pref = n_pref;
  p.flags = flags;

  auto kernel = cluster_gemm_kernel<CG_BF16 != 0, SC, CG_EPI, BM, BN>;
  const int smem = (flags & NO_SPREAD) != 0 ? cluster_gemm_smem_bytes(stages)
                                            : spread_smem(cluster_gemm_smem_bytes(stages), n_tiles * m_tiles * SC);
  static int configured = 0;
  if (allow_smem(kernel, smem, configured, err, errlen)) return 1;
  return launch_z_clusters(kernel, p, dim3(n_tiles, m_tiles, SC), TV::THREADS, smem, stream, (flags & USE_PDL) != 0,
                           "cluster_gemm", err, errlen);
}
