// decode_attention: one decoding step's self-attention of every hypothesis of a beam search over
// its own history, read from a key/value cache that is written once and never reordered (LightSeq
// technique: incremental decoding on memory shared across steps, arXiv 2010.13887; the beams'
// reordering becomes a table of slot numbers instead of a copy of the cache at every step).
// It fuses, in one warp per (hypothesis, head), the gather of the hypothesis's keys and values
// through `origin` (position p of hypothesis n lives in cache slot origin[n, p]), q.k, the softmax
// and the weighted sum of the values. Neither the gathered keys and values, nor the scores, nor the
// probabilities are written to global memory. Positions are taken 32 at a time, one a lane, with an
// online softmax (running maximum and sum, rescaled per chunk) in shuffles, so the length has no cap
// and no block-wide barrier is needed. The length may be read from device memory, so that a CUDA
// graph of the step replays at every step; the kernel clamps it to the capacity the host passes.
// Given the step's own keys and values, it also writes them into the cache at the last position,
// slot n, and attends to them from shared memory: the cache write costs no launch of its own. Given
// the projection's bias too, q, k and v are the qkv GEMM's output as it is (views of one [N, 3 x d]
// row): the kernel adds the bias and scales q as the QKV transform would, rounding to T as it does,
// so that transform's launch and its copy of q, k and v are gone.
#include <cstdint>

#include "common.cuh"

namespace ls {

namespace {

constexpr int kDecodeWarps = 4;  // (hypothesis, head) pairs a block, a warp each
constexpr unsigned kFull = 0xffffffffu;

// Warp (n, h): out[n, h] = softmax_p(q[n, h] . K_p) V_p over p < length, with K_p and V_p the rows
// of head h in cache slot origin[n, p] at position p. For the scores a lane takes a position of the
// chunk and reads its whole key row (16-byte pieces, all in flight) against q in shared memory; for
// the weighted sum a lane holds D / 32 dimensions and the warp walks the chunk's positions, each
// position's weight and slot broadcast from the lane that scored it.
template <typename T, int D>
__global__ void __launch_bounds__(32 * kDecodeWarps)
    decode_attention_kernel(const T* __restrict__ q, int64_t q_stride, const T* __restrict__ keys,
                            const T* __restrict__ values, int64_t position_stride, int64_t slot_stride,
                            const int* __restrict__ origin, int64_t origin_stride, int length,
                            const int64_t* __restrict__ length_on_device, int64_t pairs, int heads,
                            const T* __restrict__ new_keys, const T* __restrict__ new_values, int64_t new_stride,
                            const T* __restrict__ bias, float scaling, T* __restrict__ key_cache,
                            T* __restrict__ value_cache, T* __restrict__ out) {
  // A device length is bounded by the host's (the cache's capacity): a wrong value reads fewer
  // positions, never memory past the cache or the origin table.
  if (length_on_device != nullptr) length = int(min(max(*length_on_device, int64_t(0)), int64_t(length)));
  constexpr int V = kVec<T> < D ? kVec<T> : D;     // a key row's 16-byte pieces
  constexpr int kUnroll = D <= 128 ? D / V : 8;    // a whole key row's loads in flight, but for 256 (spills)
  // The weighted sum: L lanes hold a value row (E dimensions each, read VE at a time), so the warp
  // takes P = 32 / L positions at once, each group of L lanes its own, and adds the groups' sums at
  // the end (one position at a time, 2 dimensions a lane, left a short row's warp mostly waiting).
  constexpr int L = D / kVec<T> < 32 ? D / kVec<T> : 32;
  constexpr int P = 32 / L;
  constexpr int E = D / L;
  constexpr int VE = E < kVec<T> ? E : kVec<T>;
  __shared__ float qs[kDecodeWarps][D];
  __shared__ __align__(16) T fresh[kDecodeWarps][2][D];  // the step's key and value rows, biased
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t item = int64_t(blockIdx.x) * kDecodeWarps + warp;
  if (item >= pairs) return;  // the whole warp: the kernel has no block-wide barrier
  const int64_t n = item / heads;
  const int64_t head = (item % heads) * D;
  float* qw = qs[warp];
  // bias [3, heads x D]: q's part, k's, v's; each sum rounded to T as the QKV transform stores it
  const int width = heads * D;
  for (int d = lane; d < D; d += 32) {
    const float b = bias != nullptr ? to_f(bias[head + d]) : 0.f;
    qw[d] = to_f(from_f<T>((to_f(q[n * q_stride + head + d]) + b) * scaling));
  }
  // the step's key and value of (n, head), stored at the last position of slot n for later steps; this
  // step reads them from shared memory (the cache's copy is not read back in this kernel)
  const int last = new_keys != nullptr ? length - 1 : -1;
  const T* fresh_key = fresh[warp][0];
  const T* fresh_value = fresh[warp][1];
  if (last >= 0) {
    for (int d = lane; d < D; d += 32) {
      T key = new_keys[n * new_stride + head + d], value = new_values[n * new_stride + head + d];
      if (bias != nullptr) {
        key = from_f<T>(to_f(key) + to_f(bias[width + head + d]));
        value = from_f<T>(to_f(value) + to_f(bias[2 * width + head + d]));
      }
      fresh[warp][0][d] = key;
      fresh[warp][1][d] = value;
      key_cache[last * position_stride + n * slot_stride + head + d] = key;
      value_cache[last * position_stride + n * slot_stride + head + d] = value;
    }
  }
  __syncwarp();
  const int* slots = origin + n * origin_stride;
  float running_max = -INFINITY, running_sum = 0.f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int start = 0; start < length; start += 32) {
    const int count = min(32, length - start);
    const bool live = lane < count;
    const int slot = live ? slots[start + lane] : 0;
    float s = -INFINITY;
    if (live) {
      const T* k = start + lane == last ? fresh_key : keys + (start + lane) * position_stride + slot * slot_stride + head;
      s = 0.f;
#pragma unroll kUnroll
      for (int d0 = 0; d0 < D; d0 += V) {
        float kv[V];
        load<T, V>(k + d0, kv);
#pragma unroll
        for (int j = 0; j < V; ++j) s = fmaf(qw[d0 + j], kv[j], s);
      }
    }
    const float new_max = fmaxf(running_max, warp_max(s));
    // -inf everywhere (only where q or the keys hold inf/NaN): the sum stays 0 and the output NaN, as
    // softmax's
    const float rescale = running_max == -INFINITY ? 0.f : expf(running_max - new_max);
    // a chunk of -inf scores after only -inf ones weighs 0 (not NaN), so later finite positions count
    const float w = live && new_max != -INFINITY ? expf(s - new_max) : 0.f;
    running_sum = running_sum * rescale + warp_sum(w);
    running_max = new_max;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= rescale;
    const int group = lane / L, dims = (lane % L) * E;
    // no branch around the loads (a group past the chunk's end reads its last position and adds
    // nothing), so that the unrolled iterations' loads are all in flight before the first one is used
#pragma unroll 4
    for (int j0 = 0; j0 < count; j0 += P) {
      const int j = j0 + group, jc = min(j, count - 1);
      const float wj = __shfl_sync(kFull, w, jc);
      const int sj = __shfl_sync(kFull, slot, jc);
      const T* v =
          (start + jc == last ? fresh_value : values + (start + jc) * position_stride + sj * slot_stride + head) + dims;
#pragma unroll
      for (int e0 = 0; e0 < E; e0 += VE) {
        float vv[VE];
        load<T, VE>(v + e0, vv);
#pragma unroll
        for (int e = 0; e < VE; ++e) acc[e0 + e] = j < count ? fmaf(wj, vv[e], acc[e0 + e]) : acc[e0 + e];
      }
    }
  }
#pragma unroll
  for (int offset = L; offset < 32; offset <<= 1)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] += __shfl_xor_sync(kFull, acc[e], offset);
  if (lane < L) {
    float r[E];
#pragma unroll
    for (int e = 0; e < E; ++e) r[e] = acc[e] / running_sum;
    store<T, E>(out + item * D + lane * E, r);
  }
}

template <typename T, int D>
void launch(const void* q, int64_t q_stride, const void* keys, const void* values, int64_t position_stride,
            int64_t slot_stride, const int* origin, int64_t origin_stride, int64_t hypotheses, int heads, int length,
            const int64_t* length_on_device, const void* new_keys, const void* new_values, int64_t new_stride,
            const void* bias, float scaling, void* out, cudaStream_t stream) {
  const int64_t pairs = hypotheses * heads;
  decode_attention_kernel<T, D><<<(pairs + kDecodeWarps - 1) / kDecodeWarps, 32 * kDecodeWarps, 0, stream>>>(
      (const T*)q, q_stride, (const T*)keys, (const T*)values, position_stride, slot_stride, origin, origin_stride,
      length, length_on_device, pairs, heads, (const T*)new_keys, (const T*)new_values, new_stride, (const T*)bias,
      scaling, (T*)keys, (T*)values, (T*)out);
}

}  // namespace

bool decode_attention_supports(int head_dim) {
  return head_dim_compiled(head_dim);
}

void decode_attention(DType dt, const void* q, int64_t q_stride, const void* keys, const void* values,
                      int64_t position_stride, int64_t slot_stride, const int* origin, int64_t origin_stride,
                      int64_t hypotheses, int heads, int head_dim, int length, const int64_t* length_on_device,
                      const void* new_keys, const void* new_values, int64_t new_stride, const void* bias,
                      float scaling, void* out, cudaStream_t stream) {
  if (hypotheses == 0 || heads == 0) return;
  LS_DISPATCH(dt, {
    const auto run = [&](auto dim) {
      launch<T, decltype(dim)::value>(q, q_stride, keys, values, position_stride, slot_stride, origin, origin_stride,
                                      hypotheses, heads, length, length_on_device, new_keys, new_values, new_stride,
                                      bias, scaling, out, stream);
    };
    dispatch_head_dim(head_dim, run);
  })
}

}  // namespace ls
