// Elementwise "compute, drop out, finish" over a [rows, hidden] tensor, shared
// by bias_dropout_residual and bias_act_dropout:
//   out[e] = F.finish(e, keep[e] ? F.value(e) / (1 - p) : 0)
// with 16-byte vector access when hidden and every pointer allow it and a
// scalar path otherwise, and the keep-mask drawn from Philox and stored as one
// byte per element (only when p > 0 and `mask` is set: a given mask is not
// rewritten). F provides
//   template <int N> void values(int64_t e, float (&v)[N]) const;   // N elements from e
//   template <int N> void finish(int64_t e, float (&v)[N]) const;   // in place
#pragma once

#include "common.cuh"

namespace ls {

// x + bias for N columns from element e of a [rows, hidden] x.
template <typename T, int N>
__device__ __forceinline__ void load_biased(const T* x, const T* bias, int64_t e, int hidden, float (&v)[N]) {
  float bv[N];
  load<T, N>(x + e, v);
  load<T, N>(bias + e % hidden, bv);
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] += bv[i];
}

template <typename T, int V, typename F>
__global__ void dropout_map_kernel(F f, T* __restrict__ out, uint8_t* __restrict__ mask, int64_t n, float p,
                                   RngState rng) {
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;
  for (int64_t base = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; base < n;
       base += int64_t(gridDim.x) * blockDim.x * V) {
    if (base + V <= n) {
      float v[V];
      bool keep[V];
      f.template values<V>(base, v);
      if constexpr (V % 4 == 0) {  // base is a multiple of 4: whole Philox groups
#pragma unroll
        for (int i = 0; i < V; i += 4) {
          bool k[4] = {true, true, true, true};
          if (p > 0.f) keep4(rng, (base + i) >> 2, p, k);
#pragma unroll
          for (int j = 0; j < 4; ++j) keep[i + j] = k[j];
        }
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) keep[i] = p > 0.f ? keep1(rng, base + i, p) : true;
      }
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = keep[i] ? v[i] * scale : 0.f;
      if (mask) store_mask<V>(mask + base, keep);
      f.template finish<V>(base, v);
      store<T, V>(out + base, v);
    } else {
      for (int64_t e = base; e < n; ++e) {
        float v[1];
        f.template values<1>(e, v);
        const bool k = p > 0.f ? keep1(rng, e, p) : true;
        v[0] = k ? v[0] * scale : 0.f;
        if (mask) mask[e] = k;
        f.template finish<1>(e, v);
        out[e] = from_f<T>(v[0]);
      }
    }
  }
}

// V = 16-byte vectors when `vectorizable`, else one element per access.
template <typename T, typename F>
void dropout_map(F f, bool vectorizable, T* out, uint8_t* mask, int64_t n, float p, RngState rng,
                 cudaStream_t stream) {
  if (n == 0) return;
  constexpr int V = kVec<T>;
  if (vectorizable && aligned16(out))
    dropout_map_kernel<T, V><<<ceil_div(n, 256 * V), 256, 0, stream>>>(f, out, mask, n, p, rng);
  else
    dropout_map_kernel<T, 1><<<ceil_div(n, 256), 256, 0, stream>>>(f, out, mask, n, p, rng);
}

}  // namespace ls
