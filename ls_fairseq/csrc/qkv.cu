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
  // offset in [parts, B, heads, T, d_head] of element (b, t, c) of [B, T, parts * d]; row = b * T + t
  // (32-bit division: a batch holds fewer than 2^31 tokens, checked by the bindings)
  __device__ int64_t split_offset(int row, int c) const {
    const int d = heads * head_dim;
    const int part = c / d, h = (c % d) / head_dim, i = c % head_dim;
    const int b = row / len, t = row - b * len;
    return (((int64_t(part) * batch + b) * heads + h) * len + t) * head_dim + i;
  }
};

// A block handles kRows consecutive rows (b, t) of x; each thread loads its vector of
// every row before storing any, so several 16-byte loads are in flight per thread, and
// steps (b, t) from row to row (one division per thread, none per row).
constexpr int kRows = 4;

template <typename T, int V>
__global__ void qkv_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ out,
                                   HeadLayout L, float first_scale, int rows) {
  const int cols = L.parts * L.heads * L.head_dim, row0 = blockIdx.x * kRows;
  for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V) {
    const float s = c < L.heads * L.head_dim ? first_scale : 1.f;
    float bv[V], v[kRows][V];
    load<T, V>(bias + c, bv);
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (row0 + r < rows) load<T, V>(x + int64_t(row0 + r) * cols + c, v[r]);
    // rows row0 + r are (b, t0 + r) until t wraps: offsets step by head_dim, and by
    // (heads - 1) * len * head_dim more where a new sentence starts
    int64_t o = L.split_offset(row0, c);
    int t = row0 % L.len;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= rows) break;
#pragma unroll
      for (int k = 0; k < V; ++k) v[r][k] = (v[r][k] + bv[k]) * s;
      store<T, V>(out + o, v[r]);
      o += L.head_dim;
      if (++t == L.len) {
        t = 0;
        o += int64_t(L.heads - 1) * L.len * L.head_dim;
      }
    }
  }
}

template <typename T>
struct QkvBackwardMap {
  const T* dy;
  T* dx;
  HeadLayout L;
  float first_scale;
  template <int N>  // N columns inside one head (head_dim % N == 0)
  __device__ void operator()(int64_t r, int c, float (&v)[1][N]) const {
    const int cols = L.parts * L.heads * L.head_dim;
    const float s = c < L.heads * L.head_dim ? first_scale : 1.f;
    load<T, N>(dy + L.split_offset(int(r), c), v[0]);
#pragma unroll
    for (int i = 0; i < N; ++i) v[0][i] *= s;
    store<T, N>(dx + r * cols + c, v[0]);
  }
};

void qkv_forward(DType dt, const void* x, const void* bias, void* out, int batch, int len, int parts, int heads,
                 int head_dim, float first_scale, cudaStream_t stream) {
  const int64_t rows = int64_t(batch) * len;
  const int cols = parts * heads * head_dim;
  if (rows == 0) return;
  HeadLayout L{batch, len, parts, heads, head_dim};
  LS_DISPATCH(dt, {
    constexpr int V = kVec<T>;
    const bool vec = head_dim % V == 0 && aligned16(x) && aligned16(bias) && aligned16(out);
    const int accesses = vec ? cols / V : cols;
    const int threads = accesses < 128 ? (accesses + 31) / 32 * 32 : 128;
    const int grid = ceil_div(rows, kRows);
    if (vec)
      qkv_forward_kernel<T, V><<<grid, threads, 0, stream>>>((const T*)x, (const T*)bias, (T*)out, L, first_scale, int(rows));
    else
      qkv_forward_kernel<T, 1><<<grid, threads, 0, stream>>>((const T*)x, (const T*)bias, (T*)out, L, first_scale, int(rows));
  })
}

void qkv_backward(DType dt, const void* dy, void* dx, GradOut dbias, float* partial, int batch, int len, int parts,
                  int heads, int head_dim, float first_scale, cudaStream_t stream) {
  HeadLayout L{batch, len, parts, heads, head_dim};
  LS_DISPATCH(dt, {
    const bool vec = head_dim % kVec<T> == 0 && aligned16(dy) && aligned16(dx);
    map_column_sum<T, 1>(QkvBackwardMap<T>{(const T*)dy, (T*)dx, L, first_scale}, vec, GradOuts<1>{{dbias}}, partial,
                         int64_t(batch) * len, parts * heads * head_dim, stream);
  })
}

}  // namespace ls
