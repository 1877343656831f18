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
enum Epi { HAS_BIAS = 1, BIAS_F32 = 2, HAS_RES = 4, LN_IN = 8, STATS_OUT = 16 };
// Runtime flags.
enum Flags {
  USE_PDL = 64,
  RACY = 128,  // test-only defect: the first activation tile is loaded before griddepcontrol.wait
  // bits 8-11: 1 + the most weight tiles loaded into shared memory before griddepcontrol.wait (0: every stage's);
  // the rest of the prefetch goes to L2 only
  EARLY_SHIFT = 8,
  NO_SPREAD = 4096,  // A/B only: request just the shared memory the kernel uses (two CTAs may share an SM)
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
  float inv_k;            // 1 / K (the LayerNorm's mean without a division)
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


// KT: 64-wide K tiles a stage, loaded by one TMA box an operand (3-D tensor maps, encode3): a box costs the SM's TMA
// unit ~250 cycles whatever its size up to 16 KB (L2 hits; scripts/wgmma_bench.py), so one box a K tile bounds a CTA
// at 32 B/cycle with 64-row tiles. With KT > 1, p.stages counts stages of KT tiles and per_split is a multiple of KT.
// The epilogue of an unsplit tile straight from the wgmma accumulator fragments (m64nBNk16, fp32): a thread holds rows
// r and r + 8 (r = 16 * warp + lane / 4) and, for j < BN / 8, columns c + 8j and c + 8j + 1 (c = 2 * (lane % 4)) in
// acc[4j + 2h + e] (row r + 8h, column c + 8j + e). Its inputs are loaded in that layout before the K loop: bias and
// LayerNorm column sums two columns at a time, the residual two columns of a row at a time (4 or 8 bytes), and the
// row's LayerNorm parts q = lane % 4 + 4i, summed over the row's 4 lanes after the loop. No shared memory, no barrier:
// the split tiles' epilogue (fp32 tile to shared memory, two barriers, read back 8 columns a thread) took 1.25-2 us
// on bert-base's QKV and FFN1 against Triton's 0.25-0.5 (perf notes 19.7).
template <typename BT, typename T, int BN, bool LN>
struct FragIn {
  static constexpr int NJ = BN / 8;
  static constexpr int LNQ = MAX_LN_PARTS / 4;
  alignas(8) BT bias[NJ][2];
  alignas(8) T res[2][NJ][2];
  alignas(8) float u[LN ? NJ : 1][2];
  float2 st[2][LN ? LNQ : 1];

  template <typename U>
  __device__ static void pair(U (&dst)[2], const U* src, long long i, int c, int n) {
    // two elements at src[i], src[i + 1] (columns c, c + 1): one load where both lie inside n and are aligned,
    // else each clamped to column n - 1
    if (c + 1 < n && (reinterpret_cast<uintptr_t>(src + i) % (2 * sizeof(U))) == 0) {
      if constexpr (sizeof(U) == 2) {
        *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src + i);
      } else {
        *reinterpret_cast<float2*>(dst) = *reinterpret_cast<const float2*>(src + i);
      }
    } else {
      dst[0] = src[i - c + min(c, n - 1)];
      dst[1] = src[i - c + min(c + 1, n - 1)];
    }
  }

  template <int EPI, typename P>
  __device__ void load(const P& p, int r, int c, int q0) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int cj = c + 8 * j;
      if constexpr ((EPI & HAS_BIAS) != 0) pair(bias[j], static_cast<const BT*>(p.bias), cj, cj, p.N);
      if constexpr (LN) pair(u[j], p.ln_colsum, cj, cj, p.N);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr ((EPI & HAS_RES) != 0)
          pair(res[h][j], static_cast<const T*>(p.res),
               static_cast<long long>(min(r + 8 * h, p.M - 1)) * p.res_stride + cj, cj, p.N);
      }
    }
    if constexpr (LN) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < LNQ; ++i) {
          const int q = min(q0 + 4 * i, p.ln_parts - 1);
          st[h][i] = *reinterpret_cast<const float2*>(
              p.ln_stats + (static_cast<long long>(q) * p.M + min(r + 8 * h, p.M - 1)) * 2);
        }
      }
    }
  }

  template <int EPI, typename E, typename P, int NACC>
  __device__ void finish(const P& p, float (&acc)[NACC], int r, int c, int q0, int n_tile) {
    constexpr int ACT = (EPI >> 6) & 3;
    float rstd[2] = {1.f, 1.f}, mr[2] = {0.f, 0.f};
    if constexpr (LN) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int i = 0; i < LNQ; ++i) {
          if (q0 + 4 * i < p.ln_parts) s1 += st[h][i].x, s2 += st[h][i].y;
        }
        // the row's 4 lanes (lane % 4)
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s2 += __shfl_xor_sync(0xffffffffu, s2, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
        s2 += __shfl_xor_sync(0xffffffffu, s2, 2);
        const float mean = s1 * p.inv_k;
        rstd[h] = rsqrtf(fmaxf(s2 * p.inv_k - mean * mean, 0.f) + p.ln_eps);
        mr[h] = mean * rstd[h];
      }
    }
    float rs1[2] = {0.f, 0.f}, rs2[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = acc[4 * j + 2 * h + e];
          if constexpr (LN) v = rstd[h] * v - mr[h] * u[j][e];
          if constexpr ((EPI & HAS_BIAS) != 0) {
            if constexpr ((EPI & BIAS_F32) != 0) {
              v += bias[j][e];
            } else {
              v += E::f(bias[j][e]);
            }
          }
          v = activate<ACT>(v);
          if constexpr ((EPI & HAS_RES) != 0) v += E::f(res[h][j][e]);
          v = (c + 8 * j + e < p.N) ? v : 0.f;
          acc[4 * j + 2 * h + e] = v;
          rs1[h] += v;
          rs2[h] += v * v;
        }
    using T2 = typename E::T;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r + 8 * h;
      if (row >= p.M) continue;
      T2* op = static_cast<T2*>(p.out) + static_cast<long long>(row) * p.out_stride;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int cj = c + 8 * j;
        alignas(4) T2 pk[2] = {E::one(acc[4 * j + 2 * h]), E::one(acc[4 * j + 2 * h + 1])};
        if (cj + 1 < p.N && (reinterpret_cast<uintptr_t>(op + cj) % 4) == 0) {
          *reinterpret_cast<uint32_t*>(op + cj) = *reinterpret_cast<const uint32_t*>(pk);
        } else {
          if (cj < p.N) op[cj] = pk[0];
          if (cj + 1 < p.N) op[cj + 1] = pk[1];
        }
      }
    }
    if constexpr ((EPI & STATS_OUT) != 0) {
      // One part per column tile, as the unsplit Triton GEMM writes them (gemm.stats_parts).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float s1 = rs1[h], s2 = rs2[h];
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s2 += __shfl_xor_sync(0xffffffffu, s2, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
        s2 += __shfl_xor_sync(0xffffffffu, s2, 2);
        const int row = r + 8 * h;
        if (q0 == 0 && row < p.M)
          *reinterpret_cast<float2*>(p.stats_out + (static_cast<long long>(n_tile) * p.M + row) * 2) =
              make_float2(s1, s2);
      }
    }
  }
};

template <bool BF16, int SC, int EPI, int BM, int BN, int KT>
__global__ void __launch_bounds__(Tile<BM, BN>::THREADS, 1) cluster_gemm_kernel(const __grid_constant__ Params p) {
  static_assert(SC == 1 || SC == 2 || SC == 4, "the K splits of a tile: 1 (no split), 2 or 4 CTAs a cluster");
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
  // The epilogue's mapping: TPR consumer threads a row (adjacent lanes), CPT columns a thread, RP rows a thread
  // RSTEP apart. A split tile's R rows take one group of threads each (RP 1); an unsplit tile (SC 1) goes 8 columns a
  // thread over RP rows (2 threads a row, 32 columns each, made its epilogue 2.5x longer: perf notes 19.7).
  constexpr int TPR = SC == 1 ? BN / 8 : CONSUMERS / R;
  constexpr int RP = R * TPR / CONSUMERS;
  constexpr int RSTEP = CONSUMERS / TPR;
  constexpr int CPT = BN / TPR;          // columns a thread
  constexpr int SLAB = R * SROW * 4;     // bytes of one row slab of a partial tile
  constexpr int LNP = MAX_LN_PARTS / TPR;  // LN_IN: row-sum parts a thread loads
  static_assert(TPR <= 32 && 32 % TPR == 0 && CPT % 8 == 0 && RP >= 1 && RP * RSTEP == R, "epilogue mapping");

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const int S = p.stages;
  constexpr int A_STAGE = KT * TL::A_BYTES, B_STAGE = KT * TL::B_BYTES;
  const uint32_t a_smem = base;
  const uint32_t b_smem = base + S * A_STAGE;
  const uint32_t recv = b_smem + S * B_STAGE;  // SC row slabs pushed here by the cluster (slot = source rank)
  const uint32_t full = recv + TL::PART_BYTES;     // S mbarriers: the stage's bytes have landed
  const uint32_t empty = full + 8 * S;             // S mbarriers: the consumers are done with the stage
  const uint32_t red = empty + 8 * S;              // 1 mbarrier: the other CTAs' slabs have landed
  // This CTA's partial after the loop, over the idle A and B stages (the host checks that they hold it).
  float* const part = reinterpret_cast<float*>(smem_raw + (a_smem - raw));
  const float* const slabs = reinterpret_cast<const float*>(smem_raw + (recv - raw));

  const int tid = threadIdx.x;
  const int prog = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (p.trace != nullptr && tid == 0) p.trace[prog * 4 + 0] = globaltimer();
  const int n_tile = blockIdx.x, m_tile = blockIdx.y;
  const int rank = blockIdx.z;  // the cluster spans the SC splits of this tile: rank = split
  const int m0 = m_tile * BM, n0 = n_tile * BN;
  const int k_first = rank * p.per_split;
  const int n_iters = max(0, min(p.per_split, p.k_tiles - k_first)) / KT;  // stages of this split
  const bool pdl = (p.flags & USE_PDL) != 0;

  if (tid == CONSUMERS) {
    prefetch_tensormap(&p.a_map);
    prefetch_tensormap(&p.b_map);
    for (int s = 0; s < S; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS / 32);  // one arrival per consumer warp
    }
    mbar_init(red, 1);
    // The one arrival of `red`'s phase, with the bytes the SC-1 other CTAs will push (their complete_tx may
    // come first: the phase cannot complete before this arrival).
    mbar_expect_tx(red, (SC - 1) * SLAB);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Every CTA's barriers must be initialised before any CTA of the cluster pushes into them.
  cluster_sync();

  if (tid >= CONSUMERS) {
    // Producer warp: one thread issues the loads.
    if (tid == CONSUMERS) {
      const bool racy = (p.flags & RACY) != 0;
      int early = p.n_pref > 0 ? min(S, n_iters) : 0;  // stages whose weight tiles go before the wait
      const int cap = (p.flags >> EARLY_SHIFT) & 15;
      if (cap > 0) early = min(early, (cap - 1 + KT - 1) / KT);
      if (racy && early == 0 && n_iters > 0) early = 1;
      auto load_b = [&](int i, uint32_t dst, uint32_t bar) {
        if constexpr (KT == 1) {
          tma_load(dst, &p.b_map, bar, (k_first + i) * BK, n0);
        } else {
          tma_load3(dst, &p.b_map, bar, n0, k_first + i * KT);
        }
      };
      auto load_a = [&](int i, uint32_t dst, uint32_t bar) {
        if constexpr (KT == 1) {
          tma_load(dst, &p.a_map, bar, (k_first + i) * BK, m0);
        } else {
          tma_load3(dst, &p.a_map, bar, m0, k_first + i * KT);
        }
      };
      for (int i = 0; i < early; ++i) {
        mbar_expect_tx(full + 8 * i, KT * TL::STAGE_BYTES);
        load_b(i, b_smem + i * B_STAGE, full + 8 * i);
      }
      for (int i = early * KT; i < min(p.n_pref, n_iters * KT); ++i) {
        if constexpr (KT == 1) {
          tma_prefetch_l2(&p.b_map, (k_first + i) * BK, n0);
        } else {
          tma_prefetch_l2_3d(&p.b_map, n0, k_first + i);  // (a one-tile box of the 3-D map would be KT tiles)
        }
      }
      if (racy && n_iters > 0) load_a(0, a_smem, full);
      gdc_wait();
      if (p.trigger_k == 0) gdc_launch();
      int s = 0;
      uint32_t phase = 0;  // of the stage's empty barrier, from the second round on
      for (int i = 0; i < n_iters; ++i) {
        const uint32_t bar = full + 8 * s;
        if (i >= S) mbar_wait(empty + 8 * s, phase);
        if (i >= early) {
          mbar_expect_tx(bar, KT * TL::STAGE_BYTES);
          load_b(i, b_smem + s * B_STAGE, bar);
        }
        if (!(racy && i == 0)) load_a(i, a_smem + s * A_STAGE, bar);
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
  if (tid == 0 && p.trace != nullptr) p.trace[prog * 4 + 1] = globaltimer();
  if (p.trigger_k == 0) gdc_launch();

  // The epilogue's inputs for this thread's row and columns of the CTA's slab, loaded now (clamped addresses,
  // no branches, no conversion) so that all are in flight before the K loop and waited for only after it.
  const int lr = tid / TPR;                  // first row within the slab (then every RSTEP rows)
  const int row = m0 + rank * R + lr;        // global row of the first
  const int c0 = n0 + (tid % TPR) * CPT;     // first global column
  // An unsplit tile (FRAG) takes its epilogue straight from the accumulator fragments (frag_epilogue), with inputs
  // in the fragments' layout; a split tile takes it from the reduced slab, TPR threads a row.
  constexpr bool FRAG = SC == 1;
  constexpr int NF = FRAG ? 1 : RP;  // (the slab arrays, unused by FRAG)
  alignas(16) BT bias_raw[FRAG ? 1 : CPT];
  alignas(16) T res_raw[NF][FRAG ? 1 : CPT];
  alignas(16) float ln_u[LN && !FRAG ? CPT : 1];
  float2 ln_st[NF][LN && !FRAG ? LNP : 1];  // this thread's share of each row's parts (summed over the TPR lanes)
  FragIn<BT, T, BN, LN> fin;
  if constexpr (FRAG) fin.template load<EPI>(p, m0 + warp * 16 + lane / 4, n0 + (lane % 4) * 2, lane % 4);
  // 8 columns at a time: 16-byte loads where the 8 lie inside N and the rows are 16-byte aligned, else one clamped
  // element at a time.
  const bool vec = (reinterpret_cast<uintptr_t>(p.bias) | reinterpret_cast<uintptr_t>(p.res) |
                    reinterpret_cast<uintptr_t>(p.ln_colsum)) % 16 == 0 && p.res_stride % 8 == 0;
#pragma unroll
  for (int e8 = 0; e8 < (FRAG ? 0 : CPT); e8 += 8) {
    if (vec && c0 + e8 + 8 <= p.N) {
      const int c = c0 + e8;
      if constexpr ((EPI & HAS_BIAS) != 0) {
        if constexpr ((EPI & BIAS_F32) != 0) {
          *reinterpret_cast<float4*>(&bias_raw[e8]) = *reinterpret_cast<const float4*>(static_cast<const float*>(p.bias) + c);
          *reinterpret_cast<float4*>(&bias_raw[e8 + 4]) =
              *reinterpret_cast<const float4*>(static_cast<const float*>(p.bias) + c + 4);
        } else {
          *reinterpret_cast<uint4*>(&bias_raw[e8]) = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.bias) + c);
        }
      }
#pragma unroll
      for (int r = 0; r < RP; ++r) {
        const int rrow = min(row + r * RSTEP, p.M - 1);
        if constexpr ((EPI & HAS_RES) != 0)
          *reinterpret_cast<uint4*>(&res_raw[r][e8]) =
              *reinterpret_cast<const uint4*>(static_cast<const T*>(p.res) + static_cast<long long>(rrow) * p.res_stride + c);
      }
      if constexpr (LN) {
        *reinterpret_cast<float4*>(&ln_u[e8]) = *reinterpret_cast<const float4*>(p.ln_colsum + c);
        *reinterpret_cast<float4*>(&ln_u[e8 + 4]) = *reinterpret_cast<const float4*>(p.ln_colsum + c + 4);
      }
    } else {
#pragma unroll
      for (int e = e8; e < e8 + 8; ++e) {
        const int c = min(c0 + e, p.N - 1);
        if constexpr ((EPI & HAS_BIAS) != 0) bias_raw[e] = static_cast<const BT*>(p.bias)[c];
#pragma unroll
        for (int r = 0; r < RP; ++r) {
          const int rrow = min(row + r * RSTEP, p.M - 1);
          if constexpr ((EPI & HAS_RES) != 0)
            res_raw[r][e] = static_cast<const T*>(p.res)[static_cast<long long>(rrow) * p.res_stride + c];
        }
        if constexpr (LN) ln_u[e] = p.ln_colsum[c];
      }
    }
  }
  if constexpr (LN && !FRAG) {
#pragma unroll
    for (int r = 0; r < RP; ++r) {
      const int rrow = min(row + r * RSTEP, p.M - 1);
#pragma unroll
      for (int i = 0; i < LNP; ++i) {
        const int q = min((tid % TPR) + TPR * i, p.ln_parts - 1);
        ln_st[r][i] = *reinterpret_cast<const float2*>(p.ln_stats + (static_cast<long long>(q) * p.M + rrow) * 2);
      }
    }
  }

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  int s = 0, prev = 0;  // this tile's stage and the previous one's
  uint32_t phase = 0;
  for (int i = 0; i < n_iters; ++i) {
    mbar_wait(full + 8 * s, phase);
    fence_acc<NACC>(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      const uint64_t da = smem_desc(a_smem + s * A_STAGE + k * TL::A_BYTES + wg * (64 * BK * 2));
      const uint64_t db = smem_desc(b_smem + s * B_STAGE + k * TL::B_BYTES);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) wgmma_64xNx16<BF16, BN>(acc, da + 2 * kk, db + 2 * kk);
    }
    wgmma_commit();
    fence_acc<NACC>(acc);
    // Keep this tile's MMAs in flight while the next tile is awaited, and hand the previous tile's stage back
    // to the producer (the host requires 2 stages or more).
    wgmma_wait<1>();
    if (i >= 1 && i - 1 + S < n_iters) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * prev);
    }
    if (pdl && p.trigger_k > 0 && i + 1 == (p.trigger_k + KT - 1) / KT) gdc_launch();
    prev = s;
    if (++s == S) {
      s = 0;
      phase ^= 1;
    }
  }
  wgmma_wait<0>();
  if (tid == 0 && p.trace != nullptr) p.trace[prog * 4 + 2] = globaltimer();
  if constexpr (FRAG) {
    // No split: no exchange, no shared-memory round trip; each thread finishes its own fragments.
    fin.template finish<EPI, E>(p, acc, m0 + warp * 16 + lane / 4, n0 + (lane % 4) * 2, lane % 4, n_tile);
    if (tid == 0 && p.trace != nullptr) p.trace[prog * 4 + 3] = globaltimer();
    return;
  }

  // Reduce-scatter. Every MMA of the warpgroups is done (the barrier), so the stages hold this CTA's partial.
  consumer_sync<CONSUMERS>();
  {
    const int r_lo = warp * 16 + lane / 4, c_lo = (lane % 4) * 2;  // (warp counts over the warpgroups: 64*wg + ..)
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(part + (r_lo + 8 * h) * SROW + c_lo + 8 * j) =
            make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  }
  // The bulk copies read the partial through the async proxy: order the stores before them.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  consumer_sync<CONSUMERS>();
  if (tid == 0) {
#pragma unroll
    for (int q = 1; q < SC; ++q) {
      const int dst = (rank + q) % SC;
      bulk_push(map_to_cta(recv + rank * SLAB, dst), a_smem + dst * SLAB, SLAB, map_to_cta(red, dst));
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  mbar_wait(red, 0);

  // This CTA's slab: its own partial's rows plus the SC-1 pushed ones.
  float y[RP][CPT];
#pragma unroll
  for (int r = 0; r < RP; ++r) {
    const float* own = part + (rank * R + lr + r * RSTEP) * SROW + (tid % TPR) * CPT;
#pragma unroll
    for (int e = 0; e < CPT; e += 4) {
      float4 v = *reinterpret_cast<const float4*>(own + e);
      y[r][e] = v.x, y[r][e + 1] = v.y, y[r][e + 2] = v.z, y[r][e + 3] = v.w;
    }
#pragma unroll
    for (int q = 0; q < SC; ++q) {
      if (q == rank) continue;
      const float* o = slabs + q * (SLAB / 4) + (lr + r * RSTEP) * SROW + (tid % TPR) * CPT;
#pragma unroll
      for (int e = 0; e < CPT; e += 4) {
        float4 v = *reinterpret_cast<const float4*>(o + e);
        y[r][e] += v.x, y[r][e + 1] += v.y, y[r][e + 2] += v.z, y[r][e + 3] += v.w;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RP; ++r) {
  const int row_r = row + r * RSTEP;
  float ln_rstd = 1.f, ln_mr = 0.f;
  if constexpr (LN) {
    // The row's sums of x and x^2: this thread's parts (those past ln_parts were clamped to the last: not counted),
    // then the row's TPR lanes.
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < LNP; ++i) {
      if ((tid % TPR) + TPR * i < p.ln_parts) s1 += ln_st[r][i].x, s2 += ln_st[r][i].y;
    }
#pragma unroll
    for (int o = 1; o < TPR; o *= 2) {
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    const float mean = s1 * p.inv_k;
    ln_rstd = rsqrtf(fmaxf(s2 * p.inv_k - mean * mean, 0.f) + p.ln_eps);
    ln_mr = mean * ln_rstd;
  }
  float rs1 = 0.f, rs2 = 0.f;
#pragma unroll
  for (int e = 0; e < CPT; ++e) {
    float v = y[r][e];
    if constexpr (LN) v = ln_rstd * v - ln_mr * ln_u[e];
    if constexpr ((EPI & HAS_BIAS) != 0) {
      if constexpr ((EPI & BIAS_F32) != 0) {
        v += bias_raw[e];
      } else {
        v += E::f(bias_raw[e]);
      }
    }
    v = activate<ACT>(v);
    if constexpr ((EPI & HAS_RES) != 0) v += E::f(res_raw[r][e]);
    y[r][e] = (c0 + e < p.N) ? v : 0.f;
    rs1 += y[r][e];
    rs2 += y[r][e] * y[r][e];
  }
  if (row_r < p.M) {
    T* op = static_cast<T*>(p.out) + static_cast<long long>(row_r) * p.out_stride + c0;
    if (c0 + CPT <= p.N && (p.out_stride % 8) == 0 && (reinterpret_cast<uintptr_t>(p.out) % 16) == 0) {
#pragma unroll
      for (int e = 0; e < CPT; e += 8) {
        alignas(16) T pk[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) pk[k] = E::one(y[r][e + k]);
        *reinterpret_cast<uint4*>(op + e) = *reinterpret_cast<const uint4*>(pk);
      }
    } else {
#pragma unroll
      for (int e = 0; e < CPT; ++e)
        if (c0 + e < p.N) op[e] = E::one(y[r][e]);
    }
  }
  if constexpr ((EPI & STATS_OUT) != 0) {
    // One part per 64 columns, whatever BN (gemm.stats_parts: the Triton split-K reduction's parts): the TPH
    // threads of a row's 64 columns are adjacent lanes.
    constexpr int TPH = TPR / (BN / 64);
    static_assert(TPH >= 1 && CPT <= 64, "a thread's columns lie in one 64-column part");
#pragma unroll
    for (int o = 1; o < TPH; o *= 2) {
      rs1 += __shfl_xor_sync(0xffffffffu, rs1, o);
      rs2 += __shfl_xor_sync(0xffffffffu, rs2, o);
    }
    const int part = n_tile * (BN / 64) + (tid % TPR) / TPH;
    if ((tid % TPH) == 0 && row_r < p.M && part * 64 < p.N)
      *reinterpret_cast<float2*>(p.stats_out + (static_cast<long long>(part) * p.M + row_r) * 2) =
          make_float2(rs1, rs2);
  }
  }  // rows r
  if (tid == 0) {
    // The partial must stay, and this CTA must not exit, until its pushes have completed.
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    if (p.trace != nullptr) p.trace[prog * 4 + 3] = globaltimer();
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
#ifndef CG_KT
#define CG_KT 1
#endif

using TV = Tile<CG_BM, CG_BN>;

extern "C" int cluster_gemm_variant() {
  return CG_BF16 | (CG_SC << 1) | (CG_EPI << 8) | ((CG_BM / 64) << 16) | ((CG_BN / 64) << 20) | (CG_KT << 24);
}

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
  constexpr int KT = CG_KT;
  if (KT > 1 && (K % BK != 0 || per_split % KT != 0 || (K / BK) % per_split != 0 || stages < 2 * KT ||
                 (stages / KT) * KT * TV::STAGE_BYTES < TV::PART_BYTES)) {
    snprintf(err, errlen, "stages of %d K tiles need K %% 64 == 0 (K=%d), whole splits (per_split=%d) of a multiple "
             "of %d tiles and 2 stages (stages=%d)", KT, K, per_split, KT, stages);
    return 1;
  }
  if (KT == 1 ? (encode(&p.a_map, CG_BF16, x, M, K, x_stride, BM, err, errlen) ||
                 encode(&p.b_map, CG_BF16, w, N, K, w_stride, BN, err, errlen))
              : (encode3(&p.a_map, CG_BF16, x, M, K, x_stride, BM, KT, err, errlen) ||
                 encode3(&p.b_map, CG_BF16, w, N, K, w_stride, BN, KT, err, errlen)))
    return 1;
  p.bias = bias;
  p.res = res;
  p.out = out;
  p.stats_out = stats_out;
  p.trace = trace;
  p.ln_stats = ln_stats;
  p.ln_colsum = ln_colsum;
  p.ln_eps = ln_eps;
  p.inv_k = 1.0f / K;
  p.ln_parts = ln_parts;
  p.M = M;
  p.N = N;
  p.K = K;
  p.res_stride = res_stride;
  p.out_stride = out_stride;
  p.k_tiles = (K + BK - 1) / BK;
  p.per_split = per_split;
  p.stages = stages / KT;  // (stages of KT tiles)
  p.trigger_k = trigger_k;
  p.n_pref = n_pref;
  p.flags = flags;

  auto kernel = cluster_gemm_kernel<CG_BF16 != 0, SC, CG_EPI, BM, BN, KT>;
  // One CTA to an SM where the grid could double up: a footprint under half an SM lets two CTAs of this kernel
  // share one and halve each other's bandwidth (H200, bert-base: the out-projection's 96 CTAs at 66 KB added
  // 3.84-3.86 us to the layer, padded 2.94-2.95; perf notes 16.7). A grid of at most half the SMs cannot double
  // up and is left as it is, so that the neighbouring kernels' CTAs may still share its SMs.
  static int spread = -1, sms = 0;
  if (spread < 0) {
    int dev = 0, per_sm = 0, reserved = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    spread = per_sm > 0 ? per_sm / 2 - reserved + 16 : 0;  // two CTAs need 2 * (smem + reserved) <= per_sm
  }
  const bool pad = (flags & NO_SPREAD) == 0 && 2 * n_tiles * m_tiles * SC > sms;
  const int smem = pad ? max(cluster_gemm_smem_bytes(stages), spread) : cluster_gemm_smem_bytes(stages);
  static int configured = 0;
  if (allow_smem(kernel, smem, configured, err, errlen)) return 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(n_tiles, m_tiles, SC);
  cfg.blockDim = dim3(TV::THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attrs[2];
  int n = 0;
  attrs[n].id = cudaLaunchAttributeClusterDimension;
  attrs[n].val.clusterDim.x = 1;
  attrs[n].val.clusterDim.y = 1;
  attrs[n].val.clusterDim.z = SC;
  ++n;
  if (flags & USE_PDL) add_pdl(attrs, n);
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, p);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "cluster_gemm launch (grid %d x %d x %d, cluster 1x1x%d, %d B shared memory): %s", n_tiles,
             m_tiles, SC, SC, smem, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
