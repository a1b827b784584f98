// qkv: bias add + split into heads (LightSeq2's QKV transform).
// x [B, T, parts * d] (a projection GEMM's output, without bias) -> out
// [parts, B, heads, T, d_head]; part 0 scaled by first_scale (1/sqrt(d_head)
// for a query). x + bias is never written in the GEMM's layout; the permuted
// copy is the only write. parts = 3: self-attention q, k, v; parts = 2L: the
// keys and values of all L decoder layers' cross-attention from one GEMM.
// Backward: dx[b, t, c] = dy[part, b, head, t, i] (x first_scale for part 0),
// dbias = column sum of dx, fused into the same pass.
#include "common.cuh"
#include "reduce.cuh"

namespace ls {

struct HeadLayout {
  int batch, len, parts, heads, head_dim;
  // offset in [parts, B, heads, T, d_head] of element (b, t, c) of [B, T, parts * d]
  __device__ int64_t split_offset(int64_t row, int c) const {
    const int d = heads * head_dim;
    const int part = c / d, h = (c % d) / head_dim, i = c % head_dim;
    const int64_t b = row / len, t = row % len;
    return (((int64_t(part) * batch + b) * heads + h) * len + t) * head_dim + i;
  }
};

template <typename T, int V>
__global__ void qkv_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ out,
                                   HeadLayout L, float first_scale, int64_t n) {
  const int cols = L.parts * L.heads * L.head_dim, d = L.heads * L.head_dim;
  for (int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; e < n;
       e += int64_t(gridDim.x) * blockDim.x * V) {
    const int64_t row = e / cols;
    const int c = int(e % cols);
    float v[V], b[V];
    load<T, V>(x + e, v);
    load<T, V>(bias + c, b);
    const float s = c < d ? first_scale : 1.f;
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = (v[i] + b[i]) * s;
    store<T, V>(out + L.split_offset(row, c), v);
  }
}

template <typename T>
struct QkvBackwardMap {
  const T* dy;
  T* dx;
  HeadLayout L;
  float first_scale;
  __device__ float operator()(int64_t r, int c) const {
    const int cols = L.parts * L.heads * L.head_dim;
    const float v = to_f(dy[L.split_offset(r, c)]) * (c < L.heads * L.head_dim ? first_scale : 1.f);
    dx[r * cols + c] = from_f<T>(v);
    return v;
  }
};

void qkv_forward(DType dt, const void* x, const void* bias, void* out, int batch, int len, int parts, int heads,
                 int head_dim, float first_scale, cudaStream_t stream) {
  const int64_t n = int64_t(batch) * len * parts * heads * head_dim;
  if (n == 0) return;
  HeadLayout L{batch, len, parts, heads, head_dim};
  LS_DISPATCH(dt, {
    constexpr int V = kVec<T>;
    if (head_dim % V == 0 && aligned16(x) && aligned16(bias) && aligned16(out))
      qkv_forward_kernel<T, V><<<ceil_div(n, 256 * V), 256, 0, stream>>>((const T*)x, (const T*)bias, (T*)out, L,
                                                                          first_scale, n);
    else
      qkv_forward_kernel<T, 1><<<ceil_div(n, 256), 256, 0, stream>>>((const T*)x, (const T*)bias, (T*)out, L,
                                                                      first_scale, n);
  })
}

void qkv_backward(DType dt, const void* dy, void* dx, void* dbias, float* partial, int batch, int len, int parts,
                  int heads, int head_dim, float first_scale, cudaStream_t stream) {
  HeadLayout L{batch, len, parts, heads, head_dim};
  LS_DISPATCH(dt, {
    map_column_sum<T>(QkvBackwardMap<T>{(const T*)dy, (T*)dx, L, first_scale}, (T*)dbias, partial,
                      int64_t(batch) * len, parts * heads * head_dim, stream);
  })
}

}  // namespace ls
