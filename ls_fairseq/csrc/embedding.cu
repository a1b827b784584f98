// embedding: out[i] = dropout(scale * weight[token_i] + pos_weight[position_i]),
// zero for padding tokens; pos_weight is the learned table or fairseq's
// sinusoid table (ls_fairseq/ops/embedding.py passes it).
// Fuses: lookup, scale, positional add, padding zeroing, dropout (Philox mask,
// never stored: backward draws the keep-bits again from the forward's state).
// Backward: dtable[t] = sum over tokens i with token_i = t != pad of
// scale * dout[i] * keep / (1 - p), accumulated in fp32 without atomics, so the
// result is deterministic: the ids are sorted beforehand (a stable radix sort of
// 32-bit keys over only the bits the table needs, 15 for a 32k vocabulary: up to
// 12,288 ids in one block's shared memory, one launch; more with cub's device-wide
// sort), which lines up each id's tokens as a run of sorted positions. The
// sorted positions are cut into chunks of kPieceRows; one warp sums the piece of
// a run inside one chunk (four vectors of a lane in flight), so a frequent token's long run
// (hundreds of tokens of "," or "the" in a real batch) is summed by many warps,
// not walked by one. A run inside one chunk is written to the table at once; a
// run across chunks leaves its pieces' fp32 sums in the chunks' head/tail slots,
// and a second kernel adds them in chunk order. Padding rows and ids absent from
// the batch are not written: the caller zeroes the table, or accumulates into a
// gradient (ls_adam's workspace) that holds what it held.
#include <cub/block/block_radix_sort.cuh>
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

constexpr int kRunVectors = 4;  // a lane's vectors in flight: ITEMS of each of kRunVectors / ITEMS rows
constexpr int kPieceRows = 32;  // sorted positions per chunk: the most rows one block sums

// The table row `id` from a run's fp32 sum: scaled, written or added.
template <typename T, int V>
__device__ __forceinline__ void write_row(T* dtable, bool accumulate, int id, int dim, int c, float scale,
                                          const float (&acc)[V]) {
  T* const out = dtable + int64_t(id) * dim + c;
  float o[V];
  if (accumulate) load<T, V>(out, o);
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = accumulate ? o[i] + acc[i] * scale : acc[i] * scale;
  store<T, V>(out, o);
}

// Warp k (kPieceWarps a block) sums the piece that starts at sorted position k (a run's
// start, or a chunk's start inside a run) up to the run's or the chunk's end. Its lanes find
// that end at once (a chunk is 32 positions, one a lane) and load the piece's row numbers;
// a lane then holds ITEMS vectors of a row (ITEMS x 32 x V columns a trip), with
// kRunVectors / ITEMS rows' loads in flight. Its sum goes to the table (the whole run), to the chunk's head slot (a
// run continued from the previous chunk) or to its tail slot (a run that continues into
// the next chunk): pieces[(2 chunk + slot) dim].
constexpr int kPieceWarps = 8;
static_assert(kPieceRows == 32, "a piece's positions are one warp's lanes");

template <typename T, int V, int ITEMS>
__global__ void __launch_bounds__(32 * kPieceWarps)
    embedding_backward_piece_kernel(const T* __restrict__ dout, Redraw keeps,
                                    const int* __restrict__ sorted_ids, const int* __restrict__ order,
                                    T* __restrict__ dtable, bool accumulate, float* __restrict__ pieces, int64_t n,
                                    int dim, float scale, int padding_idx, float p) {
  const int lane = threadIdx.x & 31;
  const int64_t k = int64_t(blockIdx.x) * kPieceWarps + (threadIdx.x >> 5), chunk = k / kPieceRows;
  if (k >= n) return;
  const int id = sorted_ids[k];
  const bool run_start = k == 0 || sorted_ids[k - 1] != id;
  if (id == padding_idx || !(run_start || k % kPieceRows == 0)) return;  // the whole warp
  const int64_t chunk_end = (chunk + 1) * kPieceRows < n ? (chunk + 1) * kPieceRows : n;
  // the run's positions from k on are a prefix of the lanes (sorted ids)
  const bool in_run = k + lane < chunk_end && sorted_ids[k + lane] == id;
  const unsigned run = __ballot_sync(0xffffffffu, in_run);
  const int len = run == 0xffffffffu ? 32 : __ffs(~run) - 1;
  const int64_t end = k + len;
  const bool continues = end == chunk_end && end < n && sorted_ids[end] == id;
  float* const slot = !run_start ? pieces + 2 * chunk * dim : continues ? pieces + (2 * chunk + 1) * dim : nullptr;
  const int my_row = in_run ? order[k + lane] : 0;
  const float drop = p > 0.f ? 1.f / (1.f - p) : 1.f;
  constexpr int ROWS = kRunVectors / ITEMS;
  for (int c0 = 0; c0 < dim; c0 += ITEMS * 32 * V) {  // the same trips for every lane: they shuffle
    float acc[ITEMS][V] = {};
    for (int r0 = 0; r0 < len; r0 += ROWS) {
      Pack<T, V> v[ROWS][ITEMS];
      bool keep[ROWS][ITEMS][V];
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        const int64_t row = __shfl_sync(0xffffffffu, my_row, (r0 + u) & 31);
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          const int c = c0 + (it * 32 + lane) * V;
          const bool in = r0 + u < len && c < dim;
          v[u][it] = in ? *reinterpret_cast<const Pack<T, V>*>(dout + row * dim + c) : Pack<T, V>{};
          if (in) {
            keeps.run<V>(row * dim + c, p, keep[u][it]);
          } else {
#pragma unroll
            for (int i = 0; i < V; ++i) keep[u][it][i] = false;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < ROWS; ++u)
#pragma unroll
        for (int it = 0; it < ITEMS; ++it)
#pragma unroll
          for (int i = 0; i < V; ++i)
            acc[it][i] += keep[u][it][i] ? to_f(v[u][it].v[i]) * drop : 0.f;
    }
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int c = c0 + (it * 32 + lane) * V;
      if (c >= dim) continue;
      if (slot) {
#pragma unroll
        for (int i = 0; i < V; ++i) slot[c + i] = acc[it][i];
      } else {
        write_row<T, V>(dtable, accumulate, id, dim, c, scale, acc[it]);
      }
    }
  }
}

// Block c joins the run that crosses from chunk c into chunk c + 1, when it starts in
// chunk c: chunk c's tail slot, then the head slots of the chunks it continues into.
template <typename T, int V>
__global__ void embedding_backward_join_kernel(const int* __restrict__ sorted_ids, const float* __restrict__ pieces,
                                               T* __restrict__ dtable, bool accumulate, int64_t n, int dim,
                                               float scale, int padding_idx) {
  const int64_t c = blockIdx.x, last = (c + 1) * kPieceRows - 1;
  if (last + 1 >= n) return;
  const int id = sorted_ids[last];
  if (id == padding_idx || sorted_ids[last + 1] != id) return;  // no run crosses into chunk c + 1
  if (c > 0 && sorted_ids[c * kPieceRows - 1] == id) return;   // started earlier: joined by that chunk's block
  for (int col = (blockIdx.y * blockDim.x + threadIdx.x) * V; col < dim; col += gridDim.y * blockDim.x * V) {
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = pieces[(2 * c + 1) * dim + col + i];
    for (int64_t c2 = c + 1; c2 * kPieceRows < n && sorted_ids[c2 * kPieceRows] == id; ++c2)
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += pieces[2 * c2 * dim + col + i];
    write_row<T, V>(dtable, accumulate, id, dim, col, scale, acc);
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

// Up to kBlockSortKeys ids (12,288: a batch of --max-tokens 8192 with its lengths padded to a
// multiple of 8 holds up to ~10,000 ids) one block sorts them with their positions in shared
// memory (cub's block radix sort, 4 bits a pass), in one launch: cub's device-wide sort takes
// five (a memset, a histogram, a scan, two passes; ~23 us for 8,192 keys on an H200) and
// sort_input_kernel one more. ITEMS keys a thread, 8 up to 8,192 ids, else 12 (64 registers, the
// most at 1,024 threads, 48 bytes spilled; 48 KB of shared memory). Keys past n are the largest key
// the bits hold, after every real id (a stable sort keeps them after an id of that value too).
constexpr int kBlockSortThreads = 1024, kBlockSortKeys = kBlockSortThreads * 12;

template <int ITEMS>
__global__ void __launch_bounds__(kBlockSortThreads)
    sort_block_kernel(const int64_t* __restrict__ ids, int* __restrict__ keys_out, int* __restrict__ order_out,
                      int n, int bits) {
  using Sort = cub::BlockRadixSort<int, kBlockSortThreads, ITEMS, int>;
  __shared__ typename Sort::TempStorage temp;
  const int last = int((1u << bits) - 1u);
  int keys[ITEMS], order[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {  // blocked: thread t holds positions ITEMS t .. ITEMS t + ITEMS - 1
    const int e = threadIdx.x * ITEMS + i;
    keys[i] = e < n ? int(ids[e]) : last;
    order[i] = e;
  }
  Sort(temp).SortBlockedToStriped(keys, order, 0, bits);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {  // striped: rank i x 1024 + t, coalesced stores
    const int e = i * kBlockSortThreads + threadIdx.x;
    if (e < n) {
      keys_out[e] = keys[i];
      order_out[e] = order[i];
    }
  }
}

int key_bits(int64_t rows) {
  int bits = 1;
  while (bits < 31 && (int64_t(1) << bits) < rows) ++bits;
  return bits;
}

// The backward's buffers inside the caller's workspace: keys and order in and out (n
// ints each), the pieces' head/tail slots (2 x chunks x dim floats), each 256-byte
// aligned, then cub's temporary storage.
size_t aligned256(size_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t piece_chunks(int64_t n) { return (n + kPieceRows - 1) / kPieceRows; }

struct BackwardBuffers {
  int *keys_in, *order_in, *keys_out, *order_out;
  float* pieces;
  void* temp;
  size_t temp_bytes;
  BackwardBuffers(void* base, int64_t n, int dim, size_t temp_bytes_) : temp_bytes(temp_bytes_) {
    const size_t slot = aligned256(size_t(n) * sizeof(int));
    char* b = static_cast<char*>(base);
    keys_in = reinterpret_cast<int*>(b);
    order_in = reinterpret_cast<int*>(b + slot);
    keys_out = reinterpret_cast<int*>(b + 2 * slot);
    order_out = reinterpret_cast<int*>(b + 3 * slot);
    pieces = reinterpret_cast<float*>(b + 4 * slot);
    temp = b + 4 * slot + pieces_bytes(n, dim);
  }
  static size_t pieces_bytes(int64_t n, int dim) { return aligned256(2 * size_t(piece_chunks(n)) * dim * sizeof(float)); }
  static size_t bytes(int64_t n, int dim) { return 4 * aligned256(size_t(n) * sizeof(int)) + pieces_bytes(n, dim); }
};

// cub's temporary storage for its device-wide sort; none for the block's
size_t sort_temp_bytes(int64_t n, int64_t rows) {
  size_t bytes = 0;
  if (n > kBlockSortKeys)
    cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const int*)nullptr, (int*)nullptr, (const int*)nullptr,
                                    (int*)nullptr, n, 0, key_bits(rows));
  return bytes;
}

size_t embedding_backward_workspace_bytes(int64_t n, int64_t rows, int dim) {
  return BackwardBuffers::bytes(n, dim) + sort_temp_bytes(n, rows);
}

void embedding_forward(DType dt, const int64_t* tokens, const int64_t* positions, const void* weight,
                       const void* pos_weight, void* out, int64_t n, int dim, float scale,
                       int padding_idx, float p, RngState rng, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    EmbForward<T> f{tokens, positions, (const T*)weight, (const T*)pos_weight, dim, padding_idx, scale};
    const bool vec = dim % kVec<T> == 0 && aligned16(weight) && aligned16(pos_weight);
    dropout_map<T>(f, vec, (T*)out, n, dim, p, rng, stream);
  })
}

void embedding_backward(DType dt, const void* dout, const RngState* rng, const int64_t* ids, void* workspace,
                        GradOut dtable, int64_t n, int64_t rows, int dim, float scale, int padding_idx, float p,
                        cudaStream_t stream) {
  if (n == 0) return;
  BackwardBuffers bb(workspace, n, dim, sort_temp_bytes(n, rows));
  if (n <= kBlockSortThreads * 8) {
    sort_block_kernel<8><<<1, kBlockSortThreads, 0, stream>>>(ids, bb.keys_out, bb.order_out, int(n), key_bits(rows));
  } else if (n <= kBlockSortKeys) {
    sort_block_kernel<12><<<1, kBlockSortThreads, 0, stream>>>(ids, bb.keys_out, bb.order_out, int(n), key_bits(rows));
  } else {
    sort_input_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(ids, bb.keys_in, bb.order_in, n);
    cub::DeviceRadixSort::SortPairs(bb.temp, bb.temp_bytes, bb.keys_in, bb.keys_out, bb.order_in, bb.order_out, n,
                                    0, key_bits(rows), stream);
  }
  LS_DISPATCH(dt, {
    auto launch = [&]<int V>() {
      const int vectors = dim / V, threads = vectors < 256 ? (vectors + 31) / 32 * 32 : 256;
      const int col_blocks = ceil_div(vectors, threads);
      auto pieces = [&]<int ITEMS>() {
        embedding_backward_piece_kernel<T, V, ITEMS><<<ceil_div(n, kPieceWarps), 32 * kPieceWarps, 0, stream>>>(
            (const T*)dout, redraw(rng, p), bb.keys_out, bb.order_out, (T*)dtable.ptr, dtable.accumulate, bb.pieces, n, dim,
            scale, padding_idx, p);
      };
      if (vectors <= 32) pieces.template operator()<1>();
      else if (vectors <= 64) pieces.template operator()<2>();
      else pieces.template operator()<4>();
      embedding_backward_join_kernel<T, V><<<dim3(piece_chunks(n), col_blocks), threads, 0, stream>>>(
          bb.keys_out, bb.pieces, (T*)dtable.ptr, dtable.accumulate, n, dim, scale, padding_idx);
    };
    if (dim % kVec<T> == 0 && aligned16(dout) && aligned16(dtable.ptr))
      launch.template operator()<kVec<T>>();
    else
      launch.template operator()<1>();
  })
}

}  // namespace ls
