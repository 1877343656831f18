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
                                                int warps, int lanes, int group, int shared, long long* out) {
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
      // load j of the issuer's sequence: the first `shared` issuers of every CTA read the same sequences in every
      // CTA at the same time (as the column tiles of a GEMM read its A rows), the others sequences of their own
      const int j = (me < shared ? me * 1000 : c * 37) + i + u;
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
                          int shared, int ctas, int threads, long long* out, char* err) {
  CUtensorMap m2, m3;
  const int box2 = kind == 0 ? rows : 64, kt = kind == 1 ? rows / 64 : 1;
  if (encode(&m2, false, t, 2048, 3072, 3072, box2, err, 256) ||
      encode3(&m3, false, t, 2048, 3072, 3072, 64, kt, err, 256))
    return 1;
  const int smem = 1024 + warps * lanes * slots * group * rows * 128 + 8 * warps * lanes * slots;
  if (cudaFuncSetAttribute(ingest, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 3;
  ingest<<<ctas, threads, smem>>>(m2, m3, static_cast<const uint8_t*>(t), 2048LL * 3072 * 2, kind, rows, loads,
                                  slots, warps, lanes, group, shared, out);
  return cudaDeviceSynchronize() != cudaSuccess ? 2 : 0;
}

// Multicast: clusters of `csize` CTAs read the same `rows` x 64 boxes; each CTA loads rows / csize of a box and
// multicasts them to the whole cluster, so each SM receives whole boxes while L2 serves each box once. A slot is
// reused once every CTA of the cluster has seen its previous box (an empty mbarrier counted over the cluster).
namespace {
__global__ void __launch_bounds__(32, 1) ingest_mc(const __grid_constant__ CUtensorMap m, int rows, int loads,
                                                  int slots, int csize, long long* out) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t bytes = rows * 128, share = bytes / csize;
  const uint32_t full = base + slots * bytes, empty = full + 8 * slots;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, csize);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    prefetch_tensormap(&m);
  }
  cluster_sync();
  if (threadIdx.x == 0) {
    const int cl = blockIdx.x / csize, row_blocks = 2048 / rows, sub = rows / csize;
    const uint16_t mask = static_cast<uint16_t>((1u << csize) - 1);
    const long long t0 = clock64();
    int s = 0, r = 0;  // slot and round of load i
    int sq = 0, rq = 0;  // slot and round of load i - (slots - 1), the one released next
    for (int i = 0; i < loads; ++i) {
      if (r >= 1) mbar_wait(empty + 8 * s, (r - 1) & 1);
      mbar_expect_tx(full + 8 * s, bytes);
      const int j = cl * 37 + i;
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
          " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(base + s * bytes + rank * share),
          "l"(reinterpret_cast<uint64_t>(&m)), "r"(full + 8 * s), "r"((j % 48) * 64),
          "r"(((j / 48) % row_blocks) * rows + rank * sub), "h"(mask)
          : "memory");
      if (++s == slots) s = 0, ++r;
      if (i >= slots - 1) {  // load i - (slots - 1) has landed here: release its slot in every CTA of the cluster
        mbar_wait(full + 8 * sq, rq & 1);
        for (int c = 0; c < csize; ++c)
          asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                           map_to_cta(empty + 8 * sq, c))
                       : "memory");
        if (++sq == slots) sq = 0, ++rq;
      }
    }
    for (int i = max(0, loads - slots + 1); i < loads; ++i) {
      mbar_wait(full + 8 * sq, rq & 1);
      if (++sq == slots) sq = 0, ++rq;
    }
    out[blockIdx.x] = clock64() - t0;
  }
  cluster_sync();  // no CTA exits while others may still arrive on its barriers
}
// Launches `kernel(args...)` on ctas / csize clusters of `csize` CTAs along x, 32 threads each, with `smem` bytes of
// dynamic shared memory, and waits for it: 0, or 4 (launch) / 2 (run) with the CUDA error in err.
template <typename K, typename... A>
int launch_clusters(K kernel, int ctas, int csize, int smem, char* err, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas / csize * csize, 1, 1);
  cfg.blockDim = dim3(32, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = csize;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess) {
    snprintf(err, 256, "%s", cudaGetErrorString(e));
    return 4;
  }
  e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    snprintf(err, 256, "%s", cudaGetErrorString(e));
    return 2;
  }
  return 0;
}
}  // namespace

extern "C" int tma_ingest_mc(void* t, int rows, int loads, int slots, int csize, int ctas, long long* out, char* err) {
  CUtensorMap m;
  if (encode(&m, false, t, 2048, 3072, 3072, rows / csize, err, 256)) return 1;
  const int smem = 1024 + slots * rows * 128 + 16 * slots;
  if (cudaFuncSetAttribute(ingest_mc, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 3;
  return launch_clusters(ingest_mc, ctas, csize, smem, err, m, rows, loads, slots, csize, out);
}

// The issue cost of the primitives a producer loop is made of, one thread, nothing to wait for: `n` (<= 16) of
// each back to back, cycles per instruction (clock64 around the run). Modes:
//   0: TMA 2-D loads into 16 distinct 8 KB buffers, one mbarrier armed once for all their bytes
//   1: expect_tx + TMA load, each load its own mbarrier (the usual stage)
//   2: expect_tx alone (arrive + tx on a fresh mbarrier)
//   3: try_wait on a completed phase
//   4: %globaltimer reads
//   5: TMA loads, coordinates from a runtime division (j / rows, j % 48) as the benchmarks above compute them
namespace {
__global__ void __launch_bounds__(32, 1) issue_cost(const __grid_constant__ CUtensorMap m, int mode, int n, int rows,
                                                   long long* out) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + 16 * 8192;
  if (threadIdx.x != 0) return;
  for (int s = 0; s < 17; ++s) mbar_init(bars + 8 * s, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  prefetch_tensormap(&m);
  // a completed phase on barrier 16 (for mode 3)
  mbar_arrive(bars + 8 * 16);
  mbar_wait(bars + 8 * 16, 0);
  long long sink = 0;
  const long long t0 = clock64();
  if (mode == 0) {
    mbar_expect_tx(bars, n * 8192);
    const long long t1 = clock64();
    for (int i = 0; i < n; ++i) tma_load(base + i * 8192, &m, bars, i * 64, 0);
    out[0] = (clock64() - t1);
    mbar_wait(bars, 0);
    return;
  } else if (mode == 1) {
    for (int i = 0; i < n; ++i) {
      mbar_expect_tx(bars + 8 * i, 8192);
      tma_load(base + i * 8192, &m, bars + 8 * i, i * 64, 0);
    }
  } else if (mode == 2) {
    for (int i = 0; i < n; ++i) mbar_expect_tx(bars + 8 * i, 8192);
  } else if (mode == 3) {
    for (int i = 0; i < n; ++i) mbar_wait(bars + 8 * 16, 0);
  } else if (mode == 4) {
    for (int i = 0; i < n; ++i) sink += globaltimer();
  } else {
    mbar_expect_tx(bars, n * 8192);
    for (int i = 0; i < n; ++i) {
      const int j = i + n * rows;
      tma_load(base + i * 8192, &m, bars, (j % 48) * 64, ((j / 48) % (2048 / rows)) * 64);
    }
  }
  out[0] = clock64() - t0 + (sink == 1 ? 1 : 0);
  if (mode == 1)
    for (int i = 0; i < n; ++i) mbar_wait(bars + 8 * i, 0);
  if (mode == 5) mbar_wait(bars, 0);
}
}  // namespace

extern "C" int tma_issue_cost(void* t, int mode, int n, int rows, long long* out, char* err) {
  CUtensorMap m;
  if (encode(&m, false, t, 2048, 3072, 3072, 64, err, 256)) return 1;
  const int smem = 1024 + 16 * 8192 + 17 * 8;
  if (cudaFuncSetAttribute(issue_cost, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 3;
  issue_cost<<<1, 32, smem>>>(m, mode, n, rows, out);
  return cudaDeviceSynchronize() != cudaSuccess ? 2 : 0;
}

// A GEMM program's loads as one burst (perf notes 43): every CTA takes in `n_shared` + `n_own` boxes of 64 rows x
// kt 64-wide tiles (8 KB x kt each), all issued at once with no slot reused, as the 64x64 GEMM programs issue their
// whole K slice (A's rows, then B's). The `n_shared` boxes (A: the activation rows that every column tile reads) are
// the same in every CTA of a cluster of `csize`; with `mc` 1 the CTA of rank r issues shared boxes r, r + csize, ...
// once for the whole cluster by TMA multicast (L2 serves each once a cluster), with `mc` 0 every CTA loads them all
// itself, the same boxes as the other CTAs of its `group` of consecutive CTAs (whatever the cluster size). The own boxes (B: the CTA's weight columns) are its own. Issued by `lanes` lanes of warp 0, box b by lane
// b % lanes. Per CTA: SM cycles from the burst's start (after the cluster barrier) to its last box landing, and the
// %globaltimer ns of the start and of the end (for the chip's span).
namespace {
__global__ void __launch_bounds__(32, 1) ingest_burst(const __grid_constant__ CUtensorMap m, int kt, int n_shared,
                                                     int n_own, int csize, int mc, int group, int lanes,
                                                     long long* out) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t bytes = kt * 8192;
  const int n = n_shared + n_own;
  const uint32_t bars = base + n * bytes;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) {
    for (int b = 0; b < n; ++b) {
      mbar_init(bars + 8 * b, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    prefetch_tensormap(&m);
    // armed before the cluster barrier, so that no peer's multicast can complete a box before its bytes are expected
    for (int b = 0; b < n; ++b) mbar_expect_tx(bars + 8 * b, bytes);
  }
  cluster_sync();
  const long long t0 = clock64();
  const long long g0 = globaltimer();
  const int cl = blockIdx.x / (mc ? csize : group), ctiles = 48 - kt + 1;
  const uint16_t mask = static_cast<uint16_t>((1u << csize) - 1);
  if (threadIdx.x < lanes) {
    for (int b = threadIdx.x; b < n; b += lanes) {
      const uint32_t dst = base + b * bytes, bar = bars + 8 * b;
      if (b < n_shared) {
        const int row = ((cl * 7 + b) % 32) * 64, ct = ((cl * 5 + b) * kt) % ctiles;
        if (!mc) {
          tma_load3(dst, &m, bar, row, ct);
        } else if (b % csize == static_cast<int>(rank)) {
          asm volatile(
              "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
              " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
              "l"(reinterpret_cast<uint64_t>(&m)), "r"(bar), "r"(0), "r"(row), "r"(ct), "h"(mask)
              : "memory");
        }
      } else {
        const int c = blockIdx.x;
        tma_load3(dst, &m, bar, ((c * 11 + b) % 32) * 64, ((c * 3 + b) * kt) % ctiles);
      }
    }
  }
  if (threadIdx.x == 0) {
    for (int b = 0; b < n; ++b) mbar_wait(bars + 8 * b, 0);
    out[3 * blockIdx.x] = clock64() - t0;
    out[3 * blockIdx.x + 1] = g0;
    out[3 * blockIdx.x + 2] = globaltimer();
  }
  cluster_sync();  // no CTA exits while its peers' multicasts may still write into it
}
}  // namespace

extern "C" int tma_ingest_burst(void* t, int kt, int n_shared, int n_own, int csize, int mc, int group, int lanes,
                                int ctas, long long* out, char* err) {
  CUtensorMap m;
  if (encode3(&m, false, t, 2048, 3072, 3072, 64, kt, err, 256)) return 1;
  const int smem = 1024 + (n_shared + n_own) * kt * 8192 + 8 * (n_shared + n_own);
  if (cudaFuncSetAttribute(ingest_burst, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 3;
  return launch_clusters(ingest_burst, ctas, csize, smem, err, m, kt, n_shared, n_own, csize, mc, group, lanes, out);
}
