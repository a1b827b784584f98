// Two-stage deterministic column reduction fused with an elementwise map. Stage one
// evaluates K values per element of a [rows, cols] matrix with f (which may also store
// what it computes, e.g. the op's dx) and writes K fp32 partial sums per (row chunk,
// column). Stage two, a kernel of its own, adds the chunks up in a fixed order and writes
// the K column sums in the storage type, or adds them to the gradients there
// (GradOut::accumulate), rounding once. Every bias gradient and LayerNorm's gamma/beta
// gradients use it, so dx is written once and never read back.
// Stage two is a separate kernel, not the tail of stage one run by the blocks that finish
// last: those blocks' atomic count-ins, one after another on the last block's path, cost
// more than the extra launch (docs/perf-log.md, "Kernel design measurements").
// A thread handles V adjacent columns (16-byte accesses when the caller allows), and a
// block 32 * V columns, 8 rows at a time. Issuing two rows' loads before either row's
// dropout draw made qkv and bias_act_dropout slower.
//   f: template <int N> __device__ void operator()(int64_t row, int col, float (&v)[K][N]) const;
#pragma once

#include "common.cuh"

namespace ls {

constexpr int kRowTile = 8;

template <int K>
struct GradOuts {
  GradOut g[K];
};

// Stage two, for map_column_sum below and LayerNorm's strips (a block per strip of rows, all
// columns). A block of 32 x kFinishLanes threads covers 32 columns: thread (x, y) adds chunks
// y, y + kFinishLanes, ... of column x, 16 loads at a time (so all of a thread's loads are in
// flight at 128 and 256 chunks), and then row y = 0 adds the lanes' sums in order. The order is
// fixed, so the result is deterministic. Eight lanes were faster than 16 or 32
// (docs/perf-log.md, "Kernel design measurements").
constexpr int kFinishLanes = 8;

template <typename T, int K>
__global__ void column_sum_finish_kernel(const float* __restrict__ partial, int chunks, int cols, GradOuts<K> out) {
  __shared__ float lane_s[kFinishLanes][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const float* part = partial + int64_t(blockIdx.y) * chunks * cols;
  float s = 0.f;
  if (col < cols) {
#pragma unroll 16
    for (int c = threadIdx.y; c < chunks; c += kFinishLanes) s += part[int64_t(c) * cols + col];
  }
  lane_s[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  s = 0.f;
#pragma unroll
  for (int y = 0; y < kFinishLanes; ++y) s += lane_s[y][threadIdx.x];
  const GradOut g = out.g[blockIdx.y];
  T* o = static_cast<T*>(g.ptr);
  if (g.accumulate) s += to_f(o[col]);
  o[col] = from_f<T>(s);
}

// Stage two's launch over `chunks` partial rows of `cols` columns, each of the K sums.
template <typename T, int K>
void column_sum_finish(const float* partial, int chunks, int cols, const GradOuts<K>& out, cudaStream_t stream) {
  column_sum_finish_kernel<T, K><<<dim3(ceil_div(cols, 32), K), dim3(32, kFinishLanes), 0, stream>>>(partial, chunks,
                                                                                                     cols, out);
}

// Stage one (the map and the chunks' partial sums): a block takes 32 x V columns of a chunk of
// rows, 8 rows at a time.
template <int K, int V, typename F>
__global__ void map_column_sum_kernel(F f, float* __restrict__ partial, int64_t rows, int cols, int64_t chunk_rows) {
  __shared__ float acc_s[kRowTile][K][32 * V + 1];
  const int strip0 = blockIdx.x * 32 * V, col0 = strip0 + threadIdx.x * V;
  const int chunks = gridDim.y, chunk = blockIdx.y;
  const int64_t r0 = chunk * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float acc[K][V] = {};
  if (col0 < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowTile) {
      float v[K][V];
      f.template operator()<V>(r, col0, v);
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[k][i] += v[k][i];
    }
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc_s[threadIdx.y][k][threadIdx.x * V + i] = acc[k][i];
  __syncthreads();
  // 32 * V columns x K sums, reduced over the 8 row lanes by all 256 threads
  for (int idx = threadIdx.y * 32 + threadIdx.x; idx < K * 32 * V; idx += 32 * kRowTile) {
    const int k = idx / (32 * V), c = idx % (32 * V);
    const int col = strip0 + c;
    if (col >= cols) continue;
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kRowTile; ++r) s += acc_s[r][k][c];
    partial[(int64_t(k) * chunks + chunk) * cols + col] = s;
  }
}

// out[k][col] = sum over rows of the k-th value f gives for (row, col); partial holds
// K x column_chunks(rows) x cols floats (the K sums' partials one after the other). A chunk
// has kMapChunkRows rows: 64 were faster than 32 or 128 (docs/perf-log.md, "Kernel design measurements").
constexpr int kMapChunkRows = 64;

template <typename T, int K, typename F>
void map_column_sum(F f, bool vectorizable, const GradOuts<K>& out, float* partial, int64_t rows, int cols,
                    cudaStream_t stream) {
  const int64_t wanted = rows > kMapChunkRows ? (rows + kMapChunkRows - 1) / kMapChunkRows : 1;
  const int chunks = wanted < column_chunks(rows) ? int(wanted) : column_chunks(rows);
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  auto launch = [&]<int V>() {
    map_column_sum_kernel<K, V, F><<<dim3(ceil_div(cols, 32 * V), chunks), dim3(32, kRowTile), 0, stream>>>(
        f, partial, rows, cols, chunk_rows);
  };
  if (vectorizable && cols % kVec<T> == 0)
    launch.template operator()<kVec<T>>();
  else
    launch.template operator()<1>();
  column_sum_finish<T, K>(partial, chunks, cols, out, stream);
}

}  // namespace ls
