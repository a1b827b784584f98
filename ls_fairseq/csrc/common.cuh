// Shared device helpers of the ls_fairseq kernels: storage types, fp32
// conversion, warp/block reductions, 16-byte vector access, and a Philox4x32-10
// counter-based generator (Salmon et al., SC'11) for dropout masks, keyed by the
// (seed, offset) that torch's CUDA generator hands out, so --seed reproduces runs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels.h"

namespace ls {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// A load in two steps: load_pack issues it, unpack converts what arrived. A kernel that draws dropout
// keep-bits issues its loads, draws, then unpacks: converting right after the load would stall the
// thread there, and ptxas does not move the draw's instructions (behind its branches) above the stall,
// so each thread would wait out the load's latency first and run its Philox rounds after.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void unpack(const Pack<T, N>& pk, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f(pk.v[i]);
}

// Unpacks bf16 values two at a time from 32-bit words. A bf16 value is the upper half of its fp32
// value, so a word's two values come out with one shift and one mask. Converting element by element
// takes 16-bit moves, which made the embedding backward's chunk kernel spill and the softmax backward
// use more registers (docs/perf-log.md, "Kernel design measurements").
template <int N>
__device__ __forceinline__ void unpack(const Pack<__nv_bfloat16, N>& pk, float (&out)[N]) {
  if constexpr (N % 2 == 0) {
    unsigned w[N / 2];
    memcpy(w, &pk, sizeof(w));
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_f(pk.v[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  unpack(load_pack<T, N>(p), out);
}

// Stores a 16-byte pack as one 16-byte store (__stwb of a uint4). A plain store of a Pack compiled to
// 16-bit pieces in some kernels (the attention output, the LayerNorm backward's dx), and a plain store
// of the uint4 compiled to four 32-bit stores in the attention kernels, which slowed the attention
// backward (docs/perf-log.md, "Kernel design measurements").
template <typename T, int N>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_f<T>(in[i]);
  if constexpr (sizeof(pk) == sizeof(uint4)) {
    uint4 u;
    memcpy(&u, &pk, sizeof(u));
    __stwb(reinterpret_cast<uint4*>(p), u);
  } else {
    *reinterpret_cast<Pack<T, N>*>(p) = pk;
  }
}

// Asynchronous 16-byte copies global -> shared (cp.async, sm_80+), bypassing L1: a thread's copies
// are committed as a group, and cp_async_wait<N> waits until at most N of its groups are in flight
// (cp_async_wait_all: none); the copies are then visible to the thread that issued them, to the
// rest of the block after a barrier. The "memory" clobbers keep the compiler from moving shared
// memory reads of a slot above the wait for it, or below the next copy into it.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// e^x and 2^x on the special function unit (ex2.approx), with results below 2^-126 flushed to zero:
// one multiply and one MUFU instruction. __expf and exp2f keep such tiny results by rescaling around
// the MUFU, which costs about five more instructions per element, for values that no probability
// stored in 16 bits, and no fp32 sum of such probabilities, can hold.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float exp_ftz(float x) { return exp2_ftz(x * kLog2e); }
// 1 / x and log2(x) on the special function unit, for x in the normal range: subnormal x is not
// rescaled, and 0 gives inf and -inf.
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Adds 1 to *counter, returning the count before, as one release-acquire atomic at GPU scope: the
// writes the calling thread's block made before it (ordered by a barrier) are visible to the thread
// that counts in after it, which sees every earlier arrival's writes. It replaces __threadfence
// (a sequentially consistent fence) and an atomicAdd: two round trips to L2, one after the other,
// on the path of the last block to arrive.
__device__ __forceinline__ unsigned arrive(unsigned* counter) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
  return before;
}

// n / d for n < 2^31 by a multiply-high and a shift (d >= 1, d < 2^31; the round-up method of
// Granlund and Montgomery): the 32-bit division it replaces is a ~20-instruction routine.
struct FastDiv {
  unsigned m, s;
  __host__ explicit FastDiv(unsigned d = 1) : m(0), s(0) {
    while ((1ull << s) < d) ++s;
    m = unsigned(((1ull << 32) * ((1ull << s) - d)) / d + 1);
  }
  __device__ unsigned operator()(unsigned n) const { return (__umulhi(n, m) + n) >> s; }
};

template <int N>
__device__ __forceinline__ void load_mask(const uint8_t* p, bool (&keep)[N]) {
  Pack<uint8_t, N> pk = *reinterpret_cast<const Pack<uint8_t, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) keep[i] = pk.v[i] != 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float shared[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.f;
  return warp_sum(v);
}

// Sums of `a` and of `b` over the block in one reduction (two values per shuffle round).
__device__ __forceinline__ void block_sum2(float& a, float& b) {
  __shared__ float2 shared[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();
  if (lane == 0) shared[warp] = make_float2(a, b);
  __syncthreads();
  const float2 v = lane < warps ? shared[lane] : make_float2(0.f, 0.f);
  a = warp_sum(v.x);
  b = warp_sum(v.y);
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float shared[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// One round of Philox4x32: counter c under round key k.
__device__ __forceinline__ uint4 philox_round(uint4 c, uint2 k) {
  const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
  const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
  return make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
}

// Round r's key of Philox4x32-10 under key k (the seed): k + r (0x9E3779B9, 0xBB67AE85), mod 2^32.
inline uint2 round_key(uint2 k, int r) {
  return make_uint2(k.x + unsigned(r) * 0x9E3779B9u, k.y + unsigned(r) * 0xBB67AE85u);
}

// Philox4x32-10: four 32-bit random words for counter `c` under key `k` (its round keys added up
// round by round).
__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    c = philox_round(c, k);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

// The scale of a kept element, 1 / (1 - p) (1 without dropout): one expression for the host and every
// kernel, so a kernel that takes it from the host and one that forms it agree to the bit.
__host__ __device__ __forceinline__ float dropout_scale(float p) { return p > 0.f ? 1.f / (1.f - p) : 1.f; }

// The keep threshold of p, ceil(65536 p), in the upper half of a 32-bit word (it is below 2^16, since
// p < 1). An element's 16-bit uniform u is one half of a random word, and u reaches the threshold
// exactly when the word (u in the upper half) or the word shifted up by 16 bits (u in the lower half)
// reaches the shifted threshold, so no mask or downward shift is needed. The host (RoundKeys) and the
// device compute it the same way.
__host__ __device__ __forceinline__ unsigned keep_threshold(float p) {
  const unsigned t = unsigned(ceilf(p * 65536.f));
  return (t < 0xFFFFu ? t : 0xFFFFu) << 16;
}

// The ten round keys of a seed known on the host, passed as a kernel parameter. Each Philox round
// then reads its key from the constant bank, which saves the key schedule's 20 adds per call (fewer
// instructions and a faster softmax forward: docs/perf-log.md, "Kernel design measurements"). The keys are not valid (`valid` false) when the
// launch is captured in a CUDA graph, which reads its seed on the device, or when a given mask
// replaces the draw.
struct RoundKeys {
  uint2 k[10];
  unsigned threshold;  // keep_threshold(p): no per-draw conversion of p
  bool valid;
};
inline RoundKeys round_keys(const RngState& rng, float p) {
  RoundKeys keys{};
  keys.valid = rng.seed_ptr == nullptr && rng.given == nullptr;
  keys.threshold = keep_threshold(p);
  const uint2 k = make_uint2(unsigned(rng.seed), unsigned(rng.seed >> 32));
  for (int r = 0; r < 10; ++r) keys.k[r] = round_key(k, r);
  return keys;
}

// The state with (seed, offset) read from the device once (when captured in a graph): a kernel that
// draws several times from it checks and loads them once, not at every draw.
__device__ __forceinline__ RngState resolved(const RngState& rng) {
  RngState r = rng;
  if (rng.seed_ptr) r.seed = uint64_t(*rng.seed_ptr);
  if (rng.offset_ptr) r.offset = uint64_t(*rng.offset_ptr) + rng.offset_intragraph;
  r.seed_ptr = nullptr;
  r.offset_ptr = nullptr;
  return r;
}

// Philox's counter for word group g of a call (its resolved state's offset in the upper half).
__device__ __forceinline__ uint4 philox_counter(const RngState& resolved_rng, uint64_t g) {
  const uint64_t offset = resolved_rng.offset;
  return make_uint4(unsigned(g), unsigned(g >> 32), unsigned(offset), unsigned(offset >> 32));
}

// Four random words for elements 4g .. 4g+3 of one call's tensor: a pure function
// of (seed, offset, element index), whatever the launch shape. (seed, offset) are
// read from the generator's device state when the call was captured in a CUDA graph.
__device__ __forceinline__ uint4 random4(const RngState& rng, uint64_t g) {
  const RngState r = resolved(rng);
  return philox(philox_counter(r, g), make_uint2(unsigned(r.seed), unsigned(r.seed >> 32)));
}

// x rounded to T stochastically with the random word r: up (away from zero) with
// probability (|x| - |lo|) / (|hi| - |lo|), lo and hi the neighbours of x in T,
// so the expected result is x itself: updates far below T's resolution survive
// in expectation (unbiased rounding for parameters kept without an fp32 copy).
template <typename T>
__device__ __forceinline__ T round_stochastic(float x, unsigned r);
template <>
__device__ __forceinline__ float round_stochastic<float>(float x, unsigned) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 round_stochastic<__nv_bfloat16>(float x, unsigned r) {
  if (!isfinite(x)) return __float2bfloat16_rn(x);
  // bf16 is fp32's upper half: add 16 random bits below it, then truncate (toward zero)
  const unsigned bits = (__float_as_uint(x) + (r & 0xFFFFu)) & 0xFFFF0000u;
  return __float2bfloat16_rz(__uint_as_float(bits));
}
template <>
__device__ __forceinline__ __half round_stochastic<__half>(float x, unsigned r) {
  const __half lo = __float2half_rz(x);
  const float flo = __half2float(lo);
  if (flo == x || !isfinite(x)) return __float2half_rn(x);
  const __half hi = __ushort_as_half(static_cast<unsigned short>(__half_as_ushort(lo) + 1));  // one unit outward
  const float frac = (x - flo) / (__half2float(hi) - flo);  // in (0, 1); 0 when hi overflows to inf
  return float(r >> 8) * (1.0f / 16777216.0f) < frac ? hi : lo;
}

// Keep-bits of the dropout mask for elements 8g .. 8g+7 of one call's tensor: a
// pure function of (seed, offset, element index), whatever the launch shape. One
// Philox call gives 128 bits, 16 per element: element i is kept when its 16-bit
// uniform u satisfies u >= p * 65536 (rounded up), i.e. with probability
// 1 - ceil(65536 p) / 65536, within 2^-16 of 1 - p. Philox is the costly part of a
// dropout kernel (10 rounds of two 32-bit multiply-highs), and 16 bits per element
// need half the calls that 32 would.
__device__ __forceinline__ void keep8_of(uint4 r, unsigned threshold, bool (&keep)[8]) {
  const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    keep[2 * i] = w[i] << 16 >= threshold;
    keep[2 * i + 1] = w[i] >= threshold;
  }
}
__device__ __forceinline__ void keep8(const RngState& rng, uint64_t g, float p, bool (&keep)[8]) {
  keep8_of(random4(rng, g), keep_threshold(p), keep);
}
// The same bits from the host's round keys and threshold (keys.valid; rng resolved, its seed the keys')
__device__ __forceinline__ void keep8(const RngState& resolved_rng, const RoundKeys& keys, uint64_t g,
                                      bool (&keep)[8]) {
  uint4 c = philox_counter(resolved_rng, g);
#pragma unroll
  for (int r = 0; r < 10; ++r) c = philox_round(c, keys.k[r]);
  keep8_of(c, keys.threshold, keep);
}

// Keep-bits of N consecutive elements from e (e a multiple of N when N < 8, of 8 otherwise):
// the given mask's own bytes (none past element e + N - 1 is read), or Philox's.
template <int N>
__device__ __forceinline__ void keep_run(const RngState& rng, uint64_t e, float p, bool (&keep)[N]) {
  if (rng.given) {
#pragma unroll
    for (int i = 0; i < N; ++i) keep[i] = rng.given[e + i] != 0;
    return;
  }
  bool k[8];
  if constexpr (N >= 8) {
#pragma unroll
    for (int i = 0; i < N; i += 8) {
      keep8(rng, (e + i) >> 3, p, k);
#pragma unroll
      for (int j = 0; j < 8; ++j) keep[i + j] = k[j];
    }
  } else {
    keep8(rng, e >> 3, p, k);
#pragma unroll
    for (int i = 0; i < N; ++i) keep[i] = k[(e & 7) + i];
  }
}

// keep[i0 .. i0 + 7] as one byte of keep-bits (bit j: element i0 + j kept)
template <int N>
__device__ __forceinline__ uint8_t keep_byte(const bool (&keep)[N], int i0 = 0) {
  unsigned byte = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) byte |= unsigned(keep[i0 + j]) << j;
  return uint8_t(byte);
}

// Writes the keep-bits of elements e .. e + N - 1 to rng.bits (when set), in the forward that drew
// them (e a multiple of N). With N < 8 (fp32's 4-element vectors, the one-element path) a thread
// holds only part of a byte, so the thread of the byte's first element draws all eight bits (keep8,
// the same pure function of the state and e that keep_run called) and writes the byte.
template <int N>
__device__ __forceinline__ void record_keeps(const RngState& rng, uint64_t e, float p, const bool (&keep)[N]) {
  if (!rng.bits) return;
  if constexpr (N >= 8) {
#pragma unroll
    for (int i = 0; i < N; i += 8) rng.bits[(e + i) >> 3] = keep_byte(keep, i);
  } else if ((e & 7) == 0) {
    bool k[8];
    keep8(rng, e >> 3, p, k);
    rng.bits[e >> 3] = keep_byte(k);
  }
}

// The keep-bits of a dropout in a backward, for N <= 8 elements within one byte of the bits: read
// from the bits the forward stored, or drawn again from the forward's state, or, with `draw` false,
// every element kept. A kernel may load the byte early (stored) and extract the bits later (from),
// so that the load is in flight while it does other work; run does both at once.
struct Redraw {
  RngState rng;
  bool draw;
  template <int N>
  __device__ __forceinline__ unsigned stored(uint64_t e) const {
    static_assert(N <= 8, "one byte of keep-bits");
    return draw && rng.bits ? rng.bits[e >> 3] : 0u;
  }
  template <int N>
  __device__ __forceinline__ void from(unsigned byte, uint64_t e, float p, bool (&keep)[N]) const {
    if (draw && rng.bits) {
#pragma unroll
      for (int i = 0; i < N; ++i) keep[i] = (byte >> ((e & 7) + i)) & 1u;
    } else if (draw) {
      keep_run<N>(rng, e, p, keep);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) keep[i] = true;
    }
  }
  template <int N>
  __device__ __forceinline__ void run(uint64_t e, float p, bool (&keep)[N]) const {
    from<N>(stored<N>(e), e, p, keep);
  }
};

inline Redraw redraw(const RngState* rng, float p) { return rng && p > 0.f ? Redraw{*rng, true} : Redraw{{}, false}; }

__device__ __forceinline__ bool keep1(const RngState& rng, uint64_t e, float p) {
  bool k[1];
  keep_run<1>(rng, e, p, k);
  return k[0];
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

#define LS_DISPATCH_CASE(dtype, type, ...) \
  case dtype: {                            \
    using T = type;                        \
    __VA_ARGS__;                           \
    break;                                 \
  }

// Runs the statements with T bound to the storage type that `dt` names.
#define LS_DISPATCH(dt, ...)                                       \
  switch (dt) {                                                    \
    LS_DISPATCH_CASE(DType::kFloat32, float, __VA_ARGS__)          \
    LS_DISPATCH_CASE(DType::kFloat16, __half, __VA_ARGS__)         \
    LS_DISPATCH_CASE(DType::kBFloat16, __nv_bfloat16, __VA_ARGS__) \
  }

// The same for the 16-bit storage types alone (the tensor cores' inputs); fp32 runs nothing.
#define LS_DISPATCH_HALF(dt, ...)                                  \
  switch (dt) {                                                    \
    LS_DISPATCH_CASE(DType::kFloat16, __half, __VA_ARGS__)         \
    LS_DISPATCH_CASE(DType::kBFloat16, __nv_bfloat16, __VA_ARGS__) \
    default:                                                       \
      break;                                                       \
  }

// The head sizes the decoding attention kernels (beam_attention, decode_attention) are compiled for.
inline bool head_dim_compiled(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// Calls run(std::integral_constant<int, D>{}) with D = head_dim, one of head_dim_compiled's sizes.
template <typename F>
inline void dispatch_head_dim(int head_dim, F&& run) {
  switch (head_dim) {
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    case 256: run(std::integral_constant<int, 256>{}); break;
  }
}

}  // namespace ls
