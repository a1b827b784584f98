// embedding: out[i] = dropout(scale * weight[token_i] + pos_weight[position_i]),
// zero for padding tokens; pos_weight is the learned table or fairseq's
// sinusoid table (ls_fairseq/ops/embedding.py passes it).
// Fuses: lookup, scale, positional add, padding zeroing, dropout (Philox mask,
// one byte per element kept for backward).
// Backward: dtable[t] = sum over tokens i with token_i = t != pad of
// scale * dout[i] * mask / (1 - p), accumulated in fp32 registers without
// atomics: the ids are sorted (stably) beforehand and one block walks each run
// of equal ids in order, so the result is deterministic. Padding rows and ids
// absent from the batch are not written: the caller zeroes the table, or
// accumulates into a gradient (ls_adam's workspace) that holds what it held.
#include "common.cuh"
#include "dropout_map.cuh"

namespace ls {

template <typename T>
struct EmbForward {
  const int64_t* tokens;
  const int64_t* positions;
  const T* weight;
  const T* pos_weight;
  int dim, padding_idx;
  float scale;
  template <int N>
  __device__ void values(int64_t e, float (&v)[N]) const {
    const int64_t i = e / dim;
    const int c = int(e - i * dim);
    const int64_t tok = tokens[i], pos = positions[i];
    if (tok == padding_idx) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = 0.f;
      return;
    }
    float w[N], pw[N];
    load<T, N>(weight + tok * dim + c, w);
    load<T, N>(pos_weight + pos * dim + c, pw);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = w[k] * scale + pw[k];
  }
  template <int N>
  __device__ void finish(int64_t, float (&)[N]) const {}
};

template <typename T>
__global__ void embedding_backward_kernel(const T* __restrict__ dout, const uint8_t* __restrict__ mask,
                                          const int64_t* __restrict__ sorted_ids, const int64_t* __restrict__ order,
                                          T* __restrict__ dtable, bool accumulate, int64_t n, int dim, float scale,
                                          int padding_idx, float p) {
  const int64_t k = blockIdx.x;
  const int64_t id = sorted_ids[k];
  if (id == padding_idx || (k > 0 && sorted_ids[k - 1] == id)) return;  // one block per run of equal ids
  const float drop = p > 0.f ? 1.f / (1.f - p) : 1.f;
  for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < dim; c += gridDim.y * blockDim.x) {
    float acc = 0.f;
    for (int64_t kk = k; kk < n && sorted_ids[kk] == id; ++kk) {
      const int64_t e = order[kk] * dim + c;
      if (!mask || mask[e]) acc += to_f(dout[e]) * drop;
    }
    T* const out = dtable + id * dim + c;
    *out = from_f<T>(accumulate ? to_f(*out) + acc * scale : acc * scale);
  }
}

void embedding_forward(DType dt, const int64_t* tokens, const int64_t* positions, const void* weight,
                       const void* pos_weight, void* out, uint8_t* mask, int64_t n, int dim, float scale,
                       int padding_idx, float p, RngState rng, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    EmbForward<T> f{tokens, positions, (const T*)weight, (const T*)pos_weight, dim, padding_idx, scale};
    const bool vec = dim % kVec<T> == 0 && aligned16(weight) && aligned16(pos_weight);
    dropout_map<T>(f, vec, (T*)out, mask, n * dim, p, rng, stream);
  })
}

void embedding_backward(DType dt, const void* dout, const uint8_t* mask, const int64_t* sorted_ids,
                        const int64_t* order, GradOut dtable, int64_t n, int dim, float scale, int padding_idx,
                        float p, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = dim < 256 ? (dim + 31) / 32 * 32 : 256;
  LS_DISPATCH(dt, {
    embedding_backward_kernel<T><<<dim3(n, ceil_div(dim, threads)), threads, 0, stream>>>(
        (const T*)dout, mask, sorted_ids, order, (T*)dtable.ptr, dtable.accumulate, n, dim, scale, padding_idx, p);
  })
}

}  // namespace ls
