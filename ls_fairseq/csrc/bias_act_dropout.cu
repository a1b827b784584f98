// bias_act_dropout: out = dropout(act(x + bias)), act = relu or gelu (the exact
// erf form, as fairseq's gelu), the first half of the FFN.
// Fuses: bias add, activation, dropout (mask drawn in-kernel from Philox).
// Never written to memory: x + bias, act(x + bias), the keep-mask (backward draws
// the keep-bits again from the forward's Philox state; LightSeq2's
// bias+activation+dropout fusion stores them).
// Backward recomputes h = x + bias from x (no bias: zero, for relu's backward
// from its output):
//   dh = dout * keep / (1 - p) * act'(h), act'(h) = [h > 0] (relu) or
//   Phi(h) + h * phi(h) (gelu, Phi/phi the normal cdf/pdf); dbias = column sum of dh,
// fused into the same pass.
#include "common.cuh"
#include "dropout_map.cuh"
#include "reduce.cuh"

namespace ls {

__device__ __forceinline__ float act(float h, int activation) {
  return activation == 0 ? fmaxf(h, 0.f) : 0.5f * h * (1.f + erff(h * 0.70710678118654752f));
}

__device__ __forceinline__ float act_grad(float h, int activation) {
  if (activation == 0) return h > 0.f ? 1.f : 0.f;
  const float cdf = 0.5f * (1.f + erff(h * 0.70710678118654752f));
  const float pdf = expf(-0.5f * h * h) * 0.39894228040143268f;
  return cdf + h * pdf;
}

// values: act(x + bias); finish: nothing
template <typename T>
struct BadForward {
  const T* x;
  const T* bias;
  int hidden, activation;
  template <int N>
  struct In {
    Pack<T, N> x, bias;
  };
  template <int N>
  __device__ In<N> fetch(int64_t r, int c) const {
    return {load_pack<T, N>(x + r * hidden + c), load_pack<T, N>(bias + c)};
  }
  template <int N>
  __device__ void values(const In<N>& in, float (&v)[N]) const {
    add_unpacked(in.x, in.bias, v);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = act(v[i], activation);
  }
  template <int N>
  __device__ void finish(const In<N>&, float (&)[N]) const {}
};

template <typename T>
struct BadBackwardMap {
  const T* dout;
  const T* x;
  const T* bias;
  Redraw keeps;
  T* dx;
  int hidden, activation;
  float p;
  template <int N>
  __device__ void operator()(int64_t r, int c, float (&v)[1][N]) const {
    const int64_t e = r * hidden + c;
    float xv[N], bv[N] = {};
    bool keep[N];
    const Pack<T, N> d = load_pack<T, N>(dout + e), xp = load_pack<T, N>(x + e);  // in flight during the draw
    Pack<T, N> bp{};
    if (bias) bp = load_pack<T, N>(bias + c);
    keeps.run<N>(e, p, keep);
    unpack(d, v[0]);
    unpack(xp, xv);
    if (bias) unpack(bp, bv);
    const float scale = dropout_scale(p);
#pragma unroll
    for (int i = 0; i < N; ++i) v[0][i] = keep[i] ? v[0][i] * scale * act_grad(xv[i] + bv[i], activation) : 0.f;
    store<T, N>(dx + e, v[0]);
  }
};

void bias_act_dropout_forward(DType dt, const void* x, const void* bias, void* out, int64_t rows, int hidden,
                              int activation, float p, RngState rng, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    const bool vec = hidden % kVec<T> == 0 && aligned16(x) && aligned16(bias);
    dropout_map<T>(BadForward<T>{(const T*)x, (const T*)bias, hidden, activation}, vec, (T*)out, rows, hidden,
                   p, rng, stream);
  })
}

void bias_act_dropout_backward(DType dt, const void* dout, const void* x, const void* bias, const RngState* rng,
                               void* dx, GradOut dbias, float* partial, int64_t rows, int hidden, int activation,
                               float p, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    BadBackwardMap<T> f{(const T*)dout, (const T*)x, (const T*)bias, redraw(rng, p), (T*)dx, hidden, activation, p};
    const bool vec = aligned16(dout) && aligned16(x) && aligned16(bias) && aligned16(dx);
    map_column_sum<T, 1>(f, vec, GradOuts<1>{{dbias}}, partial, rows, hidden, stream);
  })
}

}  // namespace ls
