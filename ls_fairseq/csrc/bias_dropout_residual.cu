// bias_dropout_residual: out = residual + dropout(x + bias), the tail of every
// attention and FFN block.
// Fuses: bias add, dropout (mask drawn in-kernel from Philox), residual add.
// Never written to memory: x + bias, the dropped value. The keep-mask is written
// as bits, 1/16 of the output's bytes in fp16 (LightSeq2's bias+dropout+residual
// fusion stores a byte per element), and the backward reads them: drawing them
// again there cost more than the read (docs/perf-log.md, "Kernel design measurements").
// Backward: dx = dout * keep / (1 - p), dresidual = dout (returned as is by the
// autograd Function), dbias = column sum of dx, fused into the same pass.
#include "common.cuh"
#include "dropout_map.cuh"
#include "reduce.cuh"

namespace ls {

// values: x + bias; finish: + residual
template <typename T>
struct BdrForward {
  const T* x;
  const T* bias;
  const T* residual;
  int hidden;
  template <int N>
  struct In {
    Pack<T, N> x, bias, residual;
  };
  template <int N>
  __device__ In<N> fetch(int64_t r, int c) const {
    return {load_pack<T, N>(x + r * hidden + c), load_pack<T, N>(bias + c), load_pack<T, N>(residual + r * hidden + c)};
  }
  template <int N>
  __device__ void values(const In<N>& in, float (&v)[N]) const {
    add_unpacked(in.x, in.bias, v);
  }
  template <int N>
  __device__ void finish(const In<N>& in, float (&v)[N]) const {
    float rv[N];
    unpack(in.residual, rv);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += rv[i];
  }
};

template <typename T>
struct BdrBackwardMap {
  const T* dout;
  Redraw keeps;
  T* dx;
  int hidden;
  float p;
  template <int N>
  __device__ void operator()(int64_t r, int c, float (&v)[1][N]) const {
    const int64_t e = r * hidden + c;
    const float scale = dropout_scale(p);
    bool keep[N];
    const Pack<T, N> d = load_pack<T, N>(dout + e);  // in flight during the draw
    keeps.run<N>(e, p, keep);
    unpack(d, v[0]);
#pragma unroll
    for (int i = 0; i < N; ++i) v[0][i] = keep[i] ? v[0][i] * scale : 0.f;
    store<T, N>(dx + e, v[0]);
  }
};

void bias_dropout_residual_forward(DType dt, const void* x, const void* bias, const void* residual, void* out,
                                   int64_t rows, int hidden, float p, RngState rng, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    const bool vec = hidden % kVec<T> == 0 && aligned16(x) && aligned16(bias) && aligned16(residual);
    dropout_map<T>(BdrForward<T>{(const T*)x, (const T*)bias, (const T*)residual, hidden}, vec, (T*)out, rows,
                   hidden, p, rng, stream);
  })
}

void bias_dropout_residual_backward(DType dt, const void* dout, const RngState* rng, void* dx, GradOut dbias,
                                    float* partial, int64_t rows, int hidden, float p, cudaStream_t stream) {
  LS_DISPATCH(dt, {
    BdrBackwardMap<T> f{(const T*)dout, redraw(rng, p), (T*)dx, hidden, p};
    map_column_sum<T, 1>(f, aligned16(dout) && aligned16(dx), GradOuts<1>{{dbias}}, partial, rows, hidden, stream);
  })
}

}  // namespace ls
