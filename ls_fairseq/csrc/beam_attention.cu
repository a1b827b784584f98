// beam_attention: a decoding step's cross-attention, every beam of a sentence against that sentence's
// keys and values of the encoder output (LightSeq technique: fused incremental decoding with the
// encoder's keys and values computed once per batch and shared by the beams, never copied per beam,
// arXiv 2010.13887). One warp per (sentence, head, up to kBeams beams) fuses the query's bias and
// scaling (the QKV transform's work for this query), q.k against every key position (each key row read
// once for all the warp's queries), the key padding mask, the softmax and the weighted sum (each value
// row read once for them). Positions are taken 32 at a time, one a lane, with an online softmax per
// query in shuffles, so the source length has no cap. Never written to global memory: the scaled
// query, the scores, the probabilities. The output is token-major ([sentence, beam, head, d_head]),
// so that the out projection reads it as merged heads without a copy.
#include <cstdint>

#include "common.cuh"

namespace ls {

namespace {

constexpr int kWarps = 4;  // warps a block
constexpr int kBeams = 4;  // queries a warp
constexpr unsigned kFull = 0xffffffffu;

template <typename T, int D>
__global__ void __launch_bounds__(32 * kWarps)
    beam_attention_kernel(const T* __restrict__ q, BeamAttentionStrides qs, const T* __restrict__ keys,
                          const T* __restrict__ values, BeamAttentionStrides kvs, const uint8_t* __restrict__ padding,
                          int64_t padding_stride, const T* __restrict__ bias, float scaling, int sentences, int heads,
                          int beams, int length, T* __restrict__ out) {
  constexpr int V = kVec<T> < D ? kVec<T> : D;   // a key row's 16-byte pieces
  constexpr int kUnroll = D / V <= 8 ? D / V : (D <= 128 ? 8 : 4);  // loads in flight; more spill
  // the weighted sum: L lanes hold a value row (E dimensions each, VE a load), P = 32 / L positions at once
  constexpr int L = D / kVec<T> < 32 ? D / kVec<T> : 32;
  constexpr int P = 32 / L;
  constexpr int E = D / L;
  constexpr int VE = E < kVec<T> ? E : kVec<T>;
  __shared__ float qs_all[kWarps][kBeams][D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups = (beams + kBeams - 1) / kBeams;
  const int64_t item = int64_t(blockIdx.x) * kWarps + warp;
  if (item >= int64_t(sentences) * heads * groups) return;  // the whole warp: no block-wide barrier
  const int group = int(item % groups);
  const int head = int((item / groups) % heads);
  const int64_t b = item / groups / heads;
  const int first = group * kBeams, queries = min(kBeams, beams - first);
  float(*qw)[D] = qs_all[warp];
  // (q + bias) x scaling, rounded to T as the QKV transform stores a query; unused rows 0
#pragma unroll
  for (int j = 0; j < kBeams; ++j)
    for (int d = lane; d < D; d += 32) {
      float x = 0.f;
      if (j < queries) {
        const float bv = bias != nullptr ? to_f(bias[head * D + d]) : 0.f;
        x = to_f(from_f<T>((to_f(q[b * qs.sentence + head * qs.head + (first + j) * qs.row + d]) + bv) * scaling));
      }
      qw[j][d] = x;
    }
  __syncwarp();
  const T* kb = keys + b * kvs.sentence + head * kvs.head;
  const T* vb = values + b * kvs.sentence + head * kvs.head;
  const uint8_t* pad = padding != nullptr ? padding + b * padding_stride : nullptr;
  float running_max[kBeams], running_sum[kBeams], acc[kBeams][E];
#pragma unroll
  for (int j = 0; j < kBeams; ++j) {
    running_max[j] = -INFINITY;
    running_sum[j] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[j][e] = 0.f;
  }
  const int grp = lane / L, dims = (lane % L) * E;
  for (int start = 0; start < length; start += 32) {
    const int count = min(32, length - start);
    const bool live = lane < count && (pad == nullptr || pad[start + lane] == 0);
    float s[kBeams];
#pragma unroll
    for (int j = 0; j < kBeams; ++j) s[j] = live ? 0.f : -INFINITY;
    if (live) {
      const T* k = kb + (start + lane) * kvs.row;
#pragma unroll kUnroll
      for (int d0 = 0; d0 < D; d0 += V) {
        float kv[V];
        load<T, V>(k + d0, kv);
#pragma unroll
        for (int j = 0; j < kBeams; ++j)
#pragma unroll
          for (int i = 0; i < V; ++i) s[j] = fmaf(qw[j][d0 + i], kv[i], s[j]);
      }
    }
    float w[kBeams];
#pragma unroll
    for (int j = 0; j < kBeams; ++j) {
      const float new_max = fmaxf(running_max[j], warp_max(s[j]));
      // -inf everywhere (a chunk of padding, or -inf scores): the sum stays 0 and such a chunk weighs 0,
      // so later finite positions count; a query with no finite score gets zeros, as ops.softmax gives
      const float rescale = running_max[j] == -INFINITY ? 0.f : expf(running_max[j] - new_max);
      w[j] = live && new_max != -INFINITY ? expf(s[j] - new_max) : 0.f;
      running_sum[j] = running_sum[j] * rescale + warp_sum(w[j]);
      running_max[j] = new_max;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[j][e] *= rescale;
    }
    // no branch around the loads (a group past the chunk's end reads its last position), so that the
    // unrolled iterations' loads are all in flight before the first one is used; a padded position's
    // values are read but not added (0 x its values could be NaN)
#pragma unroll 4
    for (int j0 = 0; j0 < count; j0 += P) {
      const int p = j0 + grp, pc = min(p, count - 1);
      const bool used = __shfl_sync(kFull, live, pc) && p < count;
      float wp[kBeams];
#pragma unroll
      for (int j = 0; j < kBeams; ++j) wp[j] = __shfl_sync(kFull, w[j], pc);
      const T* v = vb + (start + pc) * kvs.row + dims;
#pragma unroll
      for (int e0 = 0; e0 < E; e0 += VE) {
        float vv[VE];
        load<T, VE>(v + e0, vv);
#pragma unroll
        for (int j = 0; j < kBeams; ++j)
#pragma unroll
          for (int e = 0; e < VE; ++e) acc[j][e0 + e] = used ? fmaf(wp[j], vv[e], acc[j][e0 + e]) : acc[j][e0 + e];
      }
    }
  }
#pragma unroll
  for (int offset = L; offset < 32; offset <<= 1)
#pragma unroll
    for (int j = 0; j < kBeams; ++j)
#pragma unroll
      for (int e = 0; e < E; ++e) acc[j][e] += __shfl_xor_sync(kFull, acc[j][e], offset);
  if (lane < L) {
#pragma unroll
    for (int j = 0; j < kBeams; ++j) {
      if (j >= queries) break;
      float r[E];
#pragma unroll
      for (int e = 0; e < E; ++e) r[e] = running_sum[j] == 0.f ? 0.f : acc[j][e] / running_sum[j];
      store<T, E>(out + ((b * beams + first + j) * heads + head) * D + lane * E, r);  // E x T: one or two stores
    }
  }
}

}  // namespace

bool beam_attention_supports(int head_dim) {
  return head_dim_compiled(head_dim);
}

void beam_attention(DType dt, const void* q, BeamAttentionStrides q_strides, const void* keys, const void* values,
                    BeamAttentionStrides kv_strides, const uint8_t* padding, int64_t padding_stride, const void* bias,
                    float scaling, int sentences, int heads, int beams, int head_dim, int length, void* out,
                    cudaStream_t stream) {
  if (sentences == 0 || heads == 0 || beams == 0) return;
  const int64_t items = int64_t(sentences) * heads * ((beams + kBeams - 1) / kBeams);
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  LS_DISPATCH(dt, {
    const auto run = [&](auto dim) {
      beam_attention_kernel<T, decltype(dim)::value><<<blocks, 32 * kWarps, 0, stream>>>(
          (const T*)q, q_strides, (const T*)keys, (const T*)values, kv_strides, padding, padding_stride,
          (const T*)bias, scaling, sentences, heads, beams, length, (T*)out);
    };
    dispatch_head_dim(head_dim, run);
  })
}

}  // namespace ls
