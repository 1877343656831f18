// Microbenchmark: the fused block's in-kernel attention (mlp_cluster.cu attention_rows, ATT_IN) on its own: one CTA
// of 256 threads, every head's 16-row tasks as the block runs them, on shared-memory tiles of finite values. Per
// warp: clock64 cycles of the first pass (code cold) and of the second (warm). Built and run by attn_probe.py.
#include "../kernels/mlp_cluster.cu"

namespace {

template <int BT, int KT1, int STOP>
__global__ void __launch_bounds__(256, 1) attn_probe_kernel(int m, int ntasks, long long* out) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  constexpr int XT = BT * 128;
  const uint32_t xs = base, kvs = base + KT1 * XT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < 3 * KT1 * XT / 4; i += 256) {  // finite values: 0.01 * ((i % 17) - 8) in fp16
    const __half v = __float2half(0.01f * ((i % 17) - 8));
    const uint32_t pair = static_cast<uint32_t>(__half_as_ushort(v)) * 0x10001u;
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + 4 * i), "r"(pair) : "memory");
  }
  __syncthreads();
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();
    const long long t0 = clock64();
#pragma unroll 1
    for (int task = warp; task < ntasks; task += 8) {
      const int hd = task % KT1;
      attention_rows<false, BT, STOP>(xs + hd * XT, kvs + hd * XT, kvs + (KT1 + hd) * XT, 16 * (task / KT1), m,
                                      lane);
    }
    const long long t1 = clock64();
    if (lane == 0) out[warp * 2 + pass] = t1 - t0;
  }
}

}  // namespace

template <int STOP>
int probe(int m, int ntasks, long long* out) {
  constexpr int smem = 1024 + 3 * 4 * 32 * 128;
  cudaFuncSetAttribute(attn_probe_kernel<32, 4, STOP>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  attn_probe_kernel<32, 4, STOP><<<1, 256, smem>>>(m, ntasks, out);
  return cudaGetLastError() != cudaSuccess;
}

// tiny's shape: 32 tokens, 4 heads; tasks 0 .. ntasks - 1 (8: all; 4: block 0 of each head, one warp an SM
// sub-partition); stop 1: S only, 2: S and the softmax, 3: all. out: [8 warps, 2 passes] cycles.
extern "C" int attn_probe(int m, int ntasks, int stop, long long* out) {
  if (stop == 1) return probe<1>(m, ntasks, out);
  if (stop == 2) return probe<2>(m, ntasks, out);
  return probe<3>(m, ntasks, out);
}
