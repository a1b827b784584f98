// embedding: out[i] = dropout(scale * weight[token_i] + pos_weight[position_i]), zero for padding
// tokens; pos_weight is the learned table or fairseq's sinusoid table (ls_fairseq/ops/embedding.py
// passes it).
// Fuses: lookup, scale, positional add, padding zeroing and dropout. LightSeq2 technique: its fused
// embedding layer (whose backward adds with half-precision atomics, which this one avoids).
// Never written to memory: the dropout mask as bytes (the forward stores nothing; the backward
// draws the keep-bits again from the forward's state beside its sorts, as bits in its workspace,
// 1/16 of dout's bytes), and fp32 copies of dout or of the table.
// Backward: dtable[t] = sum over tokens i with token_i = t != pad of
// scale * dout[i] * keep / (1 - p), accumulated in fp32 without atomics, so the result is
// deterministic. The ids are sorted first, which lines up each id's tokens as a run of sorted
// positions. Up to 12,288 ids are sorted by rank: one launch orders slices of the id-and-position
// keys, and a second places each key by binary searches in them. More ids go through cub's
// device-wide radix sort. The sorted positions are cut into chunks of kChunkRows; one warp walks a
// chunk's rows in order over a slice of the columns, with kRowsInFlight rows' loads in flight, so a
// frequent token's long run (hundreds of tokens of "," or "the" in a real batch) is summed by many
// warps side by side, not walked by one. A run inside one chunk is written to the table at once; a
// run across chunks leaves its pieces' fp32 sums in the chunks' head/tail slots, and a second
// kernel adds them in chunk order. When accumulating into a gradient (ls_adam's workspace), the
// rows of ids absent from the batch keep what they held; when writing a new tensor, the second
// kernel's other blocks write zeros to those rows alone (no zero-fill of the whole table first).
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
  // The row's values, converted in fetch. The ids are loaded first (locate), and the keep-bits are
  // drawn while those loads are in flight (dropout_map.cuh). Four rows per thread, with their ids'
  // loads in flight together, made the forward slower.
  template <int N>
  struct In {
    float v[N];
  };
  struct Located {
    int64_t tok, pos;
  };
  __device__ Located locate(int64_t i) const { return {tokens[i], positions[i]}; }
  template <int N>
  __device__ In<N> fetch(const Located& at, int c) const {
    In<N> in;
    if (at.tok == padding_idx) {
#pragma unroll
      for (int k = 0; k < N; ++k) in.v[k] = 0.f;
      return in;
    }
    float w[N], pw[N];
    load<T, N>(weight + at.tok * dim + c, w);
    load<T, N>(pos_weight + at.pos * dim + c, pw);
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

// One warp sums a chunk's rows one after another, at a few hundred instructions per row. With 32
// rows per chunk, 8,192 ids made only 1,024 warps (8 per SM), and the kernel was bound by the
// latency of each warp's instruction chain at low occupancy (docs/perf-log.md, "Kernel design measurements"). 8 rows per chunk give four
// times the warps, each with fewer registers.
constexpr int kChunkRows = 8;     // sorted positions per chunk: one per lane of the warp that sums them
constexpr int kChunkWarps = 4;    // chunks per block (one column slice)
// The rows of a chunk a lane loads before it adds any: 2 when accumulating (with each run's table
// row also loaded, 4 took 84 registers without bounds), 4 when writing a new table (62 registers at
// 8 blocks per SM, no spills).
template <bool ACCUMULATE>
constexpr int kRowsInFlight = ACCUMULATE ? 2 : 4;
constexpr int kJoinChunks = 4;    // head slots a join's lane loads at once
constexpr int kJoinLanes = 4;     // a join's lanes, each walking every 4th continued chunk
constexpr int kFinishThreads = 256;  // the finish kernel's block size: a join's columns, or 8 zeroed rows
constexpr int kJoinBlocks = 256;     // the finish kernel's blocks that join (each takes every 256th crossing run)
constexpr int kChunkBlocksPerSM = 8;  // 32 warps per SM, so at most 64 registers per thread
static_assert(kChunkRows <= 32 && kChunkRows % kRowsInFlight<false> == 0 && kChunkRows % kRowsInFlight<true> == 0,
              "a chunk's positions are lanes of one warp, walked in whole groups of rows");

// The table row `id` from a run's fp32 sum: scaled, written or added to `old` (its value before).
template <typename T, int V>
__device__ __forceinline__ void write_row(T* dtable, bool accumulate, int id, int dim, int c, float scale,
                                          const float (&acc)[V], const float (&old)[V]) {
  float o[V];
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = accumulate ? old[i] + acc[i] * scale : acc[i] * scale;
  store<T, V>(dtable + int64_t(id) * dim + c, o);
}

// A warp sums one chunk of kChunkRows sorted positions over one slice of 32 x V columns (V columns
// per lane and row). Its lanes first load the chunk's ids and row numbers (one each) and mark where
// each run of equal ids ends and where its sum goes. Then the warp walks the chunk's rows in sorted
// order, kRowsInFlight at a time, issuing all their loads (dout, each row's byte of keep-bits, and
// for a run that ends there the table row it adds to) before the first add. A run that begins and
// ends inside the chunk is written to the table. The chunk's first run, when the previous chunk
// holds its start, goes to the chunk's head slot; its last run, when the next chunk continues it,
// goes to its tail slot (pieces[(2 chunk + slot) dim], fp32), and the chunk goes on the list of
// `starts`, whose count is the word before `present`. The finish kernel adds the slots up. A chunk
// is the same kChunkRows positions whatever the ids, so a frequent token's long run is summed by
// many warps side by side, and a batch of rare ids costs the same as one of frequent ids. With
// ACCUMULATE the table rows are added to (ls_adam's workspace); without it, each id with a run sets
// its bit in `present`, and the finish kernel's zeros leave those rows alone.
template <typename T, int V, bool ACCUMULATE>
__global__ void __launch_bounds__(32 * kChunkWarps, kChunkBlocksPerSM)
    embedding_backward_chunk_kernel(const T* __restrict__ dout, const uint8_t* __restrict__ keep_bits,
                                    const int* __restrict__ sorted_ids,
                                    const int* __restrict__ order, T* __restrict__ dtable,
                                    float* __restrict__ pieces, unsigned* __restrict__ present, int* __restrict__ starts,
                                    int64_t n, int dim, float scale, int padding_idx, float p) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr bool accumulate = ACCUMULATE;
  constexpr int kRows = kRowsInFlight<ACCUMULATE>;
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
  // An id's bit is set once, by the chunk where its run begins, in the first column slice only. The
  // most frequent ids share the bitmap's first words, and setting their bits from every column slice
  // serialised those atomics (docs/perf-log.md, "Kernel design measurements").
  if (!accumulate && ends && !head && blockIdx.y == 0) atomicOr(present + (id >> 5), 1u << (id & 31));
  if (tail && blockIdx.y == 0) starts[atomicAdd(present - 1, 1u)] = int(chunk);
  const int c = (blockIdx.y * 32 + lane) * V;
  const bool cols = c < dim;
  const float drop = dropout_scale(p);
  float acc[V] = {};
  for (int r0 = 0; r0 < len; r0 += kRows) {
    Pack<T, V> v[kRows], old[kRows];
    unsigned keep[kRows];  // bit k: column c + k kept
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int i = (r0 + u) & 31, rid = __shfl_sync(kAll, id, i);
      const int64_t r = __shfl_sync(kAll, row, i);
      const bool in = r0 + u < len && rid != padding_idx && cols;
      const bool table = accumulate && in && (ends_mask & ~head_mask & ~tail_mask) >> i & 1u;
      v[u] = in ? *reinterpret_cast<const Pack<T, V>*>(dout + r * dim + c) : Pack<T, V>{};
      old[u] = table ? *reinterpret_cast<const Pack<T, V>*>(dtable + int64_t(rid) * dim + c) : Pack<T, V>{};
      const int64_t e = r * dim + c;  // V divides 8 and c: the V bits in one byte
      keep[u] = !in ? 0u : keep_bits ? unsigned(keep_bits[e >> 3]) >> (e & 7) : ~0u;
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int i = r0 + u;
      float d[V];
      unpack(v[u], d);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += keep[u] >> k & 1u ? d[k] * drop : 0.f;
      if (i < len && (ends_mask >> i & 1u)) {  // the same branch for the whole warp
        const int rid = __shfl_sync(kAll, id, i);
        if (cols) {
          float* const slot = head_mask >> i & 1u   ? pieces + 2 * chunk * dim
                              : tail_mask >> i & 1u ? pieces + (2 * chunk + 1) * dim
                                                    : nullptr;
          if (slot) {
            store<float, V>(slot + c, acc);
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

// Joins the run that crosses from chunk c into chunk c + 1 and began in chunk c: chunk c's tail
// slot plus the head slots of the m chunks it continues into (those whose first id is the run's;
// the ids are sorted, so these are the next m chunks). m is counted first, each of the block's
// threads testing one chunk's first id (kFinishThreads chunks per round, counted by a barrier), so
// that the walk's loads then depend on nothing but their issue. Testing each chunk before loading
// its slot would make every step of the walk two dependent loads; with Zipf-distributed ids a
// frequent id's run crosses about 100 chunks, and this walk is the join's critical path.
// A block joins the columns col0 .. col0 + kFinishThreads / kJoinLanes x V - 1, one part of the
// row. A join's parts go to different blocks, so that each part's walk is split kJoinLanes ways,
// which was faster than fewer lanes or more (docs/perf-log.md, "Kernel design measurements"). The block's threads form kJoinLanes
// lanes: a lane's threads take the columns, and lane l takes the chunks c + 1 + l,
// c + 1 + l + kJoinLanes, ..., kJoinChunks of them loaded at once. Lane 0 adds the tail slot and
// the lanes' sums in lane order: a fixed order, so the result is deterministic.
template <typename T, int V>
__device__ void join_run(const int* __restrict__ sorted_ids, const float* __restrict__ pieces, T* __restrict__ dtable,
                         bool accumulate, int64_t c, int col0, int64_t n, int dim, float scale) {
  constexpr int kLaneThreads = kFinishThreads / kJoinLanes;
  __shared__ float lane_s[kJoinLanes - 1][kLaneThreads][V];
  const int lane = threadIdx.x / kLaneThreads, t = threadIdx.x % kLaneThreads;
  const int id = sorted_ids[(c + 1) * kChunkRows - 1];
  int64_t m = 0;
  for (;;) {
    const int64_t cj = c + 1 + m + threadIdx.x;
    const int k = __syncthreads_count(cj * kChunkRows < n && sorted_ids[cj * kChunkRows] == id);
    m += k;
    if (k < kFinishThreads) break;
  }
  const int col = col0 + t * V;
  float acc[V] = {};
  if (col < dim)
    for (int64_t j = lane; j < m; j += kJoinLanes * kJoinChunks) {
      float v[kJoinChunks][V];
#pragma unroll
      for (int u = 0; u < kJoinChunks; ++u) {
        const int64_t ju = j + u * kJoinLanes;
        if (ju < m) {
          load<float, V>(pieces + 2 * (c + 1 + ju) * dim + col, v[u]);
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) v[u][i] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kJoinChunks; ++u)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += v[u][i];
    }
  if (lane > 0 && col < dim)
#pragma unroll
    for (int i = 0; i < V; ++i) lane_s[lane - 1][t][i] = acc[i];
  __syncthreads();
  if (lane == 0 && col < dim) {
    float sum[V], old[V] = {};
    if (accumulate) load<T, V>(dtable + int64_t(id) * dim + col, old);
#pragma unroll
    for (int i = 0; i < V; ++i) sum[i] = pieces[(2 * c + 1) * dim + col + i] + acc[i];
#pragma unroll
    for (int l = 1; l < kJoinLanes; ++l)
#pragma unroll
      for (int i = 0; i < V; ++i) sum[i] += lane_s[l - 1][t][i];
    write_row<T, V>(dtable, accumulate, id, dim, col, scale, sum, old);
  }
  __syncthreads();  // lane_s is read before the next join's sums go in
}

// Without `accumulate`: zeros in table row r when its id is absent from the batch (no bit in
// `present`) or is the padding row, so that the chunk kernel's rows and these make the whole
// table (no zero-fill first: the present rows would be written twice). One warp per row.
template <typename T, int V>
__device__ void zero_absent_row(const unsigned* __restrict__ present, T* __restrict__ dtable, int64_t r, int dim,
                                int padding_idx) {
  if (r != padding_idx && (present[r >> 5] >> (r & 31) & 1u)) return;
  const float zeros[V] = {};
  for (int c = (threadIdx.x & 31) * V; c < dim; c += 32 * V) store<T, V>(dtable + r * dim + c, zeros);
}

// The joins and the zeros in one launch. The first join_blocks blocks take the chunks that start a
// crossing run (the chunk kernel's list, in any order: each join is its own sum); the other blocks
// zero the absent rows, one warp per row (never a join's row: those are present). One launch has
// one ramp and tail instead of two, and a long join (a frequent id's run over many chunks) runs
// beside the zeros instead of before them. One block per chunk, each testing its chunk's ids, made
// the zeros wait, and 32 chunks per block serialised the joins (docs/perf-log.md, "Kernel design measurements").
template <typename T, int V>
__global__ void __launch_bounds__(kFinishThreads, 4)
    embedding_backward_finish_kernel(const int* __restrict__ sorted_ids, const float* __restrict__ pieces,
                                     const unsigned* __restrict__ present, const int* __restrict__ starts,
                                     T* __restrict__ dtable, bool accumulate, int join_blocks, int64_t n, int64_t rows,
                                     int dim, float scale, int padding_idx) {
  if (blockIdx.x < join_blocks) {
    // A join's columns are split into parts, each taken by a block. The (join, part) items are counted
    // in 32 bits: there are fewer than n dim / 512 of them, below 2^32 for any dout that fits on a GPU,
    // and 64-bit division made the scalar path spill.
    constexpr unsigned kPartColumns = kFinishThreads / kJoinLanes * V;
    const unsigned parts = (unsigned(dim) + kPartColumns - 1) / kPartColumns, items = present[-1] * parts;
    for (unsigned i = blockIdx.x; i < items; i += join_blocks)
      join_run<T, V>(sorted_ids, pieces, dtable, accumulate, starts[i / parts], int(i % parts * kPartColumns), n, dim,
                     scale);
    return;
  }
  const int64_t r = ((blockIdx.x - join_blocks) * int64_t(kFinishThreads) + threadIdx.x) / 32;
  if (r < rows) zero_absent_row<T, V>(present, dtable, r, dim, padding_idx);
}

// Both sorts also zero the count of crossing runs and the bitmap of the ids present after it (when
// the chunk kernel fills it in).
__device__ __forceinline__ void zero_words(unsigned* words, int64_t count, int64_t from, int64_t step) {
  for (int64_t w = from; w < count; w += step) words[w] = 0u;
}

// The backward's keep-bits (one byte per 8 elements of dout, as record_keeps writes them), drawn by
// extra blocks that the sort kernels launch beyond their own. The sorts leave most of the GPU idle
// (32 and 256 blocks of 256 threads at 8,192 ids), and the chunk kernel, bound by each warp's chain
// of instructions, then loads a byte per row instead of making a Philox call, which makes it much
// faster. A sort kernel's extra blocks draw the bits of bytes [begin, end). Drawing all of them
// beside the first sort slowed that sort by nearly what the chunk kernel saved, so the two rank
// sorts share them (docs/perf-log.md, "Kernel design measurements").
struct KeepDraw {
  RngState rng;
  float p;
  uint8_t* bits;  // null: nothing to draw (no dropout, or the forward's bits stored)
  int64_t begin, end;  // bytes
  int64_t elements;    // dout's: the last byte may hold fewer than 8
  int blocks;          // launched past the sort's own blocks
  static constexpr int kMaxBlocks = 16384;
};

// One byte per thread: the draw is latency-bound at the sorts' occupancy, and more threads hide more
// of each Philox call's chain than more bytes per thread do. A given mask is read up to its last
// element only. Handling the last byte element by element on the Philox path too (a second Philox
// copy in the loop) was slower (docs/perf-log.md, "Kernel design measurements").
__device__ void draw_keep_bits(const KeepDraw& d, int block) {
  const int64_t stride = int64_t(d.blocks) * blockDim.x;
  for (int64_t b = d.begin + int64_t(block) * blockDim.x + threadIdx.x; b < d.end; b += stride) {
    bool k[8];
    if (d.rng.given) {  // a given mask's bytes, none past its last element
#pragma unroll
      for (int j = 0; j < 8; ++j) k[j] = b * 8 + j < d.elements && d.rng.given[b * 8 + j] != 0;
    } else {
      keep8(d.rng, uint64_t(b), d.p, k);
    }
    d.bits[b] = keep_byte(k);
  }
}

__global__ void sort_input_kernel(const int64_t* __restrict__ ids, int* __restrict__ keys, int* __restrict__ order,
                                  int64_t n, unsigned* __restrict__ flags, int64_t words, KeepDraw draw) {
  const int sort_blocks = gridDim.x - draw.blocks;
  if (int(blockIdx.x) >= sort_blocks) return draw_keep_bits(draw, blockIdx.x - sort_blocks);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  zero_words(flags, words, i, int64_t(sort_blocks) * blockDim.x);
  if (i < n) {
    keys[i] = int(ids[i]);
    order[i] = int(i);
  }
}

// Up to kRankSortKeys ids (12,288; a batch of --max-tokens 8192 with its lengths padded to a
// multiple of 8 holds up to about 10,000 ids) are sorted by rank in two launches. Id i's key is
// id << pos_bits | i: the keys are distinct and in (id, position) order, so the sort is stable and
// its result does not depend on the blocks' timing. slice_sort_kernel orders each slice of kSlice
// keys, placing each key by the number of smaller keys in its slice (kSlice comparisons, 4 per
// shared-memory load; a warp's lanes all read the same address, a broadcast). merge_rank_kernel
// places each key by the number of smaller keys in all slices, with one binary search per slice
// (kSliceSteps steps). This is faster than cub's block radix sort, cub's device-wide sort (five
// launches) and one launch comparing every key with every other (docs/perf-log.md, "Kernel design measurements").
constexpr int kSlice = 256, kSliceSteps = 9, kMergeItems = 32, kMergeGroups = 8, kMergeChains = 4, kRankLoads = 8,
              kRankSortKeys = 12288;
static_assert(1 << (kSliceSteps - 1) == kSlice, "the binary search's first step is the whole slice");

// a < b for keys below 2^31, as the sign of a - b: two instructions (a subtract, and a shift-add
// into the count), against three for a compare, a select and an add
__device__ __forceinline__ unsigned less(unsigned a, unsigned b) { return (a - b) >> 31; }

__device__ __forceinline__ unsigned sort_key(const int64_t* __restrict__ ids, int i, int pos_bits) {
  return unsigned(ids[i]) << pos_bits | unsigned(i);
}

// Block s writes slice s's keys in order to sorted[s kSlice ...] (the slice's own length).
__global__ void __launch_bounds__(kSlice)
    slice_sort_kernel(const int64_t* __restrict__ ids, unsigned* __restrict__ sorted, int n, int pos_bits,
                      unsigned* __restrict__ flags, int64_t words, KeepDraw draw) {
  __shared__ uint4 slice_s[kSlice / 4];
  unsigned* const keys = reinterpret_cast<unsigned*>(slice_s);
  const int sort_blocks = gridDim.x - draw.blocks;
  if (int(blockIdx.x) >= sort_blocks) return draw_keep_bits(draw, blockIdx.x - sort_blocks);
  zero_words(flags, words, int64_t(blockIdx.x) * kSlice + threadIdx.x, int64_t(sort_blocks) * kSlice);
  const int i = blockIdx.x * kSlice + threadIdx.x;
  const unsigned mine = i < n ? sort_key(ids, i, pos_bits) : 0x7fffffffu;  // padding: above every real key
  keys[threadIdx.x] = mine;
  __syncthreads();
  if (i >= n) return;
  unsigned rank = 0;
#pragma unroll 8
  for (int q = 0; q < kSlice / 4; ++q) {
    const uint4 k = slice_s[q];
    rank += less(k.x, mine) + less(k.y, mine) + less(k.z, mine) + less(k.w, mine);
  }
  sorted[blockIdx.x * kSlice + rank] = mine;
}

// Each block stages the sorted slices (n keys) in shared memory, with kRankLoads 16-byte loads per
// thread in flight at once, and places kMergeItems keys. Warp g counts the keys below each of them in
// slices g, g + kMergeGroups, ..., running kMergeChains slices' binary searches side by side, since
// each step of a search waits on the one before (one thread searching every slice was slower).
// Warp 0 then adds the warps' counts in order; the counts are stored in the keys' space once the
// keys have been read.
__global__ void __launch_bounds__(kMergeItems * kMergeGroups)
    merge_rank_kernel(const int64_t* __restrict__ ids, const unsigned* __restrict__ sorted, int* __restrict__ keys_out,
                      int* __restrict__ order_out, int n, int pos_bits, KeepDraw draw) {
  constexpr int kThreads = kMergeItems * kMergeGroups;
  const int sort_blocks = gridDim.x - draw.blocks;
  if (int(blockIdx.x) >= sort_blocks) return draw_keep_bits(draw, blockIdx.x - sort_blocks);
  extern __shared__ uint4 sorted_s[];  // (n + 3) / 4 vectors, at least the counts: the launch's dynamic shared memory
  const int e = threadIdx.x % kMergeItems, g = threadIdx.x / kMergeItems, i = blockIdx.x * kMergeItems + e;
  const unsigned mine = i < n ? sort_key(ids, i, pos_bits) : 0u;
  const int vectors = (n + 3) / 4;  // the last one read past n within the 256-byte-aligned buffer
  for (int q0 = 0; q0 < vectors; q0 += kRankLoads * kThreads) {
    uint4 v[kRankLoads];
#pragma unroll
    for (int u = 0; u < kRankLoads; ++u) {
      const int q = q0 + u * kThreads + threadIdx.x;
      if (q < vectors) v[u] = reinterpret_cast<const uint4*>(sorted)[q];
    }
#pragma unroll
    for (int u = 0; u < kRankLoads; ++u) {
      const int q = q0 + u * kThreads + threadIdx.x;
      if (q < vectors) sorted_s[q] = v[u];
    }
  }
  __syncthreads();
  const unsigned* const keys = reinterpret_cast<const unsigned*>(sorted_s);
  const int slices = (n + kSlice - 1) / kSlice;
  unsigned count = 0;
  for (int s0 = g; s0 < slices; s0 += kMergeGroups * kMergeChains) {
    int len[kMergeChains], below[kMergeChains];  // slice u: its length, and how many keys below mine
#pragma unroll
    for (int u = 0; u < kMergeChains; ++u) {
      const int left = n - (s0 + u * kMergeGroups) * kSlice;
      len[u] = left < 0 ? 0 : (left < kSlice ? left : kSlice);
      below[u] = 0;
    }
#pragma unroll
    for (int step = kSlice; step > 0; step >>= 1)
#pragma unroll
      for (int u = 0; u < kMergeChains; ++u)
        if (below[u] + step <= len[u] && keys[(s0 + u * kMergeGroups) * kSlice + below[u] + step - 1] < mine)
          below[u] += step;
#pragma unroll
    for (int u = 0; u < kMergeChains; ++u) count += below[u];
  }
  __syncthreads();  // the keys are read: their space takes the warps' counts
  unsigned* const counts = reinterpret_cast<unsigned*>(sorted_s);
  counts[g * kMergeItems + e] = count;
  __syncthreads();
  if (g != 0 || i >= n) return;
  unsigned rank = 0;
#pragma unroll
  for (int h = 0; h < kMergeGroups; ++h) rank += counts[h * kMergeItems + e];
  keys_out[rank] = int(mine >> pos_bits);
  order_out[rank] = i;
}

int key_bits(int64_t rows) {
  int bits = 1;
  while (bits < 31 && (int64_t(1) << bits) < rows) ++bits;
  return bits;
}

// The backward's buffers inside the caller's workspace: keys and order in and out (n ints
// each), the chunks that start a crossing run (chunks ints), the chunks' head/tail slots (2 x
// chunks x dim floats), the flags (the count of those chunks, then the bitmap of the ids
// present: rows bits), each 256-byte aligned, then cub's temporary storage.
size_t aligned256(size_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t chunks_of(int64_t n) { return (n + kChunkRows - 1) / kChunkRows; }

int64_t bitmap_words(int64_t rows) { return (rows + 31) / 32; }

struct BackwardBuffers {
  int *keys_in, *order_in, *keys_out, *order_out;
  int* starts;
  float* pieces;
  unsigned* flags;
  uint8_t* keep_bits;
  void* temp;
  size_t temp_bytes;
  BackwardBuffers(void* base, int64_t n, int64_t rows, int dim, size_t temp_bytes_) : temp_bytes(temp_bytes_) {
    const size_t slot = aligned256(size_t(n) * sizeof(int));
    char* b = static_cast<char*>(base);
    keys_in = reinterpret_cast<int*>(b);
    order_in = reinterpret_cast<int*>(b + slot);
    keys_out = reinterpret_cast<int*>(b + 2 * slot);
    order_out = reinterpret_cast<int*>(b + 3 * slot);
    starts = reinterpret_cast<int*>(b + 4 * slot);
    pieces = reinterpret_cast<float*>(b + 4 * slot + starts_bytes(n));
    flags = reinterpret_cast<unsigned*>(b + 4 * slot + starts_bytes(n) + pieces_bytes(n, dim));
    keep_bits = reinterpret_cast<uint8_t*>(flags) + flags_bytes(rows);
    temp = b + bytes(n, rows, dim);
  }
  static size_t flags_bytes(int64_t rows) { return aligned256(size_t(1 + bitmap_words(rows)) * sizeof(unsigned)); }
  static size_t keep_bytes(int64_t n, int dim) { return size_t((n * dim + 7) / 8); }
  static size_t starts_bytes(int64_t n) { return aligned256(size_t(chunks_of(n)) * sizeof(int)); }
  static size_t pieces_bytes(int64_t n, int dim) { return aligned256(2 * size_t(chunks_of(n)) * dim * sizeof(float)); }
  static size_t bytes(int64_t n, int64_t rows, int dim) {
    return 4 * aligned256(size_t(n) * sizeof(int)) + starts_bytes(n) + pieces_bytes(n, dim) + flags_bytes(rows) +
           aligned256(keep_bytes(n, dim));
  }
};

// Whether the rank sort (slice_sort_kernel, merge_rank_kernel) sorts the n ids: at most
// kRankSortKeys, and their keys (id and position) within 31 bits (less()), the position's field
// holding n (above every real key: the padding's).
bool rank_sorts(int64_t n, int64_t rows) { return n <= kRankSortKeys && key_bits(rows) + key_bits(n + 1) <= 31; }

// cub's temporary storage for its device-wide sort; none for the rank sort
size_t sort_temp_bytes(int64_t n, int64_t rows) {
  size_t bytes = 0;
  if (!rank_sorts(n, rows))
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
  if (n == 0) {
    if (!dtable.accumulate) LS_DISPATCH(dt, { cudaMemsetAsync(dtable.ptr, 0, size_t(rows) * dim * sizeof(T), stream); })
    return;
  }
  BackwardBuffers bb(workspace, n, rows, dim, sort_temp_bytes(n, rows));
  // the flags the sort zeroes: the count of crossing runs, and the bitmap of present ids only when
  // the absent rows need zeros
  unsigned* const present = bb.flags + 1;
  const int64_t words = 1 + (dtable.accumulate ? 0 : bitmap_words(rows));
  // the keep-bits: those the forward stored, or drawn beside the first sort (from the forward's Philox
  // state, or a given mask's bytes)
  const bool draw = rng && p > 0.f && !rng->bits;
  const uint8_t* const keep_bits = !rng || p == 0.f ? nullptr : draw ? bb.keep_bits : rng->bits;
  // bytes [begin, end) of the keep-bits, drawn by blocks of `threads`
  auto keep_draw = [&](int64_t begin, int64_t end, int threads) {
    const int blocks =
        draw ? int(std::min<int64_t>(ceil_div(end - begin, threads), KeepDraw::kMaxBlocks)) : 0;
    return KeepDraw{draw ? *rng : RngState{}, p, draw ? bb.keep_bits : nullptr, begin, end, n * dim, blocks};
  };
  // A third of the bits are drawn beside the slice sort and the rest beside the merge, which was
  // faster than half and half, or all beside the first sort (docs/perf-log.md, "Kernel design measurements").
  const int64_t keep_bytes = BackwardBuffers::keep_bytes(n, dim), third = keep_bytes / 3;
  if (rank_sorts(n, rows)) {
    unsigned* const sorted = reinterpret_cast<unsigned*>(bb.keys_in);
    const KeepDraw first = keep_draw(0, third, kSlice),
                   second = keep_draw(third, keep_bytes, kMergeItems * kMergeGroups);
    slice_sort_kernel<<<ceil_div(n, kSlice) + first.blocks, kSlice, 0, stream>>>(ids, sorted, int(n), key_bits(n + 1),
                                                                               bb.flags, words, first);
    // Shared memory for the sorted keys' bytes, not kRankSortKeys' 48 KB, because the kernel's shared
    // memory limits how many blocks that draw beside the merge run at once (48 KB allows 4 blocks per
    // SM; 32 KB at 8,192 ids allows 5, where registers then limit it). It is at least the size of the
    // warps' counts (1 KB), which take the keys' space once the keys have been read.
    const size_t merge_smem = std::max(size_t(n + 3) / 4 * sizeof(uint4), kMergeItems * kMergeGroups * sizeof(unsigned));
    merge_rank_kernel<<<ceil_div(n, kMergeItems) + second.blocks, kMergeItems * kMergeGroups, merge_smem, stream>>>(
        ids, sorted, bb.keys_out, bb.order_out, int(n), key_bits(n + 1), second);
  } else {
    const KeepDraw all = keep_draw(0, keep_bytes, 256);
    sort_input_kernel<<<ceil_div(n, 256) + all.blocks, 256, 0, stream>>>(ids, bb.keys_in, bb.order_in, n, bb.flags,
                                                                        words, all);
    cub::DeviceRadixSort::SortPairs(bb.temp, bb.temp_bytes, bb.keys_in, bb.keys_out, bb.order_in, bb.order_out, n,
                                    0, key_bits(rows), stream);
  }
  LS_DISPATCH(dt, {
    auto launch = [&]<int V>() {
      const int slices = ceil_div(dim, 32 * V), chunks = int(chunks_of(n));
      const auto chunk_kernel = dtable.accumulate ? embedding_backward_chunk_kernel<T, V, true>
                                                  : embedding_backward_chunk_kernel<T, V, false>;
      chunk_kernel<<<dim3(ceil_div(chunks, kChunkWarps), slices), 32 * kChunkWarps, 0, stream>>>(
          (const T*)dout, keep_bits, bb.keys_out, bb.order_out, (T*)dtable.ptr, bb.pieces, present, bb.starts, n, dim,
          scale, padding_idx, p);
      const int join_blocks = chunks < kJoinBlocks ? chunks : kJoinBlocks;
      const int zero_blocks = dtable.accumulate ? 0 : ceil_div(rows * 32, kFinishThreads);
      embedding_backward_finish_kernel<T, V><<<join_blocks + zero_blocks, kFinishThreads, 0, stream>>>(
          bb.keys_out, bb.pieces, present, bb.starts, (T*)dtable.ptr, dtable.accumulate, join_blocks, n, rows, dim,
          scale, padding_idx);
    };
    if (dim % kVec<T> == 0 && aligned16(dout) && aligned16(dtable.ptr))
      launch.template operator()<kVec<T>>();
    else
      launch.template operator()<1>();
  })
}

}  // namespace ls
