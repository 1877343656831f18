// The QKV projection and the causal attention in one kernel (``qkv.fuse: 1``), for sequences of up to 128 tokens
// and head_dim 64: the layer's QKV output never goes to global memory, and the attention kernel's boundary is gone.
//
//   q, k, v = LN(x) @ w_qkv.T + b_qkv      (x [M, D], w_qkv [3 D, D], 16-bit; fp32 accumulation)
//   out[:, h] = softmax(q_h k_h^T / 8, causal) v_h     for each head h and sequence
//
// Why (docs/perf-notes.md, section 27): on bert-base the attention kernel adds ~3.2 us to the layer for a floor of
// ~0.4 us: its wait's release after the QKV grid drains, its first loads of Q, K and V, then a short computation.
// Earlier joins lost for other reasons: 12 programs for 12 heads (section 9: the work on 12 SMs), the attention as
// the QKV GEMM's tail behind global atomics (section 20: 1.4 us of arrivals). Here one thread-block cluster per
// (head, sequence) computes exactly the QKV GEMM's 64x64 tiles of that head, 3 RT CTAs (RT = ceil(seq / 64) row
// tiles; Q, K and V of each), and hands K and V to the Q CTAs through distributed shared memory:
//
// * CTA rank = 3 t + part computes rows 64 t.. of the sequence, columns part * D + 64 h.. (part 0 Q, 1 K, 2 V), as
//   cluster_gemm.cu computes one split: one consumer warpgroup (wgmma m64n64k16) and one producer warp (TMA, the
//   weight tiles of the first stages before griddepcontrol.wait). The epilogue applies the folded LayerNorm (its row
//   sums from x's producer, norm1.fuse 2) and the bias, and writes the tile in 16 bits, 128-byte swizzled: a Q CTA
//   into its own shared memory, a K or V CTA of row tile t into its own, then into the Q CTAs of row tiles t..
//   (causal: row tile t's keys are seen by queries from row tile t on) by 16-byte st.async, counted on their
//   mbarrier, and exits (QA_PUSH 1; 0, one bulk copy a Q CTA, and 2, st.async from the epilogue's registers, stay
//   as build variants for A/B: on the H200 0.1 and 0.25 us a bert-base layer slower, perf notes 33).
// * A Q CTA waits for its K and V tiles and computes the causal attention of its 64 query rows: two warpgroups, each
//   over half of the keys (attention_part: both products by wgmma, the softmax in registers), the second's share
//   merged by the first through shared memory; then it stores O.
//
// Grid: (heads, batch, 3 RT), a cluster spans z. Built at run time by kernels/qkv_attn.py (nvcc, sm_90a), one library
// per variant.

#include "hopper.cuh"

namespace {

constexpr int CONSUMERS = 128;  // the GEMM's warpgroup (warps 0-3); warps 4-7, a second warpgroup, only attend
constexpr int ATTENDERS = 2 * CONSUMERS;
constexpr int THREADS = ATTENDERS + 32;  // + the producer warp (warp 8)
constexpr int MAX_STAGES = 12;
constexpr int MAX_LN_PARTS = 32;
constexpr int TILE = 64 * BK * 2;  // a 64-row, 64-wide 16-bit tile (8 KB)
constexpr int QUAD_PARTS = MAX_LN_PARTS / 4;  // LN_IN: row-sum parts a lane of a quad loads for each of its rows

// Epilogue bits (compile time) and the run-time flag (PDL), as cluster_gemm.cu's.
enum Epi { BIAS_F32 = 2, LN_IN = 8 };
// How a K or V CTA hands its tile to the Q CTAs (a build variant, qkv_attn.PUSH): 0 one bulk copy a Q CTA from its
// shared-memory tile, 1 st.async of 16 bytes a thread a step from that tile, 2 st.async of 4 bytes straight from the
// epilogue's registers. (As run-time flags, the paths' branches cost the bulk copy's layer 0.4 us on the H200, perf
// notes 33.)
#ifndef QA_PUSH
#define QA_PUSH 1
#endif

// Diagnostics and the test-only defect, build variants too (QA_DIAG; no branch of theirs in the production build):
// bit 0 the trace's stamps (%globaltimer, 6 a program), bit 1 with them in SM cycles (clock64, 10 a program: two more
// in the epilogue, two in a Q CTA's attention), bit 2 racy (the first activation tile loaded before
// griddepcontrol.wait).
#ifndef QA_DIAG
#define QA_DIAG 0
#endif
constexpr bool TRACED = (QA_DIAG & 1) != 0, CYCLES = (QA_DIAG & 2) != 0, RACY = (QA_DIAG & 4) != 0;
// a program's stamps: %globaltimer, or with CYCLES clock64 (qkv_attn.py's TRACE_SLOTS, CYCLE_SLOTS, checked at load)
constexpr int TRACE_SLOTS = CYCLES ? 10 : 6;

enum Flags { USE_PDL = 64 };

// A Q CTA's wait for its K and V tiles; st.async's bytes come from the generic proxy, and wgmma reads them through
// the async proxy.
__device__ __forceinline__ void kv_wait(uint32_t kv) {
  if constexpr (QA_PUSH != 0) {
    mbar_wait<true>(kv, 0);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  } else {
    mbar_wait(kv, 0);
  }
}

struct Params {
  CUtensorMap a_map;  // x [M, D]: box {64, 64}
  CUtensorMap b_map;  // w_qkv [3 D, D]: box {64, 64}
  const void* bias;   // [3 D] (fp32 when BIAS_F32: LayerNorm-folded)
  void* out;          // [M, D]: the attention's output, head h in columns 64 h..
  const float* ln_stats;   // LN_IN: [ln_parts, M, 2] sums of x and x^2 from x's producer
  const float* ln_colsum;  // LN_IN: [3 D] colsum of the folded w_qkv
  float ln_eps;
  int ln_parts;
  long long* trace;   // diagnostics: %globaltimer [programs, 6]: entry, wait returned, K loop done, tile written to
                      // shared memory, K and V landed (Q) or pushed (K, V), end; with CYCLES, clock64 [programs, 10]:
                      // the same, then the LayerNorm's factors done, the first 8-column group stored, (Q) the first
                      // warpgroup's attention share done and the second's share in (barrier B)
  int M, D, seq;
  int out_stride;
  int k_tiles;        // 64-wide K tiles of D
  int stages;         // ring stages, each a chunk of KC K tiles of x and of w
  int trigger_k;      // launch_dependents after this many K tiles (-1: never early)
  int n_pref;         // weight tiles requested before griddepcontrol.wait
  int flags;
};

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One warpgroup's share of a head's causal attention: its 64 query rows (the thread's rows at positions q_pos0 and
// q_pos0 + 8 of the sequence) against the NK keys key0.. (Q at qt, those keys' K and V rows at kt and vt: 128-byte
// swizzled tiles as loaded). S = Q K^T by wgmma m64nNK, the softmax in registers (a row's scores lie in the 4 lanes
// of a quad), O = P V by wgmma with P from registers and V N-major. Returns the unnormalised O (o[4 j + 2 h + e]: row
// h, column 8 j + 2 (lane % 4) + e), the rows' maxima of the scaled scores (-inf: no key of this share) and the sums
// of their exponentials, for the merge of the two shares (flash-decoding). MASK: the share crosses the diagonal.
// (Before: mma.sync, one warp a 16-row group over all keys, 3.5 us for 128 keys; one warpgroup over all keys by wgmma,
// 1.5 us: perf notes 27.)
template <bool BF16, int NK, bool MASK>
__device__ __forceinline__ void attention_part(uint32_t qt, uint32_t kt, uint32_t vt, int key0, int q_pos0, int lane,
                                               float* o, float* mx, float* l) {
  float sc[NK / 2];
#pragma unroll
  for (int i = 0; i < NK / 2; ++i) sc[i] = 0.f;
  fence_acc<NK / 2>(sc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_64xNx16<BF16, NK>(sc, smem_desc(qt) + 2 * kk, smem_desc(kt) + 2 * kk);
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc<NK / 2>(sc);
  constexpr float scale = 1.4426950408889634f * 0.125f;  // log2(e) / sqrt(64)
  mx[0] = mx[1] = -INFINITY;
  each_acc<NK / 8>(lane, [&](int i, int h, int key) {
    // (a valid row's causal keys lie inside the sequence; rows past it are computed on zeros, never stored)
    if (MASK && key0 + key > q_pos0 + 8 * h) sc[i] = -INFINITY;
    mx[h] = fmaxf(mx[h], sc[i]);
  });
  float ms[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    mx[h] *= scale;
    ms[h] = mx[h] == -INFINITY ? 0.f : mx[h];  // (no key here: every exponential is 0)
    l[h] = 0.f;
  }
  each_acc<NK / 8>(lane, [&](int i, int h, int) {
    sc[i] = ex2(fmaf(sc[i], scale, -ms[h]));
    l[h] += sc[i];
  });
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
  uint32_t a[NK / 16][4];
#pragma unroll
  for (int t = 0; t < NK / 16; ++t) {  // keys 16t..16t+15: P in mma.sync's A fragment layout
    a[t][0] = pack2<BF16>(sc[8 * t + 0], sc[8 * t + 1]);
    a[t][1] = pack2<BF16>(sc[8 * t + 2], sc[8 * t + 3]);
    a[t][2] = pack2<BF16>(sc[8 * t + 4], sc[8 * t + 5]);
    a[t][3] = pack2<BF16>(sc[8 * t + 6], sc[8 * t + 7]);
  }
  fence_acc<32>(o);
  wgmma_fence();
#pragma unroll
  for (int t = 0; t < NK / 16; ++t) wgmma_64x64x16_rs_tb<BF16>(o, a[t], smem_desc(vt + 2048 * t));
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc<32>(o);
}

// The share of warpgroup wg (0: the first half of the keys 0..NK-1, 1: the second half) for a Q CTA of row tile t.
template <bool BF16, int RT>
__device__ __forceinline__ void attention_share(int t, int wg, uint32_t qt, uint32_t kt, uint32_t vt, int q_pos0,
                                                int lane, float* o, float* mx, float* l) {
  if (RT == 2 && t == 1) {  // keys 0..63 (none masked), 64..127 (the diagonal)
    if (wg == 0) {
      attention_part<BF16, 64, false>(qt, kt, vt, 0, q_pos0, lane, o, mx, l);
    } else {
      attention_part<BF16, 64, true>(qt, kt + 64 * 128, vt + 64 * 128, 64, q_pos0, lane, o, mx, l);
    }
  } else {  // keys 0..31, 32..63 (both cross the diagonal)
    attention_part<BF16, 32, true>(qt, kt + wg * 32 * 128, vt + wg * 32 * 128, 32 * wg, q_pos0, lane, o, mx, l);
  }
}

template <bool BF16, int EPI, int RT, int KC>
__global__ void __launch_bounds__(THREADS, 1) qkv_attn_kernel(const __grid_constant__ Params p) {
  static_assert(RT == 1 || RT == 2, "row tiles a sequence: 1 or 2 (up to 128 tokens)");
  using E = Elem<BF16>;
  using T = typename E::T;
  using BT = std::conditional_t<(EPI & BIAS_F32) != 0, float, T>;
  constexpr bool LN = (EPI & LN_IN) != 0;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const int S = p.stages;
  constexpr int CH = KC * TILE;  // one operand's chunk: KC 64-wide K tiles, one 3-D TMA box (16 KB boxes load at ~1.5x
                                 // the rate of 8 KB ones: perf notes 19.6)
  const uint32_t a_smem = base;
  const uint32_t b_smem = base + S * CH;
  const uint32_t own = b_smem + S * CH;  // this CTA's 16-bit output tile (Q: then O)
  const uint32_t kt = own + TILE;          // Q CTAs: the RT K tiles pushed by the K CTAs, then the V tiles
  const uint32_t vt = kt + RT * TILE;
  const uint32_t full = vt + RT * TILE;    // S mbarriers: the stage's bytes have landed
  const uint32_t empty = full + 8 * S;     // S mbarriers: the consumers are done with the stage
  const uint32_t kv = empty + 8 * S;       // 1 mbarrier: the K and V tiles have landed

  const int tid = threadIdx.x;
  const int prog = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  // thread 0's trace stamp(s) (diagnostics only: nothing unless TRACED, and nothing when p.trace is null)
  const auto stamp = [&](int slot, int also = -1) {
    trace_stamp<TRACED, CYCLES>(p.trace, prog * TRACE_SLOTS, slot, also);
  };
  stamp(0);
  const int head = blockIdx.x, rank = blockIdx.z, part = rank % 3, t = rank / 3;
  const int valid = min(64, p.seq - 64 * t);  // rows of this tile inside the sequence
  const int m0 = blockIdx.y * p.seq + 64 * t, n0 = part * p.D + 64 * head;
  const int n_iters = p.k_tiles / KC;  // chunks
  const bool pdl = (p.flags & USE_PDL) != 0;

  if (tid == ATTENDERS) {
    prefetch_tensormap(&p.a_map);
    prefetch_tensormap(&p.b_map);
    for (int s = 0; s < S; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS / 32);
    }
    mbar_init(kv, 1);
    // The Q CTA of row tile t receives the K and V tiles of row tiles 0..t (their complete_tx may come first).
    mbar_expect_tx(kv, part == 0 ? 2 * (t + 1) * TILE : 0);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // every CTA's barriers initialised before any CTA pushes into them

  const int warp = tid / 32, lane = tid % 32;
  const int r_lo = (warp % 4) * 16 + lane / 4, c_lo = (lane % 4) * 2;  // the thread's rows r, r + 8 and columns
  // The second share (36 x 128 floats, 18 KB), over the stages, idle by (A): the K loop has consumed every chunk. With
  // 2 stages of one 8 KB tile it runs 2 KB past the A ring into the B ring; the two rings are >= 32 KB.
  static_assert(36 * CONSUMERS * sizeof(float) <= 2 * 2 * TILE, "the second share must fit in the stages");
  float* const red = reinterpret_cast<float*>(smem_raw + (a_smem - raw));
  if (tid >= ATTENDERS) {
    if (tid == ATTENDERS) {  // producer: one thread issues the loads (cluster_gemm.cu's loop, one split)
      const int pref = (p.n_pref + KC - 1) / KC;  // chunks of weights requested before the wait
      int early = min(S, pref);                   // of which into shared memory
      if (RACY && early == 0) early = 1;
      // (the racy x chunk first: queued behind the weight chunks it would reach memory too late, perf notes 23)
      if (RACY) tma_load3<HINT_ACT>(a_smem, &p.a_map, full, m0, 0);
      for (int i = 0; i < early; ++i) {
        mbar_expect_tx(full + 8 * i, 2 * CH);
        tma_load3<HINT_WEIGHT>(b_smem + i * CH, &p.b_map, full + 8 * i, n0, i * KC);
      }
      for (int i = early; i < min(pref, n_iters); ++i) tma_prefetch_l2_3d(&p.b_map, n0, i * KC);
      gdc_wait();
      if (p.trigger_k == 0) gdc_launch();
      int s = 0;
      uint32_t phase = 0;
      for (int i = 0; i < n_iters; ++i) {
        const uint32_t bar = full + 8 * s;
        if (i >= S) mbar_wait(empty + 8 * s, phase);
        if (i >= early) {
          mbar_expect_tx(bar, 2 * CH);
          tma_load3<HINT_WEIGHT>(b_smem + s * CH, &p.b_map, bar, n0, i * KC);
        }
        if (!(RACY && i == 0)) tma_load3<HINT_ACT>(a_smem + s * CH, &p.a_map, bar, m0, i * KC);
        if (++s == S) {
          s = 0;
          if (i >= S) phase ^= 1;
        }
      }
    }
    return;
  }
  if (tid >= CONSUMERS) {
    // The second warpgroup of a Q CTA: the second half of the keys, once Q is written and K and V have landed; its
    // share goes to shared memory (thread-major: conflict-free) for the first warpgroup's merge.
    if (part != 0) return;
    if (p.trigger_k == 0) gdc_launch();  // (reads nothing of the predecessor's: no wait)
    asm volatile("bar.sync 2, %0;" ::"n"(ATTENDERS) : "memory");  // (A) Q written
    kv_wait(kv);
    float o[32], mx[2], l[2];
    attention_share<BF16, RT>(t, 1, own, kt, vt, 64 * t + r_lo, lane, o, mx, l);
    const int i0 = tid - CONSUMERS;
#pragma unroll
    for (int i = 0; i < 32; ++i) red[i * CONSUMERS + i0] = o[i];
    red[32 * CONSUMERS + i0] = mx[0];
    red[33 * CONSUMERS + i0] = mx[1];
    red[34 * CONSUMERS + i0] = l[0];
    red[35 * CONSUMERS + i0] = l[1];
    asm volatile("bar.sync 2, %0;" ::"n"(ATTENDERS) : "memory");  // (B) the share written
    return;
  }

  gdc_wait();
  stamp(1);
  if (p.trigger_k == 0) gdc_launch();

  // The epilogue's inputs, in flight before the K loop. A thread holds rows r and r + 8 of the tile (r = 16 warp +
  // lane / 4) and columns c + 8 j, c + 8 j + 1 (c = 2 (lane % 4), j < 8): wgmma's accumulator layout.
  BT bias_raw[16];
  float ln_u[LN ? 16 : 1];
  float2 ln_st[LN ? 2 * QUAD_PARTS : 1];  // rows r, r + 8: this lane's share of the parts (summed in the quad)
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = n0 + 8 * j + c_lo + e;
      bias_raw[2 * j + e] = static_cast<const BT*>(p.bias)[c];
      if constexpr (LN) ln_u[2 * j + e] = p.ln_colsum[c];
    }
  if constexpr (LN) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(m0 + r_lo + 8 * h, p.M - 1);
#pragma unroll
      for (int i = 0; i < QUAD_PARTS; ++i) {
        const int q = min(lane % 4 + 4 * i, p.ln_parts - 1);
        ln_st[h * QUAD_PARTS + i] =
            *reinterpret_cast<const float2*>(p.ln_stats + (static_cast<long long>(q) * p.M + row) * 2);
      }
    }
  }

  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  int s = 0, prev = 0;
  uint32_t phase = 0;
  for (int i = 0; i < n_iters; ++i) {
    mbar_wait(full + 8 * s, phase);
    fence_acc<32>(acc);
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      const uint64_t da = smem_desc(a_smem + s * CH + c * TILE);
      const uint64_t db = smem_desc(b_smem + s * CH + c * TILE);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) wgmma_64xNx16<BF16, 64>(acc, da + 2 * kk, db + 2 * kk);
    }
    wgmma_commit();
    fence_acc<32>(acc);
    wgmma_wait<1>();
    if (i >= 1 && i - 1 + S < n_iters) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * prev);
    }
    if (pdl && p.trigger_k > 0 && i + 1 == (p.trigger_k + KC - 1) / KC) gdc_launch();
    prev = s;
    if (++s == S) {
      s = 0;
      phase ^= 1;
    }
  }
  wgmma_wait<0>();
  stamp(2);

  // The epilogue: the folded LayerNorm, the bias, 16 bits into this CTA's tile (rows past the sequence zero: they are
  // masked keys, which must be finite).
  float ln_rstd[2] = {1.f, 1.f}, ln_mr[2] = {0.f, 0.f};
  if constexpr (LN) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int i = 0; i < QUAD_PARTS; ++i)
        if (lane % 4 + 4 * i < p.ln_parts) s1 += ln_st[h * QUAD_PARTS + i].x, s2 += ln_st[h * QUAD_PARTS + i].y;
      lane_sum2<4>(s1, s2);
      const float2 f = ln_factors(s1, s2, p.D, p.ln_eps);
      ln_rstd[h] = f.x;
      ln_mr[h] = f.y;
    }
  }
  if constexpr (CYCLES) stamp(6);
  // K or V: the tile's place in the Q CTAs of row tiles t.. (causal: row tile t's keys are seen by queries from row
  // tile t on), and their mbarriers.
  const uint32_t dst = (part == 1 ? kt : vt) + t * TILE;
  const bool from_regs = part != 0 && QA_PUSH == 2;
  uint32_t rbar[RT];
#pragma unroll
  for (int q = 0; q < RT; ++q) rbar[q] = map_to_cta(kv, 3 * q);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float a = acc[4 * j + 2 * h + e];
        if constexpr (LN) a = ln_rstd[h] * a - ln_mr[h] * ln_u[2 * j + e];
        if constexpr ((EPI & BIAS_F32) != 0) {
          a += bias_raw[2 * j + e];
        } else {
          a += E::f(bias_raw[2 * j + e]);
        }
        v[e] = r_lo + 8 * h < valid ? a : 0.f;
      }
      const uint32_t w = pack2<BF16>(v[0], v[1]);
      if (from_regs) {
        const uint32_t at = swz(dst, r_lo + 8 * h, 8 * j + c_lo);
#pragma unroll
        for (int q = 0; q < RT; ++q)
          if (q >= t) st_async_b32(map_to_cta(at, 3 * q), w, rbar[q]);
      } else {
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(swz(own, r_lo + 8 * h, 8 * j + c_lo)), "r"(w) : "memory");
      }
    }
    if (CYCLES && j == 0) stamp(7);
  }

  stamp(3);
  if (part != 0) {
    // K or V: the tile to the Q CTAs of row tiles t.. (A/B: perf notes 28).
    if constexpr (QA_PUSH == 2) {  // stored already
      stamp(4, 5);
      return;
    }
    if constexpr (QA_PUSH == 1) {  // 16 bytes a thread a step, the same byte offsets (the same swizzle) there
      consumer_sync<CONSUMERS>();
#pragma unroll
      for (int i = 0; i < TILE / 16 / CONSUMERS; ++i) {
        const uint32_t off = 16 * (tid + CONSUMERS * i);
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(own + off));
#pragma unroll
        for (int q = 0; q < RT; ++q)
          if (q >= t) st_async_v4(map_to_cta(dst + off, 3 * q), v, rbar[q]);
      }
      stamp(4, 5);
      return;
    }
    // one bulk copy a Q CTA (the bulk copies read the tile through the async proxy).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    consumer_sync<CONSUMERS>();
    if (tid == 0) {
#pragma unroll
      for (int q = 0; q < RT; ++q)
        if (q >= t) bulk_push(map_to_cta(dst, 3 * q), own, TILE, rbar[q]);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // The tile must stay, and this CTA must not exit, until the pushes have read it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      stamp(4, 5);
    }
    return;
  }

  // Q: both warpgroups attend the 64 rows once the K and V tiles have landed, each over half of the keys (every
  // thread's rows of Q written first: wgmma reads them through the async proxy); then this one merges the shares.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync 2, %0;" ::"n"(ATTENDERS) : "memory");  // (A)
  kv_wait(kv);
  stamp(4);
  float o[32], mx[2], l[2];
  attention_share<BF16, RT>(t, 0, own, kt, vt, 64 * t + r_lo, lane, o, mx, l);
  if constexpr (CYCLES) stamp(8);
  asm volatile("bar.sync 2, %0;" ::"n"(ATTENDERS) : "memory");  // (B): the other share is in `red`, and every MMA
                                                                 // has read Q, which O now overwrites
  if constexpr (CYCLES) stamp(9);
  float f0[2], f1[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // (this share holds key 0: its maximum is finite)
    const float m1 = red[(32 + h) * CONSUMERS + tid], m = fmaxf(mx[h], m1);
    const float a0 = ex2(mx[h] - m), a1 = ex2(m1 - m);
    const float inv = softmax_rcp(l[h] * a0 + red[(34 + h) * CONSUMERS + tid] * a1);
    f0[h] = a0 * inv;
    f1[h] = a1 * inv;
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int h = (i / 2) % 2;
    o[i] = o[i] * f0[h] + red[i * CONSUMERS + tid] * f1[h];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(swz(own, r_lo + 8 * h, 8 * j + c_lo)),
                   "r"(pack2<BF16>(o[4 * j + 2 * h], o[4 * j + 2 * h + 1])) : "memory");
  consumer_sync<CONSUMERS>();

  // O to global memory: 16 bytes a thread a step, rows inside the sequence only.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = tid + CONSUMERS * i, row = c / 8, ch = c % 8;
    if (row < valid) {
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(own + row * 128 + (((ch ^ row) & 7) << 4)));
      T* op = static_cast<T*>(p.out) + static_cast<long long>(m0 + row) * p.out_stride + 64 * head + 8 * ch;
      *reinterpret_cast<uint4*>(op) = v;
    }
  }
  stamp(5);
}

}  // namespace

#ifndef QA_BF16
#define QA_BF16 0
#endif
#ifndef QA_EPI
#define QA_EPI 0
#endif
#ifndef QA_RT
#define QA_RT 2
#endif
#ifndef QA_KC
#define QA_KC 2
#endif

extern "C" int qkv_attn_variant() {
  return QA_BF16 | (QA_EPI << 8) | (QA_RT << 16) | (QA_KC << 20) | (QA_PUSH << 24) | (QA_DIAG << 27);
}

extern "C" int qkv_attn_trace_slots() { return TRACE_SLOTS; }

extern "C" int qkv_attn_smem_bytes(int stages) {
  return 1024 + (2 * stages * QA_KC + 1 + 2 * QA_RT) * TILE + 16 * stages + 8;
}

extern "C" int qkv_attn_launch(void* x, void* w, const void* bias, void* out, long long* trace, const float* ln_stats,
                               const float* ln_colsum, int M, int D, int seq, int x_stride, int w_stride,
                               int out_stride, int stages, int trigger_k, int n_pref, int flags, int ln_parts, float ln_eps,
                               void* stream, char* err, int errlen) {
  constexpr int RT = QA_RT;
  if (stages < 2 || stages > MAX_STAGES) {
    snprintf(err, errlen, "stages=%d must be in 2..%d", stages, MAX_STAGES);
    return 1;
  }
  if (D % (64 * QA_KC) != 0 || seq < 1 || M % seq != 0 || (seq + 63) / 64 != RT) {
    snprintf(err, errlen, "D=%d must be a multiple of 64 (heads of 64) and of the chunk and seq=%d within 64 %d and divide M=%d", D,
             seq, RT, M);
    return 1;
  }
  if ((QA_EPI & LN_IN) != 0 && (ln_parts < 1 || ln_parts > MAX_LN_PARTS)) {
    snprintf(err, errlen, "ln_parts=%d must be in 1..%d", ln_parts, MAX_LN_PARTS);
    return 1;
  }
  if (out_stride % 8 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    snprintf(err, errlen, "out must be 16-byte aligned with rows of a multiple of 8 elements");
    return 1;
  }
  Params p;
  memset(&p, 0, sizeof(p));
  if (encode3(&p.a_map, QA_BF16, x, M, D, x_stride, 64, QA_KC, err, errlen) ||
      encode3(&p.b_map, QA_BF16, w, 3 * D, D, w_stride, 64, QA_KC, err, errlen))
    return 1;
  p.bias = bias;
  p.out = out;
  p.ln_stats = ln_stats;
  p.ln_colsum = ln_colsum;
  p.ln_eps = ln_eps;
  p.ln_parts = ln_parts;
  p.trace = trace;
  p.M = M;
  p.D = D;
  p.seq = seq;
  p.out_stride = out_stride;
  p.k_tiles = D / 64;
  p.stages = stages;
  p.trigger_k = trigger_k;
  p.n_pref = n_pref;
  p.flags = flags;

  auto kernel = qkv_attn_kernel<QA_BF16 != 0, QA_EPI, RT, QA_KC>;
  const int heads = D / 64, batch = M / seq;
  const int smem = spread_smem(qkv_attn_smem_bytes(stages), heads * batch * 3 * RT);
  static int configured = 0;
  if (allow_smem(kernel, smem, configured, err, errlen)) return 1;
  return launch_z_clusters(kernel, p, dim3(heads, batch, 3 * RT), THREADS, smem, stream, (flags & USE_PDL) != 0,
                           "qkv_attn", err, errlen);
}
