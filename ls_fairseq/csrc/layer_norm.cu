// layer_norm: y = (x - mean) * rstd * gamma + beta over the last dimension.
// LightSeq2 technique: its one-pass reduction for the statistics. Each thread accumulates
// sum(x - s) and sum((x - s)^2), where s, the row's first element, is a shift that guards
// E[d^2] - E[d]^2 against cancellation when |mean| >> std, and both sums go through one
// reduction. Rows of up to 32 x 16 vectors take one warp each and are held in registers
// (read once, written once, warp shuffles only); other rows take a block and loop.
// Never written to memory: any statistic but mean and rstd (fp32, one per row), which with
// x and gamma are all the backward needs; xhat.
// Backward:
//   xhat = (x - mean) * rstd, g = dy * gamma
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))  (the two means in one reduction)
//   dgamma = sum over rows of dy * xhat, dbeta = sum over rows of dy
//   (a two-stage, deterministic column reduction: chunks of rows, then the chunks).
// bias_dropout_residual_layer_norm (post-LN's block end) fuses bias add, dropout and
// residual add (LightSeq2's bias+dropout+residual fusion) with the LayerNorm after them:
// the same forward, with the kernel making the row's values itself, x = residual +
// dropout(h + bias). x is written once (the backward needs it) and never read back; x + bias
// and the dropped values are never written. Its backward is LayerNorm's followed by
// bias_dropout_residual's, in one kernel when LayerNorm's backward takes the strip kernel.
// For rows of 1 to 4 x 32 vectors of 16 bytes (hidden 256 .. 1024 in fp16/bf16) that strip
// kernel computes dx and the chunks' column sums from one read of dy and x: a warp (or a pair
// of warps, each with half of the row) per row, with the next rows' loads in flight during
// this row's reduction. Other rows take a dx kernel and a column-sum kernel, which read dy
// and x once each.
#include "common.cuh"
#include "dropout_map.cuh"
#include "reduce.cuh"

namespace ls {

// Reduction of two values over the lanes of a warp, or over the block.
template <bool WARP>
__device__ __forceinline__ void row_sum2(float& a, float& b) {
  if (WARP) {
    a = warp_sum(a);
    b = warp_sum(b);
  } else {
    block_sum2(a, b);
  }
}

// The values a LayerNorm normalises. XRows: x itself. BdrRows: x = residual +
// dropout(h + bias), the post-LN block's end (bias_dropout_residual_layer_norm), computed
// in the order bias_dropout_residual's kernel uses and rounded to T as it stores them, so
// both paths give the same bits; x is written for backward, and the keep-bits where the
// RngState asks; x + bias and the dropped values never.
template <typename T>
struct XRows {
  const T* x;
  template <int V>
  __device__ void load(int64_t e, int, float (&v)[V]) const {
    ls::load<T, V>(x + e, v);
  }
  __device__ float at(int64_t e) const { return to_f(x[e]); }
  __device__ const T* stored() const { return x; }
};

template <typename T>
struct BdrRows {
  const T* h;
  const T* bias;
  const T* residual;
  T* x;
  float p;
  RngState rng;
  template <int V>
  __device__ void values(int64_t e, int c, float (&v)[V], bool (&keep)[V]) const {
    float rv[V];
    const Pack<T, V> hp = load_pack<T, V>(h + e), bp = load_pack<T, V>(bias + c);  // in flight during the draw
    const Pack<T, V> rp = load_pack<T, V>(residual + e);
    if (p > 0.f) {
      keep_run<V>(rng, e, p, keep);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) keep[i] = true;
    }
    add_unpacked(hp, bp, v);
    unpack(rp, rv);
    const float scale = dropout_scale(p);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = to_f(from_f<T>((keep[i] ? v[i] * scale : 0.f) + rv[i]));
  }
  template <int V>
  __device__ void load(int64_t e, int c, float (&v)[V]) const {
    bool keep[V];
    values<V>(e, c, v, keep);
    if (p > 0.f) record_keeps<V>(rng, e, p, keep);
    store<T, V>(x + e, v);
  }
  // the value at a row's start (the statistics' shift), before any thread has stored it
  __device__ float at(int64_t e) const {
    float v[1];
    bool keep[1];
    values<1>(e, 0, v, keep);
    return v[0];
  }
  __device__ const T* stored() const { return x; }
};

// A row is handled by a warp (WARP: ITEMS vectors per lane, in registers) or by a
// block (ITEMS = 1, looping over the row twice).
template <typename T, int V, int ITEMS, bool WARP, typename Rows>
__global__ void ln_forward_kernel(Rows in, const T* __restrict__ gamma, const T* __restrict__ beta,
                                  T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                  int64_t rows, int hidden, float eps) {
  const int lane = WARP ? threadIdx.x & 31 : threadIdx.x, width = WARP ? 32 : blockDim.x;
  const int64_t row = WARP ? int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
  if (row >= rows) return;
  const int64_t r0 = row * hidden;
  const float shift = in.at(r0);
  float v[ITEMS][V], s1 = 0.f, s2 = 0.f;
  for (int c0 = 0; c0 < hidden; c0 += width * V * ITEMS) {
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int c = c0 + (it * width + lane) * V;
      if (c < hidden) {
        in.template load<V>(r0 + c, c, v[it]);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float d = v[it][i] - shift;
          s1 += d;
          s2 += d * d;
        }
      }
    }
  }
  row_sum2<WARP>(s1, s2);
  const float m1 = s1 / hidden;
  const float mean = m1 + shift, rstd = rsqrtf(fmaxf(s2 / hidden - m1 * m1, 0.f) + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  for (int c0 = 0; c0 < hidden; c0 += width * V * ITEMS) {
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int c = c0 + (it * width + lane) * V;
      if (c < hidden) {
        float g[V], b[V];
        if (!WARP) load<T, V>(in.stored() + r0 + c, v[it]);  // this thread's own stores of the first loop
        load<T, V>(gamma + c, g);
        load<T, V>(beta + c, b);
#pragma unroll
        for (int i = 0; i < V; ++i) v[it][i] = (v[it][i] - mean) * rstd * g[i] + b[i];
        store<T, V>(y + row * hidden + c, v[it]);
      }
    }
  }
}

// g = dy * gamma and xhat = (x - mean) * rstd for V columns from c.
template <typename T, int V>
__device__ __forceinline__ void load_g_xhat(const T* dy, const T* x, const T* gamma, int c, float mu, float rs,
                                            float (&g)[V], float (&xh)[V]) {
  float gm[V];
  load<T, V>(dy + c, g);
  load<T, V>(x + c, xh);
  load<T, V>(gamma + c, gm);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    g[i] *= gm[i];
    xh[i] = (xh[i] - mu) * rs;
  }
}

template <typename T, int V, int ITEMS, bool WARP>
__global__ void ln_backward_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ gamma,
                                      const float* __restrict__ mean, const float* __restrict__ rstd,
                                      T* __restrict__ dx, int64_t rows, int hidden) {
  const int lane = WARP ? threadIdx.x & 31 : threadIdx.x, width = WARP ? 32 : blockDim.x;
  const int64_t row = WARP ? int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
  if (row >= rows) return;
  const T *dyr = dy + row * hidden, *xr = x + row * hidden;
  const float mu = mean[row], rs = rstd[row];
  float g[ITEMS][V], xh[ITEMS][V], sg = 0.f, sgx = 0.f;
  for (int c0 = 0; c0 < hidden; c0 += width * V * ITEMS) {
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int c = c0 + (it * width + lane) * V;
      if (c < hidden) {
        load_g_xhat<T, V>(dyr, xr, gamma, c, mu, rs, g[it], xh[it]);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          sg += g[it][i];
          sgx += g[it][i] * xh[it][i];
        }
      }
    }
  }
  row_sum2<WARP>(sg, sgx);
  const float mg = sg / hidden, mgx = sgx / hidden;
  for (int c0 = 0; c0 < hidden; c0 += width * V * ITEMS) {
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int c = c0 + (it * width + lane) * V;
      if (c < hidden) {
        if (!WARP) load_g_xhat<T, V>(dyr, xr, gamma, c, mu, rs, g[it], xh[it]);
#pragma unroll
        for (int i = 0; i < V; ++i) g[it][i] = rs * (g[it][i] - mg - xh[it][i] * mgx);
        store<T, V>(dx + row * hidden + c, g[it]);
      }
    }
  }
}

// dgamma and dbeta: the sums of dy * xhat and of dy over rows.
template <typename T>
struct LnParamMap {
  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  int hidden;
  template <int N>
  __device__ void operator()(int64_t r, int c, float (&v)[2][N]) const {
    float xv[N];
    load<T, N>(dy + r * hidden + c, v[1]);
    load<T, N>(x + r * hidden + c, xv);
    const float mu = mean[r], rs = rstd[r];
#pragma unroll
    for (int i = 0; i < N; ++i) v[0][i] = v[1][i] * (xv[i] - mu) * rs;
  }
};

// One pass over a strip of rows. Row group g of the block takes rows g, g + kStripRows, ... of the
// strip. Each thread copies its dy and x vectors of the group's next kStages - 1 rows into its own
// slots of a shared-memory ring (cp.async), so that kStages - 1 rows' loads per group are in flight
// while it computes one row, at no register cost. A row's mean and rstd come from one load of 32
// rows' statistics, one per lane, passed along by shuffles. dx is stored at once, dy * xhat and dy
// are added to the lane's column sums, and the block folds its warps' sums in a fixed order into
// the strip's partial sums (column_sum_finish_kernel adds the strips up).
// A row group is one warp holding whole rows (ITEMS x 32 vectors per lane) or, with SPLIT = 2
// (ITEMS even), a pair of warps each holding half of the row: half the registers per thread, so
// more warps fit on an SM. The halves' row sums meet in shared memory behind a barrier of the
// pair's 64 threads only. The slots are double-buffered by the row's parity, so one barrier per row
// suffices: a half cannot overwrite a slot its partner still reads, since it has passed the barrier
// of the row in between. Both halves add the sums in the same order.
// Holding the next row's dy and x in registers instead of the ring kept one row in flight per group
// and left the kernel far below copy bandwidth (docs/perf-log.md, "Kernel design measurements").
// With a BdrTail (post-LN's block end, bias_dropout_residual_layer_norm) the kernel also does
// bias_dropout_residual's backward on each row's dx while it holds it: dh = dx * keep / (1 - p)
// (from dx rounded to T, as the two ops one after the other compute it) is stored, and its column
// sums (the bias's gradient) join gamma's and beta's. That is one kernel and one read of dx fewer
// than LayerNorm's backward followed by bias_dropout_residual's. The keep-bits the forward stored
// are loaded a row ahead, one byte per vector.
constexpr int kStripRows = 4;
constexpr int kStages = 4;  // ring slots per thread: kStages - 1 rows' loads in flight per row group

template <typename T>
struct BdrTail {
  Redraw keeps;  // the forward's keep-bits
  T* dh;
  float p;
};

// Barrier 1 + group (0 is __syncthreads'), its id an immediate so that the kernel holds 1 +
// kStripRows barriers, not all 16 an id in a register would reserve.
template <int SPLIT>
__device__ __forceinline__ void row_group_barrier(int group) {
  static_assert(kStripRows == 4, "one barrier a row group");
  switch (group) {
    case 0: asm volatile("bar.sync 1, %0;" ::"n"(32 * SPLIT) : "memory"); break;
    case 1: asm volatile("bar.sync 2, %0;" ::"n"(32 * SPLIT) : "memory"); break;
    case 2: asm volatile("bar.sync 3, %0;" ::"n"(32 * SPLIT) : "memory"); break;
    default: asm volatile("bar.sync 4, %0;" ::"n"(32 * SPLIT) : "memory"); break;
  }
}

// The strip kernel's dynamic shared memory: the ring, [kStages][warp][dy, x][item][lane] 16-byte
// vectors, which the fold of the column sums reuses at the end (it needs at most one stage's bytes).
template <int W, int SPLIT>
constexpr int strip_ring_bytes() {
  return kStages * kStripRows * SPLIT * 2 * W * 32 * 16;
}

template <typename T, int ITEMS, int SPLIT, bool BDR>
__global__ void __launch_bounds__(32 * kStripRows * SPLIT, SPLIT == 1 ? 1 : 2)
    ln_backward_strip_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ gamma,
                             const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
                             BdrTail<T> tail, float* __restrict__ partial, int64_t rows, int hidden, int strip) {
  static_assert(ITEMS % SPLIT == 0, "a row splits into whole lane vectors");
  constexpr int V = kVec<T>, W = ITEMS / SPLIT, C = W * 32 * V;  // a warp's vectors per lane, its columns
  constexpr int kWarps = kStripRows * SPLIT, K = BDR ? 3 : 2;     // K sums: dgamma, dbeta (, dbias)
  static_assert(kWarps * C * sizeof(float) <= strip_ring_bytes<W, SPLIT>(), "the fold fits in the ring");
  extern __shared__ uint4 ring[];
  __shared__ float halves[kStripRows][2][SPLIT][2];  // [group][row parity][half][sum g, sum g xhat]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp / SPLIT, half = warp % SPLIT;
  const int64_t r0 = int64_t(blockIdx.x) * strip, r1 = r0 + strip < rows ? r0 + strip : rows;
  const T* const g0 = gamma + half * C;
  const float inv_hidden = 1.f / hidden;
  float acc[W][K][V] = {};
  auto slot = [&](int stage, int tensor, int it) -> uint4* {
    return ring + ((((stage * kWarps) + warp) * 2 + tensor) * W + it) * 32 + lane;
  };
  // row's vectors into ring stage `stage`; a group past the strip's end is empty, committed all the
  // same, so that the count of groups in flight says which row has arrived
  auto issue = [&](int64_t row, int stage) {
    if (row < r1) {
#pragma unroll
      for (int it = 0; it < W; ++it) {
        const int64_t c = row * hidden + half * C + (it * 32 + lane) * V;
        cp_async16(slot(stage, 0, it), dy + c);
        cp_async16(slot(stage, 1, it), x + c);
      }
    }
    cp_async_commit();
  };
  int64_t r = r0 + group;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(r + int64_t(s) * kStripRows, s);
  float lane_mu = 0.f, lane_rs = 0.f;  // the statistics of row r + kStripRows * lane (of 32 from j & ~31)
  // with BDR, the bytes of stored keep-bits of this thread's vectors, loaded a row ahead
  unsigned next_bits[W] = {};
  auto fetch_bits = [&](int64_t row) {
#pragma unroll
    for (int it = 0; it < W; ++it)
      if (row < r1) next_bits[it] = tail.keeps.template stored<V>(row * hidden + half * C + (it * 32 + lane) * V);
  };
  if constexpr (BDR) fetch_bits(r);
  for (int j = 0, parity = 0; r < r1; ++j, r += kStripRows, parity ^= 1) {
    if ((j & 31) == 0) {
      const int64_t row = r + int64_t(kStripRows) * lane;
      lane_mu = row < r1 ? mean[row] : 0.f;
      lane_rs = row < r1 ? rstd[row] : 0.f;
    }
    issue(r + int64_t(kStages - 1) * kStripRows, (j + kStages - 1) % kStages);  // the stage row j - 1 used
    const float mu = __shfl_sync(0xffffffffu, lane_mu, j & 31), rs = __shfl_sync(0xffffffffu, lane_rs, j & 31);
    unsigned bits[W];
#pragma unroll
    for (int it = 0; it < W; ++it) bits[it] = next_bits[it];
    if constexpr (BDR) fetch_bits(r + kStripRows);
    cp_async_wait<kStages - 1>();  // row j's copies have arrived
    // g = dy * gamma and xhat held for dx; dy's column sums taken here, so neither dy nor gamma is
    // needed (nor gamma loaded and converted again) after the row's reduction
    float g[W][V], xh[W][V], sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int it = 0; it < W; ++it) {
      Pack<T, V> cur_dy, cur_x;
      memcpy(&cur_dy, slot(j % kStages, 0, it), sizeof(uint4));
      memcpy(&cur_x, slot(j % kStages, 1, it), sizeof(uint4));
      float gm[V];
      load<T, V>(g0 + (it * 32 + lane) * V, gm);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = to_f(cur_dy.v[i]);
        xh[it][i] = (to_f(cur_x.v[i]) - mu) * rs;
        g[it][i] = d * gm[i];
        sg += g[it][i];
        sgx += g[it][i] * xh[it][i];
        acc[it][0][i] += d * xh[it][i];
        acc[it][1][i] += d;
      }
    }
    sg = warp_sum(sg);
    sgx = warp_sum(sgx);
    if constexpr (SPLIT > 1) {
      if (lane == 0) {
        halves[group][parity][half][0] = sg;
        halves[group][parity][half][1] = sgx;
      }
      row_group_barrier<SPLIT>(group);
      sg = sgx = 0.f;
#pragma unroll
      for (int h = 0; h < SPLIT; ++h) {
        sg += halves[group][parity][h][0];
        sgx += halves[group][parity][h][1];
      }
    }
    const float mg = sg * inv_hidden, mgx = sgx * inv_hidden;
#pragma unroll
    for (int it = 0; it < W; ++it) {
      const int c = (it * 32 + lane) * V;
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = rs * (g[it][i] - mg - xh[it][i] * mgx);
      const int64_t e = r * hidden + half * C + c;
      store<T, V>(dx + e, o);
      if constexpr (BDR) {
        bool keep[V];
        tail.keeps.template from<V>(bits[it], e, tail.p, keep);
        const float scale = tail.p > 0.f ? 1.f / (1.f - tail.p) : 1.f;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          o[i] = keep[i] ? to_f(from_f<T>(o[i])) * scale : 0.f;
          acc[it][2][i] += o[i];
        }
        store<T, V>(tail.dh + e, o);
      }
    }
  }
  // the block's sums into the strip's partial sums, one sum at a time through shared memory (the
  // ring, its copies all arrived: the groups left are empty) in a lane-fastest layout
  // (conflict-free stores and loads), the row groups added in a fixed order
  float(*fold)[C] = reinterpret_cast<float(*)[C]>(ring);
  cp_async_wait_all();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    __syncthreads();  // the ring's last reads, or the previous sum's, are done
#pragma unroll
    for (int it = 0; it < W; ++it)
#pragma unroll
      for (int i = 0; i < V; ++i) fold[warp][(it * V + i) * 32 + lane] = acc[it][k][i];
    __syncthreads();
    for (int j = threadIdx.x; j < SPLIT * C; j += 32 * kWarps) {
      const int h = j / C, e = j % C;  // e: (item, element, lane) in half h
      float s = 0.f;
#pragma unroll
      for (int g = 0; g < kStripRows; ++g) s += fold[g * SPLIT + h][e];
      const int it = e / (32 * V), i = (e / 32) % V, l = e % 32;
      partial[(int64_t(k) * gridDim.x + blockIdx.x) * hidden + h * C + (it * 32 + l) * V + i] = s;
    }
  }
}

constexpr int kRowsPerBlock = 4;

// Launches `kernel<T, V, ITEMS, WARP>` for the row length: a warp per row with the
// row in registers when it fits 32 x 16 vectors, else a block per row.
template <typename T, int V, typename Launch>
void by_row_length(int hidden, int64_t rows, Launch&& launch) {
  const int vectors = hidden / V;
  const int warp_grid = ceil_div(rows, kRowsPerBlock), warp_block = 32 * kRowsPerBlock;
  if (vectors <= 32) launch.template operator()<V, 1, true>(warp_grid, warp_block);
  else if (vectors <= 64) launch.template operator()<V, 2, true>(warp_grid, warp_block);
  else if (vectors <= 128) launch.template operator()<V, 4, true>(warp_grid, warp_block);
  else if (vectors <= 256) launch.template operator()<V, 8, true>(warp_grid, warp_block);
  else if (vectors <= 512) launch.template operator()<V, 16, true>(warp_grid, warp_block);
  else launch.template operator()<V, 1, false>(int(rows), 1024);
}

// At most this many rows (a decoding step's) take a block of one vector a thread per row in the
// forward, not a warp: a warp per row left ~4 warps an SM, each issuing the whole row's instructions
// one dependent latency at a time (~6 us for 512 rows of 1,024, 6% occupancy under ncu).
constexpr int64_t kFewRows = 1024;

// The forward's launch: by_row_length's, but for few rows of more than 32 vectors a block per row.
template <typename T, int V, typename Launch>
void by_row_count(int hidden, int64_t rows, Launch&& launch) {
  const int vectors = hidden / V;
  if (rows <= kFewRows && vectors > 32 && vectors <= 1024)
    launch.template operator()<V, 1, false>(int(rows), ceil_div(vectors, 32) * 32);
  else
    by_row_length<T, V>(hidden, rows, launch);
}

// vec: the rows' pointers allow 16-byte accesses (gamma, beta and y are checked here)
template <typename T, typename Rows>
void ln_forward_rows(Rows in, bool vec, const T* gamma, const T* beta, T* y, float* mean, float* rstd, int64_t rows,
                     int hidden, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  auto launch = [&]<int V, int ITEMS, bool WARP>(int grid, int block) {
    ln_forward_kernel<T, V, ITEMS, WARP><<<grid, block, 0, stream>>>(in, gamma, beta, y, mean, rstd, rows, hidden, eps);
  };
  if (vec && hidden % kVec<T> == 0 && aligned16(gamma) && aligned16(beta) && aligned16(y))
    by_row_count<T, kVec<T>>(hidden, rows, launch);
  else
    by_row_count<T, 1>(hidden, rows, launch);
}

void layer_norm_forward(DType dt, const void* x, const void* gamma, const void* beta, void* y, float* mean, float* rstd,
                        int64_t rows, int hidden, float eps, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    ln_forward_rows<T>(XRows<T>{(const T*)x}, aligned16(x), (const T*)gamma, (const T*)beta, (T*)y, mean, rstd, rows,
                       hidden, eps, stream);
  })
}

void bias_dropout_residual_layer_norm_forward(DType dt, const void* h, const void* bias, const void* residual,
                                              const void* gamma, const void* beta, void* x, void* y, float* mean,
                                              float* rstd, int64_t rows, int hidden, float eps, float p, RngState rng,
                                              cudaStream_t stream) {
  LS_DISPATCH(dt, {
    const BdrRows<T> in{(const T*)h, (const T*)bias, (const T*)residual, (T*)x, p, rng};
    const bool vec = aligned16(h) && aligned16(bias) && aligned16(residual) && aligned16(x);
    ln_forward_rows<T>(in, vec, (const T*)gamma, (const T*)beta, (T*)y, mean, rstd, rows, hidden, eps, stream);
  })
}

// Whether rows of `hidden` take the strip kernel: 1 to 4 x 32 vectors of 16 bytes (hidden 256 ..
// 1,024 in fp16/bf16), with 16-byte accesses (vec).
template <typename T>
bool strips_fit(int hidden, int64_t rows, bool vec) {
  const int row = 32 * kVec<T>;  // one 16-byte vector a lane
  return vec && rows > 0 && hidden % row == 0 && hidden >= row && hidden <= 4 * row;
}

// dx (with BDR also dh) and the strips' K column sums in one kernel (ITEMS = hidden / (32 x V),
// 1 to 4), then the strips added up.
template <typename T, bool BDR, int K = BDR ? 3 : 2>
void ln_backward_strips(const T* dy, const T* x, const T* gamma, const float* mean, const float* rstd, T* dx,
                        BdrTail<T> tail, const GradOuts<K>& out, float* partial, int64_t rows, int hidden,
                        cudaStream_t stream) {
  // strips of rows, at most column_chunks(rows) of them: the partial's size
  const int chunks = column_chunks(rows);
  const int strip = int((rows + chunks - 1) / chunks), blocks = int((rows + strip - 1) / strip);
  auto launch = [&]<int ITEMS, int SPLIT>() {
    constexpr int bytes = strip_ring_bytes<ITEMS / SPLIT, SPLIT>();
    const auto kernel = ln_backward_strip_kernel<T, ITEMS, SPLIT, BDR>;
    // above the 48 KB a block may take without asking (64 KB at hidden 1,024 in fp16)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    kernel<<<blocks, 32 * kStripRows * SPLIT, bytes, stream>>>(dy, x, gamma, mean, rstd, dx, tail, partial, rows,
                                                                hidden, strip);
  };
  switch (hidden / (32 * kVec<T>)) {  // a row in two halves when it splits into whole lane vectors
    case 1: launch.template operator()<1, 1>(); break;
    case 2: launch.template operator()<2, 2>(); break;
    case 3: launch.template operator()<3, 1>(); break;
    default: launch.template operator()<4, 2>(); break;
  }
  column_sum_finish<T, K>(partial, blocks, hidden, out, stream);
}

void layer_norm_backward(DType dt, const void* dy, const void* x, const void* gamma, const float* mean,
                         const float* rstd, void* dx, GradOut dgamma, GradOut dbeta, float* partial, int64_t rows,
                         int hidden, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    const bool vec = hidden % kVec<T> == 0 && aligned16(dy) && aligned16(x) && aligned16(gamma) && aligned16(dx);
    if (strips_fit<T>(hidden, rows, vec)) {
      ln_backward_strips<T, false>((const T*)dy, (const T*)x, (const T*)gamma, mean, rstd, (T*)dx, BdrTail<T>{},
                                   GradOuts<2>{{dgamma, dbeta}}, partial, rows, hidden, stream);
    } else {
      if (rows > 0) {
        auto launch = [&]<int V, int ITEMS, bool WARP>(int grid, int block) {
          ln_backward_dx_kernel<T, V, ITEMS, WARP><<<grid, block, 0, stream>>>(
              (const T*)dy, (const T*)x, (const T*)gamma, mean, rstd, (T*)dx, rows, hidden);
        };
        if (vec)
          by_row_length<T, kVec<T>>(hidden, rows, launch);
        else
          by_row_length<T, 1>(hidden, rows, launch);
      }
      map_column_sum<T, 2>(LnParamMap<T>{(const T*)dy, (const T*)x, mean, rstd, hidden}, vec,
                           GradOuts<2>{{dgamma, dbeta}}, partial, rows, hidden, stream);
    }
  })
}

void bias_dropout_residual_layer_norm_backward(DType dt, const void* dy, const void* x, const void* gamma,
                                               const float* mean, const float* rstd, const RngState* rng, float p,
                                               void* dx, void* dh, GradOut dgamma, GradOut dbeta, GradOut dbias,
                                               float* partial, int64_t rows, int hidden, cudaStream_t stream) {
  bool fused = false;
  LS_DISPATCH(dt, {
    const bool vec = hidden % kVec<T> == 0 && aligned16(dy) && aligned16(x) && aligned16(gamma) && aligned16(dx) &&
                     aligned16(dh);
    if (strips_fit<T>(hidden, rows, vec)) {
      const BdrTail<T> tail{redraw(rng, p), (T*)dh, p};
      ln_backward_strips<T, true>((const T*)dy, (const T*)x, (const T*)gamma, mean, rstd, (T*)dx, tail,
                                  GradOuts<3>{{dgamma, dbeta, dbias}}, partial, rows, hidden, stream);
      fused = true;
    }
  })
  if (fused) return;
  layer_norm_backward(dt, dy, x, gamma, mean, rstd, dx, dgamma, dbeta, partial, rows, hidden, stream);
  bias_dropout_residual_backward(dt, dx, rng, dh, dbias, partial + int64_t(2) * column_chunks(rows) * hidden, rows,
                                 hidden, p, stream);
}

}  // namespace ls
