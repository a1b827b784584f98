// attention: softmax(q k^T + masks) v with dropout on the probabilities, for short
// rows (query and key lengths up to kAttnMaxLen, d_head kAttnHeadDim), fp16/bf16.
// Fuses: the q k^T GEMM, the masked softmax, dropout, the GEMM with v (forward); the
// same GEMMs again, the softmax and dropout backward, and the three gradient GEMMs
// (backward). One block per (batch, head) holds its q, k, v rows in shared memory
// and multiplies them on the tensor cores (WMMA, fp32 accumulation).
// Never written to memory: the [Tq, Tk] scores, probabilities and their gradients
// (forward and backward recompute them from q, k and each row's log-sum-exp, the
// one value kept per query row), the keep-mask (drawn from Philox for each block's
// range of the [B, heads, Tq, Tk] element index, and drawn again in backward).
// LightSeq2 technique: its fused masked softmax + dropout with the attention GEMMs
// around it, taken one step further (FlashAttention's recompute instead of stored
// probabilities). For the short rows of translation batches the library
// FlashAttention and memory-efficient kernels tile 128 keys at a time and
// accumulate dq across blocks with atomics; here a block owns whole rows, so the
// backward is deterministic and the softmax's row term
//   D_i = sum_j P_ij dP'_ij  (dP' the gradient of the undropped probabilities)
// comes from the fp32 probabilities and dP, not from rowsum(dO * O) in fp16.
// Gradients, with s = q k^T (q pre-scaled), P = softmax(s), keep/(1-p) the dropout,
// Pd = P * keep / (1 - p), O = Pd v:
//   dV = Pd^T dO;  dP' = (dO v^T) * keep / (1 - p);  dS = P * (dP' - D);
//   dQ = dS k;     dK = dS^T q.
#include <mma.h>

#include "common.cuh"

namespace ls {

namespace {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 128, kWarps = kThreads / 32, kTile = 16;
static_assert(kAttnMaxLen <= 64, "a softmax row is two elements a lane");
constexpr int kLdh = kAttnHeadDim + 8;  // smem pitch of a head row (elements): 16-byte rows, banks staggered
constexpr int kLdt = kTile + 8;  // fp32 pitch of a warp's staging tile: its fragment stores conflict-free
constexpr size_t kStagingBytes = size_t(kWarps) * kTile * kLdt * sizeof(float);

__host__ __device__ inline int round16(int n) { return (n + kTile - 1) / kTile * kTile; }

// Shared-memory carve-up of one block; every region starts at a 32-byte multiple (WMMA's alignment).
struct Layout {
  // lengths rounded to 16; fp32 and T pitches of [lq, lk] matrices (fp32 rows 8 words apart modulo the 32
  // banks: the fragment stores are conflict-free)
  int lq, lk, lds, ldp;
  __host__ __device__ Layout(int tq, int tk) : lq(round16(tq)), lk(round16(tk)), lds(lk + 8), ldp(lk + 8) {}
  template <typename T>
  __host__ __device__ size_t heads(int rows) const { return size_t(rows) * kLdh * sizeof(T); }
  template <typename T>
  __host__ __device__ size_t probs() const { return size_t(lq) * ldp * sizeof(T); }
  __host__ __device__ size_t scores() const { return size_t(lq) * lds * sizeof(float); }
  __host__ __device__ size_t bits(int tq, int tk) const { return (size_t(tq) * tk / 8 + 2 + 8 + 31) / 32 * 32; }
  // the rows' log-sum-exps (backward) and the batch row's key padding, read once per block
  __host__ __device__ size_t row_info(int tk) const { return (size_t(lq) * sizeof(float) + tk + 31) / 32 * 32; }
};

// The scores' region also holds the warps' staging tiles once the scores are dead.
template <typename T>
size_t forward_smem(int tq, int tk) {
  const Layout l(tq, tk);
  const size_t s = l.scores() > kStagingBytes ? l.scores() : kStagingBytes;
  return l.heads<T>(l.lq) + 2 * l.heads<T>(l.lk) + s + l.probs<T>() + l.bits(tq, tk) + l.row_info(tk);
}

template <typename T>
size_t backward_smem(int tq, int tk) {
  const Layout l(tq, tk);
  const size_t s = 2 * l.scores() > kStagingBytes ? 2 * l.scores() : kStagingBytes;
  return 2 * l.heads<T>(l.lq) + 2 * l.heads<T>(l.lk) + s + 2 * l.probs<T>() + l.bits(tq, tk) + l.row_info(tk);
}

// A [rows, d_head] slice of one (batch, head) into smem rows of pitch kLdh, zero rows up to `padded`.
template <typename T>
__device__ void load_rows(T* dst, const T* src, int64_t stride, int rows, int padded) {
  constexpr int kRowVecs = kAttnHeadDim / kVec<T>;
  for (int idx = threadIdx.x; idx < padded * kRowVecs; idx += kThreads) {
    const int r = idx / kRowVecs, c = idx % kRowVecs * kVec<T>;
    if (r < rows)
      cp_async16(dst + r * kLdh + c, src + r * stride + c);
    else
      *reinterpret_cast<uint4*>(dst + r * kLdh + c) = make_uint4(0, 0, 0, 0);
  }
}

using Acc = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;

// C = A B over [m, n] in tiles of 16 (k in tiles of 16 too), one warp per tile, each tile handed to
// `put(acc, m0, n0)`. A's tile (m0, kk) sits at a + m0 * a_m + kk * a_k, B's (kk, n0) at
// b + kk * b_k + n0 * b_n (element strides of the layouts LA and LB, pitch lda and ldb).
template <typename T, typename LA, typename LB, typename Put>
__device__ void gemm(const T* a, int lda, int a_m, int a_k, const T* b, int ldb, int b_k, int b_n, int m, int n,
                     int k, const Put& put) {
  const int warp = threadIdx.x >> 5, tiles_n = n / kTile;
  for (int t = warp; t < (m / kTile) * tiles_n; t += kWarps) {
    const int m0 = t / tiles_n * kTile, n0 = t % tiles_n * kTile;
    Acc acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kk = 0; kk < k; kk += kTile) {
      wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, LA> fa;
      wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, LB> fb;
      wmma::load_matrix_sync(fa, a + m0 * a_m + kk * a_k, lda);
      wmma::load_matrix_sync(fb, b + kk * b_k + n0 * b_n, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    put(acc, m0, n0);
  }
}

// Tiles into an fp32 smem matrix of pitch ldc.
struct ToSmem {
  float* c;
  int ldc;
  __device__ void operator()(const Acc& acc, int m0, int n0) const {
    wmma::store_matrix_sync(c + m0 * ldc + n0, acc, ldc, wmma::mem_row_major);
  }
};

// Tiles straight to rows 0 .. rows - 1 of a [rows, d_head] slice of T in global memory (row pitch
// `stride`) through the warp's own staging tile: no barrier of the block between a gradient GEMM
// and its stores, nor between one gradient GEMM and the next.
template <typename T>
struct ToGlobal {
  T* dst;
  int64_t stride;
  int rows;
  float* staging;  // kWarps tiles of kTile x kLdt
  __device__ void operator()(const Acc& acc, int m0, int n0) const {
    float* const tile = staging + (threadIdx.x >> 5) * kTile * kLdt;
    wmma::store_matrix_sync(tile, acc, kLdt, wmma::mem_row_major);
    __syncwarp();
    const int lane = threadIdx.x & 31, r = lane >> 1, c = (lane & 1) * 8;
    if (m0 + r < rows) {
      const float4 a = *reinterpret_cast<const float4*>(tile + r * kLdt + c);
      const float4 b = *reinterpret_cast<const float4*>(tile + r * kLdt + c + 4);
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      store<T, 8>(dst + (m0 + r) * stride + n0 + c, v);
    }
    __syncwarp();  // the tile is read before the warp's next one overwrites it
  }
};

// X Y^T for X [m, d_head] and Y [n, d_head] in smem rows (pitch kLdh): q k^T, dO v^T.
template <typename T, typename Put>
__device__ void gemm_nt(const T* x, const T* y, int m, int n, const Put& put) {
  gemm<T, wmma::row_major, wmma::col_major>(x, kLdh, kLdh, 1, y, kLdh, 1, kLdh, m, n, kAttnHeadDim, put);
}

// P Y for P [m, k] (pitch ldp) and Y [k, d_head] (pitch kLdh): Pd v, dS k.
template <typename T, typename Put>
__device__ void gemm_nn(const T* p, int ldp, const T* y, int m, int k, const Put& put) {
  gemm<T, wmma::row_major, wmma::row_major>(p, ldp, ldp, 1, y, kLdh, kLdh, 1, m, kAttnHeadDim, k, put);
}

// P^T Y for P [k, m] (pitch ldp) and Y [k, d_head]: Pd^T dO, dS^T q.
template <typename T, typename Put>
__device__ void gemm_tn(const T* p, int ldp, const T* y, int m, int k, const Put& put) {
  gemm<T, wmma::col_major, wmma::row_major>(p, ldp, 1, ldp, y, kLdh, kLdh, 1, m, kAttnHeadDim, k, put);
}

// Draws the keep-bits of the block's elements base .. base + n - 1 of the [B, heads, Tq, Tk] index,
// one byte per Philox group of 8 (keep8's draw, so that Dropout.mask() writes the same mask). The bit
// of the block's element e (0 .. n - 1) is keep_bit(bits, (base & 7) + e).
__device__ void draw_keep_bits(const RngState& rng, uint64_t base, int n, float p, uint8_t* bits) {
  const uint64_t g0 = base >> 3, groups = ((base + n - 1) >> 3) - g0 + 1;
  for (uint64_t g = threadIdx.x; g < groups; g += kThreads) {
    bool k[8];
    keep8(rng, g0 + g, p, k);
    unsigned b = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) b |= unsigned(k[i]) << i;
    bits[g] = uint8_t(b);
  }
}

__device__ __forceinline__ bool keep_bit(const uint8_t* bits, int at) { return (bits[at >> 3] >> (at & 7)) & 1u; }

// Columns 0 .. lk - 1 of a smem row of T, a warp's lanes at 32-column strides.
template <typename T>
__device__ __forceinline__ void zero_row(T* row, int lk, int lane) {
  for (int j = lane; j < lk; j += 32) row[j] = from_f<T>(0.f);
}

struct Rows {
  const uint8_t* key_padding;  // [B, Tk] or nullptr
  bool causal;
  int tq, tk;
};

// One block's masks: its batch row of the key padding copied to smem `pad` (by the block's threads,
// before a barrier), so the softmax rows read it there.
struct BlockMask {
  const uint8_t* pad;
  bool causal;
  int tq, tk;
  __device__ BlockMask(const Rows& rows, int b, uint8_t* pad_s)
      : pad(rows.key_padding ? pad_s : nullptr), causal(rows.causal), tq(rows.tq), tk(rows.tk) {
    if (pad)
      for (int j = threadIdx.x; j < tk; j += kThreads) pad_s[j] = rows.key_padding[int64_t(b) * tk + j];
  }
  // key j exists and is not padding (the same for every row: a lane reads it once)
  __device__ bool key_live(int j) const { return j < tk && !(pad && pad[j]); }
  // key j is after query i (causal; with Tq < Tk the queries are the last Tq positions)
  __device__ bool after(int i, int j) const { return causal && j > i + (tk - tq); }
};

// A warp's share of the softmax rows: its lane's kCols columns (lane, lane + 32) and whether each holds
// a live key (present, not padding: the same for every row), and the dropout's scale.
template <int kCols>
struct RowLanes {
  int warp, lane;
  bool key[kCols];
  float scale;
  __device__ RowLanes(const BlockMask& mask, float p) : warp(threadIdx.x >> 5), lane(threadIdx.x & 31) {
#pragma unroll
    for (int m = 0; m < kCols; ++m) key[m] = mask.key_live(lane + 32 * m);
    scale = dropout_scale(p);
  }
};

// The forward's softmax rows, one warp per row and kCols columns per lane (lane, lane + 32; kCols = 1
// when the keys fit in one column per lane): Pd (dropped and scaled) into p_s, each row's log-sum-exp
// into lse.
template <int kCols, typename T>
__device__ void forward_rows(const Layout& l, const BlockMask& mask, const float* s_s, T* p_s,
                             const uint8_t* bits, int bit0, float p, float* lse) {
  const RowLanes<kCols> w(mask, p);
  const int lane = w.lane;
  for (int i = w.warp; i < l.lq; i += kWarps) {
    if (i >= mask.tq) {  // padding rows (a branch for the whole warp: nothing of a real row is read for them)
      zero_row(p_s + i * l.ldp, l.lk, lane);
      continue;
    }
    float s[kCols], mx = -INFINITY;
#pragma unroll
    for (int m = 0; m < kCols; ++m) {
      const int j = lane + 32 * m;
      s[m] = w.key[m] && !mask.after(i, j) ? s_s[i * l.lds + j] : -INFINITY;
      mx = fmaxf(mx, s[m]);
    }
    mx = warp_max(mx);
    float e[kCols], sum = 0.f;
#pragma unroll
    for (int m = 0; m < kCols; ++m) {
      e[m] = mx == -INFINITY ? 0.f : exp_ftz(s[m] - mx);
      sum += e[m];
    }
    sum = warp_sum(sum);
    if (lane == 0) lse[i] = mx == -INFINITY ? -INFINITY : mx + logf(sum);
    const float inv = mx == -INFINITY ? 0.f : w.scale / sum;
    const int row = bit0 + i * mask.tk;
#pragma unroll
    for (int m = 0; m < kCols; ++m) {
      const int j = lane + 32 * m;
      if (j >= l.lk) continue;
      const bool dropped = p > 0.f && !keep_bit(bits, row + j);
      p_s[i * l.ldp + j] = from_f<T>(dropped ? 0.f : e[m] * inv);
    }
  }
}

// The backward's softmax rows (the layout of forward_rows): Pd into p_s, dS = P * (dP' - D) into ds_s,
// from the recomputed P = exp(s - lse), dP = dO v^T and the keep-bits.
template <int kCols, typename T>
__device__ void backward_rows(const Layout& l, const BlockMask& mask, const float* s_s, const float* dp_s,
                              const float* lse_s, T* p_s, T* ds_s, const uint8_t* bits, int bit0, float p) {
  const RowLanes<kCols> w(mask, p);
  const int lane = w.lane;
  for (int i = w.warp; i < l.lq; i += kWarps) {
    if (i >= mask.tq) {  // padding rows: zero, as the gradient GEMMs add over them
      zero_row(p_s + i * l.ldp, l.lk, lane);
      zero_row(ds_s + i * l.ldp, l.lk, lane);
      continue;
    }
    const float row_lse = lse_s[i];
    const int row = bit0 + i * mask.tk;
    float pr[kCols], dp[kCols], kept[kCols], d = 0.f;
#pragma unroll
    for (int m = 0; m < kCols; ++m) {
      const int j = lane + 32 * m;
      const bool live = row_lse != -INFINITY && w.key[m] && !mask.after(i, j);
      pr[m] = live ? exp_ftz(s_s[i * l.lds + j] - row_lse) : 0.f;
      kept[m] = p > 0.f ? (keep_bit(bits, row + j) ? w.scale : 0.f) : 1.f;
      dp[m] = live ? dp_s[i * l.lds + j] * kept[m] : 0.f;
      d += pr[m] * dp[m];
    }
    d = warp_sum(d);
#pragma unroll
    for (int m = 0; m < kCols; ++m) {
      const int j = lane + 32 * m;
      if (j >= l.lk) continue;
      p_s[i * l.ldp + j] = from_f<T>(pr[m] * kept[m]);
      ds_s[i * l.ldp + j] = from_f<T>(pr[m] * (dp[m] - d));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(const T* __restrict__ q, PartStrides qs,
                                                                     const T* __restrict__ k, PartStrides ks,
                                                                     const T* __restrict__ v, PartStrides vs,
                                                                     Rows rows, T* __restrict__ out, PartStrides os,
                                                                     float* __restrict__ lse, int heads, float p,
                                                                     RngState rng) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / heads, h = blockIdx.x % heads, tq = rows.tq, tk = rows.tk;
  const Layout l(tq, tk);
  T* const q_s = reinterpret_cast<T*>(smem);
  T* const k_s = q_s + l.lq * kLdh;
  T* const v_s = k_s + l.lk * kLdh;
  float* const s_s = reinterpret_cast<float*>(v_s + l.lk * kLdh);  // scores, then the staging tiles
  const size_t s_bytes = l.scores() > kStagingBytes ? l.scores() : kStagingBytes;
  T* const p_s = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(s_s) + s_bytes);
  uint8_t* const bits = reinterpret_cast<uint8_t*>(p_s + l.lq * l.ldp);
  const uint64_t base = uint64_t(blockIdx.x) * tq * tk;
  const BlockMask mask(rows, b, bits + l.bits(tq, tk));

  load_rows(q_s, q + b * qs.batch + h * qs.head, qs.len, tq, l.lq);
  load_rows(k_s, k + b * ks.batch + h * ks.head, ks.len, tk, l.lk);
  load_rows(v_s, v + b * vs.batch + h * vs.head, vs.len, tk, l.lk);
  if (p > 0.f) draw_keep_bits(rng, base, tq * tk, p, bits);
  cp_async_wait_all();
  __syncthreads();
  gemm_nt(q_s, k_s, l.lq, l.lk, ToSmem{s_s, l.lds});
  __syncthreads();
  float* const row_lse = lse + int64_t(blockIdx.x) * tq;
  if (l.lk <= 32)
    forward_rows<1>(l, mask, s_s, p_s, bits, int(base & 7), p, row_lse);
  else
    forward_rows<2>(l, mask, s_s, p_s, bits, int(base & 7), p, row_lse);
  __syncthreads();
  gemm_nn(p_s, l.ldp, v_s, l.lq, l.lk, ToGlobal<T>{out + b * os.batch + h * os.head, os.len, tq, s_s});
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_backward_kernel(
    const T* __restrict__ dout, PartStrides dos, const T* __restrict__ q, PartStrides qs, const T* __restrict__ k,
    PartStrides ks, const T* __restrict__ v, PartStrides vs, const float* __restrict__ lse, Rows rows,
    T* __restrict__ dq, PartStrides dqs, T* __restrict__ dk, PartStrides dks, T* __restrict__ dv, PartStrides dvs,
    int heads, float p, RngState rng) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / heads, h = blockIdx.x % heads, tq = rows.tq, tk = rows.tk;
  const Layout l(tq, tk);
  T* const q_s = reinterpret_cast<T*>(smem);
  T* const do_s = q_s + l.lq * kLdh;
  T* const k_s = do_s + l.lq * kLdh;
  T* const v_s = k_s + l.lk * kLdh;
  float* const s_s = reinterpret_cast<float*>(v_s + l.lk * kLdh);
  float* const dp_s = s_s + l.lq * l.lds;
  // s_s and dp_s, then the staging tiles
  const size_t s_bytes = 2 * l.scores() > kStagingBytes ? 2 * l.scores() : kStagingBytes;
  T* const p_s = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(s_s) + s_bytes);  // Pd
  T* const ds_s = p_s + l.lq * l.ldp;
  uint8_t* const bits = reinterpret_cast<uint8_t*>(ds_s + l.lq * l.ldp);
  float* const lse_s = reinterpret_cast<float*>(bits + l.bits(tq, tk));
  const uint64_t base = uint64_t(blockIdx.x) * tq * tk;
  const BlockMask mask(rows, b, reinterpret_cast<uint8_t*>(lse_s + l.lq));
  for (int i = threadIdx.x; i < tq; i += kThreads) lse_s[i] = lse[int64_t(blockIdx.x) * tq + i];

  load_rows(q_s, q + b * qs.batch + h * qs.head, qs.len, tq, l.lq);
  load_rows(do_s, dout + b * dos.batch + h * dos.head, dos.len, tq, l.lq);
  load_rows(k_s, k + b * ks.batch + h * ks.head, ks.len, tk, l.lk);
  load_rows(v_s, v + b * vs.batch + h * vs.head, vs.len, tk, l.lk);
  if (p > 0.f) draw_keep_bits(rng, base, tq * tk, p, bits);
  cp_async_wait_all();
  __syncthreads();
  gemm_nt(q_s, k_s, l.lq, l.lk, ToSmem{s_s, l.lds});
  gemm_nt(do_s, v_s, l.lq, l.lk, ToSmem{dp_s, l.lds});
  __syncthreads();
  if (l.lk <= 32)
    backward_rows<1>(l, mask, s_s, dp_s, lse_s, p_s, ds_s, bits, int(base & 7), p);
  else
    backward_rows<2>(l, mask, s_s, dp_s, lse_s, p_s, ds_s, bits, int(base & 7), p);
  __syncthreads();
  gemm_tn(p_s, l.ldp, do_s, l.lk, l.lq, ToGlobal<T>{dv + b * dvs.batch + h * dvs.head, dvs.len, tk, s_s});
  gemm_tn(ds_s, l.ldp, q_s, l.lk, l.lq, ToGlobal<T>{dk + b * dks.batch + h * dks.head, dks.len, tk, s_s});
  gemm_nn(ds_s, l.ldp, k_s, l.lq, l.lk, ToGlobal<T>{dq + b * dqs.batch + h * dqs.head, dqs.len, tq, s_s});
}

// Dynamic shared memory beyond the default 48 KB: the kernel's need at the longest rows, allowed once.
template <auto Kernel>
void allow_smem(size_t most) {
  static const cudaError_t set = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(most));
  (void)set;
}

}  // namespace

void attention_forward(DType dt, const void* q, PartStrides qs, const void* k, PartStrides ks, const void* v,
                       PartStrides vs, const uint8_t* key_padding, bool causal, void* out, PartStrides os, float* lse,
                       int batch, int heads, int tq, int tk, float p, RngState rng, cudaStream_t stream) {
  if (batch == 0 || heads == 0 || tq == 0) return;
  LS_DISPATCH_HALF(dt, {
    constexpr auto kernel = attention_forward_kernel<T>;
    allow_smem<kernel>(forward_smem<T>(kAttnMaxLen, kAttnMaxLen));
    kernel<<<batch * heads, kThreads, forward_smem<T>(tq, tk), stream>>>((const T*)q, qs, (const T*)k, ks, (const T*)v, vs,
                                                       Rows{key_padding, causal, tq, tk}, (T*)out, os, lse, heads, p,
                                                       rng);
  })
}

void attention_backward(DType dt, const void* dout, PartStrides dos, const void* q, PartStrides qs, const void* k,
                        PartStrides ks, const void* v, PartStrides vs, const float* lse, const uint8_t* key_padding,
                        bool causal, const RngState* rng, float p, void* dq, PartStrides dqs, void* dk,
                        PartStrides dks, void* dv, PartStrides dvs, int batch, int heads, int tq, int tk,
                        cudaStream_t stream) {
  if (batch == 0 || heads == 0 || tq == 0) return;
  LS_DISPATCH_HALF(dt, {
    constexpr auto kernel = attention_backward_kernel<T>;
    allow_smem<kernel>(backward_smem<T>(kAttnMaxLen, kAttnMaxLen));
    kernel<<<batch * heads, kThreads, backward_smem<T>(tq, tk), stream>>>(
        (const T*)dout, dos, (const T*)q, qs, (const T*)k, ks, (const T*)v, vs, lse, Rows{key_padding, causal, tq, tk},
        (T*)dq, dqs, (T*)dk, dks, (T*)dv, dvs, heads, rng ? p : 0.f, rng ? *rng : RngState{});
  })
}

}  // namespace ls
