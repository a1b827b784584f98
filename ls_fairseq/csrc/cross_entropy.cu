// cross_entropy: fairseq's label-smoothed cross-entropy from the logits (LightSeq2 technique: its
// fused cross-entropy layer, loss and gradient straight from the logits).
// One block per token reads its row of logits once, keeping a running max and
// sum of exponentials (online logsumexp) and the sum of the logits, and writes
// three fp32 numbers: loss, nll and lse. The [tokens x vocab] log-probabilities
// are never written, in any precision. With V the vocabulary, eps_i = eps / (V - 1):
//   nll = (max_j x_j - x_t) + log(sum_j exp(x_j - max_j x_j)) (lse - x_t without the rounding of
//   lse: where x_t is the maximum and the rest far below, nll is tiny), smooth = V * lse - sum_j x_j,
//   loss = (1 - eps - eps_i) * nll + eps_i * smooth (0 where target = padding).
// Backward reads the row once more and writes the gradient in the logits' dtype, over
// the logits themselves when the caller allows (LightSeq2 reuses that buffer too):
//   dloss/dx_j = p_j - eps_i - (1 - eps - eps_i) [j = t]   (p_j's coefficient,
//   (1 - eps - eps_i) + V eps_i, is 1); dnll/dx_j = p_j - [j = t]; p_j = exp(x_j - lse).
#include "common.cuh"

namespace ls {

// Merge running (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

template <typename T, int V>
__global__ void ce_forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                                  float* __restrict__ loss, float* __restrict__ nll, float* __restrict__ lse_out,
                                  int vocab, float epsilon, int padding_idx) {
  __shared__ float sm[32], ss[32], sx[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  // per vector of V logits: the running max moves (and s is rescaled) at most once, then one
  // exp2 (one FMA before it) per element: no per-element branch
  constexpr float kLog2e = 1.4426950408889634f;
  float m = -INFINITY, s = 0.f, sumx = 0.f;
  for (int j = threadIdx.x * V; j < vocab; j += blockDim.x * V) {
    float v[V], vm = -INFINITY;
    load<T, V>(x + j, v);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      sumx += v[i];
      vm = fmaxf(vm, v[i]);
    }
    if (vm > m) {
      s = m == -INFINITY ? 0.f : s * exp2_ftz((m - vm) * kLog2e);
      m = vm;
    }
    if (m != -INFINITY) {
      const float ml = m * kLog2e;
#pragma unroll
      for (int i = 0; i < V; ++i) s += exp2_ftz(fmaf(v[i], kLog2e, -ml));
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
    sumx += __shfl_xor_sync(0xffffffffu, sumx, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
    sx[warp] = sumx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w) {
      lse_merge(m, s, sm[w], ss[w]);
      sumx += sx[w];
    }
    const float lse = m + logf(s);
    const int64_t t = target[row];
    lse_out[row] = lse;
    if (t == padding_idx) {
      loss[row] = 0.f;
      nll[row] = 0.f;
    } else {
      const float eps_i = epsilon / (vocab - 1);
      const float n = (m - to_f(x[t])) + logf(s);
      nll[row] = n;
      loss[row] = (1.f - epsilon - eps_i) * n + eps_i * (float(vocab) * lse - sumx);
    }
  }
}

template <typename T, int V>
// logits and dlogits may be the same buffer (each element is read once, then written once in its place);
// dloss: a row's at row * dloss_stride (0: one value for every row, the gradient of a sum); dnll: none
// (nullptr) when the nll loss took no gradient
__global__ void ce_backward_kernel(const float* __restrict__ dloss, int64_t dloss_stride,
                                   const float* __restrict__ dnll, const T* logits,
                                   const int64_t* __restrict__ target, const float* __restrict__ lse, T* dlogits,
                                   int vocab, float epsilon, int padding_idx) {
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const bool live = t != padding_idx;
  const float gl = live ? dloss[row * dloss_stride] : 0.f, gn = live && dnll ? dnll[row] : 0.f, l = lse[row];
  const float eps_i = epsilon / (vocab - 1), c = 1.f - epsilon - eps_i;
  const T* x = logits + row * vocab;
  T* dx = dlogits + row * vocab;
  for (int j = threadIdx.x * V; j < vocab; j += blockDim.x * V) {
    float v[V];
    load<T, V>(x + j, v);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float p = exp_ftz(v[i] - l), hit = j + i == t ? 1.f : 0.f;
      v[i] = gl * (p - eps_i - c * hit) + gn * (p - hit);
    }
    store<T, V>(dx + j, v);
  }
}

// Vectorized when every row starts 16-byte aligned.
template <typename T>
bool rows_vectorizable(const void* p, int vocab) {
  return aligned16(p) && vocab % kVec<T> == 0;
}

void cross_entropy_forward(DType dt, const void* logits, const int64_t* target, float* loss, float* nll, float* lse,
                           int64_t n, int vocab, float epsilon, int padding_idx, cudaStream_t stream) {
  if (n == 0) return;
  LS_DISPATCH(dt, {
    if (rows_vectorizable<T>(logits, vocab))
      ce_forward_kernel<T, kVec<T>><<<n, 512, 0, stream>>>((const T*)logits, target, loss, nll, lse, vocab, epsilon,
                                                           padding_idx);
    else
      ce_forward_kernel<T, 1><<<n, 512, 0, stream>>>((const T*)logits, target, loss, nll, lse, vocab, epsilon,
                                                     padding_idx);
  })
}

void cross_entropy_backward(DType dt, const float* dloss, int64_t dloss_stride, const float* dnll, const void* logits,
                            const int64_t* target, const float* lse, void* dlogits, int64_t n, int vocab,
                            float epsilon, int padding_idx, cudaStream_t stream) {
  if (n == 0) return;
  LS_DISPATCH(dt, {
    if (rows_vectorizable<T>(logits, vocab) && aligned16(dlogits))
      ce_backward_kernel<T, kVec<T>><<<n, 512, 0, stream>>>(dloss, dloss_stride, dnll, (const T*)logits, target, lse,
                                                            (T*)dlogits, vocab, epsilon, padding_idx);
    else
      ce_backward_kernel<T, 1><<<n, 512, 0, stream>>>(dloss, dloss_stride, dnll, (const T*)logits, target, lse,
                                                      (T*)dlogits, vocab, epsilon, padding_idx);
  })
}

}  // namespace ls
