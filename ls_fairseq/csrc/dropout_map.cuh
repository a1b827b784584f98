// Elementwise "compute, drop out, finish" over a [rows, cols] tensor, shared by
// bias_dropout_residual, bias_act_dropout and embedding:
//   out[r, c] = F.finish(r, c, keep[r, c] ? F.values(r, c) / (1 - p) : 0)
// A thread takes V adjacent columns of a row (16-byte vectors when cols and every
// pointer allow, else V = 1), a block's y index the rows: no division or modulo by
// cols anywhere. The keep-mask comes from Philox (keep_run, a function of the element
// index r * cols + c only, so any launch shape draws the same mask, and a backward kernel
// draws it again from the same RngState); it is written only as bits, where the RngState
// asks. The thread issues its loads (F.fetch), draws the keep-bits while they are in flight,
// then computes. F provides
//   template <int N> struct In;                                            // what fetch loaded
//   template <int N> In<N> fetch(int64_t r, int c) const;                  // N elements from (r, c)
//   template <int N> void values(const In<N>& in, float (&v)[N]) const;
//   template <int N> void finish(const In<N>& in, float (&v)[N]) const;    // in place
// A map whose row addresses wait on loads of their own (the embedding's ids) provides instead of
// fetch(r, c)
//   Located locate(int64_t r) const;                                       // issues those loads
//   template <int N> In<N> fetch(const Located& at, int c) const;
// and the thread draws while locate's loads are in flight, then fetches: drawing after fetch left
// the draw behind two dependent loads (the embedding forward, 8,192 x 1,024 fp16: 14.3 us, drawing
// first 11.2 us, 11.5 at p = 0; 18th session).
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

template <int V>
__device__ __forceinline__ void draw_keeps(const RngState& rng, int64_t e, float p, bool (&keep)[V]) {
  if (p > 0.f) {
    keep_run<V>(rng, e, p, keep);
    record_keeps<V>(rng, e, p, keep);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) keep[i] = true;
  }
}

template <typename T, int V, typename F>
__global__ void dropout_map_kernel(F f, T* __restrict__ out, int64_t rows, int cols, float p, RngState rng) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c >= cols) return;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t e = r * cols + c;
    bool keep[V];
    const auto in = [&] {
      if constexpr (Locating<F>) {
        const auto at = f.locate(r);
        draw_keeps<V>(rng, e, p, keep);
        return f.template fetch<V>(at, c);
      } else {
        const auto loaded = f.template fetch<V>(r, c);
        draw_keeps<V>(rng, e, p, keep);
        return loaded;
      }
    }();
    float v[V];
    f.template values<V>(in, v);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = keep[i] ? v[i] * scale : 0.f;
    f.template finish<V>(in, v);
    store<T, V>(out + e, v);
  }
}

// V = 16-byte vectors when `vectorizable` (cols a multiple of them, the functor's pointers
// aligned), else one element per access.
template <typename T, typename F>
void dropout_map(F f, bool vectorizable, T* out, int64_t rows, int cols, float p, RngState rng, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  constexpr int V = kVec<T>;
  auto launch = [&]<int N>() {
    const int vectors = cols / N, threads = vectors < 256 ? (vectors + 31) / 32 * 32 : 256;
    const dim3 grid(ceil_div(vectors, threads), unsigned(rows < 65535 ? rows : 65535));
    dropout_map_kernel<T, N><<<grid, threads, 0, stream>>>(f, out, rows, cols, p, rng);
  };
  if (vectorizable && cols % V == 0 && aligned16(out))
    launch.template operator()<V>();
  else
    launch.template operator()<1>();
}

}  // namespace ls
