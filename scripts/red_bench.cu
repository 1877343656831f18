// Microbenchmark: what a split-K reduction by global vector atomics costs, for the out-projection summed over heads
// (or FFN2 over FFN1's column tiles) straight from the producing kernel's tail instead of in a kernel of its own
// (docs/perf-notes.md, section 34). Grid (adders, row_tiles, col_splits), 256 threads: every CTA adds a 64-row tile
// of cols / col_splits columns into out[M, cols]; the `adders` CTAs of a (row tile, column split) add into the same
// addresses. mode 0: nothing (the launch); 1: st.global.v4 of the same bytes into a private slab a CTA (no atomics,
// no contention); 2: red.global.add.v4.f32; 3: red.global.add.noftz.v4.f16x2 (16 bytes a red: 8 halves); from a
// tile in shared memory (written by the CTA's threads first), one bulk operation a row by the TMA unit:
// 4: cp.reduce.async.bulk .add.f32, 5: cp.reduce.async.bulk .add.noftz.f16, 6: cp.async.bulk (a plain copy into the
// private slab, as 1).
// Built and run by scripts/red_bench.py.
#include "../kernels/hopper.cuh"

namespace {

struct RParams {
  void* out;      // [M, cols] fp32 (mode 2) or fp16 (mode 3)
  void* priv;     // mode 1: [ctas, 64, cols / col_splits] of the element size
  int cols, mode;
};

__global__ void __launch_bounds__(256, 1) red_tail(const __grid_constant__ RParams p) {
  const int adder = blockIdx.x, t = blockIdx.y, split = blockIdx.z;
  const int w = p.cols / gridDim.z;  // this CTA's columns
  const int esz = (p.mode == 3 || p.mode == 5) ? 2 : 4, per = 16 / esz;  // bytes an element, elements a 16-byte vector
  const int vecs_row = w / per, vecs = 64 * vecs_row;
  const float v = 1.0f + adder;
  if (p.mode == 0) return;
  if (p.mode >= 4) {
    extern __shared__ __align__(128) uint8_t tile[];
    const uint32_t t0 = smem_addr(tile);
    const __half2 h = __floats2half2_rn(1.0f, 1.0f);
    const uint32_t u = p.mode == 5 ? *reinterpret_cast<const uint32_t*>(&h) : __float_as_uint(v);
    for (int i = threadIdx.x; i < vecs; i += 256)
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(t0 + 16 * i), "r"(u) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int rb = w * esz;  // bytes a row
    if (threadIdx.x < 64) {
      const int r = threadIdx.x;
      const uint32_t src = t0 + r * rb;
      if (p.mode == 6) {
        const int cta = adder + gridDim.x * (t + gridDim.y * split);
        char* dst = static_cast<char*>(p.priv) + (static_cast<long long>(cta) * 64 + r) * rb;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(rb)
                     : "memory");
      } else {
        char* dst = static_cast<char*>(p.out) + (static_cast<long long>(64 * t + r) * p.cols + split * w) * esz;
        if (p.mode == 4)
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
                       "r"(src), "r"(rb) : "memory");
        else
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [%0], [%1], %2;" ::"l"(dst),
                       "r"(src), "r"(rb) : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    return;
  }
  if (p.mode == 1) {
    const int cta = adder + gridDim.x * (t + gridDim.y * split);
    char* base = static_cast<char*>(p.priv) + static_cast<long long>(cta) * vecs * 16;
    for (int i = threadIdx.x; i < vecs; i += 256)
      asm volatile("st.global.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(base + 16LL * i), "f"(v) : "memory");
    return;
  }
  for (int i = threadIdx.x; i < vecs; i += 256) {
    const int r = i / vecs_row, c = (i % vecs_row) * per + split * w;
    char* a = static_cast<char*>(p.out) + (static_cast<long long>(64 * t + r) * p.cols + c) * esz;
    if (p.mode == 2) {
      asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(a), "f"(v) : "memory");
    } else {
      const __half2 h = __floats2half2_rn(1.0f, 1.0f);
      const uint32_t u = *reinterpret_cast<const uint32_t*>(&h);
      asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %1, %1, %1};" ::"l"(a), "r"(u) : "memory");
    }
  }
}

}  // namespace

extern "C" int red_run(int adders, int row_tiles, int col_splits, int cols, int mode, void* out, void* priv,
                       void* stream, char* err) {
  RParams p{out, priv, cols, mode};
  const int smem = mode >= 4 ? 64 * (cols / col_splits) * ((mode == 5) ? 2 : 4) : 0;
  if (smem > 48 * 1024) cudaFuncSetAttribute(red_tail, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  red_tail<<<dim3(adders, row_tiles, col_splits), 256, smem, static_cast<cudaStream_t>(stream)>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(err, 256, "red_tail: %s", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
