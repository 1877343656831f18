// Microbenchmark: cycles per wgmma m64nNk16 (fp16, operands from 128-byte swizzled shared memory) issued by one
// warpgroup, as the GEMM loops of cluster_gemm.cu and layer_kernel.cu issue them: per "stage" 4 MMAs (K = 64) into
// one accumulator, commit, then wait until at most WAIT groups are pending. Built and run by scripts/wgmma_bench.py.
#include "../kernels/hopper.cuh"

namespace {

template <int N, int WAIT, int MMAS>
__global__ void __launch_bounds__(128, 1) bench(long long* cycles, float* sink, int iters) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t a = base, b = base + 64 * 128;  // a 64 x 64 A tile, then an N x 64 B tile (zeros: not read back)
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    fence_acc<N / 2>(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < MMAS; ++kk) wgmma_64xNx16<false, N>(acc, smem_desc(a) + 2 * (kk % 4), smem_desc(b) + 2 * (kk % 4));
    wgmma_commit();
    fence_acc<N / 2>(acc);
    wgmma_wait<WAIT>();
  }
  wgmma_wait<0>();
  fence_acc<N / 2>(acc);
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[i];
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  sink[blockIdx.x * 128 + threadIdx.x] = s;
}

template <int N, int WAIT, int MMAS>
int run(long long* cycles, float* sink, int iters, int ctas) {
  auto k = bench<N, WAIT, MMAS>;
  const int smem = 1024 + 64 * 128 + N * 128;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<ctas, 128, smem>>>(cycles, sink, iters);
  return cudaDeviceSynchronize() != cudaSuccess;
}

}  // namespace

// variant: N (64, 128) x WAIT (0, 1) x MMAs a commit group (4 or 8)
extern "C" int wgmma_bench(int n, int wait, int mmas, long long* cycles, float* sink, int iters, int ctas) {
#define CASE(NN, WW, MM) \
  if (n == NN && wait == WW && mmas == MM) return run<NN, WW, MM>(cycles, sink, iters, ctas);
  CASE(64, 0, 4) CASE(64, 1, 4) CASE(128, 0, 4) CASE(128, 1, 4)
  CASE(64, 1, 8) CASE(64, 0, 8)
#undef CASE
  return 2;
}

// TMA: one CTA issues `boxes` loads of a box_rows x 64 16-bit box (128-byte swizzle) into a ring of `slots` buffers,
// alternating between `maps` descriptors (1 or 2), each load completing on its slot's mbarrier; slot reuse waits for
// the previous load into it. Cycles from the first issue to the last arrival.
namespace {
__global__ void __launch_bounds__(32, 1) tma_bench(const __grid_constant__ CUtensorMap m0,
                                                  const __grid_constant__ CUtensorMap m1, int maps, int box_rows,
                                                  int boxes, int slots, long long* cycles) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t bytes = box_rows * 128;
  const uint32_t bars = base + slots * bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) mbar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    prefetch_tensormap(&m0);
    prefetch_tensormap(&m1);
  }
  __syncwarp();
  if (threadIdx.x != 0) return;
  const long long t0 = clock64();
  for (int i = 0; i < boxes; ++i) {
    const int s = i % slots;
    if (i >= slots) mbar_wait(bars + 8 * s, ((i / slots) - 1) & 1);
    mbar_expect_tx(bars + 8 * s, bytes);
    const CUtensorMap* m = (maps == 2 && (i & 1)) ? &m1 : &m0;
    tma_load(base + s * bytes, m, bars + 8 * s, (i % 48) * 64, ((i / 48) % 16) * box_rows);
  }
  for (int i = max(0, boxes - slots); i < boxes; ++i) mbar_wait(bars + 8 * (i % slots), (i / slots) & 1);
  cycles[0] = clock64() - t0;
}
}  // namespace

extern "C" int tma_bench_run(void* t0, void* t1, int maps, int box_rows, int boxes, int slots, long long* cycles,
                             char* err) {
  CUtensorMap m0, m1;
  if (encode(&m0, false, t0, 4096, 3072, 3072, box_rows, err, 256) ||
      encode(&m1, false, t1, 4096, 3072, 3072, box_rows, err, 256))
    return 1;
  const int smem = 1024 + slots * box_rows * 128 + 8 * slots;
  cudaFuncSetAttribute(tma_bench, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  tma_bench<<<1, 32, smem>>>(m0, m1, maps, box_rows, boxes, slots, cycles);
  return cudaDeviceSynchronize() != cudaSuccess ? 2 : 0;
}

// Instruction fetch: `reps` passes over a straight run of 4096 FMAs (independent chains of 8; ~64 KB of code) by one
// warpgroup. The first pass fetches the code cold, the later ones find it in the SM's instruction caches.
namespace {
__global__ void __launch_bounds__(128, 1) icache_bench(float* sink, long long* cycles, int reps) {
  float r[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) r[i] = threadIdx.x * 0.001f + i;
  long long t[4];
  for (int rep = 0; rep < reps && rep < 4; ++rep) {
    t[rep] = clock64();
#pragma unroll
    for (int i = 0; i < 4096; ++i) asm volatile("fma.rn.f32 %0, %0, 0f3F800001, 0f3A83126F;" : "+f"(r[i % 8]));
  }
  const long long end = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += r[i];
  sink[threadIdx.x] = s;
  if (threadIdx.x == 0)
    for (int rep = 0; rep < reps && rep < 4; ++rep) cycles[rep] = (rep + 1 < reps ? t[rep + 1] : end) - t[rep];
}
}  // namespace

extern "C" int icache_bench_run(float* sink, long long* cycles, int reps) {
  icache_bench<<<1, 128>>>(sink, cycles, reps);
  return cudaDeviceSynchronize() != cudaSuccess;
}
