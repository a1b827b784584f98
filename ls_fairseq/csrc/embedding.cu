// embedding: out[i] = dropout(scale * weight[token_i] + pos_weight[position_i]),
// zero for padding tokens; pos_weight is the learned table or fairseq's
// sinusoid table (ls_fairseq/ops/embedding.py passes it).
// Fuses: lookup, scale, positional add, padding zeroing, dropout (Philox mask,
// one byte per element kept for backward).
// Backward: dtable[t] = sum over tokens i with token_i = t != pad of
// scale * dout[i] * mask / (1 - p), accumulated in fp32 registers without
// atomics: the ids are sorted beforehand (a stable radix sort of 32-bit keys over
// only the bits the table needs, so a 32k vocabulary takes two 8-bit passes) and
// one block walks each run of equal ids in position order, four rows in flight at
// a time, so the result is deterministic. Padding rows and ids absent from the
// batch are not written: the caller zeroes the table, or accumulates into a
// gradient (ls_adam's workspace) that holds what it held.
#include <cub/device/device_radix_sort.cuh>

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
  __device__ void values(int64_t i, int c, float (&v)[N]) const {
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
  __device__ void finish(int64_t, int, float (&)[N]) const {}
};

constexpr int kRunRows = 4;  // rows of a run in flight per thread

template <typename T, int V>
__global__ void embedding_backward_kernel(const T* __restrict__ dout, const uint8_t* __restrict__ mask,
                                          const int* __restrict__ sorted_ids, const int* __restrict__ order,
                                          T* __restrict__ dtable, bool accumulate, int64_t n, int dim, float scale,
                                          int padding_idx, float p) {
  const int64_t k = blockIdx.x;
  const int id = sorted_ids[k];
  if (id == padding_idx || (k > 0 && sorted_ids[k - 1] == id)) return;  // one block per run of equal ids
  int64_t end = k + 1;
  while (end < n && sorted_ids[end] == id) ++end;
  const float drop = p > 0.f ? 1.f / (1.f - p) : 1.f;
  for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * V; c < dim; c += gridDim.y * blockDim.x * V) {
    float acc[V] = {};
    for (int64_t kk = k; kk < end; kk += kRunRows) {
      float v[kRunRows][V];
      bool keep[kRunRows][V];
#pragma unroll
      for (int u = 0; u < kRunRows; ++u) {
        const bool in = kk + u < end;
        const int64_t e = in ? int64_t(order[kk + u]) * dim + c : 0;
        if (in) load<T, V>(dout + e, v[u]);
        if (in && mask) load_mask<V>(mask + e, keep[u]);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          if (!in) v[u][i] = 0.f;
          if (!in || !mask) keep[u][i] = true;
        }
      }
#pragma unroll
      for (int u = 0; u < kRunRows; ++u)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += keep[u][i] ? v[u][i] * drop : 0.f;
    }
    T* const out = dtable + int64_t(id) * dim + c;
    float o[V];
    if (accumulate) load<T, V>(out, o);
#pragma unroll
    for (int i = 0; i < V; ++i) o[i] = accumulate ? o[i] + acc[i] * scale : acc[i] * scale;
    store<T, V>(out, o);
  }
}

__global__ void sort_input_kernel(const int64_t* __restrict__ ids, int* __restrict__ keys, int* __restrict__ order,
                                  int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    keys[i] = int(ids[i]);
    order[i] = int(i);
  }
}

int key_bits(int64_t rows) {
  int bits = 1;
  while (bits < 31 && (int64_t(1) << bits) < rows) ++bits;
  return bits;
}

// The sort's buffers inside the caller's workspace: keys and order in and out (n ints
// each, 256-byte aligned), then cub's temporary storage.
struct SortBuffers {
  int *keys_in, *order_in, *keys_out, *order_out;
  void* temp;
  size_t temp_bytes;
  SortBuffers(void* base, int64_t n, size_t temp_bytes_) : temp_bytes(temp_bytes_) {
    const size_t slot = (size_t(n) * sizeof(int) + 255) / 256 * 256;
    char* b = static_cast<char*>(base);
    keys_in = reinterpret_cast<int*>(b);
    order_in = reinterpret_cast<int*>(b + slot);
    keys_out = reinterpret_cast<int*>(b + 2 * slot);
    order_out = reinterpret_cast<int*>(b + 3 * slot);
    temp = b + 4 * slot;
  }
  static size_t slots(int64_t n) { return 4 * ((size_t(n) * sizeof(int) + 255) / 256 * 256); }
};

size_t cub_temp_bytes(int64_t n, int64_t rows) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const int*)nullptr, (int*)nullptr, (const int*)nullptr,
                                  (int*)nullptr, n, 0, key_bits(rows));
  return bytes;
}

size_t embedding_backward_workspace_bytes(int64_t n, int64_t rows) {
  return SortBuffers::slots(n) + cub_temp_bytes(n, rows);
}

void embedding_forward(DType dt, const int64_t* tokens, const int64_t* positions, const void* weight,
                       const void* pos_weight, void* out, uint8_t* mask, int64_t n, int dim, float scale,
                       int padding_idx, float p, RngState rng, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    EmbForward<T> f{tokens, positions, (const T*)weight, (const T*)pos_weight, dim, padding_idx, scale};
    const bool vec = dim % kVec<T> == 0 && aligned16(weight) && aligned16(pos_weight);
    dropout_map<T>(f, vec, (T*)out, mask, n, dim, p, rng, stream);
  })
}

void embedding_backward(DType dt, const void* dout, const uint8_t* mask, const int64_t* ids, void* workspace,
                        GradOut dtable, int64_t n, int64_t rows, int dim, float scale, int padding_idx, float p,
                        cudaStream_t stream) {
  if (n == 0) return;
  SortBuffers sb(workspace, n, cub_temp_bytes(n, rows));
  sort_input_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(ids, sb.keys_in, sb.order_in, n);
  cub::DeviceRadixSort::SortPairs(sb.temp, sb.temp_bytes, sb.keys_in, sb.keys_out, sb.order_in, sb.order_out, n, 0,
                                  key_bits(rows), stream);
  LS_DISPATCH(dt, {
    auto launch = [&]<int V>() {
      const int vectors = dim / V, threads = vectors < 256 ? (vectors + 31) / 32 * 32 : 256;
      embedding_backward_kernel<T, V><<<dim3(n, ceil_div(vectors, threads)), threads, 0, stream>>>(
          (const T*)dout, mask, sb.keys_out, sb.order_out, (T*)dtable.ptr, dtable.accumulate, n, dim, scale,
          padding_idx, p);
    };
    if (dim % kVec<T> == 0 && aligned16(dout) && aligned16(dtable.ptr))
      launch.template operator()<kVec<T>>();
    else
      launch.template operator()<1>();
  })
}

}  // namespace ls
