// Two-stage deterministic column reduction fused with an elementwise map, in one
// launch: stage one evaluates K values per element of a [rows, cols] matrix with f
// (which may also store what it computes, e.g. the op's dx), and writes K fp32
// partial sums per (row chunk, column); stage two adds the chunks up in a fixed
// order and writes the K column sums in the storage type, or adds them to the
// gradients there (GradOut::accumulate), rounding once. Stage two runs in the
// blocks that finish last (counted in with atomics), not in a kernel of its own: a
// launch less per bias gradient. Used by every bias gradient and by LayerNorm's
// gamma/beta gradients, so dx is written once and never re-read. The counters are
// shared by the launches of one module: its launches must not overlap (they run on
// one stream, as an autograd backward does).
// A thread handles V adjacent columns (16-byte accesses when the caller allows),
// a block 32 * V columns by 8 rows at a time.
//   f: template <int N> __device__ void operator()(int64_t row, int col, float (&v)[K][N]) const;
#pragma once

#include "common.cuh"

namespace ls {

constexpr int kRowTile = 8;

template <int K>
struct GradOuts {
  GradOut g[K];
};

// Stage two as a kernel of its own, for LayerNorm's strips (a block per strip of rows,
// all columns): a block of 32 x 32 threads per 32 columns; thread (x, y) adds chunks
// y, y + 32, ... of column x (independent loads, all in flight at once), then row
// y = 0 adds the 32 lane sums in order: a fixed order, so deterministic.
constexpr int kFinishLanes = 32;

template <typename T, int K>
__global__ void column_sum_finish_kernel(const float* __restrict__ partial, int chunks, int cols, GradOuts<K> out) {
  __shared__ float lane_s[kFinishLanes][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const float* part = partial + int64_t(blockIdx.y) * chunks * cols;
  float s = 0.f;
  if (col < cols) {
#pragma unroll 8  // 256 chunks (8,192 rows): all of a thread's loads in flight at once
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

// Stage two inside the map kernel, without a launch of its own: the blocks of a column strip
// count themselves in (one counter per group of kGroupChunks chunks, one for the groups);
// the last block of a group adds that group's partial sums in chunk order into the group's
// first chunk's slot, and the last group to finish adds the groups' sums in group order and
// writes the column sums: a fixed order whatever the blocks' timing, so deterministic. Each
// finishing block resets its counter, so the counters (module globals, zero at load) are zero
// again for the next launch on the stream.
static __device__ unsigned column_counters[kColumnCounters];

__host__ __device__ inline int chunk_groups(int chunks) { return (chunks + kGroupChunks - 1) / kGroupChunks; }

// Whether this block is the last of `count` to arrive at *counter (then it resets it); all of the
// block's earlier global writes are visible to the last one: the barrier orders the block's writes
// before thread 0's release (cumulative, the pattern of a cooperative grid sync), and the last
// block's acquire and barrier order them before its reads.
__device__ __forceinline__ bool last_to_arrive(unsigned* counter, unsigned count) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    last = arrive(counter) == count - 1;
    if (last) *counter = 0;  // for the next launch on the stream, which starts after this one ends
  }
  __syncthreads();
  return last;
}

// Adds slots first, first + step, ... (n of them) of each of the strip's K x 32V columns into
// the first slot, or (FINAL) into the outputs.
template <typename T, int K, int V, bool FINAL>
__device__ void add_slots(float* partial, int chunks, int cols, int col_begin, int first, int step, int n,
                          const GradOuts<K>& out) {
  for (int idx = threadIdx.y * 32 + threadIdx.x; idx < K * 32 * V; idx += 32 * kRowTile) {
    const int k = idx / (32 * V), col = col_begin + idx % (32 * V);
    if (col >= cols) continue;
    float* const p = partial + int64_t(k) * chunks * cols + col;
    float s = 0.f;
    for (int i0 = 0; i0 < n; i0 += kGroupChunks) {  // kGroupChunks slots' loads in flight at once
      float v[kGroupChunks];
#pragma unroll
      for (int i = 0; i < kGroupChunks; ++i)
        v[i] = i0 + i < n ? __ldcg(p + int64_t(first + (i0 + i) * step) * cols) : 0.f;
#pragma unroll
      for (int i = 0; i < kGroupChunks; ++i) s += v[i];
    }
    if constexpr (FINAL) {
      GradOut g = out.g[0];
#pragma unroll
      for (int j = 1; j < K; ++j)  // no run-time index into the kernel's parameters (a local copy)
        if (k == j) g = out.g[j];
      T* const o = static_cast<T*>(g.ptr);
      o[col] = from_f<T>(g.accumulate ? s + to_f(o[col]) : s);
    } else {
      __stcg(p + int64_t(first) * cols, s);
    }
  }
}

// Stage one (the map and the chunks' partial sums) and stage two (above) in one launch: a
// block takes 32 x V columns of a chunk of rows, 8 rows at a time.
template <typename T, int K, int V, typename F>
__global__ void map_column_sum_kernel(F f, float* __restrict__ partial, int64_t rows, int cols, int64_t chunk_rows,
                                      GradOuts<K> out) {
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
  const int groups = chunk_groups(chunks), group = chunk / kGroupChunks, first = group * kGroupChunks;
  const int in_group = chunks - first < kGroupChunks ? chunks - first : kGroupChunks;
  unsigned* const counters = column_counters + blockIdx.x * (groups + 1);
  if (!last_to_arrive(counters + group, in_group)) return;
  add_slots<T, K, V, false>(partial, chunks, cols, strip0, first, 1, in_group, out);
  if (!last_to_arrive(counters + groups, groups)) return;
  add_slots<T, K, V, true>(partial, chunks, cols, strip0, 0, kGroupChunks, groups, out);
}

// out[k][col] = sum over rows of the k-th value f gives for (row, col); partial holds
// K x column_chunks(rows) x cols floats (the K sums' partials one after the other); cols at
// most kMaxColumnSumCols.
// How many blocks of `Kernel` (32 x kRowTile threads) the device runs at once (its blocks an
// SM found once per kernel: a template argument, not a pointer type that kernels share).
template <auto Kernel>
int resident_blocks() {
  static const int per_sm = [] {
    int n = 1;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, 32 * kRowTile, 0);
    return n < 1 ? 1 : n;
  }();
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return per_sm * sms;
}

// Row chunks: column_chunks(rows) at most (the partial's size), and no more than one wave of
// blocks holds: every block waits for its partial sums to reach L2 and for its counter before
// it exits, a delay a second wave would pay again.
template <typename T, int K, typename F>
void map_column_sum(F f, bool vectorizable, const GradOuts<K>& out, float* partial, int64_t rows, int cols,
                    cudaStream_t stream) {
  auto launch = [&]<int V>() {
    constexpr auto kernel = map_column_sum_kernel<T, K, V, F>;
    const int strips = ceil_div(cols, 32 * V), wave = resident_blocks<kernel>() / strips;
    const int chunks = column_chunks(rows) < wave ? column_chunks(rows) : (wave < 1 ? 1 : wave);
    const int64_t chunk_rows = (rows + chunks - 1) / chunks;
    kernel<<<dim3(strips, chunks), dim3(32, kRowTile), 0, stream>>>(f, partial, rows, cols, chunk_rows, out);
  };
  if (vectorizable && cols % kVec<T> == 0)
    launch.template operator()<kVec<T>>();
  else
    launch.template operator()<1>();
}

}  // namespace ls
