// softmax: attention probabilities from scores [B, heads, Tq, Tk] with the key-padding mask
// [B, Tk] and the causal mask applied on the fly (never expanded in memory), fused with dropout.
// A fully masked row gives zeros.
// LightSeq2 technique: its fused masked softmax + dropout, with launch shapes chosen per row
// length at compile time. Rows of up to 1024 keys are held in registers by GROUP lanes of a warp
// and read once and written once: in the backward 4 lanes take a row of up to 32 keys, so eight
// short rows share a warp; in the forward 2 lanes take 16 keys each; longer rows take 32 lanes
// with ITEMS = 8 .. 32 keys each. Rows longer still (there is no cap) take a block each and loop.
// When the row length is a multiple of 8 (and the pointers allow), a lane owns runs of 8
// consecutive keys, which gives 16-byte loads and stores and one Philox call per 8 keep-bits;
// otherwise the lanes interleave key by key.
// Written: the output (the probabilities or, with dropout, the kept ones) and each row's
// log-sum-exp (4 bytes per row). Never written to memory: the keep-mask (the backward draws the
// keep-bits again from the forward's Philox state) and, with dropout, the undropped
// probabilities. A kept probability is scaled by 1 / (1 - p) in fp32 and rounded once. Stock
// fairseq rounds the probabilities to 16 bits, then scales and rounds again; the two results are
// at most an ulp apart, and the single rounding is the nearer to the exact value.
// Backward, from the scores and the log-sum-exp: dp = dout * keep / (1 - p);
// dscores = P * (dp - sum_j dp_j * P_j), with P_j = exp(s_j - lse) in fp32, never the 16-bit
// probabilities. Their rounding (2^-9 relative in bf16) enters the row term sum_j dp_j P_j as an
// error common to the whole row, and it gave the cross-attention's query gradients a larger
// error against fp64 than stock fairseq's, whose softmax keeps fp32 probabilities for its
// backward (docs/perf-log.md, "Kernel design measurements"). The backward reads the scores where it would have read the probabilities:
// the same number of bytes.
#include "common.cuh"

namespace ls {

struct RowInfo {
  const uint8_t* key_padding;  // 0 or 1 a byte (the bindings pass a bool mask's bytes, or mask != 0)
  bool causal;
  int heads, tq, tk;
  bool fast;  // rows and heads x tq below 2^31: the row's batch and query index by FastDiv
  FastDiv per_batch, per_query;
  RowInfo(const uint8_t* key_padding, bool causal, int heads, int tq, int tk, int64_t rows)
      : key_padding(key_padding), causal(causal), heads(heads), tq(tq), tk(tk),
        fast(rows < (int64_t(1) << 31) && int64_t(heads) * tq < (int64_t(1) << 31)),
        per_batch(fast ? unsigned(heads * tq) : 1u), per_query(unsigned(tq)) {}
};

// Bits 0..3 of the result: whether bytes 0..3 of w (0 or 1 each) are 1. The multiply moves byte
// i's bit to bit 24 + i; every other product bit lands apart from them, so no carry reaches them.
__device__ __forceinline__ unsigned byte_bits4(unsigned w) { return (w * 0x01020408u) >> 24 & 0xFu; }

// The padding bytes a row without a key-padding mask reads: none padded.
__device__ __align__(8) const uint8_t kNoPadding[8] = {};

// The masks of one row, resolved once per row: key j is masked when padded or after `last`.
struct RowMask {
  const uint8_t* padding;
  int last;
  __device__ RowMask(const RowInfo& info, int64_t row) {
    int64_t b;
    int q;
    if (info.fast) {
      const unsigned n = unsigned(row);
      b = info.per_batch(n);
      q = int(n - info.per_query(n) * unsigned(info.tq));
    } else {
      b = row / (int64_t(info.heads) * info.tq);
      q = int(row % info.tq);
    }
    padding = info.key_padding ? info.key_padding + b * info.tk : nullptr;
    last = info.causal ? q + info.tk - info.tq : info.tk - 1;
  }
  __device__ bool operator()(int j) const { return j > last || (padding && padding[j]); }
  // keys j0 .. j0 + N - 1 as bits (bit i: key j0 + i masked); N = 8: j0 a multiple of 8, the rows
  // 8-byte aligned, the padding's 8 bytes in one access
  template <int N>
  __device__ unsigned bits(int j0) const {
    static_assert(N == 1 || N == 8, "a key or a run of 8");
    if constexpr (N == 1) return (*this)(j0) ? 1u : 0u;
    else return run_bits(padding8(j0), j0);
  }
  // the padding bytes of keys j0 .. j0 + 7 (j0 a multiple of 8, in the row), loaded without a
  // branch (a row without a mask reads kNoPadding), so a kernel can issue it beside its other loads
  __device__ uint2 padding8(int j0) const {
    return *reinterpret_cast<const uint2*>(padding ? padding + j0 : kNoPadding);
  }
  // keys j0 .. j0 + 7 as bits, from their padding bytes
  __device__ unsigned run_bits(uint2 pad_bytes, int j0) const {
    const unsigned pad = byte_bits4(pad_bytes.x) | byte_bits4(pad_bytes.y) << 4;
    // keys j0 .. last are not after `last`: the run's keys from `live` on are; the clamped funnel
    // shift gives 0xFF << live for live in [0, 32], 0 beyond
    const unsigned live = unsigned(max(last - j0 + 1, 0));
    return pad | (__funnelshift_lc(0u, 0xFFu, live) & 0xFFu);
  }
};

// Reductions over the GROUP lanes that share a row (GROUP a power of two <= 32).
template <int GROUP>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = GROUP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <int GROUP>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = GROUP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Key of item k of a lane: CONTIG, runs of 8 consecutive keys, the group's lanes side by side in
// each run of runs (a warp's 16-byte accesses of one item group cover whole sectors); else lanes
// interleave key by key.
template <int ITEMS, int GROUP, bool CONTIG>
__device__ __forceinline__ int key_of(int lane, int k) {
  return CONTIG ? k / 8 * (GROUP * 8) + lane * 8 + k % 8 : lane + GROUP * k;
}

constexpr int kThreads = 128;

// The forward's rows in registers: GROUP lanes per row (32 / GROUP rows per warp), ITEMS keys per
// lane. Every lane takes part in the shuffles, `valid` or not (an invalid lane reads row 0). KEYS:
// draw from the host's Philox round keys (`keys`). Index: the type of the row and element indices
// (uint32_t when there are fewer than 2^32 elements).
template <typename T, int ITEMS, int GROUP, bool CONTIG, bool KEYS, typename Index>
__device__ __forceinline__ void forward_rows(const T* __restrict__ scores, const RowInfo& info, T* __restrict__ out,
                                             float* __restrict__ lse, int64_t rows, float p, float scale,
                                             const RngState& rng_state, const RoundKeys& keys) {
  constexpr int N = CONTIG ? 8 : 1;
  const Index row = (Index(blockIdx.x) * blockDim.x + threadIdx.x) / GROUP;
  const int lane = threadIdx.x % GROUP, tk = info.tk;
  const bool valid = row < Index(rows);
  const Index at = valid ? row : 0;  // an invalid lane reads row 0 (its shuffles need every lane)
  const T* s = scores + at * tk;
  const RowMask masked(info, at);
  // Every run's loads (scores, padding bytes) are issued before any is used, and none sits behind a
  // branch: a lane's runs outside the row (with CONTIG tk % 8 == 0, so a run is wholly in or out)
  // load the row's first run instead. With a branch per run, each run's loads waited for the
  // previous run's to arrive, two trips to memory per thread (docs/perf-log.md, "Kernel design measurements").
  Pack<T, N> raw[ITEMS / N];
  uint2 pad[ITEMS / N];
#pragma unroll
  for (int k0 = 0; k0 < ITEMS; k0 += N) {
    const int j0 = key_of<ITEMS, GROUP, CONTIG>(lane, k0);
    const bool in = valid && j0 < tk;
    raw[k0 / N] = load_pack<T, N>(s + (in ? j0 : 0));
    if constexpr (CONTIG) pad[k0 / N] = masked.padding8(in ? j0 : 0);
  }
  float v[ITEMS], m = -INFINITY;
#pragma unroll
  for (int k0 = 0; k0 < ITEMS; k0 += N) {
    const int j0 = key_of<ITEMS, GROUP, CONTIG>(lane, k0);
    unsigned hidden = ~0u;
    // Every run's bits are formed, its own or all hidden: when the padding's load went unused for a
    // run outside the row, the compiler moved that load behind a branch again.
    if constexpr (CONTIG) hidden = masked.run_bits(pad[k0 / N], j0) | (valid && j0 < tk ? 0u : ~0u);
    else if (valid && j0 < tk) hidden = masked.template bits<1>(j0);
    float t[N];
    unpack(raw[k0 / N], t);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v[k0 + i] = hidden >> i & 1u ? -INFINITY : t[i];
      m = fmaxf(m, v[k0 + i]);
    }
  }
  m = group_max<GROUP>(m);
  // exp(v - m), with the max's own term exactly 1. Forming the exponent as one FFMA with a prescaled
  // max, v log2(e) - m log2(e), leaves that term off 1 by m's rounding: a one-key row's log-sum-exp
  // then misses m, its backward's P is not 1 and its dscores are not 0 (the GPU tests catch this).
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    v[k] = m == -INFINITY ? 0.f : exp_ftz(v[k] - m);
    sum += v[k];
  }
  sum = group_sum<GROUP>(sum);
  if (!valid) return;
  // sum >= 1 when a key is unmasked (the max's term is 1), so the SFU's reciprocal needs no range
  // scaling. The dropout's scale (the host's 1 / (1 - p)) is folded in, so that a kept probability
  // is rounded once.
  const float inv = sum > 0.f ? rcp_ftz(sum) * scale : 0.f;
  // The row's log-sum-exp, -inf for a fully masked row (the SFU's lg2: sum >= 1 as above, and its
  // precision is ample for P = exp(s - lse) in fp32). It is formed before the draws, so that one
  // register stays live across them instead of two (sum and m), which keeps the short kernel from
  // spilling at 32 registers. It is stored after the row's probabilities.
  const float row_lse = fmaf(log2_ftz(sum), kLn2, m);
  const RngState rng = resolved(rng_state);  // (seed, offset) loaded once for the row's draws
#pragma unroll
  for (int k0 = 0; k0 < ITEMS; k0 += N) {
    const int j0 = key_of<ITEMS, GROUP, CONTIG>(lane, k0);
    if (j0 >= tk) continue;
    const Index e = row * tk + j0;
    bool keep[N];
    if (p > 0.f) {
      if constexpr (!CONTIG) keep[0] = keep1(rng, e, p);
      else if constexpr (KEYS) keep8(rng, keys, uint64_t(e) >> 3, keep);
      else keep_run<8>(rng, e, p, keep);
    }
    float pr[N];
#pragma unroll
    for (int i = 0; i < N; ++i) pr[i] = p > 0.f && !keep[i] ? 0.f : v[k0 + i] * inv;
    store<T, N>(out + e, pr);
  }
  if (lane == 0) lse[row] = row_lse;
}

// Every layout and dtype, with the draw's round keys added up on the device. Only the short kernel
// takes the host's round keys: its layout is the one they were measured faster at.
template <typename T, int ITEMS, int GROUP, bool CONTIG>
__global__ void softmax_forward_warp_kernel(const T* __restrict__ scores, RowInfo info, T* __restrict__ out,
                                            float* __restrict__ lse, int64_t rows, float p, float scale,
                                            RngState rng_state) {
  forward_rows<T, ITEMS, GROUP, CONTIG, false, int64_t>(scores, info, out, lse, rows, p, scale, rng_state,
                                                        RoundKeys{});
}

// Rows of 16-bit scores in runs of 16 keys per lane, with dropout and fewer than 2^32 elements. The
// kernel uses 32-bit indices and is bounded to 32 registers, so that 2,048 threads fit on an SM
// (bench_ops' 1,024 blocks at once). At that bound the draw from the host's round keys spills 4
// bytes and is still faster, and the draw from a graph's device-side seed does not spill. The
// bound is this kernel's own because on the general kernel it raised the other layouts' register
// counts. Blocks of 256 threads (8 per SM) were faster than 128 (16 per SM) and 512
// (docs/perf-log.md, "Kernel design measurements").
constexpr int kShortThreads = 256;
template <typename T, int GROUP, bool KEYS>
__global__ void __launch_bounds__(kShortThreads, 8)
    softmax_forward_short_kernel(const T* __restrict__ scores, RowInfo info, T* __restrict__ out,
                                 float* __restrict__ lse, int64_t rows, float p, float scale, RngState rng_state,
                                 RoundKeys keys) {
  forward_rows<T, 16, GROUP, true, KEYS, uint32_t>(scores, info, out, lse, rows, p, scale, rng_state, keys);
}

// A row handled by a whole block (rows beyond the warp layouts, no length cap): its scores, masks and
// log-sum-exp.
template <typename T>
struct BlockRow {
  const T* s;
  RowMask masked;
  float lse;
  __device__ float prob(int j) const { return masked(j) ? 0.f : expf(to_f(s[j]) - lse); }
};

template <typename T>
__global__ void softmax_forward_block_kernel(const T* __restrict__ scores, RowInfo info, T* __restrict__ out,
                                             float* __restrict__ lse, float p, float scale, RngState rng) {
  const int64_t row = blockIdx.x;
  const int tk = info.tk;
  BlockRow<T> r{scores + row * tk, RowMask(info, row), 0.f};
  float m = -INFINITY;
  for (int j = threadIdx.x; j < tk; j += blockDim.x)
    if (!r.masked(j)) m = fmaxf(m, to_f(r.s[j]));
  m = block_max(m);
  float sum = 0.f;
  if (m != -INFINITY)
    for (int j = threadIdx.x; j < tk; j += blockDim.x)
      if (!r.masked(j)) sum += expf(to_f(r.s[j]) - m);
  sum = block_sum(sum);
  r.lse = m + logf(sum);
  if (threadIdx.x == 0) lse[row] = r.lse;
  for (int j = threadIdx.x; j < tk; j += blockDim.x) {
    const bool keep = p == 0.f || keep1(rng, row * tk + j, p);
    out[row * tk + j] = from_f<T>(keep ? r.prob(j) * scale : 0.f);
  }
}

// dscores_j = P_j (dp_j - sum_k dp_k P_k), dp = dout * keep / (1 - p): the softmax's Jacobian
// diag(P) - P P^T applied to dp (the dropout's scale and mask applied first, as the forward applied
// them last). P = exp(s_j - lse) in fp32, from the scores and the forward's log-sum-exp (the header
// says why not the stored probabilities).
template <typename T, int ITEMS, int GROUP, bool CONTIG>
__global__ void softmax_backward_warp_kernel(const T* __restrict__ dout, const T* __restrict__ scores,
                                             const float* __restrict__ lse, RowInfo info, Redraw keeps,
                                             T* __restrict__ ds, int64_t rows, float p, float scale) {
  constexpr int N = CONTIG ? 8 : 1;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / GROUP;
  const int lane = threadIdx.x % GROUP, tk = info.tk;
  const bool valid = row < rows;
  const RowMask masked(info, valid ? row : 0);
  const float l = valid ? lse[row] : 0.f;
  float dp[ITEMS], pr[ITEMS], dot = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < ITEMS; k0 += N) {
    const int j0 = key_of<ITEMS, GROUP, CONTIG>(lane, k0);
    const int64_t e = row * tk + j0;
    Pack<T, N> dk{}, sk{};
    bool keep[N] = {};
    unsigned hidden = ~0u;
    if (valid && j0 < tk) {
      dk = load_pack<T, N>(dout + e);
      sk = load_pack<T, N>(scores + e);
      hidden = masked.template bits<N>(j0);
      keeps.run<N>(e, p, keep);
    }
    float d[N], t[N];
    unpack(dk, d);
    unpack(sk, t);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      pr[k0 + i] = hidden >> i & 1u ? 0.f : exp_ftz(t[i] - l);
      dp[k0 + i] = keep[i] ? d[i] * scale : 0.f;
      dot += dp[k0 + i] * pr[k0 + i];
    }
  }
  dot = group_sum<GROUP>(dot);
  if (!valid) return;
#pragma unroll
  for (int k0 = 0; k0 < ITEMS; k0 += N) {
    const int j0 = key_of<ITEMS, GROUP, CONTIG>(lane, k0);
    if (j0 >= tk) continue;
    float g[N];
#pragma unroll
    for (int i = 0; i < N; ++i) g[i] = pr[k0 + i] * (dp[k0 + i] - dot);
    store<T, N>(ds + row * tk + j0, g);
  }
}

template <typename T>
__global__ void softmax_backward_block_kernel(const T* __restrict__ dout, const T* __restrict__ scores,
                                              const float* __restrict__ lse, RowInfo info, Redraw keeps,
                                              T* __restrict__ ds, float p, float scale) {
  const int64_t row = blockIdx.x, base = row * info.tk;
  const int tk = info.tk;
  const BlockRow<T> r{scores + base, RowMask(info, row), lse[row]};
  auto dp = [&](int j) {
    bool keep[1];
    keeps.run<1>(base + j, p, keep);
    return keep[0] ? to_f(dout[base + j]) * scale : 0.f;
  };
  float dot = 0.f;
  for (int j = threadIdx.x; j < tk; j += blockDim.x) dot += dp(j) * r.prob(j);
  dot = block_sum(dot);
  for (int j = threadIdx.x; j < tk; j += blockDim.x) ds[base + j] = from_f<T>(r.prob(j) * (dp(j) - dot));
}

// Calls launch.template operator()<ITEMS, GROUP, CONTIG>() with the row layout for tk (a
// short row shares a warp with others), or returns false when tk needs the block path.
// CONTIG (tk % 8 == 0 and every pointer aligned to 8 elements): runs of ITEMS0 = 8 keys per
// lane; otherwise lanes interleave, ITEMS0 = 4 keys each. Rows of up to 128 keys take
// 128 / ITEMS0 lanes or fewer, longer ones a whole warp with more keys per lane.
template <int ITEMS0, bool CONTIG, typename L>
bool row_layout(int tk, L&& launch) {
  if (tk <= 32) return launch.template operator()<ITEMS0, 32 / ITEMS0, CONTIG>(), true;
  if (tk <= 64) return launch.template operator()<ITEMS0, 64 / ITEMS0, CONTIG>(), true;
  if (tk <= 128) return launch.template operator()<ITEMS0, 128 / ITEMS0, CONTIG>(), true;
  if (tk <= 256) return launch.template operator()<8, 32, CONTIG>(), true;
  if (tk <= 512) return launch.template operator()<16, 32, CONTIG>(), true;
  if (tk <= 1024) return launch.template operator()<32, 32, CONTIG>(), true;
  return false;
}

template <typename L>
bool with_row_layout(int tk, bool contig, L&& launch) {
  return contig ? row_layout<8, true>(tk, launch) : row_layout<4, false>(tk, launch);
}

// The forward's layout: CONTIG rows of up to 128 keys take 16 keys per lane (two runs of 8), so the
// row's fixed costs (its index, masks, reductions, log-sum-exp, the generator's state) are shared by
// twice the keys. This was faster than 8 keys per lane, and than 32 keys per lane with a row per
// thread, whose accesses lie 64 bytes apart (docs/perf-log.md, "Kernel design measurements").
template <typename L>
bool with_forward_row_layout(int tk, bool contig, L&& launch) {
  return contig && tk <= 128 ? row_layout<16, true>(tk, launch) : with_row_layout(tk, contig, launch);
}

inline bool aligned_to(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void softmax_forward(DType dt, const void* scores, const uint8_t* key_padding, bool causal, void* out, float* lse,
                     int batch, int heads, int tq, int tk, float p, RngState rng, cudaStream_t stream) {
  const int64_t rows = int64_t(batch) * heads * tq;
  if (rows == 0 || tk == 0) return;
  const RowInfo info(key_padding, causal, heads, tq, tk, rows);
  const float scale = dropout_scale(p);
  const RoundKeys keys = round_keys(rng, p);
  LS_DISPATCH(dt, {
    const int run = 8 * sizeof(T);
    const bool contig = tk % 8 == 0 && aligned_to(scores, run) && aligned_to(out, run) && aligned_to(key_padding, 8);
    const bool warp = with_forward_row_layout(tk, contig, [&]<int ITEMS, int GROUP, bool CONTIG>() {
      if constexpr (CONTIG && ITEMS == 16 && sizeof(T) == 2) {
        if (p > 0.f && rows * tk < (int64_t(1) << 32)) {
          const auto short_rows = keys.valid ? softmax_forward_short_kernel<T, GROUP, true>
                                             : softmax_forward_short_kernel<T, GROUP, false>;
          return short_rows<<<ceil_div(rows * GROUP, kShortThreads), kShortThreads, 0, stream>>>(
              (const T*)scores, info, (T*)out, lse, rows, p, scale, rng, keys);
        }
      }
      softmax_forward_warp_kernel<T, ITEMS, GROUP, CONTIG><<<ceil_div(rows * GROUP, kThreads), kThreads, 0, stream>>>(
          (const T*)scores, info, (T*)out, lse, rows, p, scale, rng);
    });
    if (!warp)
      softmax_forward_block_kernel<T><<<rows, 512, 0, stream>>>((const T*)scores, info, (T*)out, lse, p, scale, rng);
  })
}

void softmax_backward(DType dt, const void* dout, const void* scores, const float* lse, const uint8_t* key_padding,
                      bool causal, const RngState* rng, void* dscores, int batch, int heads, int tq, int tk, float p,
                      cudaStream_t stream) {
  const int64_t rows = int64_t(batch) * heads * tq;
  if (rows == 0 || tk == 0) return;
  const RowInfo info(key_padding, causal, heads, tq, tk, rows);
  const Redraw keeps = redraw(rng, p);
  const float scale = dropout_scale(p);  // as the forward's, from the host
  LS_DISPATCH(dt, {
    const int run = 8 * sizeof(T);
    const bool contig = tk % 8 == 0 && aligned_to(dout, run) && aligned_to(scores, run) && aligned_to(dscores, run) &&
                        aligned_to(key_padding, 8);
    const bool warp = with_row_layout(tk, contig, [&]<int ITEMS, int GROUP, bool CONTIG>() {
      softmax_backward_warp_kernel<T, ITEMS, GROUP, CONTIG><<<ceil_div(rows * GROUP, kThreads), kThreads, 0, stream>>>(
          (const T*)dout, (const T*)scores, lse, info, keeps, (T*)dscores, rows, p, scale);
    });
    if (!warp)
      softmax_backward_block_kernel<T><<<rows, 512, 0, stream>>>((const T*)dout, (const T*)scores, lse, info, keeps,
                                                                  (T*)dscores, p, scale);
  })
}

}  // namespace ls
