// Elementwise "compute, drop out, finish" over a [rows, cols] tensor, shared by
// bias_dropout_residual, bias_act_dropout and embedding:
//   out[r, c] = F.finish(r, c, keep[r, c] ? F.values(r, c) / (1 - p) : 0)
// A thread takes V adjacent columns of a row (16-byte vectors when cols and every
// pointer allow, else V = 1), and a block's x index is its row, so no thread divides by
// cols or takes a modulo. The keep-mask comes from Philox (keep_run, a function of the
// element index r * cols + c only, so every launch shape draws the same mask, and a
// backward kernel draws it again from the same RngState); it is written only as bits, and
// only where the RngState asks for them. The thread issues its loads (F.fetch), draws the
// keep-bits while they are in flight, then computes. F provides
//   template <int N> struct In;                                            // what fetch loaded
//   template <int N> In<N> fetch(int64_t r, int c) const;                  // N elements from (r, c)
//   template <int N> void values(const In<N>& in, float (&v)[N]) const;
//   template <int N> void finish(const In<N>& in, float (&v)[N]) const;    // in place
// A map whose row addresses depend on loads of their own (the embedding's ids) provides,
// instead of fetch(r, c),
//   Located locate(int64_t r) const;                                       // issues those loads
//   template <int N> In<N> fetch(const Located& at, int c) const;
// and the thread draws while locate's loads are in flight, then fetches. Drawing after fetch
// left the draw waiting behind two dependent loads (docs/perf-log.md, "Kernel design measurements").
#pragma once

#include "common.cuh"

namespace ls {

// x + bias for N adjacent elements, from their packs.
template <typename T, int N>
__device__ __forceinline__ void add_unpacked(const Pack<T, N>& x, const Pack<T, N>& bias, float (&v)[N]) {
  float bv[N];
  unpack(x, v);
  unpack(bias, bv);
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] += bv[i];
}

template <typename F>
concept Locating = requires(const F& f, int64_t r) { f.locate(r); };

// A block takes `threads` x V columns of one row: grid x indexes the rows and grid y the column
// blocks, so no thread loops (a loop over the rows by gridDim.y made the embedding forward
// slower). DROP (p > 0) is a template argument, so a thread with dropout carries no test of p and
// one without draws nothing; testing p at run time was slower (docs/perf-log.md, "Kernel design measurements").
template <typename T, int V, bool DROP, typename F>
__global__ void dropout_map_kernel(F f, T* __restrict__ out, int64_t row0, int col0, int cols, float p,
                                   RngState rng) {
  const int c = col0 + (blockIdx.y * blockDim.x + threadIdx.x) * V;
  if (c >= cols) return;
  const int64_t r = row0 + blockIdx.x, e = r * cols + c;
  bool keep[V];
  auto draw = [&] {
    if constexpr (DROP) {
      keep_run<V>(rng, e, p, keep);
      record_keeps<V>(rng, e, p, keep);
    }
  };
  const auto in = [&] {
    if constexpr (Locating<F>) {
      const auto at = f.locate(r);
      draw();
      return f.template fetch<V>(at, c);
    } else {
      const auto loaded = f.template fetch<V>(r, c);
      draw();
      return loaded;
    }
  }();
  float v[V];
  f.template values<V>(in, v);
  if constexpr (DROP) {
    const float scale = dropout_scale(p);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = keep[i] ? v[i] * scale : 0.f;
  }
  f.template finish<V>(in, v);
  store<T, V>(out + e, v);
}

// V = 16-byte vectors when `vectorizable` (cols a multiple of them, the functor's pointers
// aligned), else one element per access. Rows and column blocks beyond one grid's reach (2^31 - 1
// and 65,535) take more launches.
template <typename T, typename F>
void dropout_map(F f, bool vectorizable, T* out, int64_t rows, int cols, float p, RngState rng, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  constexpr int V = kVec<T>;
  constexpr int64_t kMaxRows = 2147483647, kMaxColumnBlocks = 65535;
  auto launch = [&]<int N, bool DROP>() {
    const int vectors = cols / N, threads = vectors < 256 ? (vectors + 31) / 32 * 32 : 256;
    const int64_t blocks = ceil_div(vectors, threads);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows)
      for (int64_t b0 = 0; b0 < blocks; b0 += kMaxColumnBlocks) {
        const dim3 grid(unsigned(rows - r0 < kMaxRows ? rows - r0 : kMaxRows),
                        unsigned(blocks - b0 < kMaxColumnBlocks ? blocks - b0 : kMaxColumnBlocks));
        dropout_map_kernel<T, N, DROP><<<grid, threads, 0, stream>>>(f, out, r0, int(b0 * threads * N), cols, p, rng);
      }
  };
  const bool vec = vectorizable && cols % V == 0 && aligned16(out);
  if (vec && p > 0.f)
    launch.template operator()<V, true>();
  else if (vec)
    launch.template operator()<V, false>();
  else if (p > 0.f)
    launch.template operator()<1, true>();
  else
    launch.template operator()<1, false>();
}

}  // namespace ls
