// fp8_cast: a GEMM operand x [rows, cols] (fp32/fp16/bf16) times its delayed scale, rounded to FP8
// (e4m3, or e5m2 for gradients) row-major and/or transposed, and the amax of x recorded for the
// scales of later calls. It fuses what torch runs as abs, amax, a division, a multiply, a clamp and a
// cast (~11 bytes an element over six launches) into one pass: 2 bytes read, 1 written a layout. The
// scale is never read or computed on the host: the kernel takes it from the tensor's amax history in
// device memory (delayed scaling, as NVIDIA's FP8 training recipes do), so a CUDA graph replays it.
// Never written: x's scaled fp32 values. Beyond LightSeq2 (fp16 GEMMs only): FP8 tensor-core GEMMs on
// Hopper, with LightSeq's rule of one fused pass per memory-bound step. ls_fairseq/ops/fp8_cast.py is
// the contract and the reference.
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "common.cuh"

namespace ls {

namespace {

constexpr int kCastThreads = 256;
constexpr int kCastMaxBlocks = 4096;
constexpr int kTile = 64;

// The scale of a call: the format's largest value over the largest amax of the history (state[0..H)),
// at most FLT_MAX; 1 while the history holds nothing. The lanes of a warp read the history together
// (a load each, then shuffles), not each of them all of it, one dependent load after another. Called
// by every thread of a block, before any branch.
template <bool E5M2>
__device__ __forceinline__ float scale_of(const float* state, int history) {
  float m = 0.f;
  for (int i = threadIdx.x & 31; i < history; i += 32) m = fmaxf(m, state[i]);
  m = warp_max(m);
  return m > 0.f ? fminf(__fdiv_rn(E5M2 ? 57344.f : 448.f, m), FLT_MAX) : 1.f;
}

// x s rounded to nearest even in the format, finite values saturating at its largest; inf and NaN
// stay non-finite (NaN in e4m3, which has no inf), so that an fp16 run's overflow check still sees them.
template <bool E5M2>
__device__ __forceinline__ uint8_t to_fp8(float x, float s) {
  return __nv_cvt_float_to_fp8(x * s, isfinite(x) ? __NV_SATFINITE : __NV_NOSAT, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

__device__ __forceinline__ float finite_abs(float x) { return isfinite(x) ? fabsf(x) : 0.f; }

// The block's amax into state[H] (non-negative floats order as their bit patterns), and by block 0
// the inverse scale into state[H + 1], for the GEMM that dequantises.
__device__ __forceinline__ void record(float amax, float s, float* state, int history) {
  amax = block_max(amax);
  if (threadIdx.x == 0) {
    if (amax > 0.f) atomicMax(reinterpret_cast<int*>(state + history), __float_as_int(amax));
    if (blockIdx.x == 0 && blockIdx.y == 0) state[history + 1] = __fdiv_rn(1.f, s);
  }
}

// Row-major output only: x flat, V elements a thread at a time (16-byte loads when V > 1).
template <typename T, int V, bool E5M2>
__global__ void __launch_bounds__(kCastThreads)
    fp8_cast_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ state, int history, uint8_t* __restrict__ q) {
  const float s = scale_of<E5M2>(state, history);
  float amax = 0.f;
  for (int64_t i = (int64_t(blockIdx.x) * kCastThreads + threadIdx.x) * V; i < n; i += int64_t(gridDim.x) * kCastThreads * V) {
    float v[V];
    load<T, V>(x + i, v);
    Pack<uint8_t, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      amax = fmaxf(amax, finite_abs(v[j]));
      out.v[j] = to_fp8<E5M2>(v[j], s);
    }
    *reinterpret_cast<Pack<uint8_t, V>*>(q + i) = out;
  }
  record(amax, s, state, history);
}

// A 64 x 64 tile of x a block, through shared memory, so that both layouts are written in runs of
// 4 bytes a thread: q [rows, cols] (when given) and qT [cols, rows]. A thread converts 4 adjacent
// elements of 4 rows; the tile's rows are padded to 65 bytes, so that the transposed reads of a
// warp fall in distinct banks.
template <typename T, bool E5M2>
__global__ void __launch_bounds__(kCastThreads)
    fp8_cast_transpose_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, float* __restrict__ state,
                              int history, uint8_t* __restrict__ q, uint8_t* __restrict__ qT) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const float s = scale_of<E5M2>(state, history);
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int t = threadIdx.x, sub = (t % 16) * 4;
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int r = t / 16 + 16 * k;
    const int64_t row = r0 + r;
    uint8_t b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = c0 + sub + j;
      const float v = row < rows && col < cols ? to_f(x[row * cols + col]) : 0.f;
      amax = fmaxf(amax, finite_abs(v));
      b[j] = to_fp8<E5M2>(v, s);
      tile[r][sub + j] = b[j];
    }
    if (q != nullptr && row < rows) {
      if (cols % 4 == 0 && c0 + sub + 3 < cols) {
        *reinterpret_cast<Pack<uint8_t, 4>*>(q + row * cols + c0 + sub) = {b[0], b[1], b[2], b[3]};
      } else {
        for (int j = 0; j < 4 && c0 + sub + j < cols; ++j) q[row * cols + c0 + sub + j] = b[j];
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int c = t / 16 + 16 * k;
    const int64_t col = c0 + c;
    if (col >= cols) continue;
    uint8_t b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = tile[sub + j][c];
    uint8_t* dst = qT + col * rows + r0 + sub;
    if (rows % 4 == 0 && r0 + sub + 3 < rows) {
      *reinterpret_cast<Pack<uint8_t, 4>*>(dst) = {b[0], b[1], b[2], b[3]};
    } else {
      for (int j = 0; j < 4 && r0 + sub + j < rows; ++j) dst[j] = b[j];
    }
  }
  record(amax, s, state, history);
}

template <typename T, bool E5M2>
void launch(const T* x, int64_t rows, int64_t cols, bool vec, float* state, int history, uint8_t* q, uint8_t* qT,
            cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (qT != nullptr) {
    const dim3 grid(ceil_div(cols, kTile), ceil_div(rows, kTile));
    fp8_cast_transpose_kernel<T, E5M2><<<grid, kCastThreads, 0, stream>>>(x, rows, cols, state, history, q, qT);
  } else if (vec && n % kVec<T> == 0) {
    constexpr int V = kVec<T>;
    const int blocks = int(std::min<int64_t>(ceil_div(n, int64_t(kCastThreads) * V), kCastMaxBlocks));
    fp8_cast_kernel<T, V, E5M2><<<blocks, kCastThreads, 0, stream>>>(x, n, state, history, q);
  } else {
    const int blocks = int(std::min<int64_t>(ceil_div(n, kCastThreads), kCastMaxBlocks));
    fp8_cast_kernel<T, 1, E5M2><<<blocks, kCastThreads, 0, stream>>>(x, n, state, history, q);
  }
}

}  // namespace

void fp8_cast(DType dt, const void* x, int64_t rows, int64_t cols, bool vec, float* state, int history, bool e5m2,
              uint8_t* q, uint8_t* qT, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    if (e5m2)
      launch<T, true>((const T*)x, rows, cols, vec, state, history, q, qT, stream);
    else
      launch<T, false>((const T*)x, rows, cols, vec, state, history, q, qT, stream);
  })
}

}  // namespace ls
