// The feed-forward block in one kernel for a small d_model (tiny: 256), the hidden activations never in global memory:
//
//   y = act(LN(x) @ w1.T + b1) @ w2.T + b2 + residual     (x [M, D], w1 [F, D], w2 [D, F], 16-bit; fp32 accumulation)
//
// Why (docs/perf-notes.md, section 23): at tiny's 32 tokens every kernel of the layer is latency (a boundary, a first
// load, an epilogue: ~2 us each against floors of 0.01-0.17 us), so one kernel fewer is worth ~2 us if its work stays
// short. The F hidden columns are split over the SC = F / FS CTAs of a thread-block cluster (FS = 128, or 64 for a
// cluster of up to 16: half the work a CTA); CTA `rank` computes its FS hidden columns for all tokens of its token
// tile and multiplies them by its FS columns of w2, and the SC
// partial outputs are reduced inside the cluster through distributed shared memory, in 16 bits, as cluster_gemm.cu
// does for split-K.
//
// Both GEMMs are computed transposed (swap AB), so that the token count is wgmma's N (32 or 64) and not its fixed
// M = 64: hT = w1_slice @ x.T (A: 128 rows of w1, B: the token tile of x) and yT = w2_slice @ hT (A: 128 rows of w2's
// column slice, B: h as written by the first GEMM's epilogue into shared memory, K-major, 128-byte swizzled). Each
// of the two consumer warpgroups owns 64 of the 128 rows. A CTA's weights (128 x D of w1, 128 x 128 of w2; with
// OUT_IN first its 64 rows of wo) go into shared memory in 64-wide tiles, the first n_early of them (the kernel's
// prefetch ratio: ffn1.prefetch_ratio) before griddepcontrol.wait, the rest right after the token tile.
//
// With OUT_IN the block also computes the attention's out-projection in front (out.fuse 1; perf notes section 24):
//
//   x = res + a @ wo.T + bo    (a: the attention output [M, D], wo [D, D]; res: the layer's input, its residual)
//
// so that the layer has one kernel fewer again. Each CTA computes one 64-column tile jt = rank % (D / 64) of x for the
// token tile (swapped: xT = wo_rows @ a.T, its 64 rows of wo in shared memory before the wait), writes it into its
// copy of the token tile of x in GEMM 1's B layout, and pushes it with its rows' sums to the D / 64 - 1 other CTAs of
// its group of D / 64 consecutive ranks (bulk copies, as the reduce-scatter). After that exchange every CTA holds all
// of x for GEMM 1, the LayerNorm's row sums of x from the parts, and x as the block's residual.
//
// Grid: (D / 128 output column groups, token tiles, SC); a cluster spans the SC hidden slices of one (column group,
// token tile). Built at run time by kernels/mlp_cluster.py (nvcc, sm_90a), one library per variant.

#include "hopper.cuh"

namespace {

constexpr int NG = 128;       // output columns a CTA group (two consumer warpgroups of 64)
constexpr int CONSUMERS = 256;
constexpr int THREADS = CONSUMERS + 32;  // + the producer warp
constexpr int MAX_LN_PARTS = 32;
constexpr int TILE_BYTES = 128 * 64 * 2;  // a 128-row, 64-wide 16-bit weight tile (w2's)

// Epilogue bits (compile time; the activation in bits 6-7).
enum Epi { B1_F32 = 2, ATT_IN = 4, LN_IN = 8, STATS_OUT = 16, OUT_IN = 32 };
enum Flags { USE_PDL = 64 };
// The trace's stamps and the test-only defect are build variants (MLP_DIAG, as qkv_attn.cu's QA_DIAG: no branch of
// theirs in the production build): bit 0 the trace (%globaltimer, 8 a program), bit 2 racy (the token tile loaded
// before griddepcontrol.wait).
#ifndef MLP_DIAG
#define MLP_DIAG 0
#endif
constexpr bool TRACED = (MLP_DIAG & 1) != 0, RACY = (MLP_DIAG & 4) != 0;
constexpr int TRACE_SLOTS = 8;  // a program's stamps (mlp_cluster.py's TRACE_SLOTS, checked at load)

struct Params {
  CUtensorMap x_map;   // x [M, D] as [D / 64][M][64] (encode3): one box {64, BT, D / 64} brings the token tile
  CUtensorMap w1_map;  // w1 [F, D]: box {64, 128}
  CUtensorMap w2_map;  // w2 [D, F]: box {64, 128}
  CUtensorMap wo_map;  // OUT_IN: wo [D, D]: box {64, 64}
  const void* bo;      // OUT_IN: [D]
  const void* b1;      // [F] (fp32 when B1_F32: LayerNorm-folded)
  const void* b2;      // [D]
  const void* res;     // [M, D] (OUT_IN: the out-projection's residual; the block's own is x itself)
  void* out;           // [M, D]
  float* stats_out;    // [D / R, M, 2]: the output rows' sums of y and y^2 over each CTA's R = 128 / SC columns
  const float* ln_stats;   // LN_IN: [ln_parts, M, 2] sums of x and x^2 from x's producer
  const float* ln_colsum;  // LN_IN: [F] colsum of the folded w1
  float ln_eps;
  int ln_parts;
  long long* trace;    // diagnostics: %globaltimer [programs, 8]: entry, wait returned, both GEMMs done, end, then
                       // w1 landed, the token tile landed, the first GEMM done, the exchange done (OUT_IN: the
                       // attention's token tile landed, x gathered, the first GEMM done, the exchange done)
  int M, D, F;
  int res_stride, out_stride;
  int flags;
  int n_early;  // weight tiles loaded before griddepcontrol.wait, in the order wo's (OUT_IN), w1's, w2's
};

// ATT_IN (attn.fuse 1): causal attention of the 16 query rows q0.. of one head (head_dim 64) for one warp, by
// mma.sync m16n8k16: Q's rows from tile qt (then overwritten by O, 16-bit), K's and V's BT rows from tiles kt and vt
// (16-bit, 128-byte swizzled, rows past m zero and masked). S = Q K^T, the softmax of a row in the 4 lanes of a quad,
// O = P V with P in registers.
// KG: the 16-key groups these rows see (causal: q0 / 16 + 1), a compile-time count so that every load and MMA of S
// can be issued at once (a run-time skip inside the loops measured no faster: perf notes 25).
template <bool BF16, int KG, int STOP>
__device__ __forceinline__ void attention_keys(uint32_t qt, uint32_t kt, uint32_t vt, int q0, int m, int lane) {
  constexpr int NT = 2 * KG;  // 8-key tiles
  const int mat = lane / 8, r8 = lane % 8, g = lane / 4, q2 = (lane % 4) * 2;
  float s[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // head dims 16k..16k+15
    uint32_t a[4];
    ldmatrix_x4(a, swz(qt, q0 + (mat & 1) * 8 + r8, 16 * k + (mat >> 1) * 8));
#pragma unroll
    for (int n = 0; n < NT / 2; ++n) {  // keys 16n..16n+15
      uint32_t b[4];
      ldmatrix_x4(b, swz(kt, 16 * n + (mat >> 1) * 8 + r8, 16 * k + (mat & 1) * 8));
      mma_16x8x16<BF16>(s[2 * n], a, b[0], b[1]);
      mma_16x8x16<BF16>(s[2 * n + 1], a, b[2], b[3]);
    }
  }
  constexpr float scale = 1.4426950408889634f * 0.125f;  // log2(e) / sqrt(64)
  if constexpr (STOP == 1) {  // (keep S: one value a thread)
    float t = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) t += s[n][0] + s[n][1] + s[n][2] + s[n][3];
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(qt + 4 * lane), "f"(t) : "memory");
    return;
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = 8 * n + q2 + e;
        const float v = key <= q0 + g + 8 * h && key < m ? s[n][2 * h + e] * scale : -INFINITY;
        s[n][2 * h + e] = v;
        mx[h] = fmaxf(mx[h], v);
      }
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // (key 0 is valid for every row: the maxima are finite)
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
  // P = 2^(s - max) as the PV MMA's A fragments (16-bit pairs: rows g, g + 8 of key tile n). fp16: ex2.approx.f16x2,
  // two a MUFU op (the SM's MUFU rate bounds this step: perf notes 25), the row sums by an MMA with ones; bf16: in
  // fp32 (a bf16 exponent would cost too much precision), the row sums in the quad.
  uint32_t ph[NT][2];
  float l[4] = {0.f, 0.f, 0.f, 0.f};  // the row sums: l[0] row g, l[2] row g + 8
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (BF16) {
        const float p0 = exp2f(s[n][2 * h] - mx[h]), p1 = exp2f(s[n][2 * h + 1] - mx[h]);
        l[2 * h] += p0 + p1;
        ph[n][h] = pack2<true>(p0, p1);
      } else {
        asm("ex2.approx.f16x2 %0, %1;" : "=r"(ph[n][h]) : "r"(pack2<false>(s[n][2 * h] - mx[h], s[n][2 * h + 1] - mx[h])));
      }
    }
  if constexpr (BF16) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[2 * h] += __shfl_xor_sync(0xffffffffu, l[2 * h], 1);
      l[2 * h] += __shfl_xor_sync(0xffffffffu, l[2 * h], 2);
    }
  }
  if constexpr (STOP == 2) {  // (keep P and the row sums)
    uint32_t t = __float_as_uint(l[0] + l[2]);
#pragma unroll
    for (int n = 0; n < NT; ++n) t += ph[n][0] + ph[n][1];
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(qt + 4 * lane), "r"(t) : "memory");
    return;
  }
  float o[8][4];
#pragma unroll
  for (int v = 0; v < 8; ++v) o[v][0] = o[v][1] = o[v][2] = o[v][3] = 0.f;
#pragma unroll
  for (int t = 0; t < NT / 2; ++t) {  // keys 16t..16t+15
    const uint32_t a[4] = {ph[2 * t][0], ph[2 * t][1], ph[2 * t + 1][0], ph[2 * t + 1][1]};
    if constexpr (!BF16) mma_16x8x16<false>(l, a, 0x3c003c00u, 0x3c003c00u);  // (B all ones: each column a row sum)
    const int key = 16 * t + (mat & 1) * 8 + r8;
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // head dims 16u..16u+15
      uint32_t b[4];
      ldmatrix_x4_trans(b, swz(vt, key, 16 * u + (mat >> 1) * 8));
      mma_16x8x16<BF16>(o[2 * u], a, b[0], b[1]);
      mma_16x8x16<BF16>(o[2 * u + 1], a, b[2], b[3]);
    }
  }
  const float inv0 = softmax_rcp(l[0]), inv1 = softmax_rcp(l[2]);
  __syncwarp();  // every lane's Q reads done before the rows are overwritten
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(swz(qt, q0 + g, 8 * v + q2)),
                 "r"(pack2<BF16>(o[v][0] * inv0, o[v][1] * inv0)) : "memory");
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(swz(qt, q0 + g + 8, 8 * v + q2)),
                 "r"(pack2<BF16>(o[v][2] * inv1, o[v][3] * inv1)) : "memory");
  }
}

// One warp's causal attention: the 16 query rows q0.. of one head (head_dim 64) over BT keys (see attention_keys).
template <bool BF16, int BT, int STOP = 3>  // STOP (scripts/attn_probe.cu): 1 after S, 2 after the softmax
__device__ __forceinline__ void attention_rows(uint32_t qt, uint32_t kt, uint32_t vt, int q0, int m, int lane) {
  static_assert(BT == 32 || BT == 64, "token tile: 32 or 64");
  switch (q0 / 16) {  // (uniform in the warp)
    case 0: attention_keys<BF16, 1, STOP>(qt, kt, vt, q0, m, lane); break;
    case 1: attention_keys<BF16, 2, STOP>(qt, kt, vt, q0, m, lane); break;
    case 2: if constexpr (BT == 64) attention_keys<BF16, 3, STOP>(qt, kt, vt, q0, m, lane); break;
    default: if constexpr (BT == 64) attention_keys<BF16, 4, STOP>(qt, kt, vt, q0, m, lane); break;
  }
}

// acc (64 x N) += A B^T over KT 64-wide K tiles, waited for: A's tile k at a + k A_STRIDE (64 rows of a weight
// tile), B's (N rows) at b + k B_STRIDE, both K-major and 128-byte swizzled.
template <bool BF16, int N, int KT, int A_STRIDE, int B_STRIDE>
__device__ __forceinline__ void mma_tiles(float* acc, uint32_t a, uint32_t b) {
  fence_acc<N / 2>(acc);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < KT; ++k) {
    const uint64_t da = smem_desc(a + k * A_STRIDE), db = smem_desc(b + k * B_STRIDE);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_64xNx16<BF16, N>(acc, da + 2 * kk, db + 2 * kk);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc<N / 2>(acc);
}

// FS hidden columns a CTA: 128 (the two warpgroups split them in the first GEMM) or 64 (they split the tokens).
template <bool BF16, int SC, int EPI, int BT, int KT1, int FS>
__global__ void __launch_bounds__(THREADS, 1) mlp_kernel(const __grid_constant__ Params p) {
  static_assert(SC >= 2 && SC <= 16 && (SC & (SC - 1)) == 0, "hidden slices: 2 to 16 CTAs a cluster");
  static_assert(BT == 32 || BT == 64, "token tile: 32 or 64");
  static_assert(FS == 64 || FS == 128, "hidden columns a CTA: 64 or 128");
  constexpr bool OUTP = (EPI & OUT_IN) != 0;
  constexpr bool ATT = (EPI & ATT_IN) != 0;  // the attention too, every head (needs OUT_IN; one token tile)
  static_assert(!ATT || OUTP, "ATT_IN needs OUT_IN");
  static_assert(!OUTP || SC % KT1 == 0, "OUT_IN: the cluster a whole number of groups of D / 64 CTAs");
  using E = Elem<BF16>;
  using T = typename E::T;
  constexpr int ACT = (EPI >> 6) & 3;
  constexpr bool LN = (EPI & LN_IN) != 0;
  constexpr int NACC = BT / 2;           // accumulator registers a thread (wgmma m64nBT, fp32)
  constexpr int N1 = FS == 128 ? BT : BT / 2;  // the first GEMM's N a warpgroup (its tokens)
  constexpr int FT = FS / 64;            // 64-wide tiles of the hidden slice (the second GEMM's K tiles)
  constexpr int W1T = FS * 128;          // bytes of one 64-wide K tile of the w1 slice
  constexpr int XT = BT * 128;           // bytes of one 64-wide K tile of the token tile (and of h)
  constexpr int XR = BT + 8;             // the partial's row pitch, 16-bit elements (16-byte rows)
  constexpr int R = NG / SC;             // output columns (rows of yT) this CTA reduces and stores
  constexpr int SLAB = R * XR * 2;       // bytes of one slab of the partial
  constexpr int TPT = (CONSUMERS / BT < R / 2) ? CONSUMERS / BT : R / 2;  // epilogue threads a token
  constexpr int CPT = R / TPT;           // output columns a thread (adjacent)
  constexpr int ACTIVE = BT * TPT;       // epilogue threads (whole warps)
  static_assert(CPT >= 2 && CPT % 2 == 0 && TPT <= 32 && ACTIVE % 32 == 0, "epilogue mapping");

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  constexpr int kt1 = KT1;  // 64-wide K tiles of the first GEMM (D / 64)
  const uint32_t w1s = base;
  const uint32_t w2s = w1s + kt1 * W1T;
  const uint32_t xs = w2s + FT * TILE_BYTES;
  const uint32_t hs = xs + kt1 * XT;
  const uint32_t part = hs + FT * XT;
  const uint32_t recv = part + NG * XR * 2;
  constexpr int WOT = 64 * 128;             // OUT_IN: bytes of a 64-wide K tile of the 64 rows of wo
  const uint32_t kvs = recv + SC * SLAB;    // ATT_IN: K's and V's tiles (D / 64 each; Q's are in xs)
  const uint32_t wos = kvs + (ATT ? 2 * kt1 * XT : 0);  // OUT_IN: this CTA's 64 rows of wo (its 64 columns of x)
  const uint32_t x1s = wos + (OUTP ? kt1 * WOT : 0);  // OUT_IN: x's token tile, computed and gathered (GEMM 1's B)
  const uint32_t x1st = x1s + (OUTP ? kt1 * XT : 0);  // OUT_IN: x's row sums, [D / 64][BT] (s1, s2) a 64-column tile
  const uint32_t w1bar = x1st + (OUTP ? kt1 * BT * 8 : 0);  // w1's slice has landed
  const uint32_t w2bar = w1bar + 8;         // w2's slice has landed
  const uint32_t xbar = w2bar + 8;          // the token tile has landed
  const uint32_t red = xbar + 8;            // the other CTAs' slabs have landed
  const uint32_t wobar = red + 8;           // OUT_IN: wo's rows have landed
  const uint32_t x1bar = wobar + 8;         // OUT_IN: the other tiles of x (and their row sums) have landed
  float2* const lnrow = reinterpret_cast<float2*>(smem_raw + (x1bar + 8 - raw));  // BT (rstd, mean * rstd)
  T* const part16 = reinterpret_cast<T*>(smem_raw + (part - raw));
  const T* const recv16 = reinterpret_cast<const T*>(smem_raw + (recv - raw));

  const int tid = threadIdx.x;
  const int prog = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const auto stamp = [&](int slot) { trace_stamp<TRACED>(p.trace, prog * TRACE_SLOTS, slot); };  // (thread 0)
  stamp(0);
  const int n0 = blockIdx.x * NG, t0 = blockIdx.y * BT;
  const int rank = blockIdx.z;
  const int f0 = rank * FS;
  const int jt = rank % kt1;  // OUT_IN: the 64-column tile of x this CTA computes
  const bool pdl = (p.flags & USE_PDL) != 0;

  if (tid == CONSUMERS) {
    prefetch_tensormap(&p.x_map);
    prefetch_tensormap(&p.w1_map);
    prefetch_tensormap(&p.w2_map);
    mbar_init(w1bar, 1);
    mbar_init(w2bar, 1);
    mbar_init(xbar, 1);
    mbar_init(red, 1);
    mbar_expect_tx(red, (SC - 1) * SLAB);
    if constexpr (OUTP) {
      prefetch_tensormap(&p.wo_map);
      mbar_init(wobar, 1);
      mbar_init(x1bar, 1);
      mbar_expect_tx(x1bar, (kt1 - 1) * (XT + BT * 8));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();

  if (tid >= CONSUMERS) {
    if (tid == CONSUMERS) {
      // The weights never depend on the predecessor: the first n_early tiles before the wait, in the order they are
      // needed, and the rest right after the token tile (tiny, H200: all of them before the wait cost 0.24 us a
      // layer against w1's and w2's after it, perf notes 26.4). (The test-only racy variant loads the token tile
      // before them, so that nothing queued ahead of it in the TMA unit hides the race.)
      auto load_input = [&]() {  // after the wait: the token tile (ATT_IN: its Q, K and V, x_map over qkv)
        mbar_expect_tx(xbar, (ATT ? 3 : 1) * kt1 * XT);
        tma_load3<HINT_ACT>(xs, &p.x_map, xbar, t0, 0);
        if constexpr (ATT) {
          tma_load3<HINT_ACT>(kvs, &p.x_map, xbar, t0, kt1);
          tma_load3<HINT_ACT>(kvs + kt1 * XT, &p.x_map, xbar, t0, 2 * kt1);
        }
      };
      // Weight tile i: wo's (OUT_IN: the first thing needed after the wait), w1's, w2's; each barrier's bytes are
      // expected with its first tile.
      constexpr int NWO = OUTP ? kt1 : 0, NW = NWO + kt1 + FT;
      auto load_weight = [&](int i) {
        if (i < NWO) {
          if (i == 0) mbar_expect_tx(wobar, kt1 * WOT);
          tma_load<HINT_WEIGHT>(wos + i * WOT, &p.wo_map, wobar, i * 64, jt * 64);
        } else if (i < NWO + kt1) {
          const int k = i - NWO;
          if (k == 0) mbar_expect_tx(w1bar, kt1 * W1T);
          tma_load<HINT_WEIGHT>(w1s + k * W1T, &p.w1_map, w1bar, k * 64, f0);
        } else {
          const int k = i - NWO - kt1;
          if (k == 0) mbar_expect_tx(w2bar, FT * TILE_BYTES);
          tma_load<HINT_WEIGHT>(w2s + k * TILE_BYTES, &p.w2_map, w2bar, f0 + k * 64, n0);
        }
      };
      const int early = min(max(p.n_early, 0), NW);
      if (RACY) load_input();
      for (int i = 0; i < early; ++i) load_weight(i);
      gdc_wait();
      if (pdl) gdc_launch();
      if (!RACY) load_input();
      for (int i = early; i < NW; ++i) load_weight(i);
    } else {
      gdc_wait();
    }
    return;
  }

  const int warp = tid / 32, lane = tid % 32, wg = tid / 128;
  const int r_lo = (warp % 4) * 16 + lane / 4, c_lo = (lane % 4) * 2;  // fragment row and column within a warpgroup
  // The first GEMM's share of this warpgroup: hidden rows fw.. (64) and tokens tw.. (N1).
  const int fw = FS == 128 ? 64 * wg : 0, tw = FS == 128 ? 0 : N1 * wg;
  // The first epilogue's per-row inputs (weights: before the wait): hidden columns f0 + fw + r_lo (+8).
  float b1v[2], uv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = f0 + fw + r_lo + 8 * h;
    if constexpr ((EPI & B1_F32) != 0) {
      b1v[h] = static_cast<const float*>(p.b1)[f];
    } else {
      b1v[h] = E::f(static_cast<const T*>(p.b1)[f]);
    }
    uv[h] = LN ? p.ln_colsum[f] : 0.f;
  }
  gdc_wait();
  stamp(1);
  if (pdl) gdc_launch();

  // The second epilogue's inputs for this thread's token and columns, in flight during both GEMMs.
  const int et = tid / TPT;                     // token within the tile
  const int ec = (tid % TPT) * CPT;             // first column within this CTA's R
  const int row = t0 + et, rrow = min(row, p.M - 1);
  const int col = n0 + rank * R + ec;
  const bool active = tid < ACTIVE;
  const int ccol = active ? col : n0;  // (the idle threads' loads stay in bounds)
  T b2_raw[CPT], res_raw[CPT];
#pragma unroll
  for (int e = 0; e < CPT; ++e) {
    b2_raw[e] = static_cast<const T*>(p.b2)[ccol + e];
    if constexpr (!OUTP)
      res_raw[e] = static_cast<const T*>(p.res)[static_cast<long long>(rrow) * p.res_stride + ccol + e];
  }
  if constexpr (OUTP) {
    // The out-projection: xT[c, t] = sum_k wo[64 jt + c, k] a[t0 + t, k], both warpgroups on all 64 rows c, each on
    // half the tokens; + bo + res, into tile jt of x1s as GEMM 1's B operand.
    constexpr int NO = BT / 2;
    const int to = NO * wg;
    float bov[2];
    T xr[NO / 8][2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) bov[h] = E::f(static_cast<const T*>(p.bo)[64 * jt + r_lo + 8 * h]);
#pragma unroll
    for (int j = 0; j < NO / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int xrow = min(t0 + to + 8 * j + c_lo + e, p.M - 1);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          xr[j][e][h] = static_cast<const T*>(p.res)[static_cast<long long>(xrow) * p.res_stride + 64 * jt + r_lo +
                                                     8 * h];
      }
    float oacc[NO / 2];
#pragma unroll
    for (int i = 0; i < NO / 2; ++i) oacc[i] = 0.f;
    if constexpr (ATT) {  // every head's attention for the token tile, one warp 16 rows of one head, O in Q's place
      mbar_wait(xbar, 0);
#pragma unroll 1
      for (int task = warp; task < kt1 * (BT / 16); task += CONSUMERS / 32) {
        const int hd = task % kt1;
        attention_rows<BF16, BT>(xs + hd * XT, kvs + hd * XT, kvs + (kt1 + hd) * XT, 16 * (task / kt1), p.M, lane);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      consumer_sync<CONSUMERS>();
    }
    mbar_wait(wobar, 0);
    mbar_wait(xbar, 0);
    stamp(4);
    mma_tiles<BF16, NO, KT1, WOT, XT>(oacc, wos, xs + to * 128);
    const uint32_t tile = x1s + jt * XT;
#pragma unroll
    for (int j = 0; j < NO / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const T xv = E::one(oacc[4 * j + 2 * h + e] + bov[h] + E::f(xr[j][e][h]));
          asm volatile("st.shared.b16 [%0], %1;" ::"r"(swz(tile, to + 8 * j + c_lo + e, r_lo + 8 * h)),
                       "h"(*reinterpret_cast<const unsigned short*>(&xv))
                       : "memory");
        }
    consumer_sync<CONSUMERS>();
    {  // the tile's row sums (of x as rounded): TPX adjacent threads a token, CPX columns each
      constexpr int TPX = CONSUMERS / BT, CPX = 64 / TPX;
      const int t = tid / TPX, q = tid % TPX;
      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int c = 0; c < CPX; c += 8) {
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(swz(tile, t, q * CPX + c)));
        const T* vv = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float f = E::f(vv[i]);
          s1 += f;
          s2 += f * f;
        }
      }
      lane_sum2<TPX>(s1, s2);
      if (q == 0) reinterpret_cast<float2*>(smem_raw + (x1st - raw))[jt * BT + t] = make_float2(s1, s2);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    consumer_sync<CONSUMERS>();
    if (tid == 0) {  // to the other CTAs of this group of kt1 ranks: each gets one tile (and its sums) from each
      const int g = rank - jt;
#pragma unroll 1
      for (int j = 1; j < kt1; ++j) {
        const int dst = g + (jt + j) % kt1;
        bulk_push(map_to_cta(tile, dst), tile, XT, map_to_cta(x1bar, dst));
        bulk_push(map_to_cta(x1st + jt * BT * 8, dst), x1st + jt * BT * 8, BT * 8, map_to_cta(x1bar, dst));
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    mbar_wait(x1bar, 0);
    stamp(5);
    if (tid < BT) {  // the LayerNorm's row factors from the kt1 parts (lnrow: read after GEMM 1's barrier)
      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int j = 0; j < kt1; ++j) {
        const float2 v = reinterpret_cast<const float2*>(smem_raw + (x1st - raw))[j * BT + tid];
        s1 += v.x;
        s2 += v.y;
      }
      lnrow[tid] = ln_factors(s1, s2, p.D, p.ln_eps);
    }
#pragma unroll
    for (int e = 0; e < CPT; ++e) {  // the block's residual: x itself
      const int c = ccol + e;
      unsigned short v;
      asm volatile("ld.shared.b16 %0, [%1];" : "=h"(v) : "r"(swz(x1s + (c / 64) * XT, active ? et : 0, c % 64)));
      res_raw[e] = *reinterpret_cast<const T*>(&v);
    }
  }
  if constexpr (LN && !OUTP) {
    // The token's row sums from the producer's parts: LPT adjacent lanes a token, every load issued at once, not a
    // loop that waits for each (the Triton GEMMs measured ~1 us for such a loop over 12 parts; with tiny's 4 parts
    // this kernel measured the same either way, perf notes 23).
    constexpr int LPT = CONSUMERS / BT, LNP = MAX_LN_PARTS / LPT;
    const int lt = tid / LPT, lj = tid % LPT;
    const int r = min(t0 + lt, p.M - 1);
    float2 v[LNP];
#pragma unroll
    for (int i = 0; i < LNP; ++i) {
      const int q = min(lj + LPT * i, p.ln_parts - 1);
      v[i] = *reinterpret_cast<const float2*>(p.ln_stats + (static_cast<long long>(q) * p.M + r) * 2);
    }
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < LNP; ++i)
      if (lj + LPT * i < p.ln_parts) s1 += v[i].x, s2 += v[i].y;
    lane_sum2<LPT>(s1, s2);
    if (lj == 0) lnrow[lt] = ln_factors(s1, s2, p.D, p.ln_eps);
  }

  // GEMM 1: hT[f, t] = sum_k w1[f0 + f, k] x[t0 + t, k], this warpgroup's 64 rows f.
  float acc[NACC];  // (the first GEMM uses N1 / 2 of them)
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  mbar_wait(w1bar, 0);
  if constexpr (!OUTP) stamp(4);
  mbar_wait(xbar, 0);
  if constexpr (!OUTP) stamp(5);
  mma_tiles<BF16, N1, kt1, W1T, XT>(acc, w1s + fw * 128, (OUTP ? x1s : xs) + tw * 128);
  stamp(6);
  consumer_sync<CONSUMERS>();  // lnrow

  // Its epilogue: h = act(LN(x) w1 + b1) in 16 bits, stored as the second GEMM's B operand: h[t, f] K-major, the
  // 64-wide tile of this warpgroup's f, 128-byte swizzled as TMA would have written it.
  {
    const uint32_t tile = hs + (fw / 64) * XT;
#pragma unroll
    for (int j = 0; j < N1 / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = tw + 8 * j + c_lo + e;
        float2 ln = make_float2(1.f, 0.f);
        if constexpr (LN) ln = lnrow[t];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v = acc[4 * j + 2 * h + e];
          if constexpr (LN) v = ln.x * v - ln.y * uv[h];
          v = activate<ACT>(v + b1v[h]);
          const T hv = E::one(v);
          asm volatile("st.shared.b16 [%0], %1;" ::"r"(swz(tile, t, r_lo + 8 * h)),
                       "h"(*reinterpret_cast<const unsigned short*>(&hv))
                       : "memory");
        }
      }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  consumer_sync<CONSUMERS>();

  // GEMM 2: yT[n, t] = sum_f w2[n0 + n, f0 + f] h[t, f], this warpgroup's 64 rows n.
  mbar_wait(w2bar, 0);
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  mma_tiles<BF16, BT, FT, TILE_BYTES, XT>(acc, w2s + wg * (64 * 128), hs);
  stamp(2);

  // Reduce-scatter over the cluster: the partial yT [128, BT] in 16 bits; slab q (rows R q ..) goes to CTA q.
#pragma unroll
  for (int j = 0; j < BT / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      alignas(4) T pk[2] = {E::one(acc[4 * j + 2 * h]), E::one(acc[4 * j + 2 * h + 1])};
      *reinterpret_cast<uint32_t*>(part16 + (64 * wg + r_lo + 8 * h) * XR + 8 * j + c_lo) =
          *reinterpret_cast<const uint32_t*>(pk);
    }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  consumer_sync<CONSUMERS>();
  if (tid == 0) {
#pragma unroll
    for (int q = 1; q < SC; ++q) {
      const int dst = (rank + q) % SC;
      bulk_push(map_to_cta(recv + rank * SLAB, dst), part + dst * SLAB, SLAB, map_to_cta(red, dst));
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  mbar_wait(red, 0);
  stamp(7);

  // This CTA's R output columns of the token tile: y = sum of the SC slabs + b2 + residual.
  if (!active) return;  // (whole warps: the shuffles below stay within active ones)
  float y[CPT];
#pragma unroll
  for (int e = 0; e < CPT; ++e) y[e] = E::f(part16[(rank * R + ec + e) * XR + et]);
#pragma unroll
  for (int q = 0; q < SC; ++q) {
    if (q == rank) continue;
#pragma unroll
    for (int e = 0; e < CPT; ++e) y[e] += E::f(recv16[q * (SLAB / 2) + (ec + e) * XR + et]);
  }
  float rs1 = 0.f, rs2 = 0.f;
#pragma unroll
  for (int e = 0; e < CPT; ++e) {
    y[e] += E::f(b2_raw[e]) + E::f(res_raw[e]);
    rs1 += y[e];
    rs2 += y[e] * y[e];
  }
  if (row < p.M) {
    T* op = static_cast<T*>(p.out) + static_cast<long long>(row) * p.out_stride + col;
#pragma unroll
    for (int e = 0; e < CPT; e += 2) {
      alignas(4) T pk[2] = {E::one(y[e]), E::one(y[e + 1])};
      *reinterpret_cast<uint32_t*>(op + e) = *reinterpret_cast<const uint32_t*>(pk);
    }
  }
  if constexpr ((EPI & STATS_OUT) != 0) {
    // One part per CTA (its R columns; D / R parts): the TPT threads of a token are adjacent lanes.
    lane_sum2<TPT>(rs1, rs2);
    if ((tid % TPT) == 0 && row < p.M)
      *reinterpret_cast<float2*>(p.stats_out + (static_cast<long long>((n0 + rank * R) / R) * p.M + row) * 2) =
          make_float2(rs1, rs2);
  }
  if (tid == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    stamp(3);
  }
}

}  // namespace

#ifndef MLP_BF16
#define MLP_BF16 0
#endif
#ifndef MLP_SC
#define MLP_SC 8
#endif
#ifndef MLP_EPI
#define MLP_EPI 0
#endif
#ifndef MLP_BT
#define MLP_BT 32
#endif
#ifndef MLP_D
#define MLP_D 256
#endif
#ifndef MLP_FS
#define MLP_FS 128
#endif

extern "C" int mlp_diag() { return MLP_DIAG; }

extern "C" int mlp_trace_slots() { return TRACE_SLOTS; }

extern "C" int mlp_variant() {
  return MLP_BF16 | (MLP_SC << 1) | (MLP_EPI << 8) | (MLP_BT << 16) | ((MLP_D / 64) << 24) | ((MLP_FS / 64) << 29);
}

extern "C" int mlp_smem_bytes() {
  constexpr int d = MLP_D, FS = MLP_FS;
  constexpr int BT = MLP_BT, XR = BT + 8, R = NG / MLP_SC;
  constexpr int out_in = (MLP_EPI & OUT_IN) != 0 ? (d / 64) * (64 * 128 + BT * 128 + BT * 8) : 0;
  constexpr int att_in = (MLP_EPI & ATT_IN) != 0 ? 2 * (d / 64) * BT * 128 : 0;
  return 1024 + (d / 64) * FS * 128 + (FS / 64) * TILE_BYTES + (d / 64) * BT * 128 + (FS / 64) * BT * 128 +
         NG * XR * 2 + MLP_SC * R * XR * 2 + att_in + out_in + 48 + BT * 8;
}

extern "C" int mlp_launch(void* x, void* w1, void* w2, const void* b1, const void* b2, const void* res, void* out,
                          float* stats_out, const float* ln_stats, const float* ln_colsum, long long* trace,
                          void* wo, const void* bo, int M, int D, int F, int x_stride, int w1_stride,
                          int w2_stride, int res_stride, int out_stride, int flags, int ln_parts, int wo_stride,
                          int n_early,
                          float ln_eps, void* stream, char* err, int errlen) {
  constexpr int SC = MLP_SC, BT = MLP_BT, FS = MLP_FS;
  if (F != SC * FS || D != MLP_D) {
    snprintf(err, errlen, "mlp: F=%d must be %d x %d and D=%d must be %d (this build)", F, SC, FS, D, MLP_D);
    return 1;
  }
  if ((MLP_EPI & LN_IN) != 0 && (MLP_EPI & OUT_IN) == 0 && (ln_parts < 1 || ln_parts > MAX_LN_PARTS)) {
    snprintf(err, errlen, "ln_parts=%d must be in 1..%d", ln_parts, MAX_LN_PARTS);
    return 1;
  }
  Params p;
  memset(&p, 0, sizeof(p));
  constexpr bool att = (MLP_EPI & ATT_IN) != 0;  // x is then qkv [M, 3D]
  if (att && M > BT) {
    snprintf(err, errlen, "mlp: the attention in the block needs one token tile (M <= %d), not M=%d", BT, M);
    return 1;
  }
  if (encode3(&p.x_map, MLP_BF16, x, M, att ? 3 * D : D, x_stride, BT, D / 64, err, errlen) ||
      encode(&p.w1_map, MLP_BF16, w1, F, D, w1_stride, FS, err, errlen) ||
      encode(&p.w2_map, MLP_BF16, w2, D, F, w2_stride, 128, err, errlen))
    return 1;
  if ((MLP_EPI & OUT_IN) != 0 && encode(&p.wo_map, MLP_BF16, wo, D, D, wo_stride, 64, err, errlen)) return 1;
  p.bo = bo;
  p.b1 = b1;
  p.b2 = b2;
  p.res = res;
  p.out = out;
  p.stats_out = stats_out;
  p.ln_stats = ln_stats;
  p.ln_colsum = ln_colsum;
  p.ln_eps = ln_eps;
  p.ln_parts = ln_parts;
  p.trace = trace;
  p.M = M;
  p.D = D;
  p.F = F;
  p.res_stride = res_stride;
  p.out_stride = out_stride;
  p.flags = flags;
  p.n_early = n_early;
  static_assert(MLP_D % NG == 0 && MLP_D <= 512, "D: a multiple of 128 up to 512");
  auto kernel = mlp_kernel<MLP_BF16 != 0, SC, MLP_EPI, BT, MLP_D / 64, FS>;
  if (SC > 8) {  // a cluster of 16: beyond the portable 8 (Hopper allows it on request)
    static bool allowed = false;
    if (!allowed) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (e != cudaSuccess) {
        snprintf(err, errlen, "mlp: a cluster of %d: %s", SC, cudaGetErrorString(e));
        return 1;
      }
      allowed = true;
    }
  }
  const int smem = mlp_smem_bytes();
  static int configured = 0;
  if (allow_smem(kernel, smem, configured, err, errlen)) return 1;
  return launch_z_clusters(kernel, p, dim3(D / NG, (M + BT - 1) / BT, SC), THREADS, smem, stream,
                           (flags & USE_PDL) != 0, "mlp", err, errlen);
}
