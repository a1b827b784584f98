// qkv: bias add + split into heads (LightSeq2's QKV transform).
// x [B, T, parts * d] (a projection GEMM's output, without bias) -> out
// [parts, B, heads, T, d_head] (head-major), or [parts, B, T, heads, d_head]
// (token-major: what FlashAttention and the memory-efficient kernel keep, so their
// output merges its heads for the out projection without a copy); part 0 scaled by
// first_scale (1/sqrt(d_head) for a query). x + bias is never written in the GEMM's layout; the permuted
// copy is the only write. parts = 3: self-attention q, k, v; parts = 2L: the
// keys and values of all L decoder layers' cross-attention from one GEMM.
// Backward: dx[b, t, c] = dy_part[b, head, t, i] (x first_scale for part 0),
// dbias = column sum of dx, fused into the same pass. Each part's gradient comes
// as its own tensor (as autograd hands them over), read through its own strides
// (attention backwards return some as views of a [B, T, heads, d_head] buffer), so
// they are never stacked into one [parts, ...] copy, nor made contiguous, first.
#include "common.cuh"
#include "reduce.cuh"

namespace ls {

struct HeadLayout {
  int batch, len, parts, heads, head_dim;
  bool token_major;
  // offset in out of element (b, t, c) of [B, T, parts * d]; row = b * T + t
  // (32-bit division: a batch holds fewer than 2^31 tokens, checked by the bindings)
  __device__ int64_t split_offset(int row, int c) const {
    const int d = heads * head_dim;
    const int part = c / d;
    if (token_major) return (int64_t(part) * batch * len + row) * d + c % d;
    const int h = (c % d) / head_dim, i = c % head_dim;
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
    // rows row0 + r are (b, t0 + r) until t wraps: token-major offsets step by d; head-major
    // ones by head_dim, and by (heads - 1) * len * head_dim more where a new sentence starts
    int64_t o = L.split_offset(row0, c);
    int t = row0 % L.len;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= rows) break;
#pragma unroll
      for (int k = 0; k < V; ++k) v[r][k] = (v[r][k] + bv[k]) * s;
      store<T, V>(out + o, v[r]);
      if (L.token_major) {
        o += L.heads * L.head_dim;
        continue;
      }
      o += L.head_dim;
      if (++t == L.len) {
        t = 0;
        o += int64_t(L.heads - 1) * L.len * L.head_dim;
      }
    }
  }
}

// This launch's parts of dy, each [B, heads, T, d_head] with its strides (nullptr: a part without
// gradient, zero).
struct PartGrads {
  const void* p[kQkvMaxParts];
  PartStrides stride[kQkvMaxParts];
};

template <typename T>
struct QkvBackwardMap {
  PartGrads dy;
  T* dx;              // the launch's first column of dx
  int64_t dx_stride;  // columns of dx: parts * d of the whole op
  int len, heads, head_dim;
  float first_scale;  // for the launch's first part (1 unless it is the op's first)
  template <int N>    // N columns inside one head (head_dim % N == 0)
  __device__ void operator()(int64_t r, int c, float (&v)[1][N]) const {
    const int d = heads * head_dim, part = c / d, h = (c % d) / head_dim, i = c % head_dim;
    const T* g = static_cast<const T*>(dy.p[part]);
    if (g) {
      const int b = int(r) / len, t = int(r) - b * len;
      const PartStrides st = dy.stride[part];
      load<T, N>(g + b * st.batch + h * st.head + t * st.len + i, v[0]);
    }
    const float s = part == 0 ? first_scale : 1.f;
#pragma unroll
    for (int k = 0; k < N; ++k) v[0][k] = g ? v[0][k] * s : 0.f;
    store<T, N>(dx + r * dx_stride + c, v[0]);
  }
};

void qkv_forward(DType dt, const void* x, const void* bias, void* out, int batch, int len, int parts, int heads,
                 int head_dim, bool token_major, float first_scale, cudaStream_t stream) {
  const int64_t rows = int64_t(batch) * len;
  const int cols = parts * heads * head_dim;
  if (rows == 0) return;
  HeadLayout L{batch, len, parts, heads, head_dim, token_major};
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

void qkv_backward(DType dt, const void* const* dy, const PartStrides* dy_strides, void* dx, GradOut dbias,
                  float* partial, int batch, int len, int parts, int heads, int head_dim, float first_scale,
                  cudaStream_t stream) {
  const int64_t rows = int64_t(batch) * len;
  const int d = heads * head_dim;
  LS_DISPATCH(dt, {
    constexpr int V = kVec<T>;
    bool vec = head_dim % V == 0 && aligned16(dx);
    for (int k = 0; k < parts; ++k) {
      const PartStrides& st = dy_strides[k];
      vec = vec && aligned16(dy[k]) && st.batch % V == 0 && st.head % V == 0 && st.len % V == 0;
    }
    // parts in groups of kQkvMaxParts: each group is its own range of dx's and dbias' columns
    for (int p0 = 0; p0 < parts; p0 += kQkvMaxParts) {
      const int n = parts - p0 < kQkvMaxParts ? parts - p0 : kQkvMaxParts;
      PartGrads g{};
      for (int k = 0; k < n; ++k) {
        g.p[k] = dy[p0 + k];
        g.stride[k] = dy_strides[p0 + k];
      }
      const QkvBackwardMap<T> f{g, (T*)dx + int64_t(p0) * d, int64_t(parts) * d, len, heads, head_dim,
                                p0 == 0 ? first_scale : 1.f};
      const GradOut group_bias{static_cast<T*>(dbias.ptr) + int64_t(p0) * d, dbias.accumulate};
      map_column_sum<T, 1>(f, vec, GradOuts<1>{{group_bias}}, partial, rows, n * d, stream);
    }
  })
}

}  // namespace ls
