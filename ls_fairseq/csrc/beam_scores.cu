// beam_scores: a beam search step's candidate scores from the decoder's logits [rows, M]: fairseq's
// log-softmax in fp32 with its fixes (NaN -> -inf, the pad column -inf, the unk penalty, EOS barred
// below the minimum length) plus each hypothesis's cumulative score. It fuses, in one block a row,
// what torch runs as a log_softmax, a nan_to_num, column writes and an add (LightSeq technique: the
// decoding step's non-GEMM work in few kernels, arXiv 2010.13887). The log-probabilities are never
// written: only the scores, once. ls_fairseq/ops/beam_scores.py is the contract and the reference.
// The row is read twice: its maximum and sum of exp(x - maximum), online a thread and then across
// the block, and then the scores (the second read mostly from L2). The step may be read from device
// memory, so that a CUDA graph of the step replays at every step.
#include <cstdint>

#include "common.cuh"

namespace ls {

namespace {

constexpr int kScoreThreads = 512;

// (m, s) for one more x: s the sum of exp(y - m) over the values y seen, m their maximum. -inf
// values add nothing (a row of them keeps s = 0, and its scores come out NaN, then -inf, as torch's);
// a NaN makes s NaN (torch's row of NaN, then -inf).
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.f;
    m = x;
  } else if (x != -INFINITY) {
    s += expf(x - m);
  }
}

// (m1, s1) and (m2, s2) into (m, s) over both; a part with s = 0 adds nothing
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
  const float top = fmaxf(m, m2);
  s = (s == 0.f ? 0.f : s * expf(m - top)) + (s2 == 0.f ? 0.f : s2 * expf(m2 - top));
  m = top;
}

template <typename T, int V>
__global__ void __launch_bounds__(kScoreThreads)
    beam_scores_kernel(const T* __restrict__ logits, const float* __restrict__ cum, int64_t M,
                       const int64_t* __restrict__ step_on_device, int64_t step, int64_t pad, int64_t unk,
                       float unk_penalty, int64_t eos, int64_t min_len, float* __restrict__ out) {
  __shared__ float2 parts[32];
  const T* row = logits + int64_t(blockIdx.x) * M;
  float m = -INFINITY, s = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * V; c < M; c += int64_t(blockDim.x) * V) {
    float x[V];
    load<T, V>(row + c, x);
#pragma unroll
    for (int i = 0; i < V; ++i) online_add(m, s, x[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) online_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) parts[warp] = make_float2(m, s);
  __syncthreads();
  m = -INFINITY;
  s = 0.f;
  for (int w = 0; w < warps; ++w) online_merge(m, s, parts[w].x, parts[w].y);
  const float logsum = logf(s);
  const bool bar_eos = (step_on_device != nullptr ? *step_on_device : step) < min_len;
  const float base = cum[blockIdx.x];
  float* o = out + int64_t(blockIdx.x) * M;
  for (int64_t c = int64_t(threadIdx.x) * V; c < M; c += int64_t(blockDim.x) * V) {
    float x[V];
    load<T, V>(row + c, x);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float y = x[i] - m - logsum;
      if (isnan(y) || c + i == pad || (bar_eos && c + i == eos)) y = -INFINITY;
      if (c + i == unk) y -= unk_penalty;
      x[i] = y + base;
    }
    // 16-byte stores: one 4-byte store an element left a warp's store touching 32 sectors for 128 bytes
    if constexpr (V % 4 == 0) {
#pragma unroll
      for (int i = 0; i < V; i += 4) store<float, 4>(o + c + i, *reinterpret_cast<const float(*)[4]>(x + i));
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) o[c + i] = x[i];
    }
  }
}

}  // namespace

void beam_scores(DType dt, const void* logits, const float* cum, int64_t rows, int64_t M, bool vec,
                 const int64_t* step_on_device, int64_t step, int64_t pad, int64_t unk, float unk_penalty, int64_t eos,
                 int64_t min_len, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  LS_DISPATCH(dt, {
    if (vec && M % kVec<T> == 0)
      beam_scores_kernel<T, kVec<T>><<<rows, kScoreThreads, 0, stream>>>(
          (const T*)logits, cum, M, step_on_device, step, pad, unk, unk_penalty, eos, min_len, out);
    else
      beam_scores_kernel<T, 1><<<rows, kScoreThreads, 0, stream>>>(
          (const T*)logits, cum, M, step_on_device, step, pad, unk, unk_penalty, eos, min_len, out);
  })
}

}  // namespace ls
