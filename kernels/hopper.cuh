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

// Spin until the mbarrier completes its phase `parity`. CLUSTER: acquire at cluster scope, for bytes that other CTAs'
// threads stored with st.async (whose complete_tx releases at cluster scope).
#define PDL_TUNE_MBAR_WAIT(SEM)                                        \
  "{\n\t.reg .pred p;\n"                                               \
  "CG_WAIT:\n\t"                                                       \
  "mbarrier.try_wait.parity" SEM ".shared::cta.b64 p, [%0], %1;\n\t" \
  "@!p bra CG_WAIT;\n\t}"
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if constexpr (CLUSTER) {
    asm volatile(PDL_TUNE_MBAR_WAIT(".acquire.cluster")::"r"(bar), "r"(parity) : "memory");
  } else {
    asm volatile(PDL_TUNE_MBAR_WAIT("")::"r"(bar), "r"(parity) : "memory");
  }
}
#undef PDL_TUNE_MBAR_WAIT

// A store into another CTA's shared memory that completes its bytes on that CTA's mbarrier (st.async: no arrival;
// the receiver's expect_tx counts the bytes). dst and bar are shared::cluster addresses (map_to_cta).
__device__ __forceinline__ void st_async_b32(uint32_t dst, uint32_t v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(dst), "r"(v), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void st_async_v4(uint32_t dst, uint4 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
               : "memory");
}

// L2 eviction priority of a TMA load (CUTLASS example 63's hints): weights are read once a layer (evict first),
// activations by every column tile of the next kernel too (evict last). HOPPER_CACHE_HINTS (a build define: the
// launchers' `hints`, 3 for GemmConfig.hints 1): bit 0 the weights' hint, bit 1 the activations'; 0 (the default):
// every load takes the default policy.
enum L2Hint { HINT_NONE = 0, HINT_WEIGHT = 1, HINT_ACT = 2 };

template <int H>
__device__ __forceinline__ uint64_t l2_policy() {
  uint64_t pol;
  if constexpr (H == HINT_WEIGHT)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  else
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

#ifndef HOPPER_CACHE_HINTS
#define HOPPER_CACHE_HINTS 0
#endif
constexpr int CACHE_HINTS = HOPPER_CACHE_HINTS;

template <int H = HINT_NONE>
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  if constexpr ((CACHE_HINTS & H) != 0) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "l"(l2_policy<H>())
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
  }
}

// 3-D tensor maps (encode3): coordinates {0, row, 64-wide column tile}; a box is `kt` consecutive 64 x 64 tiles.
template <int H = HINT_NONE>
__device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap* map, uint32_t bar, int row, int ctile) {
  if constexpr ((CACHE_HINTS & H) != 0) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(0), "r"(row), "r"(ctile), "l"(l2_policy<H>())
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(0), "r"(row), "r"(ctile)
        : "memory");
  }
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

// A diagnostics stamp: thread 0 of the CTA writes the clock to slot `slot` of its program's row `row` of the
// launch's trace (trace[row + slot]; null: none asked), and to slot `also` too where that is not negative:
// %globaltimer, or the SM's cycles (clock64) where CYCLES. Nothing at all in a build that is not TRACED (the
// kernels' *_DIAG bit 0).
template <bool TRACED, bool CYCLES = false>
__device__ __forceinline__ void trace_stamp(long long* trace, long long row, int slot, int also = -1) {
  if constexpr (TRACED) {
    if (threadIdx.x == 0 && trace != nullptr) {
      const long long now = CYCLES ? static_cast<long long>(clock64()) : globaltimer();
      trace[row + slot] = now;
      if (also >= 0) trace[row + also] = now;
    }
  }
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

#ifndef HOPPER_IEEE_MATH
#define HOPPER_IEEE_MATH 0
#endif

// A LayerNorm's row factors from the row's sums of x and x^2 over n elements: (rstd, mean * rstd). By the MUFU's
// reciprocal and reciprocal square root (a few ulp, far inside a 16-bit output's rounding): IEEE division and square
// root each sit behind a slow-path branch, which serialises the row chains of an epilogue (~800 cycles for two rows,
// perf notes 28.4). HOPPER_IEEE_MATH=1 builds the IEEE forms here and in softmax_rcp (an A/B switch:
// kernels._nvcc.MUFU_MATH).
__device__ __forceinline__ float2 ln_factors(float s1, float s2, int n, float eps) {
#if HOPPER_IEEE_MATH
  const float mean = s1 / n;
  const float rstd = 1.0f / sqrtf(fmaxf(s2 / n - mean * mean, 0.f) + eps);
#else
  const float inv_n = __fdividef(1.0f, static_cast<float>(n));
  const float mean = s1 * inv_n;
  const float rstd = rsqrtf(fmaxf(fmaf(s2, inv_n, -mean * mean), 0.f) + eps);
#endif
  return make_float2(rstd, mean * rstd);
}

// 1 / x for a softmax's sum of exponentials (x >= 1: the row maximum's term is 1), by the MUFU's reciprocal.
__device__ __forceinline__ float softmax_rcp(float x) {
#if HOPPER_IEEE_MATH
  return 1.0f / x;
#else
  return __fdividef(1.0f, x);
#endif
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

// wgmma m64n64k16 with A from registers (4 16-bit pairs a thread: mma.sync's A fragment layout, warp w's rows 16 w..)
// and B from shared memory N-major (transposed: B[k][n] with n contiguous, 128-byte rows swizzled, 8-row groups 1024
// bytes apart, i.e. the smem_desc of a row-major [k][64] tile): attention's P @ V with V as loaded.
#define CG_WGMMA64_RS_TB(TYPE) \
  "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n\t}"

template <bool BF16>
__device__ __forceinline__ void wgmma_64x64x16_rs_tb(float* d, const uint32_t* a, uint64_t db) {
  if constexpr (BF16) {
    asm volatile(CG_WGMMA64_RS_TB("bf16") : CG_ACC32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  } else {
    asm volatile(CG_WGMMA64_RS_TB("f16") : CG_ACC32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  }
}

// Calls f(i, h, col) for each of a thread's 4 NJ values of a wgmma m64n(8 NJ) fp32 accumulator: d[i] lies in the
// thread's row h (0: 16 (warp % 4) + lane / 4, 1: that + 8) at column `col` (attention: the scores, a key each).
template <int NJ, typename F>
__device__ __forceinline__ void each_acc(int lane, F&& f) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) f(4 * j + 2 * h + e, h, 8 * j + (lane % 4) * 2 + e);
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
  cudaLaunchAttribute attrs[4];
  int n = 0;
  attrs[n].id = cudaLaunchAttributeClusterDimension;
  attrs[n].val.clusterDim.x = 1;
  attrs[n].val.clusterDim.y = 1;
  attrs[n].val.clusterDim.z = grid.z;
  ++n;
#ifdef HOPPER_CLUSTER_POLICY  // (an A/B build only: _nvcc.CLUSTER_POLICY)
  attrs[n].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  attrs[n].val.clusterSchedulingPolicyPreference = static_cast<cudaClusterSchedulingPolicy>(HOPPER_CLUSTER_POLICY);
  ++n;
#endif
#ifdef HOPPER_MEM_SYNC_DOMAIN  // (an A/B build only: _nvcc.MEM_SYNC_DOMAIN)
  attrs[n].id = cudaLaunchAttributeMemSyncDomain;
  attrs[n].val.memSyncDomain = static_cast<cudaLaunchMemSyncDomain>(HOPPER_MEM_SYNC_DOMAIN);
  ++n;
#endif
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

// The dynamic shared memory to request for a launch of `ctas` CTAs that each use `smem` bytes: one CTA to an SM where
// the grid could double up. A footprint under half an SM lets two CTAs of one kernel share an SM and halve each other's
// bandwidth (H200, bert-base: the out-projection's 96 CTAs at 66 KB added 3.84-3.86 us to the layer, padded 2.94-2.95;
// perf notes 16.7). A grid of at most half the SMs cannot double up and is left as it is, so that the neighbouring
// kernels' CTAs may still share its SMs.
inline int spread_smem(int smem, int ctas) {
  static int spread = -1, sms = 0;
  if (spread < 0) {
    int dev = 0, per_sm = 0, reserved = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    spread = per_sm > 0 ? per_sm / 2 - reserved + 16 : 0;  // two CTAs need 2 * (smem + reserved) <= per_sm
  }
  return 2 * ctas > sms ? max(smem, spread) : smem;
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
