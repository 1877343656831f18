// Microbenchmark: what straight-line code costs the first time an SM runs it (instruction fetch), against the same
// code run again at once, and after other kernels ran in between (docs/perf-notes.md, section 25).
// A kernel of N fully unrolled FFMAs in 8 independent chains (16 bytes of SASS each: N = 2048 is 32 KB of code),
// run `passes` times over the same code addresses; lane 0 of every warp records each pass's clock64 cycles.
// TAG makes copies with different code (a kernel that runs in between to evict the first one's code).
// Built and run by scripts/icache_bench.py.
#include <cuda_runtime.h>

#include <cstdio>

namespace {

__device__ __forceinline__ long long clk(float (&r)[8]) {  // a clock read ordered after every chain's last FFMA
  long long t;
  asm volatile("mov.u64 %0, %%clock64;"
               : "=l"(t), "+f"(r[0]), "+f"(r[1]), "+f"(r[2]), "+f"(r[3]), "+f"(r[4]), "+f"(r[5]), "+f"(r[6]),
                 "+f"(r[7])::"memory");
  return t;
}

template <int N, int TAG>
__global__ void __launch_bounds__(256) straight(long long* out, float seed, int passes) {
  float r[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) r[i] = seed + threadIdx.x + i;
  long long t = clk(r);
  const int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
#pragma unroll 1
  for (int p = 0; p < passes; ++p) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i & 7] = fmaf(r[i & 7], 1.0000001f + TAG * 1e-7f, 1e-7f * (i & 15));
    const long long t1 = clk(r);
    if (threadIdx.x % 32 == 0) out[w * passes + p] = t1 - t;
    t = clk(r);
  }
  if (r[0] + r[1] + r[2] + r[3] + r[4] + r[5] + r[6] + r[7] == 1234.5f) out[0] = -1;  // keep the chains
}

template <int N, int TAG>
int run(int ctas, int warps, int passes, long long* out, float seed) {
  straight<N, TAG><<<ctas, warps * 32>>>(out, seed, passes);
  return cudaGetLastError() != cudaSuccess;
}

}  // namespace

// n: 512, 2048, 8192 (tag 0 or 1), 16384 (tag 1 only). Returns 0, or 1 (bad n/tag or a launch error).
extern "C" int icb_launch(int n, int tag, int ctas, int warps, int passes, long long* out, float seed) {
  if (tag == 0 && n == 512) return run<512, 0>(ctas, warps, passes, out, seed);
  if (tag == 0 && n == 2048) return run<2048, 0>(ctas, warps, passes, out, seed);
  if (tag == 0 && n == 8192) return run<8192, 0>(ctas, warps, passes, out, seed);
  if (tag == 1 && n == 512) return run<512, 1>(ctas, warps, passes, out, seed);
  if (tag == 1 && n == 2048) return run<2048, 1>(ctas, warps, passes, out, seed);
  if (tag == 1 && n == 8192) return run<8192, 1>(ctas, warps, passes, out, seed);
  if (tag == 1 && n == 16384) return run<16384, 1>(ctas, warps, passes, out, seed);
  return 1;
}
