// decode_attention: one decoding step's self-attention of every hypothesis of a beam search over
// its own history, read from a key/value cache that is written once and never reordered (LightSeq
// technique: incremental decoding on memory shared across steps, arXiv 2010.13887; the beams'
// reordering becomes a table of slot numbers instead of a copy of the cache at every step).
// It fuses, in one block per (hypothesis, head), the gather of the hypothesis's keys and values
// through `origin` (position p of hypothesis n lives in cache slot origin[n, p]), q.k, the softmax
// and the weighted sum of the values. Neither the gathered keys and values, nor the scores, nor the
// probabilities are written to global memory. Positions are taken in chunks of kDecodeChunk with
// an online softmax (running maximum and sum, rescaled per chunk), so the length has no cap. The
// length may be read from device memory, so that a CUDA graph of the step replays at every step;
// the kernel clamps it to the capacity the host passes.
#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace ls {

namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeChunk = 1024;  // positions whose scores a block holds in shared memory at once

__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// Block (n, h): out[n, h] = softmax_p(q[n, h] . K_p) V_p over p < length, with K_p and V_p the rows
// of head h in cache slot origin[n, p] at position p. A thread a position for the scores (its
// key row read in 16-byte pieces); for the weighted sum, D / 2 threads a position, two dimensions
// each, and kDecodeThreads / (D / 2) positions at a time, whose partial sums are added at the end.
template <typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_kernel(const T* __restrict__ q, int64_t q_stride, const T* __restrict__ keys,
                            const T* __restrict__ values, int64_t position_stride, int64_t slot_stride,
                            const int* __restrict__ origin, int64_t origin_stride, int length,
                            const int64_t* __restrict__ length_on_device, int heads, T* __restrict__ out) {
  // A device length is bounded by the host's (the cache's capacity): a wrong value reads fewer
  // positions, never memory past the cache or the origin table.
  if (length_on_device != nullptr) length = int(min(max(*length_on_device, int64_t(0)), int64_t(length)));
  constexpr int kPairs = D / 2;
  constexpr int kGroups = kDecodeThreads / kPairs;
  constexpr int V = kVec<T> < D ? kVec<T> : D;
  constexpr int kUnroll = D <= 128 ? D / V : 8;  // a whole key row's loads in flight, but for 256 (spills)
  __shared__ float qs[D];
  __shared__ float weights[kDecodeChunk];
  __shared__ float reduce[32];
  __shared__ float2 partial[kGroups][kPairs];
  const int n = blockIdx.x / heads, h = blockIdx.x % heads;
  const int64_t head = int64_t(h) * D;
  for (int d = threadIdx.x; d < D; d += kDecodeThreads) qs[d] = to_f(q[n * q_stride + head + d]);
  const int* slots = origin + n * origin_stride;
  const int pair = threadIdx.x % kPairs, group = threadIdx.x / kPairs;
  float running_max = -INFINITY, running_sum = 0.f, acc0 = 0.f, acc1 = 0.f;
  __syncthreads();
  for (int start = 0; start < length; start += kDecodeChunk) {
    const int count = min(kDecodeChunk, length - start);
    float chunk_max = -INFINITY;
    for (int i = threadIdx.x; i < count; i += kDecodeThreads) {
      const int p = start + i;
      const T* k = keys + p * position_stride + slots[p] * slot_stride + head;
      float s = 0.f;
#pragma unroll kUnroll
      for (int d0 = 0; d0 < D; d0 += V) {
        float kv[V];
        load<T, V>(k + d0, kv);
#pragma unroll
        for (int j = 0; j < V; ++j) s = fmaf(qs[d0 + j], kv[j], s);
      }
      weights[i] = s;
      chunk_max = fmaxf(chunk_max, s);
    }
    chunk_max = block_max(chunk_max, reduce);
    const float new_max = fmaxf(running_max, chunk_max);
    // -inf everywhere (only where q or the keys hold inf/NaN): the weights come out NaN, as softmax's
    const float rescale = running_max == -INFINITY ? 0.f : expf(running_max - new_max);
    float chunk_sum = 0.f;
    for (int i = threadIdx.x; i < count; i += kDecodeThreads) {
      const float w = expf(weights[i] - new_max);
      weights[i] = w;
      chunk_sum += w;
    }
    chunk_sum = block_sum(chunk_sum);  // its barriers also publish the weights
    running_sum = running_sum * rescale + chunk_sum;
    running_max = new_max;
    acc0 *= rescale;
    acc1 *= rescale;
    for (int i = group; i < count; i += kGroups) {
      const int p = start + i;
      const T* v = values + p * position_stride + slots[p] * slot_stride + head + 2 * pair;
      const float w = weights[i];
      acc0 = fmaf(w, to_f(v[0]), acc0);
      acc1 = fmaf(w, to_f(v[1]), acc1);
    }
    __syncthreads();  // the weights are overwritten by the next chunk
  }
  partial[group][pair] = make_float2(acc0, acc1);
  __syncthreads();
  if (threadIdx.x < kPairs) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      a += partial[g][threadIdx.x].x;
      b += partial[g][threadIdx.x].y;
    }
    T* o = out + (int64_t(n) * heads + h) * D + 2 * threadIdx.x;
    o[0] = from_f<T>(a / running_sum);
    o[1] = from_f<T>(b / running_sum);
  }
}

template <typename T, int D>
void launch(const void* q, int64_t q_stride, const void* keys, const void* values, int64_t position_stride,
            int64_t slot_stride, const int* origin, int64_t origin_stride, int64_t hypotheses, int heads, int length,
            const int64_t* length_on_device, void* out, cudaStream_t stream) {
  decode_attention_kernel<T, D><<<hypotheses * heads, kDecodeThreads, 0, stream>>>(
      (const T*)q, q_stride, (const T*)keys, (const T*)values, position_stride, slot_stride, origin, origin_stride,
      length, length_on_device, heads, (T*)out);
}

}  // namespace

bool decode_attention_supports(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

void decode_attention(DType dt, const void* q, int64_t q_stride, const void* keys, const void* values,
                      int64_t position_stride, int64_t slot_stride, const int* origin, int64_t origin_stride,
                      int64_t hypotheses, int heads, int head_dim, int length, const int64_t* length_on_device,
                      void* out, cudaStream_t stream) {
  if (hypotheses == 0 || heads == 0) return;
  LS_DISPATCH(dt, {
    const auto run = [&](auto dim) {
      launch<T, decltype(dim)::value>(q, q_stride, keys, values, position_stride, slot_stride, origin, origin_stride,
                                      hypotheses, heads, length, length_on_device, out, stream);
    };
    switch (head_dim) {
      case 32: run(std::integral_constant<int, 32>{}); break;
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      case 256: run(std::integral_constant<int, 256>{}); break;
    }
  })
}

}  // namespace ls
