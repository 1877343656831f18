// Microbenchmark: how fast one SM takes in data through the TMA unit, by load shape (docs/perf-notes.md, section 19).
// Each CTA has `warps` x `lanes` issuing threads (lanes 0 .. lanes - 1 of warps 0 .. warps - 1), each with a ring of
// `slots` slots of `group` loads (one mbarrier a slot, armed once for the group); an issuer issues `loads` loads,
// waiting for a slot's previous loads before reusing it. Load kinds:
//   0: a 2-D tensor box, `rows` x 64 16-bit elements, 128-byte swizzle (the GEMMs' tiles);
//   1: a 3-D tensor box, 64 rows x 64 x `rows` / 64 column tiles (the layer kernel's chunks);
//   2: a 1-D bulk copy (cp.async.bulk, no tensor map) of rows * 128 contiguous bytes.
// Per issuer: cycles from the first issue to the last arrival, the cycles its first `slots` slots' issues took,
// and the same span in %globaltimer ns (for the clock).
// Built and run by scripts/tma_bench.py.
#include "../kernels/hopper.cuh"

namespace {

__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__global__ void __launch_bounds__(256, 1) ingest(const __grid_constant__ CUtensorMap m2,
                                                const __grid_constant__ CUtensorMap m3, const uint8_t* flat,
                                                long long flat_bytes, int kind, int rows, int loads, int slots,
                                                int warps, int lanes, int group, long long* out) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t bytes = rows * 128;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int issuers = warps * lanes;
  // issuer (warp, lane < lanes): `slots` slots of `group` loads each, one mbarrier a slot
  const uint32_t bars = base + issuers * slots * group * bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < issuers * slots; ++s) mbar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    prefetch_tensormap(&m2);
    prefetch_tensormap(&m3);
  }
  __syncthreads();
  if (warp >= warps || lane >= lanes) return;
  const int me = warp * lanes + lane;
  const uint32_t buf = base + me * slots * group * bytes, bar = bars + 8 * me * slots;
  const int c = blockIdx.x * issuers + me;  // this issuer's place among all issuers (spreads the addresses)
  const long long n_flat = flat_bytes / bytes;
  const int row_blocks = 2048 / rows, kt = rows / 64;
  const long long t0 = clock64();
  const long long g0 = globaltimer();
  long long t_issue = 0;
  for (int i = 0; i < loads; i += group) {
    const int s = (i / group) % slots, r = (i / group) / slots;
    if (r >= 1) mbar_wait(bar + 8 * s, (r - 1) & 1);
    mbar_expect_tx(bar + 8 * s, bytes * group);
    for (int u = 0; u < group; ++u) {
      const uint32_t dst = buf + (s * group + u) * bytes;
      const int j = c * 37 + i + u;  // load j of the issuer's sequence
      if (kind == 0) {
        tma_load(dst, &m2, bar + 8 * s, (j % 48) * 64, ((j / 48) % row_blocks) * rows);
      } else if (kind == 1) {
        tma_load3(dst, &m3, bar + 8 * s, ((j / 12) % 32) * 64, (j % 12) * kt % (48 - kt + 1));
      } else {
        bulk_load(dst, flat + (j % n_flat) * bytes, bytes, bar + 8 * s);
      }
    }
    if (i / group == slots - 1) t_issue = clock64() - t0;
  }
  const int n_slots = (loads + group - 1) / group;
  for (int q = max(0, n_slots - slots); q < n_slots; ++q) mbar_wait(bar + 8 * (q % slots), (q / slots) & 1);
  const long long t1 = clock64();
  const long long g1 = globaltimer();
  out[3 * c] = t1 - t0;
  out[3 * c + 1] = t_issue;
  out[3 * c + 2] = g1 - g0;
}

}  // namespace

// A [2048, 3072] 16-bit tensor at `t`; 2-D maps with `rows`-row boxes, 3-D maps with boxes of rows / 64 tiles.
extern "C" int tma_ingest(void* t, int kind, int rows, int loads, int slots, int warps, int lanes, int group,
                          int ctas, int threads, long long* out, char* err) {
  CUtensorMap m2, m3;
  const int box2 = kind == 0 ? rows : 64, kt = kind == 1 ? rows / 64 : 1;
  if (encode(&m2, false, t, 2048, 3072, 3072, box2, err, 256) ||
      encode3(&m3, false, t, 2048, 3072, 3072, 64, kt, err, 256))
    return 1;
  const int smem = 1024 + warps * lanes * slots * group * rows * 128 + 8 * warps * lanes * slots;
  if (cudaFuncSetAttribute(ingest, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 3;
  ingest<<<ctas, threads, smem>>>(m2, m3, static_cast<const uint8_t*>(t), 2048LL * 3072 * 2, kind, rows, loads,
                                  slots, warps, lanes, group, out);
  return cudaDeviceSynchronize() != cudaSuccess ? 2 : 0;
}
