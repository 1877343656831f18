// Microbenchmark: what a hand-off between CTAs of one persistent kernel costs by itself, against a kernel boundary
// (scripts/boundary_bench.py; docs/perf-notes.md sections 32.3 and 43.5). One launch of P co-resident CTAs (one an SM)
// runs `hops` phases. Phase h's blocks live in slot h of a buffer of hops + 1 slots (no slot is written twice, so no
// CTA can overwrite a block that a slower one still reads). In phase h a CTA waits for its producers of phase h - 1,
// reads the block of `words` fp32 that one of them wrote in slot h - 1 (L2, bypassing L1), adds one, and writes its
// own block of slot h:
//   group 1: one producer, the next CTA ((p + 1) % P), released by a flag a CTA and phase: a per-tile flag;
//   group G > 1: the G CTAs of its group (p / G), counted on one counter a group and phase: a join over a row's G
//   column tiles (G = P: a grid barrier). It reads the block of the next CTA of its group;
//   group 0 ("LL", NCCL's low-latency protocol): no flags; every 8-byte word carries 4 bytes of data and the phase
//   that wrote it, stored and loaded whole, so a consumer spins on the words it needs until they carry phase h - 1
//   (no fence, no barrier, no separate flag: one round trip each way, at twice the bytes).
// Slot 0 is zero (data 0, phase 0), so after `hops` phases every element of slot `hops` holds `hops`.
// Built and run by scripts/flag_bench.py.
#include "../kernels/hopper.cuh"

namespace {

__device__ __forceinline__ ulonglong2 ld_volatile2(const ulonglong2* p) {
  ulonglong2 v;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile2(ulonglong2* p, ulonglong2 v) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(v.x), "l"(v.y) : "memory");
}

constexpr int THREADS = 128;
constexpr int MAX_VEC = 8;  // 16-byte vectors a thread: 128 threads read at most 16 KB of data

__global__ void __launch_bounds__(THREADS, 1) flag_chain(float* slots, int* flags, int hops, int words, int group) {
  const int p = blockIdx.x, P = gridDim.x, g = p / group;
  const int q = g * group + (p % group + 1) % group;  // whose block this CTA reads
  const long long slot = static_cast<long long>(P) * words;
  for (int h = 1; h <= hops; ++h) {
    if (h > 1 && threadIdx.x == 0) {
      const int* f = flags + static_cast<long long>(h - 1) * P + (group == 1 ? q : g);
      while (ld_acquire(f) < group) {  // (hopper.cuh's gpu-scope acquire)
      }
    }
    __syncthreads();
    // every load issued before any store (16-byte vectors), as a kernel's first stage would be
    const float4* s4 = reinterpret_cast<const float4*>(slots + (h - 1) * slot + static_cast<long long>(q) * words);
    float4* d4 = reinterpret_cast<float4*>(slots + h * slot + static_cast<long long>(p) * words);
    float4 v[MAX_VEC];
#pragma unroll
    for (int k = 0; k < MAX_VEC; ++k) {
      const int i = threadIdx.x + k * THREADS;
      if (i < words / 4) v[k] = __ldcg(s4 + i);
    }
#pragma unroll
    for (int k = 0; k < MAX_VEC; ++k) {
      const int i = threadIdx.x + k * THREADS;
      if (i < words / 4) d4[i] = make_float4(v[k].x + 1.f, v[k].y + 1.f, v[k].z + 1.f, v[k].w + 1.f);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(flags + static_cast<long long>(h) * P + (group == 1 ? p : g), 1);
    }
  }
}

// LL: a word is (phase << 32) | the data's bits; a thread moves up to 2 * MAX_VEC 16-byte pairs of words.
__device__ __forceinline__ bool ll_ready(ulonglong2 v, unsigned phase) {
  return static_cast<unsigned>(v.x >> 32) == phase && static_cast<unsigned>(v.y >> 32) == phase;
}

__device__ __forceinline__ unsigned long long ll_next(unsigned long long w, unsigned phase) {
  return (static_cast<unsigned long long>(phase) << 32) |
         __float_as_uint(__uint_as_float(static_cast<unsigned>(w)) + 1.f);
}

__global__ void __launch_bounds__(THREADS, 1) ll_chain(ulonglong2* slots, int hops, int words) {
  constexpr int PAIRS = 2 * MAX_VEC;
  const int p = blockIdx.x, P = gridDim.x, q = (p + 1) % P;
  const long long slot = static_cast<long long>(P) * words / 2;  // 16-byte pairs of words
  const int n = words / 2;
  for (int h = 1; h <= hops; ++h) {
    const ulonglong2* src = slots + (h - 1) * slot + static_cast<long long>(q) * n;
    ulonglong2* dst = slots + h * slot + static_cast<long long>(p) * n;
    ulonglong2 v[PAIRS];
#pragma unroll
    for (int k = 0; k < PAIRS; ++k) {
      const int i = threadIdx.x + k * THREADS;
      if (i < n) v[k] = ld_volatile2(src + i);
    }
#pragma unroll
    for (int k = 0; k < PAIRS; ++k) {
      const int i = threadIdx.x + k * THREADS;
      if (i < n) {
        while (!ll_ready(v[k], h - 1)) v[k] = ld_volatile2(src + i);
        st_volatile2(dst + i, make_ulonglong2(ll_next(v[k].x, h), ll_next(v[k].y, h)));
      }
    }
  }
}

}  // namespace

// One launch of `programs` CTAs (each asks for `smem` bytes, so that one runs on an SM), timed by CUDA events;
// `slots`: (hops + 1) x programs x words fp32 (group >= 1) or 8-byte LL words (group 0), slot 0 zero (the caller
// zeroes the rest too). *us: the launch's time. 0, or 1 (bad arguments) / 2 (CUDA error, in err).
extern "C" int flag_chain_run(void* slots, int* flags, int programs, int hops, int words, int group, int smem,
                              float* us, char* err) {
  const int max_words = group == 0 ? THREADS * 2 * MAX_VEC * 2 : THREADS * MAX_VEC * 4;
  if (group < 0 || (group > 0 && programs % group != 0) || words % 4 != 0 || words > max_words) {
    snprintf(err, 256, "group %d must be 0 or divide programs %d; words %d: a multiple of 4, at most %d", group,
             programs, words, max_words);
    return 1;
  }
  const void* fn = group == 0 ? reinterpret_cast<const void*>(ll_chain) : reinterpret_cast<const void*>(flag_chain);
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    snprintf(err, 256, "smem %d", smem);
    return 1;
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  if (group > 0) cudaMemset(flags, 0, sizeof(int) * static_cast<size_t>(hops + 1) * programs);
  cudaEventRecord(e0);
  if (group == 0)
    ll_chain<<<programs, THREADS, smem>>>(static_cast<ulonglong2*>(slots), hops, words);
  else
    flag_chain<<<programs, THREADS, smem>>>(static_cast<float*>(slots), flags, hops, words, group);
  cudaEventRecord(e1);
  cudaError_t e = cudaEventSynchronize(e1);
  if (e == cudaSuccess) e = cudaGetLastError();
  cudaEventElapsedTime(us, e0, e1);
  *us *= 1000.f;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (e != cudaSuccess) {
    snprintf(err, 256, "%s", cudaGetErrorString(e));
    return 2;
  }
  return 0;
}
