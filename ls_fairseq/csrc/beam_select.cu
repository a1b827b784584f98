// beam_select: the k largest entries of each row of scores [rows, M], largest first, equal values
// in index order (LightSeq technique: its hierarchical auto-regressive search, HARS, arXiv
// 2010.13887). It fuses, in one block per row, what beam search otherwise does in several passes
// (an add, a top-k over beams x vocabulary, a gather): the row's group maxima, a threshold from
// them, the compaction of the entries that reach it and their ordering. Only the k answers are
// written to global memory: neither the row's keys nor the candidates are. ls_fairseq/ops/beam_select.py
// is the contract and its reference runs the same three steps in torch ops:
//   1. the row is cut into `groups` runs of ceil(M / groups) consecutive entries and each run's
//      maximum key is taken (a warp a run);
//   2. the k-th largest of those maxima is the threshold (at or below the row's k-th largest key,
//      since k runs each hold an entry at or above it);
//   3. the entries whose key reaches the threshold go to a shared-memory buffer through one
//      shared counter, and each finds its rank among them by counting the larger keys.
// A key is the float's bits mapped to an int64 of the same order (-0.0 as +0.0) times 2^32 plus
// 2^32 - 1 - index, so keys within a row are unique and ties fall to the lower index. When more
// than kCandidates entries reach the threshold (rows of many equal values), the block takes the
// k largest keys one after another instead, k passes over the row: slower, the same answer.
#include <cstdint>

#include "common.cuh"

namespace ls {

namespace {

// A row's passes are chains of loads: a warp a run (32 runs by default) and 4 loads in flight a lane
// keep them short (a block of 256 threads took ~40 us a row of 32,000, ~8 round trips of L2 a warp).
constexpr int kSelectThreads = 1024;
constexpr int kUnroll = 4;
constexpr int kCandidates = 2048;
constexpr int64_t kMinKey = INT64_MIN;
constexpr int64_t kMaxKey = INT64_MAX;

template <typename T>
__device__ __forceinline__ int64_t order_key(T x, int64_t index) {
  const float f = to_f(x) + 0.f;  // + 0: -0.0 becomes +0.0
  const int bits = __float_as_int(f);
  const int64_t ordered = bits < 0 ? int64_t(bits ^ 0x7FFFFFFF) : int64_t(bits);
  return ordered * (int64_t(1) << 32) + (int64_t(0xFFFFFFFFu) - index);
}

__device__ __forceinline__ int64_t index_of(int64_t key) { return int64_t(0xFFFFFFFFu) - (key & 0xFFFFFFFFll); }

__device__ __forceinline__ int64_t warp_max_key(int64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long other = __shfl_xor_sync(0xffffffffu, (long long)v, o);
    v = other > v ? other : v;
  }
  return v;
}

// The largest key of the row below `below` (the fallback's pass); every thread gets it.
template <typename T>
__device__ int64_t block_max_key_below(const T* row, int64_t M, int64_t below, int64_t* shared) {
  int64_t best = kMinKey;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t key = order_key(row[j], j);
    if (key < below && key > best) best = key;
  }
  best = warp_max_key(best);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // shared may still be read by the previous pass
  if (lane == 0) shared[warp] = best;
  __syncthreads();
  best = lane < int(blockDim.x >> 5) ? shared[lane] : kMinKey;
  return warp_max_key(best);
}

template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    beam_select_kernel(const T* __restrict__ scores, T* __restrict__ values, int64_t* __restrict__ indices, int64_t M,
                       int k, int groups) {
  __shared__ int64_t group_max[kBeamSelectMaxGroups];
  __shared__ int64_t candidates[kCandidates];
  __shared__ int64_t top[kBeamSelectMaxGroups];
  __shared__ int64_t threshold, reduce[32];
  __shared__ int count;
  const T* row = scores + int64_t(blockIdx.x) * M;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

  // 1. a warp a run: its maximum key (runs past the row's end hold nothing: kMinKey)
  const int64_t size = (M + groups - 1) / groups;
  for (int g = warp; g < groups; g += warps) {
    int64_t best = kMinKey;
    const int64_t end = min(M, (g + 1) * size);
    for (int64_t j0 = g * size + lane; j0 < end; j0 += 32 * kUnroll) {
      int64_t keys[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = j0 + 32 * u;
        keys[u] = j < end ? order_key(row[j], j) : kMinKey;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) best = keys[u] > best ? keys[u] : best;
    }
    best = warp_max_key(best);
    if (lane == 0) group_max[g] = best;
  }
  if (threadIdx.x == 0) count = 0;
  __syncthreads();

  // 2. the k-th largest maximum, counting equal ones (empty runs' kMinKey) as torch.topk does
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const int64_t v = group_max[g];
    int above = 0, at_or_above = 0;
    for (int j = 0; j < groups; ++j) {
      above += group_max[j] > v;
      at_or_above += group_max[j] >= v;
    }
    if (above < k && at_or_above >= k) threshold = v;  // every thread that writes writes the same value
  }
  __syncthreads();

  // 3. the entries at or above the threshold into the buffer, then each one's rank among them
  const int64_t t = threshold;
  for (int64_t j0 = threadIdx.x; j0 < M; j0 += int64_t(blockDim.x) * kUnroll) {
    int64_t keys[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + int64_t(blockDim.x) * u;
      keys[u] = j < M ? order_key(row[j], j) : kMinKey;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j0 + int64_t(blockDim.x) * u < M && keys[u] >= t) {  // the threshold may be kMinKey itself
        const int at = atomicAdd(&count, 1);
        if (at < kCandidates) candidates[at] = keys[u];
      }
    }
  }
  __syncthreads();
  const int n = count;
  if (n <= kCandidates) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t key = candidates[i];
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += candidates[j] > key;
      if (rank < k) top[rank] = key;
    }
  } else {
    int64_t below = kMaxKey;
    for (int r = 0; r < k; ++r) {
      below = block_max_key_below(row, M, below, reduce);
      if (threadIdx.x == 0) top[r] = below;
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < k; r += blockDim.x) {
    const int64_t index = index_of(top[r]);
    indices[int64_t(blockIdx.x) * k + r] = index;
    values[int64_t(blockIdx.x) * k + r] = row[index];
  }
}

}  // namespace

void beam_select(DType dt, const void* scores, void* values, int64_t* indices, int64_t rows, int64_t M, int k,
                 int groups, cudaStream_t stream) {
  if (rows == 0) return;
  LS_DISPATCH(dt, {
    beam_select_kernel<T><<<rows, kSelectThreads, 0, stream>>>((const T*)scores, (T*)values, indices, M, k, groups);
  })
}

}  // namespace ls
