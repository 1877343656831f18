// A Hopper GEMM whose activation tile is loaded once per thread-block cluster and multicast to its CTAs.
//
//   out = act(LN(x) @ w.T + bias) + residual     (or, split-K: the fp32 partial of one K range)
//
// The Triton GEMM (gemm.py) has the same interface and epilogues; this kernel exists for what Triton 3.6
// cannot express (docs/perf-notes.md, sections 11-13):
//   * TMA multicast: the CLUSTER CTAs of a cluster share one 64-row tile of x (they cover adjacent column
//     tiles); each loads 64/CLUSTER rows of it and multicasts them to all, so a CTA pulls 1/CLUSTER of its
//     A bytes from L2 instead of all of them;
//   * a producer warp: one thread issues every TMA load; the weight tiles of the first stages are issued
//     before griddepcontrol.wait (weights are never written by a predecessor), the activation tiles after;
//   * wgmma on both operands from shared memory (128-byte swizzle, K-major).
// One CTA computes a 64x64 output tile with one consumer warpgroup (warps 0-3) and one producer warp (4).
// K is consumed in 64-wide tiles (the 128-byte swizzle span), STAGES of them in flight.
//
// Built at run time by kernels/mc_gemm.py with nvcc (sm_90a) into a shared library called through ctypes.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>

namespace {

constexpr int BM = 64, BN = 64, BK = 64;
constexpr int TILE_BYTES = BM * BK * 2;  // one 64x64 tile of 16-bit elements: 8 KB (A and B alike)
constexpr int THREADS = 160;
constexpr int MAX_STAGES = 13;

// The epilogue is a compile-time choice (EPI bits, and the activation in bits 6-7): a runtime branch per
// element made the first build's epilogue ~3000 instructions a thread, ~5 us at 4 warps (H200).
enum Epi { HAS_BIAS = 1, BIAS_F32 = 2, HAS_RES = 4, HAS_LN = 8, STATS_OUT = 16, SPLIT = 32,
  NO_MMA = 256,  // diagnostics only (wrong results): the K loop moves the tiles but issues no MMA
};
// Runtime flags.
enum Flags {
  USE_PDL = 64,
  RACY = 128,  // test-only defect: the first activation tile is loaded before griddepcontrol.wait
};

struct Params {
  CUtensorMap a_map;  // x [M, K]: box {BK, BM / cluster}
  CUtensorMap b_map;  // w [N, K]: box {BK, BN}
  const void* bias;
  const void* res;
  void* out;
  float* ws;               // split-K partials [split, M, N]
  const float* ln_u;       // colsum of the LayerNorm-folded weight [N]
  const float* ln_stats;   // the producer's row sums [ln_parts, M, 2]
  float* stats_out;        // this GEMM's row sums for the next norm [N tiles, M, 2]
  long long* trace;        // diagnostics: %globaltimer [programs, 4]
  int M, N, K;
  int res_stride, out_stride;
  int per_split;           // 64-wide K tiles per split
  int k_tiles;             // 64-wide K tiles of K
  int stages;
  int trigger_k;           // launch_dependents after this many K tiles (-1: never early)
  int n_pref;              // weight tiles requested before griddepcontrol.wait
  int ln_parts;
  float ln_eps;
  int flags;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  // relaxed: what must be visible (the mbarrier inits) is ordered by fence.mbarrier_init before it.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "MC_WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra MC_WAIT;\n\t}" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Arrive on the barrier at the same shared-memory offset in CTA `cta` of this cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n\t.reg .b32 ra;\n\t"
      "mapa.shared::cluster.u32 ra, %0, %1;\n\t"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n\t}" ::"r"(bar),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// The same box lands at offset `dst` of every CTA in `mask`, and completes bytes on each one's barrier `bar`.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                   int c1, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5}], [%2], %3;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "h"(mask), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_l2(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void gdc_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void gdc_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// wgmma shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#define MC_ACC32(d)                                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),          \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),            \
      "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),            \
      "+f"(d[30]), "+f"(d[31])

#define MC_WGMMA(TYPE)                                                                                        \
  "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"                                                          \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                                  \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "   \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n\t}"

template <bool BF16>
__device__ __forceinline__ void wgmma_64x64x16(float* d, uint64_t da, uint64_t db) {
  if constexpr (BF16) {
    asm volatile(MC_WGMMA("bf16") : MC_ACC32(d) : "l"(da), "l"(db), "r"(1));
  } else {
    asm volatile(MC_WGMMA("f16") : MC_ACC32(d) : "l"(da), "l"(db), "r"(1));
  }
}

// Pins the accumulator registers across the asynchronous MMAs (CUTLASS's warpgroup_fence_operand): without it
// the compiler may touch them in flight, and ptxas then waits for every MMA group before the next.
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <bool BF16>
struct Elem;
template <>
struct Elem<false> {
  using T = __half;
  using T2 = __half2;
  __device__ static float f(T v) { return __half2float(v); }
  __device__ static T2 pack(float a, float b) { return __floats2half2_rn(a, b); }
  __device__ static T one(float a) { return __float2half_rn(a); }
  __device__ static float2 unpack(T2 v) { return __half22float2(v); }
};
template <>
struct Elem<true> {
  using T = __nv_bfloat16;
  using T2 = __nv_bfloat162;
  __device__ static float f(T v) { return __bfloat162float(v); }
  __device__ static T2 pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  __device__ static T one(float a) { return __float2bfloat16_rn(a); }
  __device__ static float2 unpack(T2 v) { return __bfloat1622float2(v); }
};

template <int ACT>  // 0 none, 1 gelu (tanh form), 2 silu, 3 gelu with tanh.approx
__device__ __forceinline__ float activate(float v) {
  if constexpr (ACT == 1) {
    float z = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return v / (1.0f + __expf(-2.0f * z));
  } else if constexpr (ACT == 2) {
    return v / (1.0f + __expf(-v));
  } else if constexpr (ACT == 3) {
    float z = v * (0.7978845608028654f + 0.035677408136300125f * v * v);
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(z));
    float h = 0.5f * v;
    return h + h * t;
  }
  return v;
}

template <bool BF16, int CLUSTER, int EPI>
__global__ void __launch_bounds__(THREADS, 1) mc_gemm_kernel(const __grid_constant__ Params p) {
  constexpr int ACT = (EPI >> 6) & 3;
  using E = Elem<BF16>;
  using T = typename E::T;
  using T2 = typename E::T2;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const int S = p.stages;
  const uint32_t a_smem = base;
  const uint32_t b_smem = base + S * TILE_BYTES;
  const uint32_t full = b_smem + S * TILE_BYTES;  // S mbarriers: the stage's bytes have landed
  const uint32_t empty = full + 8 * S;            // S mbarriers: every CTA of the cluster has consumed it

  const int tid = threadIdx.x;
  const int prog = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (p.trace != nullptr && tid == 0) p.trace[prog * 4 + 0] = globaltimer();
  const int n_tile = blockIdx.x, m_tile = blockIdx.y, split = blockIdx.z;
  const int m0 = m_tile * BM, n0 = n_tile * BN;
  const int k_first = split * p.per_split;
  const int n_iters = min(p.per_split, p.k_tiles - k_first);
  const uint32_t rank = CLUSTER > 1 ? cluster_rank() : 0;
  const bool pdl = (p.flags & USE_PDL) != 0;

  if (tid == 128) {
    prefetch_tensormap(&p.a_map);
    prefetch_tensormap(&p.b_map);
    for (int s = 0; s < S; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 4 * CLUSTER);  // one arrival per consumer warp of every CTA
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The barriers must be initialised before any CTA of the cluster multicasts into them.
  if constexpr (CLUSTER > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  if (tid >= 128) {
    // Producer warp: one thread issues the loads.
    if (tid == 128) {
      constexpr int A_ROWS = BM / CLUSTER;
      const uint16_t mask = static_cast<uint16_t>((1u << CLUSTER) - 1u);
      const bool racy = (p.flags & RACY) != 0;
      // Stages whose weight tile is requested before the wait (weights are never a predecessor's output).
      int early = p.n_pref > 0 ? min(S, n_iters) : 0;
      if (racy && early == 0 && n_iters > 0) early = 1;
      for (int i = 0; i < early; ++i) {
        mbar_expect_tx(full + 8 * i, 2 * TILE_BYTES);
        tma_load(b_smem + i * TILE_BYTES, &p.b_map, full + 8 * i, (k_first + i) * BK, n0);
      }
      for (int i = early; i < min(p.n_pref, n_iters); ++i)
        tma_prefetch_l2(&p.b_map, (k_first + i) * BK, n0);
      auto load_a = [&](int i, int s) {
        const uint32_t a_dst = a_smem + s * TILE_BYTES + rank * A_ROWS * BK * 2;
        if constexpr (CLUSTER > 1) {
          tma_load_multicast(a_dst, &p.a_map, full + 8 * s, (k_first + i) * BK, m0 + rank * A_ROWS, mask);
        } else {
          tma_load(a_dst, &p.a_map, full + 8 * s, (k_first + i) * BK, m0);
        }
      };
      if (racy && n_iters > 0) load_a(0, 0);
      gdc_wait();
      if (p.trigger_k == 0) gdc_launch();
      int s = 0;
      uint32_t phase = 0;  // of the stage's empty barrier, from the second round on
      for (int i = 0; i < n_iters; ++i) {
        const uint32_t bar = full + 8 * s;
        if (i >= S) mbar_wait(empty + 8 * s, phase);
        if (i >= early) {
          mbar_expect_tx(bar, 2 * TILE_BYTES);
          tma_load(b_smem + s * TILE_BYTES, &p.b_map, bar, (k_first + i) * BK, n0);
        }
        if (!(racy && i == 0)) load_a(i, s);
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

  // Consumer warpgroup.
  const int warp = tid / 32, lane = tid % 32;
  const int r_lo = m0 + warp * 16 + lane / 4;  // this thread's rows: r_lo and r_lo + 8
  const int c_lo = n0 + (lane % 4) * 2;        // and columns c_lo + 8j, c_lo + 8j + 1 (j < 8)
  gdc_wait();
  if (tid == 0 && p.trace != nullptr) p.trace[prog * 4 + 1] = globaltimer();
  if (p.trigger_k == 0) gdc_launch();

  constexpr bool split_out = (EPI & SPLIT) != 0;
  // The epilogue's inputs, requested before the K loop so that their latency hides behind it.
  float bias[16], u[16];
  float2 res[16];
  float st[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = c_lo + 8 * j + e;
      bias[2 * j + e] = 0.f;
      u[2 * j + e] = 0.f;
      if (!split_out && c < p.N) {
        if constexpr ((EPI & HAS_BIAS) != 0)
          bias[2 * j + e] = (EPI & BIAS_F32) ? static_cast<const float*>(p.bias)[c]
                                             : E::f(static_cast<const T*>(p.bias)[c]);
        if constexpr ((EPI & HAS_LN) != 0) u[2 * j + e] = p.ln_u[c];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r_lo + 8 * h;
      const int c = c_lo + 8 * j;
      float2 v = make_float2(0.f, 0.f);
      if (!split_out && (EPI & HAS_RES) && r < p.M) {
        const T* rp = static_cast<const T*>(p.res) + static_cast<long long>(r) * p.res_stride + c;
        if (c + 1 < p.N && (p.res_stride % 2) == 0) {
          v = E::unpack(*reinterpret_cast<const T2*>(rp));
        } else {
          if (c < p.N) v.x = E::f(rp[0]);
          if (c + 1 < p.N) v.y = E::f(rp[1]);
        }
      }
      res[2 * j + h] = v;
    }
  }
  if constexpr (!split_out && (EPI & HAS_LN)) {
    for (int q = 0; q < p.ln_parts; ++q) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h;
        if (r < p.M) {
          const float2 v = *reinterpret_cast<const float2*>(p.ln_stats + (static_cast<long long>(q) * p.M + r) * 2);
          st[h][0] += v.x;
          st[h][1] += v.y;
        }
      }
    }
  }

  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  int s = 0, prev = 0;  // this tile's stage and the previous one's
  uint32_t phase = 0;
  for (int i = 0; i < n_iters; ++i) {
    mbar_wait(full + 8 * s, phase);
    const uint64_t da = smem_desc(a_smem + s * TILE_BYTES);
    const uint64_t db = smem_desc(b_smem + s * TILE_BYTES);
    fence_acc(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      if constexpr ((EPI & NO_MMA) == 0) wgmma_64x64x16<BF16>(acc, da + 2 * kk, db + 2 * kk);
    wgmma_commit();
    fence_acc(acc);
    // Keep this tile's MMAs in flight while the next tile is awaited, and hand the previous tile's stage back
    // to every producer of the cluster (the host requires 2 stages or more: with one, this would deadlock).
    wgmma_wait<1>();
    if (i >= 1 && i - 1 + S < n_iters) {
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (int c = 0; c < CLUSTER; ++c) mbar_arrive_cluster(empty + 8 * prev, c);
      }
    }
    if (pdl && p.trigger_k > 0 && i + 1 == p.trigger_k) gdc_launch();
    prev = s;
    if (++s == S) {
      s = 0;
      phase ^= 1;
    }
  }
  wgmma_wait<0>();
  if (tid == 0 && p.trace != nullptr) p.trace[prog * 4 + 2] = globaltimer();

  if constexpr (split_out) {
    float* ws = p.ws + static_cast<long long>(split) * p.M * p.N;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h, c = c_lo + 8 * j;
        if (r >= p.M) continue;
        float* wp = ws + static_cast<long long>(r) * p.N + c;
        const float x0 = acc[4 * j + 2 * h], x1 = acc[4 * j + 2 * h + 1];
        if (c + 1 < p.N && (p.N % 2) == 0) {
          *reinterpret_cast<float2*>(wp) = make_float2(x0, x1);
        } else {
          if (c < p.N) wp[0] = x0;
          if (c + 1 < p.N) wp[1] = x1;
        }
      }
    }
  } else {
    float rstd[2] = {1.f, 1.f}, mr[2] = {0.f, 0.f};
    if constexpr ((EPI & HAS_LN) != 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mean = st[h][0] / p.K;
        rstd[h] = rsqrtf(fmaxf(st[h][1] / p.K - mean * mean, 0.f) + p.ln_eps);
        mr[h] = mean * rstd[h];
      }
    }
    float rs1[2] = {0.f, 0.f}, rs2[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h, c = c_lo + 8 * j;
        float y[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = acc[4 * j + 2 * h + e];
          if constexpr ((EPI & HAS_LN) != 0) v = rstd[h] * v - mr[h] * u[2 * j + e];
          if constexpr ((EPI & HAS_BIAS) != 0) v += bias[2 * j + e];
          v = activate<ACT>(v);
          if constexpr ((EPI & HAS_RES) != 0) v += e == 0 ? res[2 * j + h].x : res[2 * j + h].y;
          y[e] = (c + e < p.N) ? v : 0.f;
        }
        rs1[h] += y[0] + y[1];
        rs2[h] += y[0] * y[0] + y[1] * y[1];
        if (r >= p.M) continue;
        T* op = static_cast<T*>(p.out) + static_cast<long long>(r) * p.out_stride + c;
        if (c + 1 < p.N && (p.out_stride % 2) == 0) {
          *reinterpret_cast<T2*>(op) = E::pack(y[0], y[1]);
        } else {
          if (c < p.N) op[0] = E::one(y[0]);
          if (c + 1 < p.N) op[1] = E::one(y[1]);
        }
      }
    }
    if constexpr ((EPI & STATS_OUT) != 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // The four lanes of a quad hold the same row.
        rs1[h] += __shfl_xor_sync(0xffffffffu, rs1[h], 1);
        rs1[h] += __shfl_xor_sync(0xffffffffu, rs1[h], 2);
        rs2[h] += __shfl_xor_sync(0xffffffffu, rs2[h], 1);
        rs2[h] += __shfl_xor_sync(0xffffffffu, rs2[h], 2);
        const int r = r_lo + 8 * h;
        if ((lane % 4) == 0 && r < p.M)
          *reinterpret_cast<float2*>(p.stats_out + (static_cast<long long>(n_tile) * p.M + r) * 2) =
              make_float2(rs1[h], rs2[h]);
      }
    }
  }
  if (tid == 0 && p.trace != nullptr) p.trace[prog * 4 + 3] = globaltimer();
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    cudaDriverEntryPointQueryResult q;
    void* f = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }
  return fn;
}

int encode(CUtensorMap* map, bool bf16, void* ptr, int rows, int cols, int stride, int box_rows, char* err,
           int errlen) {
  auto fn = encode_fn();
  if (fn == nullptr) {
    snprintf(err, errlen, "cuTensorMapEncodeTiled is not available from the driver");
    return 1;
  }
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(BK), static_cast<cuuint32_t>(box_rows)};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, ptr, dims,
                  strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "cuTensorMapEncodeTiled failed (CUresult %d) for a [%d, %d] tensor, row stride %d",
             static_cast<int>(r), rows, cols, stride);
    return 1;
  }
  return 0;
}

template <bool BF16, int CLUSTER, int EPI>
int launch(const Params& prm, dim3 grid, int smem, cudaStream_t stream, bool pdl, char* err, int errlen) {
  auto kernel = mc_gemm_kernel<BF16, CLUSTER, EPI>;
  static int configured = 0;
  if (configured < smem) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) {
      snprintf(err, errlen, "cudaFuncSetAttribute(%d B shared memory): %s", smem, cudaGetErrorString(e));
      return 1;
    }
    configured = smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (CLUSTER > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = CLUSTER;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, prm);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "mc_gemm launch (grid %u x %u x %u, cluster %d, %d B shared memory): %s", grid.x, grid.y,
             grid.z, CLUSTER, smem, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

}  // namespace

// One library per variant (dtype, cluster, epilogue), chosen at build time: mc_gemm.py compiles each variant a
// process asks for, once per machine.
#ifndef MC_BF16
#define MC_BF16 0
#endif
#ifndef MC_CLUSTER
#define MC_CLUSTER 2
#endif
#ifndef MC_EPI
#define MC_EPI 0
#endif

extern "C" int mc_gemm_variant() { return MC_BF16 | (MC_CLUSTER << 1) | (MC_EPI << 8); }

extern "C" int mc_gemm_smem_bytes(int stages) { return stages * 2 * TILE_BYTES + 16 * stages + 1024; }

extern "C" int mc_gemm_launch(void* x, void* w, const void* bias, const void* res, void* out, float* ws,
                              const float* ln_u, const float* ln_stats, float* stats_out, long long* trace, int M,
                              int N, int K, int x_stride, int w_stride, int res_stride, int out_stride, int split_k,
                              int per_split, int stages, int trigger_k, int n_pref, int ln_parts, float ln_eps,
                              int flags, void* stream, char* err, int errlen) {
  constexpr int cluster = MC_CLUSTER;
  const int n_tiles = (N + BN - 1) / BN, m_tiles = (M + BM - 1) / BM;
  if (n_tiles % cluster) {
    snprintf(err, errlen, "cluster=%d does not divide the %d column tiles of N=%d", cluster, n_tiles, N);
    return 1;
  }
  if (stages < 2 || stages > MAX_STAGES) {
    snprintf(err, errlen, "stages=%d must be in 2..%d", stages, MAX_STAGES);
    return 1;
  }
  Params p;
  memset(&p, 0, sizeof(p));
  if (encode(&p.a_map, MC_BF16, x, M, K, x_stride, BM / cluster, err, errlen) ||
      encode(&p.b_map, MC_BF16, w, N, K, w_stride, BN, err, errlen))
    return 1;
  p.bias = bias;
  p.res = res;
  p.out = out;
  p.ws = ws;
  p.ln_u = ln_u;
  p.ln_stats = ln_stats;
  p.stats_out = stats_out;
  p.trace = trace;
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
  p.ln_parts = ln_parts;
  p.ln_eps = ln_eps;
  p.flags = flags;
  return launch<MC_BF16 != 0, MC_CLUSTER, MC_EPI>(p, dim3(n_tiles, m_tiles, split_k), mc_gemm_smem_bytes(stages),
                                                  static_cast<cudaStream_t>(stream), (flags & USE_PDL) != 0, err,
                                                  errlen);
}
