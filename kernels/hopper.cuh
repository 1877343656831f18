// Hopper (sm_90a) building blocks shared by the CUDA kernels of this package (cluster_gemm.cu, layer_kernel.cu):
// mbarriers, TMA loads and L2 prefetches, griddepcontrol (PDL), wgmma from 128-byte-swizzled shared memory, the
// 16-bit element types, the activations, and the host-side TMA descriptor encoder. Each kernel is one translation
// unit built by nvcc at run time (kernels/_nvcc.py), so everything here lives in an anonymous namespace.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <type_traits>

namespace {

// K (and every TMA box's inner extent) is consumed in 64-wide tiles: the 128-byte swizzle span of 16-bit elements.
constexpr int BK = 64;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cluster_sync() {
  // relaxed: what must be visible (the mbarrier inits) is ordered by fence.mbarrier_init before it.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ uint32_t map_to_cta(uint32_t addr, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(cta));
  return r;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "CG_WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra CG_WAIT;\n\t}" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// 3-D tensor maps (encode3): coordinates {0, row, 64-wide column tile}; a box is `kt` consecutive 64 x 64 tiles.
__device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap* map, uint32_t bar, int row, int ctile) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(0), "r"(row), "r"(ctile)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_l2_3d(const CUtensorMap* map, int row, int ctile) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(0), "r"(row), "r"(ctile)
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

// `bytes` of this CTA's shared memory at `src` to `dst` in another CTA of the cluster (both shared::cluster
// addresses from mapa for the destination), completing on the destination's mbarrier `bar`.
__device__ __forceinline__ void bulk_push(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void gdc_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void gdc_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// a and b each summed over N adjacent lanes (N a power of two up to 32): a butterfly over the low lane bits.
template <int N>
__device__ __forceinline__ void lane_sum2(float& a, float& b) {
#pragma unroll
  for (int o = 1; o < N; o *= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
}

// A LayerNorm's row factors from the row's sums of x and x^2 over n elements: (rstd, mean * rstd).
__device__ __forceinline__ float2 ln_factors(float s1, float s2, int n, float eps) {
  const float mean = s1 / n;
  const float rstd = 1.0f / sqrtf(fmaxf(s2 / n - mean * mean, 0.f) + eps);
  return make_float2(rstd, mean * rstd);
}

// The consumer warpgroups' own barrier (the producer warp does not take part).
template <int N>
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(N) : "memory"); }

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

// Pins the accumulator registers across the asynchronous MMAs (CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands and the instruction of wgmma m64nNk16 (N/2 fp32 registers a thread).
#define CG_ACC32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define CG_ACC64(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define CG_WGMMA64(TYPE) \
  "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}, %32, %33, p, 1, 1, 0, 0;\n\t}"

#define CG_WGMMA128(TYPE) \
  "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t" \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
  "}, %64, %65, p, 1, 1, 0, 0;\n\t}"

#define CG_ACC8(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])

#define CG_WGMMA16(TYPE) \
  "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %10, 0;\n\t" \
  "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7" \
  "}, %8, %9, p, 1, 1, 0, 0;\n\t}"

#define CG_ACC16(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])

#define CG_WGMMA32(TYPE) \
  "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t" \
  "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
  "}, %16, %17, p, 1, 1, 0, 0;\n\t}"

// One wgmma of the operand type (bf16 or f16): INSTR is a CG_WGMMA* string macro, ACC the matching CG_ACC* list.
#define CG_WGMMA_TYPED(INSTR, ACC)                                                  \
  if constexpr (BF16) {                                                             \
    asm volatile(INSTR("bf16") : ACC(d) : "l"(da), "l"(db), "r"(1));                \
  } else {                                                                          \
    asm volatile(INSTR("f16") : ACC(d) : "l"(da), "l"(db), "r"(1));                 \
  }

template <bool BF16, int N>
__device__ __forceinline__ void wgmma_64xNx16(float* d, uint64_t da, uint64_t db) {
  static_assert(N == 16 || N == 32 || N == 64 || N == 128, "wgmma tile width: 16, 32, 64 or 128");
  if constexpr (N == 16) {
    CG_WGMMA_TYPED(CG_WGMMA16, CG_ACC8)
  } else if constexpr (N == 32) {
    CG_WGMMA_TYPED(CG_WGMMA32, CG_ACC16)
  } else if constexpr (N == 64) {
    CG_WGMMA_TYPED(CG_WGMMA64, CG_ACC32)
  } else {
    CG_WGMMA_TYPED(CG_WGMMA128, CG_ACC64)
  }
}

// mma.sync m16n8k16 (A from registers, B fragments through ldmatrix.trans): attention's P @ V.
template <bool BF16>
__device__ __forceinline__ void mma_16x8x16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The byte address of 16-bit element (row, col) of a tile of 128-byte rows written by TMA with the 128-byte
// swizzle (the 16-byte chunk index XOR the row's index mod 8; the tile 1024-byte aligned).
__device__ __forceinline__ uint32_t swz(uint32_t tile, int row, int col) {
  return tile + row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2;
}

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// Causal attention of the 16 query rows q0.. of one head (head_dim 64) for one warp (mlp_cluster.cu's ATT_IN,
// qkv_attn.cu), by mma.sync m16n8k16: Q's rows from tile qt (then overwritten by O, 16-bit), K's and V's rows from
// tiles kt and vt (16-bit, 128-byte swizzled; keys from m on are masked, and must be finite). S = Q K^T, the softmax of a row in the 4 lanes of a quad,
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
  const float inv0 = 1.f / l[0], inv1 = 1.f / l[2];
  __syncwarp();  // every lane's Q reads done before the rows are overwritten
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(swz(qt, q0 + g, 8 * v + q2)),
                 "r"(pack2<BF16>(o[v][0] * inv0, o[v][1] * inv0)) : "memory");
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(swz(qt, q0 + g + 8, 8 * v + q2)),
                 "r"(pack2<BF16>(o[v][2] * inv1, o[v][3] * inv1)) : "memory");
  }
}

// Inter-CTA synchronisation through global memory (gpu scope).
__device__ __forceinline__ int ld_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int atom_acq_rel_add(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// Orders this thread's generic-proxy global accesses with its async-proxy (TMA) ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ void red_add_v2(float* p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void red_add_v4(float* p, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
// Non-blocking: whether the mbarrier's phase of `parity` has completed.
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}

template <bool BF16>
struct Elem;
template <>
struct Elem<false> {
  using T = __half;
  __device__ static float f(T v) { return __half2float(v); }
  __device__ static float2 f2(uint32_t v) { return __half22float2(*reinterpret_cast<const __half2*>(&v)); }
  __device__ static T one(float a) { return __float2half_rn(a); }
};
template <>
struct Elem<true> {
  using T = __nv_bfloat16;
  __device__ static float f(T v) { return __bfloat162float(v); }
  __device__ static float2 f2(uint32_t v) { return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v)); }
  __device__ static T one(float a) { return __float2bfloat16_rn(a); }
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

// A TMA descriptor of a 16-bit tensor (128-byte swizzle): dims and boxes innermost first, strides in bytes.
int encode_nd(CUtensorMap* map, bool bf16, void* ptr, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
              const cuuint32_t* box, int rows, int cols, int stride, char* err, int errlen) {
  auto fn = encode_fn();
  if (fn == nullptr) {
    snprintf(err, errlen, "cuTensorMapEncodeTiled is not available from the driver");
    return 1;
  }
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank, ptr, dims,
                  strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "cuTensorMapEncodeTiled (%d-D) failed (CUresult %d) for a [%d, %d] tensor, row stride %d",
             rank, static_cast<int>(r), rows, cols, stride);
    return 1;
  }
  return 0;
}

// A row-major [rows, cols] 16-bit matrix, box {64 columns, box_rows rows}.
int encode(CUtensorMap* map, bool bf16, void* ptr, int rows, int cols, int stride, int box_rows, char* err,
           int errlen) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(BK), static_cast<cuuint32_t>(box_rows)};
  return encode_nd(map, bf16, ptr, 2, dims, strides, box, rows, cols, stride, err, errlen);
}

// The same matrix seen as [cols / 64][rows][64] (3-D), box {64, box_rows, kt}: one load brings kt consecutive
// 64-wide column tiles of box_rows rows, each laid out (and 128-byte swizzled) as a 2-D 64-wide box would be, one
// after another in shared memory.
int encode3(CUtensorMap* map, bool bf16, void* ptr, int rows, int cols, int stride, int box_rows, int kt, char* err,
            int errlen) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(BK), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>((cols + BK - 1) / BK)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(stride) * 2, static_cast<cuuint64_t>(BK) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(BK), static_cast<cuuint32_t>(box_rows),
                             static_cast<cuuint32_t>(kt)};
  return encode_nd(map, bf16, ptr, 3, dims, strides, box, rows, cols, stride, err, errlen);
}

// Appends the PDL launch attribute (programmatic stream serialization: the launch may begin before its predecessor
// ends; the kernel's griddepcontrol.wait waits for it).
inline void add_pdl(cudaLaunchAttribute* attrs, int& n) {
  attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[n].val.programmaticStreamSerializationAllowed = 1;
  ++n;
}

// Launches `kernel(params)` on `grid` with clusters spanning grid z (1 x 1 x grid.z), `smem` bytes of dynamic shared
// memory, and PDL when `pdl`; on failure writes "`who` launch (grid ..., cluster ..., smem): error" to err.
template <typename K, typename P>
int launch_z_clusters(K kernel, const P& params, dim3 grid, int threads, int smem, void* stream, bool pdl,
                      const char* who, char* err, int errlen) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attrs[2];
  int n = 0;
  attrs[n].id = cudaLaunchAttributeClusterDimension;
  attrs[n].val.clusterDim.x = 1;
  attrs[n].val.clusterDim.y = 1;
  attrs[n].val.clusterDim.z = grid.z;
  ++n;
  if (pdl) add_pdl(attrs, n);
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, params);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "%s launch (grid %d x %d x %d, cluster 1x1x%d, %d B shared memory): %s", who, grid.x,
             grid.y, grid.z, grid.z, smem, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

// Raises a kernel's dynamic shared-memory limit to `smem` bytes once (`configured`: the kernel's current limit).
template <typename K>
int allow_smem(K kernel, int smem, int& configured, char* err, int errlen) {
  if (configured >= smem) return 0;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "cudaFuncSetAttribute(%d B shared memory): %s", smem, cudaGetErrorString(e));
    return 1;
  }
  configured = smem;
  return 0;
}

}  // namespace
