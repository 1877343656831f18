// Microbenchmark: what a hand-off between CTAs of one persistent kernel costs by itself, against a kernel boundary
// (scripts/boundary_bench.py; docs/perf-notes.md sections 32.3 and 43.5). One launch of P co-resident CTAs (one an SM)
// runs `hops` phases. In phase h a CTA waits for its producers of phase h - 1, reads the block of `words` fp32 that one
// of them wrote (L2, bypassing L1), adds one, writes its own block of the other buffer, and releases its flag:
//   group 1: one producer, the next CTA ((p + 1) % P): a per-tile flag;
//   group G > 1: the G CTAs of its group (p / G), counted on one counter a group and phase: a join over a row's G
//   column tiles (G = P: a grid barrier). It reads the block of the next CTA of its group.
// Phase 1 waits for nothing (the buffers start at zero), so after `hops` phases every element holds `hops`.
// Built and run by scripts/flag_bench.py.
#include "../kernels/hopper.cuh"

namespace {

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

constexpr int MAX_VEC = 8;  // 16-byte vectors a thread: 128 threads read at most 16 KB

__global__ void __launch_bounds__(128, 1) flag_chain(float* a, float* b, unsigned* flags, int hops, int words,
                                                    int group) {
  const int p = blockIdx.x, P = gridDim.x, g = p / group;
  const int q = g * group + (p % group + 1) % group;  // whose block this CTA reads
  for (int h = 1; h <= hops; ++h) {
    const float* src = (h & 1) ? a : b;
    float* dst = (h & 1) ? b : a;
    if (h > 1 && threadIdx.x == 0) {
      const unsigned* f = flags + static_cast<long long>(h - 1) * P + (group == 1 ? q : g);
      while (ld_acquire(f) < static_cast<unsigned>(group)) {
      }
    }
    __syncthreads();
    // every load issued before any store (16-byte vectors, up to 8 a thread), as a kernel's first stage would be
    const float4* s4 = reinterpret_cast<const float4*>(src + static_cast<long long>(q) * words);
    float4* d4 = reinterpret_cast<float4*>(dst + static_cast<long long>(p) * words);
    float4 v[MAX_VEC];
#pragma unroll
    for (int k = 0; k < MAX_VEC; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < words / 4) v[k] = __ldcg(s4 + i);
    }
#pragma unroll
    for (int k = 0; k < MAX_VEC; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < words / 4) d4[i] = make_float4(v[k].x + 1.f, v[k].y + 1.f, v[k].z + 1.f, v[k].w + 1.f);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(flags + static_cast<long long>(h) * P + (group == 1 ? p : g), 1u);
    }
  }
}

}  // namespace

// One launch of `programs` CTAs (each asks for `smem` bytes, so that one runs on an SM), timed by CUDA events after
// the flags are zeroed; *us: the launch's time. 0, or 1 (bad arguments) / 2 (CUDA error, in err).
extern "C" int flag_chain_run(float* a, float* b, unsigned* flags, int programs, int hops, int words, int group,
                              int smem, float* us, char* err) {
  if (group < 1 || programs % group != 0 || words % 4 != 0 || words / 4 > 128 * MAX_VEC) {
    snprintf(err, 256, "group %d must divide programs %d; words %d: a multiple of 4, at most %d", group, programs,
             words, 128 * MAX_VEC * 4);
    return 1;
  }
  if (cudaFuncSetAttribute(flag_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    snprintf(err, 256, "smem %d", smem);
    return 1;
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaMemset(flags, 0, sizeof(unsigned) * static_cast<size_t>(hops + 1) * programs);
  cudaEventRecord(e0);
  flag_chain<<<programs, 128, smem>>>(a, b, flags, hops, words, group);
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
