// Two-stage deterministic column reduction fused with an elementwise map:
// stage one evaluates f(row, col) for a chunk of rows, optionally stores it, and
// writes one fp32 partial sum per (chunk, column); stage two adds the chunks up
// in a fixed order and writes the column sums in the storage type. Used by every
// bias gradient (the map being the op's own dx), so dx is written once and
// never read back.
#pragma once

#include "common.cuh"

namespace ls {

constexpr int kColTile = 32, kRowTile = 8;

template <typename F>
__global__ void map_column_sum_kernel(F f, float* __restrict__ partial, int64_t rows, int cols, int64_t chunk_rows) {
  __shared__ float acc_s[kRowTile][kColTile + 1];
  const int col = blockIdx.x * kColTile + threadIdx.x;
  const int64_t r0 = blockIdx.y * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float acc = 0.f;
  if (col < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowTile) acc += f(r, col);
  acc_s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kRowTile; ++i) s += acc_s[i][threadIdx.x];
    partial[blockIdx.y * int64_t(cols) + col] = s;
  }
}

template <typename T>
__global__ void column_sum_finish_kernel(const float* __restrict__ partial, int chunks, int cols, T* __restrict__ out) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float s = 0.f;
  for (int c = 0; c < chunks; ++c) s += partial[int64_t(c) * cols + col];
  out[col] = from_f<T>(s);
}

// out[col] = sum over rows of f(row, col); f may also store what it computes.
template <typename T, typename F>
void map_column_sum(F f, T* out, float* partial, int64_t rows, int cols, cudaStream_t stream) {
  const int chunks = column_chunks(rows);
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  map_column_sum_kernel<<<dim3(ceil_div(cols, kColTile), chunks), dim3(kColTile, kRowTile), 0, stream>>>(
      f, partial, rows, cols, chunk_rows);
  column_sum_finish_kernel<T><<<ceil_div(cols, 256), 256, 0, stream>>>(partial, chunks, cols, out);
}

}  // namespace ls
