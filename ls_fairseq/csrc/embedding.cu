// embedding: out[i] = dropout(scale * weight[token_i] + pos_weight[position_i]),
// zero for padding tokens; pos_weight is the learned table or fairseq's
// sinusoid table (ls_fairseq/ops/embedding.py passes it).
// Fuses: lookup, scale, positional add, padding zeroing, dropout (Philox mask,
// never stored: backward draws the keep-bits again from the forward's state):
// LightSeq2's fused embedding layer, whose backward added half-precision atomics.
// Backward: dtable[t] = sum over tokens i with token_i = t != pad of
// scale * dout[i] * keep / (1 - p), accumulated in fp32 without atomics, so the
// result is deterministic: the ids are sorted beforehand (a stable radix sort of
// 32-bit keys over only the bits the table needs, 15 for a 32k vocabulary: up to
// 12,288 ids in one block's shared memory, one launch; more with cub's device-wide
// sort), which lines up each id's tokens as a run of sorted positions. The
// sorted positions are cut into chunks of kChunkRows; one warp walks a chunk's
// rows in order over a slice of the columns (kRowsInFlight rows' loads in flight),
// so a frequent token's long run (hundreds of tokens of "," or "the" in a real
// batch) is summed by many warps side by side, not walked by one. A run inside one
// chunk is written to the table at once; a run across chunks leaves its pieces'
// fp32 sums in the chunks' head/tail slots, and a second kernel adds them in chunk
// order. Accumulating into a gradient (ls_adam's workspace), the rows of ids absent
// from the batch keep what they held; into a new tensor, a third kernel writes
// zeros to those rows alone (no zero-fill of the whole table first).
// Never written to memory: the dropout mask, fp32 copies of dout or of the table.
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
  // the row's values, converted in fetch: the table row's address waits on the id's load, and
  // drawing the keep-bits before converting made the forward slower (run 46: 0.013 -> 0.016 ms)
  template <int N>
  struct In {
    float v[N];
  };
  template <int N>
  __device__ In<N> fetch(int64_t i, int c) const {
    const int64_t tok = tokens[i], pos = positions[i];
    In<N> in;
    if (tok == padding_idx) {
#pragma unroll
      for (int k = 0; k < N; ++k) in.v[k] = 0.f;
      return in;
    }
    float w[N], pw[N];
    load<T, N>(weight + tok * dim + c, w);
    load<T, N>(pos_weight + pos * dim + c, pw);
#pragma unroll
    for (int k = 0; k < N; ++k) in.v[k] = w[k] * scale + pw[k];
    return in;
  }
  template <int N>
  __device__ void values(const In<N>& in, float (&v)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = in.v[k];
  }
  template <int N>
  __device__ void finish(const In<N>&, float (&)[N]) const {}
};

// A chunk's rows are summed one after another by one warp: ~300 instructions a row (a Philox
// call among them), so at 32 rows a chunk the 1,024 warps of 8,192 ids (8 an SM) left the kernel
// bound by the latency of each warp's instructions (ncu: 5 cycles a warp's instruction, 12%
// occupancy, 34 us); 8 rows a chunk make four times the warps at fewer registers.
constexpr int kChunkRows = 8;     // sorted positions per chunk: one a lane of the warp that sums them
constexpr int kChunkWarps = 4;    // chunks a block (one column slice)
constexpr int kRowsInFlight = 2;  // rows of a chunk a lane loads before it adds any
constexpr int kJoinChunks = 8;    // head slots the join kernel reads at once
constexpr int kChunkBlocksPerSM = 8;  // 32 warps an SM: at most 64 registers (84 unbounded at 4 rows in flight)
static_assert(kChunkRows <= 32 && kChunkRows % kRowsInFlight == 0, "a chunk's positions are lanes of one warp");

// The table row `id` from a run's fp32 sum: scaled, written or added to `old` (its value before).
template <typename T, int V>
__device__ __forceinline__ void write_row(T* dtable, bool accumulate, int id, int dim, int c, float scale,
                                          const float (&acc)[V], const float (&old)[V]) {
  float o[V];
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = accumulate ? old[i] + acc[i] * scale : acc[i] * scale;
  store<T, V>(dtable + int64_t(id) * dim + c, o);
}

// A warp sums one chunk of kChunkRows sorted positions over one slice of 32 x V columns (a
// lane's V columns a row): its lanes first load the chunk's ids and row numbers (one each), mark
// where each run of equal ids ends, and where its sum goes. Then the warp walks the chunk's rows in
// sorted order, kRowsInFlight at a time: all their loads (dout, and for a run that ends there the
// table row it adds to) issued before the first add, the Philox keep-bits drawn meanwhile. A run
// that ends inside the chunk and began in it is written to the table; the chunk's first run, when
// the previous chunk holds its start, goes to the chunk's head slot; its last run, when the next
// chunk continues it, to its tail slot (pieces[(2 chunk + slot) dim], fp32; the join kernel adds
// them). A chunk is the same kChunkRows positions whatever the ids, so a frequent token's long run is
// summed by many warps side by side, and a batch of rare ids costs the same as one of frequent ids.
// Without `accumulate`, each id with a run sets its bit in `present` (the rows the zero kernel
// then leaves alone).
template <typename T, int V>
__global__ void __launch_bounds__(32 * kChunkWarps, kChunkBlocksPerSM)
    embedding_backward_chunk_kernel(const T* __restrict__ dout, Redraw keeps, const int* __restrict__ sorted_ids,
                                    const int* __restrict__ order, T* __restrict__ dtable, bool accumulate,
                                    float* __restrict__ pieces, unsigned* __restrict__ present, int64_t n, int dim,
                                    float scale, int padding_idx, float p) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int64_t chunk = int64_t(blockIdx.x) * kChunkWarps + (threadIdx.x >> 5), begin = chunk * kChunkRows;
  if (begin >= n) return;  // the whole warp
  const int len = n - begin < kChunkRows ? int(n - begin) : kChunkRows;
  const int id = lane < len ? sorted_ids[begin + lane] : -1;
  const int row = lane < len ? order[begin + lane] : 0;
  const int before = begin > 0 ? sorted_ids[begin - 1] : -1, after = begin + len < n ? sorted_ids[begin + len] : -1;
  const int next = __shfl_down_sync(kAll, id, 1), first = __shfl_sync(kAll, id, 0);
  // lane i ends a run; the run is the chunk's first, begun in the previous chunk (head slot), or
  // its last, continued in the next (tail slot), or else written to the table
  const bool ends = lane < len && (lane == len - 1 || next != id) && id != padding_idx;
  const bool head = ends && id == first && first == before;
  const bool tail = ends && !head && lane == len - 1 && id == after;
  const unsigned ends_mask = __ballot_sync(kAll, ends), head_mask = __ballot_sync(kAll, head),
                 tail_mask = __ballot_sync(kAll, tail);
  if (!accumulate && ends) atomicOr(present + (id >> 5), 1u << (id & 31));
  const int c = (blockIdx.y * 32 + lane) * V;
  const bool cols = c < dim;
  const float drop = p > 0.f ? 1.f / (1.f - p) : 1.f;
  float acc[V] = {};
  for (int r0 = 0; r0 < len; r0 += kRowsInFlight) {
    Pack<T, V> v[kRowsInFlight], old[kRowsInFlight];
    bool keep[kRowsInFlight][V];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int i = (r0 + u) & 31, rid = __shfl_sync(kAll, id, i);
      const int64_t r = __shfl_sync(kAll, row, i);
      const bool in = r0 + u < len && rid != padding_idx && cols;
      const bool table = accumulate && in && (ends_mask & ~head_mask & ~tail_mask) >> i & 1u;
      v[u] = in ? *reinterpret_cast<const Pack<T, V>*>(dout + r * dim + c) : Pack<T, V>{};
      old[u] = table ? *reinterpret_cast<const Pack<T, V>*>(dtable + int64_t(rid) * dim + c) : Pack<T, V>{};
      if (in) {
        keeps.run<V>(r * dim + c, p, keep[u]);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) keep[u][k] = false;
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int i = r0 + u;
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += keep[u][k] ? to_f(v[u].v[k]) * drop : 0.f;
      if (i < len && (ends_mask >> i & 1u)) {  // the same branch for the whole warp
        const int rid = __shfl_sync(kAll, id, i);
        if (cols) {
          float* const slot = head_mask >> i & 1u   ? pieces + 2 * chunk * dim
                              : tail_mask >> i & 1u ? pieces + (2 * chunk + 1) * dim
                                                    : nullptr;
          if (slot) {
#pragma unroll
            for (int k = 0; k < V; ++k) slot[c + k] = acc[k];
          } else {
            float o[V];
#pragma unroll
            for (int k = 0; k < V; ++k) o[k] = to_f(old[u].v[k]);
            write_row<T, V>(dtable, accumulate, rid, dim, c, scale, acc, o);
          }
        }
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = 0.f;
      }
    }
  }
}

// Without `accumulate`: zeros in the table rows of ids absent from the batch (no bit in
// `present`), and in the padding row, so that the chunk kernel's rows and these make the whole
// table (no zero-fill first: the present rows would be written twice). A warp a row.
template <typename T, int V>
__global__ void embedding_zero_absent_kernel(const unsigned* __restrict__ present, T* __restrict__ dtable,
                                             int64_t rows, int dim, int padding_idx) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (r >= rows || (r != padding_idx && (present[r >> 5] >> (r & 31) & 1u))) return;
  const float zeros[V] = {};
  for (int c = (threadIdx.x & 31) * V; c < dim; c += 32 * V) store<T, V>(dtable + r * dim + c, zeros);
}

// Block c joins the run that crosses from chunk c into chunk c + 1, when it starts in
// chunk c: chunk c's tail slot, then the head slots of the chunks it continues into.
template <typename T, int V>
__global__ void embedding_backward_join_kernel(const int* __restrict__ sorted_ids, const float* __restrict__ pieces,
                                               T* __restrict__ dtable, bool accumulate, int64_t n, int dim,
                                               float scale, int padding_idx) {
  const int64_t c = blockIdx.x, last = (c + 1) * kChunkRows - 1;
  if (last + 1 >= n) return;
  const int id = sorted_ids[last];
  if (id == padding_idx || sorted_ids[last + 1] != id) return;  // no run crosses into chunk c + 1
  if (c > 0 && sorted_ids[c * kChunkRows - 1] == id) return;   // started earlier: joined by that chunk's block
  for (int col = (blockIdx.y * blockDim.x + threadIdx.x) * V; col < dim; col += gridDim.y * blockDim.x * V) {
    float acc[V], old[V] = {};
    if (accumulate) load<T, V>(dtable + int64_t(id) * dim + col, old);
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = pieces[(2 * c + 1) * dim + col + i];
    // the chunks after c that the run continues into: those whose first id is the run's (sorted ids,
    // so a prefix of them), kJoinChunks tested and loaded at once, added in chunk order
    for (int64_t c2 = c + 1;; c2 += kJoinChunks) {
      bool in[kJoinChunks];
      float v[kJoinChunks][V];
#pragma unroll
      for (int j = 0; j < kJoinChunks; ++j) {
        in[j] = (c2 + j) * kChunkRows < n && sorted_ids[(c2 + j) * kChunkRows] == id;
#pragma unroll
        for (int i = 0; i < V; ++i) v[j][i] = in[j] ? pieces[2 * (c2 + j) * dim + col + i] : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kJoinChunks; ++j)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += v[j][i];
      if (!in[kJoinChunks - 1]) break;
    }
    write_row<T, V>(dtable, accumulate, id, dim, col, scale, acc, old);
  }
}

// Both sorts also zero the bitmap of the ids present (when the chunk kernel fills it in).
__device__ __forceinline__ void zero_words(unsigned* words, int64_t count, int64_t from, int64_t step) {
  for (int64_t w = from; w < count; w += step) words[w] = 0u;
}

__global__ void sort_input_kernel(const int64_t* __restrict__ ids, int* __restrict__ keys, int* __restrict__ order,
                                  int64_t n, unsigned* __restrict__ present, int64_t words) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  zero_words(present, words, i, int64_t(gridDim.x) * blockDim.x);
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
                      int n, int bits, unsigned* __restrict__ present, int64_t words) {
  using Sort = cub::BlockRadixSort<int, kBlockSortThreads, ITEMS, int>;
  __shared__ typename Sort::TempStorage temp;
  zero_words(present, words, threadIdx.x, kBlockSortThreads);
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
// ints each), the chunks' head/tail slots (2 x chunks x dim floats), the bitmap of the ids
// present (rows bits), each 256-byte aligned, then cub's temporary storage.
size_t aligned256(size_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t chunks_of(int64_t n) { return (n + kChunkRows - 1) / kChunkRows; }

int64_t bitmap_words(int64_t rows) { return (rows + 31) / 32; }

struct BackwardBuffers {
  int *keys_in, *order_in, *keys_out, *order_out;
  float* pieces;
  unsigned* present;
  void* temp;
  size_t temp_bytes;
  BackwardBuffers(void* base, int64_t n, int64_t rows, int dim, size_t temp_bytes_) : temp_bytes(temp_bytes_) {
    const size_t slot = aligned256(size_t(n) * sizeof(int));
    char* b = static_cast<char*>(base);
    keys_in = reinterpret_cast<int*>(b);
    order_in = reinterpret_cast<int*>(b + slot);
    keys_out = reinterpret_cast<int*>(b + 2 * slot);
    order_out = reinterpret_cast<int*>(b + 3 * slot);
    pieces = reinterpret_cast<float*>(b + 4 * slot);
    present = reinterpret_cast<unsigned*>(b + 4 * slot + pieces_bytes(n, dim));
    temp = b + bytes(n, rows, dim);
  }
  static size_t pieces_bytes(int64_t n, int dim) { return aligned256(2 * size_t(chunks_of(n)) * dim * sizeof(float)); }
  static size_t bytes(int64_t n, int64_t rows, int dim) {
    return 4 * aligned256(size_t(n) * sizeof(int)) + pieces_bytes(n, dim) +
           aligned256(size_t(bitmap_words(rows)) * sizeof(unsigned));
  }
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
  return BackwardBuffers::bytes(n, rows, dim) + sort_temp_bytes(n, rows);
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
  BackwardBuffers bb(workspace, n, rows, dim, sort_temp_bytes(n, rows));
  // the bitmap of present ids, zeroed by the sort, only when the absent rows need zeros
  unsigned* const present = dtable.accumulate ? nullptr : bb.present;
  const int64_t words = dtable.accumulate ? 0 : bitmap_words(rows);
  if (n <= kBlockSortThreads * 8) {
    sort_block_kernel<8><<<1, kBlockSortThreads, 0, stream>>>(ids, bb.keys_out, bb.order_out, int(n), key_bits(rows),
                                                              present, words);
  } else if (n <= kBlockSortKeys) {
    sort_block_kernel<12><<<1, kBlockSortThreads, 0, stream>>>(ids, bb.keys_out, bb.order_out, int(n), key_bits(rows),
                                                               present, words);
  } else {
    sort_input_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(ids, bb.keys_in, bb.order_in, n, present, words);
    cub::DeviceRadixSort::SortPairs(bb.temp, bb.temp_bytes, bb.keys_in, bb.keys_out, bb.order_in, bb.order_out, n,
                                    0, key_bits(rows), stream);
  }
  LS_DISPATCH(dt, {
    auto launch = [&]<int V>() {
      const int slices = ceil_div(dim, 32 * V), chunks = int(chunks_of(n));
      embedding_backward_chunk_kernel<T, V><<<dim3(ceil_div(chunks, kChunkWarps), slices), 32 * kChunkWarps, 0, stream>>>(
          (const T*)dout, redraw(rng, p), bb.keys_out, bb.order_out, (T*)dtable.ptr, dtable.accumulate, bb.pieces,
          present, n, dim, scale, padding_idx, p);
      const int vectors = dim / V, threads = vectors < 256 ? (vectors + 31) / 32 * 32 : 256;
      embedding_backward_join_kernel<T, V><<<dim3(chunks, ceil_div(vectors, threads)), threads, 0, stream>>>(
          bb.keys_out, bb.pieces, (T*)dtable.ptr, dtable.accumulate, n, dim, scale, padding_idx);
      if (!dtable.accumulate)
        embedding_zero_absent_kernel<T, V><<<ceil_div(rows * 32, 256), 256, 0, stream>>>(present, (T*)dtable.ptr, rows,
                                                                                        dim, padding_idx);
    };
    if (dim % kVec<T> == 0 && aligned16(dout) && aligned16(dtable.ptr))
      launch.template operator()<kVec<T>>();
    else
      launch.template operator()<1>();
  })
}

}  // namespace ls
