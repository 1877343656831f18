// The whole pre-LN decoder layer in one persistent CUDA kernel, with a readiness flag per tile instead of kernel
// boundaries or grid barriers (docs/perf-notes.md, section 17):
//
//   a = x + out(attn(qkv(LN1(x))));   y = a + ffn2(gelu(ffn1(LN2(a))))
//
// The layer is a list of tasks in five phases: QKV tiles (LayerNorm 1 folded into the weights, its row sums taken
// from the A tiles as they pass through shared memory), causal attention (one head, 64 query rows), out-projection
// tiles (split-K), FFN1 tiles (LayerNorm 2 folded, GELU), FFN2 tiles (split-K). Every GEMM tile is 64 x 64, K in
// 64-wide tiles. CTA c (one a SM, all resident) takes tasks c, c + grid, c + 2 grid, ... in order; a task depends
// only on tasks before it in the list, so waiting cannot deadlock.
//
// A CTA: one consumer warpgroup (warps 0-3: wgmma, softmax, epilogues) and one producer warp (warp 4: polls the
// flags and issues the TMA loads). The producer runs ahead through a ring of STAGES (A, B) stages that continues
// from task to task: the weight (B) tiles of its next task are loaded as soon as a stage frees, before the task's
// activations are ready; the activation (A) loads of those stages wait for the flags.
//
// Flags. Each 64 x 64 tile of qkv, attn, h and ffn1 has an int counter in `sync`; its writer stores the tile,
// orders the stores before the async proxy's reads (fence.proxy.async) and adds 1 with release semantics. A reader
// polls with relaxed loads, then fence.acq_rel and fence.proxy.async before its TMA loads. Counters are never
// reset: in launch g (the per-CTA generation word, read after griddepcontrol.wait) a tile is ready at g + 1.
// Split-K: each split adds its fp32 partial into the tile's workspace (red.add), then takes a ticket from the
// tile's counter; the last split reads the sum, zeroes the workspace for the next launch and applies the epilogue.
//
// Built at run time by kernels/layer_cuda.py (one library per operand dtype) and called through ctypes. The Triton
// layer kernel (fused_layer.py) is the CPU-tested path with the same math.

#include "hopper.cuh"

namespace {

constexpr int TILE = 64;                       // rows and columns of every tile
#ifndef LK_WGMMA_N
#define LK_WGMMA_N 64
#endif
constexpr int WGMMA_N = LK_WGMMA_N;
constexpr int TILE_BYTES = TILE * BK * 2;      // one 64 x 64 16-bit tile
constexpr int STAGE_BYTES = 2 * TILE_BYTES;    // A and B
constexpr int ATT_BYTES = 5 * TILE_BYTES;      // attention: Q, K (2 x 64 rows), V (2 x 64 rows)
// Every epilogue goes through a 64 x 64 fp32 staging tile (rows padded to 68 floats): written in the MMA fragment
// layout, read back by rows, so that each warp's global loads, stores and reductions cover whole 128-byte lines.
// (Written straight from the fragments, a warp's 4-byte stores touch 8 lines an instruction: a GEMM tile's epilogue
// took 2.75 us, its 16 stores a thread alone, on an otherwise idle GPU.)
constexpr int SROW = TILE + 4;
constexpr int STAGE_TILE_BYTES = TILE * SROW * 4;
constexpr int MAX_STAGES = 12;
constexpr int CONSUMERS = 128;
constexpr int THREADS = CONSUMERS + 32;
constexpr int MAX_DEPS = 3;
constexpr int GEN_SLOTS = 1024;                // sync[0 .. grid): the generation word of each CTA
// Each flag and ticket has a 128-byte line of its own: the CTAs that poll one flag then load one L2 slice lightly
// instead of all of them hammering the slice that holds a line of many flags, which slowed every load the SMs made
// through that slice (bert-base: 0.75 us a K tile with packed flags).
constexpr int FLAG_STRIDE = 32;
constexpr int MAX_TRACE = 8;                   // tasks a CTA stamps (diagnostics)
// trace row of a CTA: [0] after the wait, [1 + 2q, 2 + 2q] task q's first input and end, then for the CTA's first
// task (up to 16 K tiles) each stage's arrival (consumer), each B and each A load's issue (producer)
constexpr int TRACE_ROW = 64, TR_FULL = 17, TR_B = 33, TR_A = 49;
// (the first task's epilogue: TR_EPI + 0 loop done, + 1 row statistics shared, + 2 stores issued, + 3 fence passed,
// + 4 barrier passed, + 5 flag raised; first task's chunks are at most 8, so these share the arrival row's end)
constexpr int TR_EPI = TR_FULL + 8;

enum Map { X_MAP, WQKV_MAP, QKV_MAP, ATTN_MAP, WOUT_MAP, H_MAP, W1_MAP, F1_MAP, W2_MAP, N_MAPS };
enum Phase { P_QKV = 0, P_ATT = 1, P_OUT = 2, P_FFN1 = 3, P_FFN2 = 4 };
enum Flags {
  USE_PDL = 1,
  // bits 4-6: 1 + a phase whose tasks load their activations without waiting for their flags (test-only defect)
  RACY_SHIFT = 4,
  NO_LN_SUMS = 256,  // A/B only (wrong results): the LayerNorm row sums are not gathered
  POLL_SLEEP = 512,  // A/B only: 100 ns between two polls of the flags
  NO_A = 1024,       // A/B only (wrong results): the GEMM tasks load no activation tiles
  NO_MMA = 2048,     // A/B only (wrong results): the GEMM tasks' consumers only wait for and release the stages
  NO_WFENCE = 4096,  // A/B only: the writers of a tile skip fence.proxy.async before raising its flag
  NO_AHEAD = 8192,   // A/B only: the producer starts a task's loads only once the consumers have finished the last
  RELEASE_NOW = 16384,  // A/B only: a stage goes back to the producer as soon as its MMAs are done, not one chunk later
};

struct Params {
  // The TMA descriptors, in global memory (layer_encode, once per set of buffers): kept out of the parameter block,
  // which the epilogues read through the constant cache all the time.
  const CUtensorMap* maps;
  const float* b_qkv;  // fp32, LayerNorm 1 folded (gemm.fold_layernorm)
  const float* u_qkv;  // fp32 colsum of the folded weights
  const void* b_out;   // 16-bit
  const float* b_ffn1;
  const float* u_ffn1;
  const void* b_ffn2;
  const void* x;       // the out-projection's residual
  void* qkv;
  void* attn;
  void* h;
  void* f1;
  void* y;
  float* ws;           // split-K sums: [out tiles, 64 * 64], then [ffn2 tiles, 64 * 64]; zero between launches
  int* sync;           // generation words, then the tile flags and split tickets (offsets below)
  long long* trace;    // diagnostics: [grid, 1 + 2 MAX_TRACE] %globaltimer: after the wait, then per task the
                       // first input's arrival and the end
  int M, seq, D, heads, F;
  int mt, nq, nd, nf;  // 64-row tiles; 64-column tiles of qkv, of d_model, of ffn
  int s_out, s_ffn2;   // K splits
  int end[5];          // cumulative task counts of the phases
  int f_qkv, f_att, f_h, f_f1, c_out, c_ffn2;  // offsets in sync
  int stages;          // ring slots, each a chunk of kt K tiles of A and of B
  int kt;              // K tiles a chunk: one TMA box (3-D tensor maps) loads a chunk of an operand
  int trigger;         // launch_dependents when a CTA starts its trigger-th task (0: at the start; -1: never)
  int pf_tasks;        // the CTA's next tasks whose weight tiles are prefetched into L2 at the start
  const void* w[4];    // the weights of QKV, out, FFN1, FFN2 (for the L2 prefetch: [N, K] row-major, 16-bit)
  float qk_scale;      // log2(e) / sqrt(head_dim)
  float eps;
  int flags;
};

// A flag's or ticket's int (logical index i >= GEN_SLOTS) in sync.
__device__ __forceinline__ int* slot(const Params& p, int i) {
  return p.sync + GEN_SLOTS + (i - GEN_SLOTS) * FLAG_STRIDE;
}

struct Dep {
  int base, count, stride;
};

struct Task {
  int phase, m, n, split;
  int a_col0, k_tiles;  // GEMM: the first K column and the K tiles of this split
  const CUtensorMap* a;
  const CUtensorMap* b;
  Dep dep[MAX_DEPS];
  int ndep;
};

// A split-K GEMM task (out-projection, FFN2): item j of its phase is split j % splits of output tile j / splits; its
// A columns are the split's K tiles, each made by one tile of the producer phase (flags from `flags`, a row of
// k_total of them a 64-row tile).
__device__ __forceinline__ void split_task(Task& t, const Params& p, int phase, int j, int splits, int k_total,
                                           const CUtensorMap* a, const CUtensorMap* b, int flags) {
  t.phase = phase;
  t.split = j % splits, j /= splits;
  t.m = j / p.nd, t.n = j % p.nd;
  t.k_tiles = k_total / splits;
  t.a_col0 = t.split * t.k_tiles * BK;
  t.a = a, t.b = b;
  t.dep[0] = {flags + t.m * k_total + t.split * t.k_tiles, t.k_tiles, 1};
  t.ndep = 1;
}

__device__ __forceinline__ Task decode(const Params& p, int j) {
  Task t;
  t.ndep = 0;
  t.split = 0;
  t.a_col0 = 0;
  if (j < p.end[P_QKV]) {
    t.phase = P_QKV;
    t.m = j / p.nq, t.n = j % p.nq;
    t.a = p.maps + X_MAP, t.b = p.maps + WQKV_MAP, t.k_tiles = p.nd;
  } else if (j < p.end[P_ATT]) {
    j -= p.end[P_QKV];
    t.phase = P_ATT;
    // The last query tiles (the most keys) first.
    t.m = p.mt - 1 - j / p.heads, t.n = j % p.heads;
    const int kv0 = (t.m * TILE / p.seq) * p.seq / TILE;  // the first 64-row tile of the query tile's sequence
    t.dep[0] = {p.f_qkv + t.m * p.nq + t.n, 1, 1};
    t.dep[1] = {p.f_qkv + kv0 * p.nq + p.nd + t.n, t.m - kv0 + 1, p.nq};
    t.dep[2] = {p.f_qkv + kv0 * p.nq + 2 * p.nd + t.n, t.m - kv0 + 1, p.nq};
    t.ndep = 3;
    t.split = kv0;  // (attention: the first key tile)
    t.a = t.b = nullptr;
    t.k_tiles = 0;
  } else if (j < p.end[P_OUT]) {
    split_task(t, p, P_OUT, j - p.end[P_ATT], p.s_out, p.nd, p.maps + ATTN_MAP, p.maps + WOUT_MAP, p.f_att);
  } else if (j < p.end[P_FFN1]) {
    j -= p.end[P_OUT];
    t.phase = P_FFN1;
    t.m = j / p.nf, t.n = j % p.nf;
    t.k_tiles = p.nd;
    t.a = p.maps + H_MAP, t.b = p.maps + W1_MAP;
    t.dep[0] = {p.f_h + t.m * p.nd, p.nd, 1};
    t.ndep = 1;
  } else {
    split_task(t, p, P_FFN2, j - p.end[P_FFN1], p.s_ffn2, p.nf, p.maps + F1_MAP, p.maps + W2_MAP, p.f_f1);
  }
  return t;
}

// Producer warp: whether every flag the task depends on has reached `target` (one relaxed load a lane a round).
__device__ __forceinline__ bool deps_ready(const Params& p, const Task& t, int target, int lane) {
  bool ok = true;
  int off = 0;
  // (unrolled: constant indices keep the task in registers; indexed at run time it lived in local memory, and every
  // read of a task field in the epilogues waited on L1, ~47% of the warps' stall cycles under ncu)
#pragma unroll
  for (int d = 0; d < MAX_DEPS; ++d) {
    if (d < t.ndep) {
      for (int e = lane - off; e < t.dep[d].count; e += 32)
        if (e >= 0) ok &= ld_relaxed(slot(p, t.dep[d].base + e * t.dep[d].stride)) >= target;
      off = (off + t.dep[d].count) % 32;
    }
  }
  return __all_sync(0xffffffffu, ok);
}

// After a successful poll: what the flags' writers stored is visible to this CTA's TMA loads.
__device__ __forceinline__ void deps_acquire() {
  fence_acq_rel_gpu();
  __syncwarp();
  fence_proxy_async_global();
}

// Spins until the task's flags are up, then acquires what their writers stored.
__device__ __forceinline__ void wait_for_deps(const Params& p, const Task& t, int target, int lane) {
  while (!deps_ready(p, t, target, lane)) {
    if (p.flags & POLL_SLEEP) __nanosleep(100);
  }
  deps_acquire();
}

// Layout of the dynamic shared memory (from a 1024-byte aligned base).
struct Smem {
  uint32_t a, b, att, stage, ln, word, full, empty, att_full, att_empty, done;
  __device__ Smem(uint32_t base, int S, int kt) {
    a = base;
    b = a + S * kt * TILE_BYTES;
    att = b + S * kt * TILE_BYTES;
    stage = att + ATT_BYTES;    // the epilogue's fp32 staging tile
    ln = stage + STAGE_TILE_BYTES;  // 64 float2: the tile's rows' (mean * rstd, rstd)
    word = ln + TILE * 8;       // 16 bytes: the split-K ticket's verdict
    full = word + 16;
    empty = full + 8 * S;
    att_full = empty + 8 * S;
    att_empty = att_full + 8;
    done = att_empty + 8;  // (NO_AHEAD) the consumers have finished a task
  }
};

template <bool BF16>
__device__ void producer(const Params& p, const Smem& sm, int lane) {
  const int G = gridDim.x, total = p.end[P_FFN2], S = p.stages, KT = p.kt;
  const int CH = KT * TILE_BYTES;  // bytes of one operand's chunk
  const int racy = ((p.flags >> RACY_SHIFT) & 7) - 1;
  const bool lead = lane == 0;
  const bool no_a = (p.flags & NO_A) != 0;
  long long* const trace = p.trace != nullptr && lead ? p.trace + blockIdx.x * TRACE_ROW : nullptr;
  // Before the wait: the first task's weight tiles into the ring (weights only: nothing the predecessor writes is
  // touched; the consumers prefetch the next tasks' weights into L2).
  int pre = 0;
  bool pre_a = false;  // (racy QKV: the first task's activation tiles too, before the wait)
  if (blockIdx.x < total) {
    const Task t = decode(p, blockIdx.x);
    if (t.phase != P_ATT) {
      pre = min(S, t.k_tiles / KT);
      pre_a = racy == P_QKV && t.phase == P_QKV;
      if (lead)
        for (int i = 0; i < pre; ++i) {
          mbar_expect_tx(sm.full + 8 * i, no_a ? CH : 2 * CH);
          tma_load3(sm.b + i * CH, t.b, sm.full + 8 * i, t.n * TILE, t.a_col0 / BK + i * KT);
          if (trace != nullptr && i < 16) trace[TR_B + i] = globaltimer();
          if (pre_a) tma_load3(sm.a + i * CH, t.a, sm.full + 8 * i, t.m * TILE, t.a_col0 / BK + i * KT);
        }
    }
  }
  gdc_wait();
  const int target = ld_relaxed(p.sync + blockIdx.x) + 1;
  if (p.trigger == 0) gdc_launch();

  int it = 0;      // the ring position: chunks this CTA has loaded
  int att_n = 0;   // attention tasks this CTA has loaded
  for (int q = 0, j = blockIdx.x; j < total; ++q, j += G) {
    if (q > 0 && q == p.trigger) gdc_launch();
    if (q > 0 && (p.flags & NO_AHEAD)) mbar_wait(sm.done, (q - 1) & 1);
    const Task t = decode(p, j);
    const bool skip = t.phase == racy;
    if (t.phase == P_ATT) {
      if (att_n > 0) mbar_wait(sm.att_empty, (att_n - 1) & 1);
      if (!skip) wait_for_deps(p, t, target, lane);
      const int kv0 = t.split, nkt = t.m - kv0 + 1;
      if (lead) {
        mbar_expect_tx(sm.att_full, TILE_BYTES * (1 + 2 * nkt));
        tma_load(sm.att, p.maps + QKV_MAP, sm.att_full, t.n * TILE, t.m * TILE);
        for (int k = 0; k < nkt; ++k) {
          tma_load(sm.att + (1 + k) * TILE_BYTES, p.maps + QKV_MAP, sm.att_full, (p.nd + t.n) * TILE, (kv0 + k) * TILE);
          tma_load(sm.att + (3 + k) * TILE_BYTES, p.maps + QKV_MAP, sm.att_full, (2 * p.nd + t.n) * TILE,
                   (kv0 + k) * TILE);
        }
      }
      ++att_n;
      continue;
    }
    // GEMM: B of each stage as soon as the stage is free; A once the flags are up. The stages [it - pend, it) have
    // their B issued and their A deferred; they are flushed before the producer could block on a stage the
    // consumers free only after consuming a deferred one.
    const int it0 = it, kt0 = t.a_col0 / BK;
    bool ready = skip || t.ndep == 0;
    int pend = 0;
    auto flush = [&]() {
      if (lead && !no_a)
        for (int u = it - pend; u < it; ++u) {
          tma_load3(sm.a + (u % S) * CH, t.a, sm.full + 8 * (u % S), t.m * TILE, kt0 + (u - it0) * KT);
          if (trace != nullptr && q == 0 && u - it0 < 16) trace[TR_A + u - it0] = globaltimer();
        }
      pend = 0;
    };
    auto wait_deps = [&]() {
      wait_for_deps(p, t, target, lane);
      ready = true;
    };
    const int n_ch = t.k_tiles / KT;
    for (int i = 0; i < n_ch; ++i, ++it) {
      const int s = it % S, r = it / S;
      if (it >= pre) {
        if (r >= 1) {
          if (pend > 0 && !mbar_test(sm.empty + 8 * s, (r - 1) & 1)) {
            wait_deps();
            flush();
          }
          mbar_wait(sm.empty + 8 * s, (r - 1) & 1);
        }
        if (lead) {
          mbar_expect_tx(sm.full + 8 * s, no_a ? CH : 2 * CH);
          tma_load3(sm.b + s * CH, t.b, sm.full + 8 * s, t.n * TILE, kt0 + i * KT);
          if (trace != nullptr && q == 0 && i < 16) trace[TR_B + i] = globaltimer();
        }
      }
      if (!ready && deps_ready(p, t, target, lane)) {
        deps_acquire();
        ready = true;
      }
      if (ready) {
        flush();
        if (lead && !(pre_a && it < pre) && !no_a)
          tma_load3(sm.a + s * CH, t.a, sm.full + 8 * s, t.m * TILE, kt0 + i * KT);
        if (trace != nullptr && q == 0 && i < 16) trace[TR_A + i] = globaltimer();
      } else {
        ++pend;
      }
    }
    if (pend > 0) {
      wait_deps();
      flush();
    }
  }
}

// One head's causal attention for 64 query rows (the 128-byte swizzled tiles at `att`: Q, then up to two 64-row K
// tiles, then the V tiles): S = Q K^T by wgmma m64n128 into registers, the softmax per row (a row's scores lie in
// the 4 lanes of a quad), O = P V by mma.sync over the loaded key tiles, O / rowsum stored to `out` (row stride D).
// `q_pos0`: the position in its sequence of the thread's first row; `nkt`: the loaded key tiles.
template <bool BF16>
__device__ __forceinline__ void attention_tile(uint32_t att, int q_pos0, int seq, int nkt, float scale, int warp,
                                               int lane, float* stage) {
  const uint32_t qt = att, kt = att + TILE_BYTES, vt = att + 3 * TILE_BYTES;
  float sc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) sc[i] = 0.f;
  fence_acc<64>(sc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_64xNx16<BF16, 128>(sc, smem_desc(qt) + 2 * kk, smem_desc(kt) + 2 * kk);
  wgmma_commit();
  fence_acc<64>(sc);
  wgmma_wait<0>();
  fence_acc<64>(sc);
  const int g = lane / 4, q2 = (lane % 4) * 2;
  const int n_keys = min(seq, 64 * nkt);
  float mx[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
  each_acc<16>(lane, [&](int i, int h, int key) {
    const bool ok = key <= q_pos0 + 8 * h && key < n_keys;
    sc[i] = ok ? sc[i] * scale : -INFINITY;
    mx[h] = fmaxf(mx[h], sc[i]);
  });
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
  each_acc<16>(lane, [&](int i, int h, int) {
    sc[i] = exp2f(sc[i] - mx[h]);
    l[h] += sc[i];
  });
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  // O = P V: this warp's 16 rows, 64 columns in 8 tiles of 8; only the loaded key tiles (the rest of the K and V
  // space holds stale bytes, whose scores were masked above).
  float o[8][4];
#pragma unroll
  for (int v = 0; v < 8; ++v) o[v][0] = o[v][1] = o[v][2] = o[v][3] = 0.f;
  const int mat = lane / 8, r8 = lane % 8;
#pragma unroll
  for (int t = 0; t < 8; ++t) {  // keys 16t..16t+15
    if (t >= 4 * nkt) break;
    uint32_t a[4] = {pack2<BF16>(sc[8 * t + 0], sc[8 * t + 1]), pack2<BF16>(sc[8 * t + 2], sc[8 * t + 3]),
                     pack2<BF16>(sc[8 * t + 4], sc[8 * t + 5]), pack2<BF16>(sc[8 * t + 6], sc[8 * t + 7])};
    const int key = 16 * t + (mat & 1) * 8 + r8;
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // columns 16u..16u+15
      uint32_t b[4];
      ldmatrix_x4_trans(b, swz(vt, key, 16 * u + (mat >> 1) * 8));
      mma_16x8x16<BF16>(o[2 * u], a, b[0], b[1]);
      mma_16x8x16<BF16>(o[2 * u + 1], a, b[2], b[3]);
    }
  }
  const int r0 = (warp % 4) * 16 + g;
  const float inv0 = softmax_rcp(l[0]), inv1 = softmax_rcp(l[1]);
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    *reinterpret_cast<float2*>(stage + r0 * SROW + 8 * v + q2) = make_float2(o[v][0] * inv0, o[v][1] * inv0);
    *reinterpret_cast<float2*>(stage + (r0 + 8) * SROW + 8 * v + q2) = make_float2(o[v][2] * inv1, o[v][3] * inv1);
  }
}

// The staging tile's rows, 8 columns a thread (8 threads a row, 16 rows a pass): thread tid covers rows
// stage_row(tid, i), i < 4, columns stage_col(tid) .. + 8.
__device__ __forceinline__ int stage_row(int tid, int i) { return tid / 8 + 16 * i; }
__device__ __forceinline__ int stage_col(int tid) { return (tid % 8) * 8; }

template <bool BF16, int KT>  // KT: K tiles a chunk (p.kt), a compile-time count so that the MMAs of a chunk are
                              // one straight run (a loop around wgmma makes ptxas serialise them)
__device__ void consumer(const Params& p, const Smem& sm, int tid, uint8_t* smem_raw, uint32_t raw) {
  using E = Elem<BF16>;
  using T = typename E::T;
  const int G = gridDim.x, total = p.end[P_FFN2], S = p.stages;
  constexpr int CH = KT * TILE_BYTES;
  const int warp = tid / 32, lane = tid % 32;
  float2* const ln_row = reinterpret_cast<float2*>(smem_raw + (sm.ln - raw));
  float* const stage = reinterpret_cast<float*>(smem_raw + (sm.stage - raw));
  int* const word = reinterpret_cast<int*>(smem_raw + (sm.word - raw));
  long long* const trace = p.trace != nullptr ? p.trace + blockIdx.x * TRACE_ROW : nullptr;
  // Before the wait: the weight tiles of this CTA's first 1 + pf_tasks tasks into L2 (pf_tasks > 0), one 128-byte line
  // a prefetch spread over the consumer threads (many in flight at once; issued as TMA prefetches, the SM's TMA unit
  // took them one box at a time, ahead of the loads the current task needed).
  for (int q = 0; q <= p.pf_tasks && p.pf_tasks > 0; ++q) {
    const int j = blockIdx.x + q * G;
    if (j >= total) break;
    const Task t = decode(p, j);
    if (t.phase == P_ATT) continue;
    const int g = t.phase == P_QKV ? 0 : t.phase == P_OUT ? 1 : t.phase == P_FFN1 ? 2 : 3;
    const int K = t.phase == P_FFN2 ? p.F : p.D;
    const char* base = static_cast<const char*>(p.w[g]) + (static_cast<long long>(t.n) * TILE * K + t.a_col0) * 2;
    for (int l = tid; l < TILE * t.k_tiles; l += CONSUMERS) {
      const char* line = base + (static_cast<long long>(l / t.k_tiles) * K + (l % t.k_tiles) * BK) * 2;
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(line));
    }
  }
  gdc_wait();
  const int gen = ld_relaxed(p.sync + blockIdx.x);
  if (trace != nullptr && tid == 0) trace[0] = globaltimer();
  if (p.trigger == 0) gdc_launch();

  int it = 0, att_n = 0;
  for (int q = 0, j = blockIdx.x; j < total; ++q, j += G) {
    if (q > 0 && q == p.trigger) gdc_launch();
    const Task t = decode(p, j);
    int* flag = nullptr;  // the tile's readiness counter, raised after the stores
    if (t.phase == P_ATT) {
      mbar_wait(sm.att_full, att_n & 1);
      if (trace != nullptr && tid == 0 && q < MAX_TRACE) trace[1 + 2 * q] = globaltimer();
      const int kv0 = t.split, m0 = t.m * TILE;
      const int q_pos0 = m0 - kv0 * TILE + warp * 16 + lane / 4;  // (a 64-row tile lies in one sequence)
      attention_tile<BF16>(sm.att, q_pos0, p.seq, t.m - kv0 + 1, p.qk_scale, warp, lane, stage);
      ++att_n;
      consumer_sync<CONSUMERS>();  // every warp has read the tiles and written its rows of O
      if (tid == 0) mbar_arrive(sm.att_empty);
      T* out = static_cast<T*>(p.attn) + t.n * TILE;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = stage_row(tid, i), c = stage_col(tid);
        if (m0 + r < p.M) {
          const float4 lo = *reinterpret_cast<const float4*>(stage + r * SROW + c);
          const float4 hi = *reinterpret_cast<const float4*>(stage + r * SROW + c + 4);
          *reinterpret_cast<uint4*>(out + static_cast<long long>(m0 + r) * p.D + c) =
              make_uint4(pack2<BF16>(lo.x, lo.y), pack2<BF16>(lo.z, lo.w), pack2<BF16>(hi.x, hi.y),
                         pack2<BF16>(hi.z, hi.w));
        }
      }
      flag = slot(p, p.f_att + t.m * p.heads + t.n);
    } else {
      const bool ln = t.phase == P_QKV || t.phase == P_FFN1;
      const bool ln_sums = ln && (p.flags & NO_LN_SUMS) == 0;
      if (t.phase == P_FFN2 && tid == 0) {
        // FFN2's residual h comes from another CTA of this launch: acquire its tile's flag (long up by now; the
        // barrier before the epilogue passes the acquisition on to the other threads).
        while (ld_acquire(slot(p, p.f_h + t.m * p.nd + t.n)) < gen + 1) {
        }
      }
      float acc[WGMMA_N / 2];  // (WGMMA_N 128: an A/B build whose MMAs read past the B tile; wrong results)
#pragma unroll
      for (int i = 0; i < WGMMA_N / 2; ++i) acc[i] = 0.f;
      // The epilogue's bias (and LayerNorm colsum) for this thread's 16 columns, loaded now: in flight during the K
      // loop, and never behind the epilogue's stores (a load after a store to possibly the same memory waits for
      // it: loaded inside the store loop they cost a round trip each, ~5 us a tile).
      const int m0 = t.m * TILE, n0 = t.n * TILE;
      const int ra = warp * 16 + lane / 4, cq = (lane % 4) * 2;  // fragment rows ra, ra + 8; columns 8j + cq
      float bias[8], colsum[8];  // (columns stage_col(tid) .. + 8 of the tile)
      {
        const int c = n0 + stage_col(tid);
        if (ln) {
          const float* bp = (t.phase == P_QKV ? p.b_qkv : p.b_ffn1) + c;
          const float* up = (t.phase == P_QKV ? p.u_qkv : p.u_ffn1) + c;
#pragma unroll
          for (int e = 0; e < 8; e += 4) {
            const float4 b4 = *reinterpret_cast<const float4*>(bp + e), u4 = *reinterpret_cast<const float4*>(up + e);
            bias[e] = b4.x, bias[e + 1] = b4.y, bias[e + 2] = b4.z, bias[e + 3] = b4.w;
            colsum[e] = u4.x, colsum[e + 1] = u4.y, colsum[e + 2] = u4.z, colsum[e + 3] = u4.w;
          }
        } else {
          const uint4 b8 = *reinterpret_cast<const uint4*>(static_cast<const T*>(t.phase == P_OUT ? p.b_out : p.b_ffn2) + c);
          const uint32_t bw[4] = {b8.x, b8.y, b8.z, b8.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = E::f2(bw[e]);
            bias[2 * e] = f.x, bias[2 * e + 1] = f.y, colsum[2 * e] = colsum[2 * e + 1] = 0.f;
          }
        }
      }
      float s1 = 0.f, s2 = 0.f;  // LayerNorm: sums of x and x^2 over this thread's half of its row
      int prev = 0;  // the previous chunk's stage, handed back once this chunk's MMAs are issued (-1: none left)
      for (int i = 0; i < t.k_tiles / KT; ++i, ++it) {
        const int s = it % S;
        mbar_wait(sm.full + 8 * s, (it / S) & 1);
        if (trace != nullptr && tid == 0) {
          if (i == 0 && q < MAX_TRACE) trace[1 + 2 * q] = globaltimer();
          if (q == 0 && i < 16) trace[TR_FULL + i] = globaltimer();
        }
        if (p.flags & NO_MMA) {  // (A/B) the stage handed back unused
          __syncwarp();
          if (lane == 0) mbar_arrive(sm.empty + 8 * s);
          prev = -1;
          continue;
        }
        // The chunk: KT 64-wide K tiles of A and of B, each a 128-byte swizzled 64 x 64 tile (8 KB).
        const uint32_t as = sm.a + s * CH;
        fence_acc<WGMMA_N / 2>(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < KT; ++k) {
          const uint64_t da = smem_desc(as + k * TILE_BYTES), db = smem_desc(sm.b + s * CH + k * TILE_BYTES);
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk) wgmma_64xNx16<BF16, WGMMA_N>(acc, da + 2 * kk, db + 2 * kk);
        }
        wgmma_commit();
        fence_acc<WGMMA_N / 2>(acc);
        if (ln_sums) {
          // Row tid / 2's 64 elements of a tile lie in its 128 bytes (the swizzle permutes 16-byte chunks within a
          // row); the chunks are read in a rotated order so that the 16 rows of a warp hit different banks.
#pragma unroll
          for (int k = 0; k < KT; ++k) {
          const uint32_t rp = as + k * TILE_BYTES + (tid / 2) * 128 + (tid % 2) * 64;
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            uint32_t v[4];
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                         : "r"(rp + 16 * ((c + tid / 2) & 3)));
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = E::f2(v[e]);
              s1 += f.x + f.y;
              s2 += f.x * f.x + f.y * f.y;
            }
          }
          }
        }
        if (p.flags & RELEASE_NOW) {
          // (A/B) this chunk's MMAs waited for at once and its stage handed back: one more stage in flight, no MMA
          // overlapping the next stage's wait
          wgmma_wait<0>();
          __syncwarp();
          if (lane == 0) mbar_arrive(sm.empty + 8 * s);
          prev = -1;
          continue;
        }
        wgmma_wait<1>();
        if (i >= 1) {
          __syncwarp();
          if (lane == 0) mbar_arrive(sm.empty + 8 * prev);
        }
        prev = s;
      }
      wgmma_wait<0>();
      fence_acc<WGMMA_N / 2>(acc);
      __syncwarp();
      if (lane == 0 && prev >= 0) mbar_arrive(sm.empty + 8 * prev);
      const bool stamp = trace != nullptr && tid == 0 && q == 0;
      if (stamp) trace[TR_EPI] = globaltimer();

      // LayerNorm: the row's statistics (threads tid and tid ^ 1 hold its two halves) for the row pass below.
      if (ln) {
        lane_sum2<2>(s1, s2);
        const float2 f = ln_factors(s1, s2, p.D, p.eps);
        if (tid % 2 == 0) ln_row[tid / 2] = make_float2(f.y, f.x);
      }
      // The accumulators into the staging tile (fragment layout: rows ra, ra + 8, columns 8j + cq).
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2*>(stage + (ra + 8 * h) * SROW + 8 * jj + cq) =
              make_float2(acc[4 * jj + 2 * h], acc[4 * jj + 2 * h + 1]);
      consumer_sync<CONSUMERS>();
      if (stamp) trace[TR_EPI + 1] = globaltimer();
      if (t.phase == P_OUT || t.phase == P_FFN2) {
        // Split-K: add this split's partial into the tile's sums (16 columns a thread-row pass: 256-byte rows), take a
        // ticket; the last split reads the sums back into the staging tile and zeroes them for the next launch.
        const int tile = t.phase == P_OUT ? t.m * p.nd + t.n : p.mt * p.nd + t.m * p.nd + t.n;
        float* w = p.ws + static_cast<long long>(tile) * (TILE * TILE);
        const int rc = (tid % 16) * 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = tid / 16 + 8 * i;
          const float4 v = *reinterpret_cast<const float4*>(stage + r * SROW + rc);
          red_add_v4(w + r * TILE + rc, v);
        }
        const int splits = t.phase == P_OUT ? p.s_out : p.s_ffn2;
        consumer_sync<CONSUMERS>();
        if (tid == 0) {
          int* ticket = slot(p, (t.phase == P_OUT ? p.c_out : p.c_ffn2) + t.m * p.nd + t.n);
          word[0] = atom_acq_rel_add(ticket, 1) == (gen + 1) * splits - 1;
        }
        consumer_sync<CONSUMERS>();
        if (word[0] == 0) {
          if (trace != nullptr && tid == 0 && q < MAX_TRACE) trace[2 + 2 * q] = globaltimer();
          if (tid == 0 && (p.flags & NO_AHEAD)) mbar_arrive(sm.done);
          continue;  // another split finishes the tile
        }
        float4 sum[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] = __ldcg(reinterpret_cast<const float4*>(w + (tid / 16 + 8 * i) * TILE + rc));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = tid / 16 + 8 * i;
          __stcg(reinterpret_cast<float4*>(w + r * TILE + rc), make_float4(0.f, 0.f, 0.f, 0.f));
          *reinterpret_cast<float4*>(stage + r * SROW + rc) = sum[i];
        }
        consumer_sync<CONSUMERS>();
      }
      // The row pass: (LayerNorm) + bias (+ GELU) (+ residual), 8 columns of 4 rows a thread, 16-byte stores.
      const int N = t.phase == P_QKV ? 3 * p.D : t.phase == P_FFN1 ? p.F : p.D;
      T* out = static_cast<T*>(t.phase == P_QKV ? p.qkv : t.phase == P_OUT ? p.h : t.phase == P_FFN1 ? p.f1 : p.y);
      const T* res = static_cast<const T*>(t.phase == P_OUT ? p.x : p.h);
      const int c = stage_col(tid);
      uint4 rv[4];  // the residual's rows, all in flight at once (FFN2's is another CTA's h: read through L2)
      if (t.phase == P_OUT || t.phase == P_FFN2) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = min(m0 + stage_row(tid, i), p.M - 1);
          rv[i] = __ldcg(reinterpret_cast<const uint4*>(res + static_cast<long long>(row) * p.D + n0 + c));
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = stage_row(tid, i);
        if (m0 + r >= p.M) continue;
        float v[8];
        const float4 lo = *reinterpret_cast<const float4*>(stage + r * SROW + c);
        const float4 hi = *reinterpret_cast<const float4*>(stage + r * SROW + c + 4);
        v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
        const float2 st = ln ? ln_row[r] : make_float2(0.f, 1.f);
        const uint32_t rw[4] = {rv[i].x, rv[i].y, rv[i].z, rv[i].w};
        uint32_t pk[4];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          float v0 = v[e], v1 = v[e + 1];
          if (ln) v0 = st.y * v0 - st.x * colsum[e], v1 = st.y * v1 - st.x * colsum[e + 1];
          v0 += bias[e], v1 += bias[e + 1];
          if (t.phase == P_FFN1) v0 = activate<1>(v0), v1 = activate<1>(v1);
          if (t.phase == P_OUT || t.phase == P_FFN2) {
            const float2 r2 = E::f2(rw[e / 2]);
            v0 += r2.x, v1 += r2.y;
          }
          pk[e / 2] = pack2<BF16>(v0, v1);
        }
        *reinterpret_cast<uint4*>(out + static_cast<long long>(m0 + r) * N + n0 + c) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
      }
      if (stamp) trace[TR_EPI + 2] = globaltimer();
      if (t.phase == P_QKV) flag = slot(p, p.f_qkv + t.m * p.nq + t.n);
      if (t.phase == P_OUT) flag = slot(p, p.f_h + t.m * p.nd + t.n);
      if (t.phase == P_FFN1) flag = slot(p, p.f_f1 + t.m * p.nf + t.n);
    }
    if (flag != nullptr) {
      const bool stamp = trace != nullptr && tid == 0 && q == 0;
      if ((p.flags & NO_WFENCE) == 0) fence_proxy_async_global();  // the readers load this tile with TMA
      if (stamp) trace[TR_EPI + 3] = globaltimer();
      consumer_sync<CONSUMERS>();
      if (stamp) trace[TR_EPI + 4] = globaltimer();
      if (tid == 0) red_release_add(flag, 1);
      if (stamp) trace[TR_EPI + 5] = globaltimer();
    } else {
      consumer_sync<CONSUMERS>();  // (ln_row and word are reused by the next task)
    }
    if (trace != nullptr && tid == 0 && q < MAX_TRACE) trace[2 + 2 * q] = globaltimer();
    if (tid == 0 && (p.flags & NO_AHEAD)) mbar_arrive(sm.done);
  }
  consumer_sync<CONSUMERS>();
  if (tid == 0) p.sync[blockIdx.x] = gen + 1;
}

template <bool BF16>
__global__ void __launch_bounds__(THREADS, 1) layer_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const Smem sm((raw + 1023u) & ~1023u, p.stages, p.kt);
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < p.stages; ++i) {
      mbar_init(sm.full + 8 * i, 1);
      mbar_init(sm.empty + 8 * i, CONSUMERS / 32);
    }
    mbar_init(sm.att_full, 1);
    mbar_init(sm.att_empty, 1);
    mbar_init(sm.done, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid >= CONSUMERS) {
    if (tid == CONSUMERS) {
      for (int i = 0; i < N_MAPS; ++i) prefetch_tensormap(p.maps + i);
    }
    __syncwarp();
    producer<BF16>(p, sm, tid - CONSUMERS);
  } else if (p.kt == 4) {
    consumer<BF16, 4>(p, sm, tid, smem_raw, raw);
  } else if (p.kt == 3) {
    consumer<BF16, 3>(p, sm, tid, smem_raw, raw);
  } else if (p.kt == 2) {
    consumer<BF16, 2>(p, sm, tid, smem_raw, raw);
  } else {
    consumer<BF16, 1>(p, sm, tid, smem_raw, raw);
  }
}

}  // namespace

#ifndef LK_BF16
#define LK_BF16 0
#endif

// K tiles a chunk (one TMA box an operand): under load an SM's TMA unit takes ~240 cycles a box whatever its size up
// to 16 KB (34 B/cycle with 8 KB boxes), and the one issuing thread pays ~60-200 cycles a load besides the ring's
// waits (scripts/tma_bench.py; perf notes section 19), so the loads go in chunks of several K tiles. The largest of
// 4, 3, 2, 1 dividing every task's K tiles and leaving two ring slots.
extern "C" int chunk_tiles(int a, int b, int c, int stages) {
  for (int kt = 4; kt > 1; --kt)
    if (a % kt == 0 && b % kt == 0 && c % kt == 0 && stages / kt >= 2) return kt;
  return 1;
}

extern "C" int layer_variant() { return LK_BF16 | (LK_WGMMA_N == 64 ? 0 : 2); }

extern "C" int layer_smem_bytes(int stages) {
  return 1024 + stages * STAGE_BYTES + ATT_BYTES + STAGE_TILE_BYTES + TILE * 8 + 16 + 16 * stages + 24;
}

// The sync ints a launch of this shape needs (generation words, then flags and tickets).
extern "C" int layer_sync_ints(int M, int D, int heads, int F) {
  const int mt = (M + TILE - 1) / TILE, nd = D / TILE, nf = F / TILE;
  return GEN_SLOTS + mt * (3 * nd + heads + nd + nf + 2 * nd) * FLAG_STRIDE;
}

// The layer's N_MAPS TMA descriptors (128 bytes each, in this order: x, w_qkv, qkv, attn, w_out, h, w_ffn1, ffn1,
// w_ffn2) written to `out` (host memory) for chunks of `kt` K tiles; the caller copies them to the device once per
// set of buffers and passes them to every launch.
extern "C" int layer_encode(void* out, void* x, void* qkv, void* attn, void* h, void* f1, void* w_qkv, void* w_out,
                            void* w_ffn1, void* w_ffn2, int M, int D, int F, int kt, char* err, int errlen) {
  constexpr bool BF = LK_BF16 != 0;
  CUtensorMap m[N_MAPS];
  if (encode3(m + X_MAP, BF, x, M, D, D, TILE, kt, err, errlen) ||
      encode3(m + WQKV_MAP, BF, w_qkv, 3 * D, D, D, TILE, kt, err, errlen) ||
      encode(m + QKV_MAP, BF, qkv, M, 3 * D, 3 * D, TILE, err, errlen) ||
      encode3(m + ATTN_MAP, BF, attn, M, D, D, TILE, kt, err, errlen) ||
      encode3(m + WOUT_MAP, BF, w_out, D, D, D, TILE, kt, err, errlen) ||
      encode3(m + H_MAP, BF, h, M, D, D, TILE, kt, err, errlen) ||
      encode3(m + W1_MAP, BF, w_ffn1, F, D, D, TILE, kt, err, errlen) ||
      encode3(m + F1_MAP, BF, f1, M, F, F, TILE, kt, err, errlen) ||
      encode3(m + W2_MAP, BF, w_ffn2, D, F, F, TILE, kt, err, errlen))
    return 1;
  memcpy(out, m, sizeof(m));
  return 0;
}

extern "C" int layer_launch(void* x, void* y, void* qkv, void* attn, void* h, void* f1, void* w_qkv,
                            const float* b_qkv, const float* u_qkv, void* w_out, const void* b_out, void* w_ffn1,
                            const float* b_ffn1, const float* u_ffn1, void* w_ffn2, const void* b_ffn2, float* ws,
                            int* sync, long long* trace, int M, int seq, int D, int heads, int F, int s_out,
                            int s_ffn2, int stages, int grid, int trigger, int pf_tasks, int flags, float eps,
                            const void* maps, void* stream, char* err, int errlen) {
  constexpr bool BF = LK_BF16 != 0;
  if (D % TILE != 0 || F % TILE != 0 || D / heads != 64 || seq > 128 || (M != seq && seq % TILE != 0)) {
    snprintf(err, errlen, "layer kernel: needs d_model and ffn multiples of 64, head dim 64, seq <= 128 and "
                          "64-row tiles within one sequence (M %d, seq %d, D %d, heads %d, F %d)", M, seq, D, heads, F);
    return 1;
  }
  const int mt = (M + TILE - 1) / TILE, nd = D / TILE, nf = F / TILE;
  if (s_out < 1 || nd % s_out != 0 || s_ffn2 < 1 || nf % s_ffn2 != 0) {
    snprintf(err, errlen, "layer kernel: splits %d and %d must divide %d and %d K tiles", s_out, s_ffn2, nd, nf);
    return 1;
  }
  if (stages < 2 || stages > MAX_STAGES || grid < 1 || grid > GEN_SLOTS) {
    snprintf(err, errlen, "layer kernel: stages %d must be in 2..%d, grid %d in 1..%d", stages, MAX_STAGES, grid,
             GEN_SLOTS);
    return 1;
  }
  // K tiles a chunk: the largest of 4, 3, 2, 1 that divides every task's K tiles and leaves two ring slots.
  const int kt = chunk_tiles(nd, nd / s_out, nf / s_ffn2, stages);
  Params p;
  memset(&p, 0, sizeof(p));
  p.maps = static_cast<const CUtensorMap*>(maps);
  p.b_qkv = b_qkv, p.u_qkv = u_qkv, p.b_out = b_out, p.b_ffn1 = b_ffn1, p.u_ffn1 = u_ffn1, p.b_ffn2 = b_ffn2;
  p.x = x, p.qkv = qkv, p.attn = attn, p.h = h, p.f1 = f1, p.y = y;
  p.ws = ws, p.sync = sync, p.trace = trace;
  p.M = M, p.seq = seq, p.D = D, p.heads = heads, p.F = F;
  p.mt = mt, p.nq = 3 * nd, p.nd = nd, p.nf = nf;
  p.s_out = s_out, p.s_ffn2 = s_ffn2;
  p.end[P_QKV] = mt * 3 * nd;
  p.end[P_ATT] = p.end[P_QKV] + mt * heads;
  p.end[P_OUT] = p.end[P_ATT] + mt * nd * s_out;
  p.end[P_FFN1] = p.end[P_OUT] + mt * nf;
  p.end[P_FFN2] = p.end[P_FFN1] + mt * nd * s_ffn2;
  p.f_qkv = GEN_SLOTS;
  p.f_att = p.f_qkv + mt * 3 * nd;
  p.f_h = p.f_att + mt * heads;
  p.f_f1 = p.f_h + mt * nd;
  p.c_out = p.f_f1 + mt * nf;
  p.c_ffn2 = p.c_out + mt * nd;
  p.stages = stages / kt;
  p.kt = kt;
  p.trigger = trigger;
  p.pf_tasks = pf_tasks;
  p.w[0] = w_qkv, p.w[1] = w_out, p.w[2] = w_ffn1, p.w[3] = w_ffn2;
  p.qk_scale = 1.4426950408889634f / sqrtf(64.f);
  p.eps = eps;
  p.flags = flags;
  grid = min(grid, p.end[P_FFN2]);

  auto kernel = layer_kernel<BF>;
  const int smem = layer_smem_bytes(stages);
  static int configured = 0;
  if (allow_smem(kernel, smem, configured, err, errlen)) return 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attrs[1];
  int n = 0;
  if (flags & USE_PDL) add_pdl(attrs, n);
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, p);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "layer kernel launch (grid %d, %d B shared memory): %s", grid, smem, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
