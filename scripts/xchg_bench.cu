// Microbenchmark: what an all-to-all exchange inside a thread-block cluster costs by itself, as the fused block and the
// cluster GEMM do it (docs/perf-notes.md, section 25): every CTA of a cluster of C writes C slabs of S bytes into its
// shared memory, fences them for the async proxy, and one thread pushes the C - 1 others by bulk copies into the other
// CTAs, completing on their mbarrier; every thread then waits for the C - 1 slabs it receives. The CTAs start it
// together (a cluster barrier just before). Per CTA: clock64 cycles of (a) the pack, fence and CTA barrier, (b) from the
// first push to the last slab received; and (c) a bare cluster barrier (arrive + wait), for scale. pull = 1: instead of
// the pushes, (b) is a cluster barrier (release / acquire: the packs are visible) and every thread's 16-byte
// ld.shared::cluster loads of the C - 1 slabs this CTA would have received, summed (a reduce-scatter's reads); the
// barrier that keeps a CTA alive while others read it is arrived at after the loads and waited for at the end.
// Built and run by scripts/xchg_bench.py.
#include "../kernels/hopper.cuh"

namespace {

struct XParams {
  int slab;  // S bytes (a multiple of 16)
  int pull;
  long long* out;
};

__global__ void __launch_bounds__(256, 1) xchg(const __grid_constant__ XParams p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 127u) & ~127u;
  const int C = gridDim.z, rank = blockIdx.z, tid = threadIdx.x, S = p.slab;
  const uint32_t send = base, recv = base + C * S, bar = recv + C * S;
  if (tid == 0) {
    mbar_init(bar, 1);
    mbar_expect_tx(bar, (C - 1) * S);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();
  long long c0 = clock64();
  cluster_sync();  // (c) a bare cluster barrier
  long long c1 = clock64();
  const long long t0 = clock64();
  for (int i = tid * 16; i < C * S; i += 256 * 16)  // (a) the pack: every slab written by every thread
    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(send + i), "r"(rank + i) : "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const long long t1 = clock64();
  uint32_t sum = 0;
  if (p.pull) {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    for (int i = tid * 16; i < S; i += 256 * 16)
      for (int q = 1; q < C; ++q) {
        const uint32_t src = map_to_cta(send + rank * S + i, (rank + q) % C);
        uint32_t a, b, c, d;
        asm volatile("ld.shared::cluster.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(src));
        sum += a ^ b ^ c ^ d;
      }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  } else if (tid == 0) {  // (b) the pushes
    for (int q = 1; q < C; ++q) {
      const int dst = (rank + q) % C;
      bulk_push(map_to_cta(recv + rank * S, dst), send + dst * S, S, map_to_cta(bar, dst));
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  if (!p.pull) mbar_wait(bar, 0);
  __syncthreads();  // (every thread's loads or every slab: the CTA's reduce-scatter reads are done)
  const long long t2 = clock64();
  if (tid == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    const int cta = blockIdx.x * C + rank;
    p.out[cta * 3 + 0] = t1 - t0;
    p.out[cta * 3 + 1] = t2 - t1;
    p.out[cta * 3 + 2] = c1 - c0;
  }
  if (sum == 0x12345678u) p.out[0] = 0;  // (keeps the loads)
  if (p.pull) {
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  } else {
    cluster_sync();  // (no CTA leaves while others may still write into it)
  }
}

}  // namespace

// `clusters` clusters of `c` CTAs (2 to 16), slabs of `slab` bytes, pushed (pull 0) or pulled (1). out: [clusters * c, 3] cycles.
extern "C" int xchg_run(int c, int clusters, int slab, int pull, long long* out, char* err) {
  XParams p{slab, pull, out};
  const int smem = 2 * c * slab + 256;
  static int configured = 0;
  if (allow_smem(xchg, smem, configured, err, 256)) return 1;
  if (c > 8) cudaFuncSetAttribute(xchg, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return launch_z_clusters(xchg, p, dim3(clusters, 1, c), 256, smem, nullptr, false, "xchg", err, 256);
}
