// layer_norm: y = (x - mean) * rstd * gamma + beta over the last dimension.
// One pass for the statistics (LightSeq2's rewritten reduction): each thread
// accumulates sum(x - s) and sum((x - s)^2), s = the row's first element as a
// shift that guards E[d^2] - E[d]^2 against cancellation when |mean| >> std,
// and both sums go through one block reduction. mean and rstd (fp32, one per
// row) are the only statistics written; backward needs x, gamma and them.
// Backward:
//   xhat = (x - mean) * rstd, g = dy * gamma
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))  (the two means in one reduction)
//   dgamma = sum over rows of dy * xhat, dbeta = sum over rows of dy
//   (two-stage, deterministic column reduction: chunks of rows, then the chunks).
#include "common.cuh"
#include "reduce.cuh"

namespace ls {

// Threads for one row: enough for one access each, a multiple of 32, at most 1024.
inline int row_threads(int accesses) {
  const int t = (accesses + 31) / 32 * 32;
  return t < 32 ? 32 : (t > 1024 ? 1024 : t);
}

template <typename T, int V>
__global__ void ln_forward_kernel(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
                                  T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                  int hidden, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hidden;
  T* yr = y + row * hidden;
  const float shift = to_f(xr[0]);
  float s1 = 0.f, s2 = 0.f;
  for (int c = threadIdx.x * V; c < hidden; c += blockDim.x * V) {
    float v[V];
    load<T, V>(xr + c, v);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = v[i] - shift;
      s1 += d;
      s2 += d * d;
    }
  }
  block_sum2(s1, s2);
  const float m1 = s1 / hidden;
  const float var = fmaxf(s2 / hidden - m1 * m1, 0.f);
  const float mean = m1 + shift, rstd = rsqrtf(var + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  for (int c = threadIdx.x * V; c < hidden; c += blockDim.x * V) {
    float v[V], g[V], b[V];
    load<T, V>(xr + c, v);
    load<T, V>(gamma + c, g);
    load<T, V>(beta + c, b);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = (v[i] - mean) * rstd * g[i] + b[i];
    store<T, V>(yr + c, v);
  }
}

template <typename T, int V>
__global__ void ln_backward_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ gamma,
                                      const float* __restrict__ mean, const float* __restrict__ rstd,
                                      T* __restrict__ dx, int hidden) {
  const int64_t row = blockIdx.x;
  const T *dyr = dy + row * hidden, *xr = x + row * hidden;
  const float mu = mean[row], rs = rstd[row];
  float sg = 0.f, sgx = 0.f;
  for (int c = threadIdx.x * V; c < hidden; c += blockDim.x * V) {
    float d[V], v[V], g[V];
    load<T, V>(dyr + c, d);
    load<T, V>(xr + c, v);
    load<T, V>(gamma + c, g);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float gi = d[i] * g[i];
      sg += gi;
      sgx += gi * (v[i] - mu) * rs;
    }
  }
  block_sum2(sg, sgx);
  const float mg = sg / hidden, mgx = sgx / hidden;
  for (int c = threadIdx.x * V; c < hidden; c += blockDim.x * V) {
    float d[V], v[V], g[V];
    load<T, V>(dyr + c, d);
    load<T, V>(xr + c, v);
    load<T, V>(gamma + c, g);
#pragma unroll
    for (int i = 0; i < V; ++i) d[i] = rs * (d[i] * g[i] - mg - (v[i] - mu) * rs * mgx);
    store<T, V>(dx + row * hidden + c, d);
  }
}

// Stage one of dgamma / dbeta: per (row chunk, column) partial sums of dy * xhat and dy.
template <typename T>
__global__ void ln_param_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                        const float* __restrict__ mean, const float* __restrict__ rstd,
                                        float* __restrict__ partial_g, float* __restrict__ partial_b, int64_t rows,
                                        int hidden, int64_t chunk_rows) {
  __shared__ float sg[kRowTile][kColTile + 1], sb[kRowTile][kColTile + 1];
  const int col = blockIdx.x * kColTile + threadIdx.x;
  const int64_t r0 = blockIdx.y * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float ag = 0.f, ab = 0.f;
  if (col < hidden)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowTile) {
      const float d = to_f(dy[r * hidden + col]);
      ag += d * (to_f(x[r * hidden + col]) - mean[r]) * rstd[r];
      ab += d;
    }
  sg[threadIdx.y][threadIdx.x] = ag;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    float tg = 0.f, tb = 0.f;
#pragma unroll
    for (int i = 0; i < kRowTile; ++i) {
      tg += sg[i][threadIdx.x];
      tb += sb[i][threadIdx.x];
    }
    partial_g[blockIdx.y * int64_t(hidden) + col] = tg;
    partial_b[blockIdx.y * int64_t(hidden) + col] = tb;
  }
}

void layer_norm_forward(DType dt, const void* x, const void* gamma, const void* beta, void* y, float* mean, float* rstd,
                        int64_t rows, int hidden, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  LS_DISPATCH(dt, {
    constexpr int V = kVec<T>;
    if (hidden % V == 0 && aligned16(x) && aligned16(gamma) && aligned16(beta) && aligned16(y))
      ln_forward_kernel<T, V><<<rows, row_threads(hidden / V), 0, stream>>>(
          (const T*)x, (const T*)gamma, (const T*)beta, (T*)y, mean, rstd, hidden, eps);
    else
      ln_forward_kernel<T, 1><<<rows, row_threads(hidden), 0, stream>>>(
          (const T*)x, (const T*)gamma, (const T*)beta, (T*)y, mean, rstd, hidden, eps);
  })
}

void layer_norm_backward(DType dt, const void* dy, const void* x, const void* gamma, const float* mean,
                         const float* rstd, void* dx, void* dgamma, void* dbeta, float* partial, int64_t rows,
                         int hidden, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    constexpr int V = kVec<T>;
    if (rows > 0) {
      if (hidden % V == 0 && aligned16(dy) && aligned16(x) && aligned16(gamma) && aligned16(dx))
        ln_backward_dx_kernel<T, V><<<rows, row_threads(hidden / V), 0, stream>>>(
            (const T*)dy, (const T*)x, (const T*)gamma, mean, rstd, (T*)dx, hidden);
      else
        ln_backward_dx_kernel<T, 1><<<rows, row_threads(hidden), 0, stream>>>(
            (const T*)dy, (const T*)x, (const T*)gamma, mean, rstd, (T*)dx, hidden);
    }
    const int chunks = column_chunks(rows);
    const int64_t chunk_rows = (rows + chunks - 1) / chunks;
    float* partial_b = partial + int64_t(chunks) * hidden;
    ln_param_partial_kernel<T><<<dim3(ceil_div(hidden, kColTile), chunks), dim3(kColTile, kRowTile), 0, stream>>>(
        (const T*)dy, (const T*)x, mean, rstd, partial, partial_b, rows, hidden, chunk_rows);
    column_sum_finish_kernel<T><<<ceil_div(hidden, 256), 256, 0, stream>>>(partial, chunks, hidden, (T*)dgamma);
    column_sum_finish_kernel<T><<<ceil_div(hidden, 256), 256, 0, stream>>>(partial_b, chunks, hidden, (T*)dbeta);
  })
}

}  // namespace ls
