// cross_entropy: fairseq's label-smoothed cross-entropy from the logits (LightSeq2 technique: its
// fused cross-entropy layer, loss and gradient straight from the logits).
// One block per token reads its row of logits once, keeping a running max and
// sum of exponentials (online logsumexp) and the sum of the logits, and writes
// three fp32 numbers: loss, nll and lse. The [tokens x vocab] log-probabilities
// are never written, in any precision. With V the vocabulary, eps_i = eps / (V - 1):
//   nll = (max_j x_j - x_t) + log(sum_j exp(x_j - max_j x_j)) (lse - x_t without the rounding of
//   lse: where x_t is the maximum and the rest far below, nll is tiny; the log of the sum taken as
//   log(c) + log1p(r / c), c the count of logits at the maximum, r the others' exponentials, so
//   that r's digits survive), smooth = V * lse - sum_j x_j,
//   loss = (1 - eps - eps_i) * nll + eps_i * smooth (0 where target = padding).
// Backward reads the row once more and writes the gradient in the logits' dtype, over
// the logits themselves when the caller allows (LightSeq2 reuses that buffer too):
//   dloss/dx_j = p_j - eps_i - (1 - eps - eps_i) [j = t]   (p_j's coefficient,
//   (1 - eps - eps_i) + V eps_i, is 1); dnll/dx_j = p_j - [j = t]; p_j = exp(x_j - lse).
#include "common.cuh"

namespace ls {

// Merge running (max m, count c of the logits at m, sum r of exp(x - m) over the others) triples.
// The sum of exponentials is c + r; keeping c apart keeps r's digits where one logit leads the
// rest by far (c = 1, r ~ 1e-9: log(c + r) = log1p(r), which 1 + r in fp32 would round to 0).
__device__ __forceinline__ void lse_merge(float& m, float& c, float& r, float m2, float c2, float r2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY || m2 > m) {
    r = r2 + (m == -INFINITY ? 0.f : (c + r) * expf(m - m2));
    c = c2;
    m = m2;
  } else if (m2 == m) {
    c += c2;
    r += r2;
  } else {
    r += (c2 + r2) * expf(m2 - m);
  }
}

template <typename T, int V>
__global__ void ce_forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                                  float* __restrict__ loss, float* __restrict__ nll, float* __restrict__ lse_out,
                                  int vocab, float epsilon, int padding_idx) {
  __shared__ float sm[32], sc[32], sr[32], sx[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  // per vector of V logits: the running max moves (and r is rescaled) at most once, then one
  // exp2 per element of x - m (exact where x is near m, unlike x log2e - m log2e) and no branch
  constexpr float kLog2e = 1.4426950408889634f;
  float m = -INFINITY, c = 0.f, r = 0.f, sumx = 0.f;
  for (int j = threadIdx.x * V; j < vocab; j += blockDim.x * V) {
    float v[V], vm = -INFINITY;
    load<T, V>(x + j, v);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      sumx += v[i];
      vm = fmaxf(vm, v[i]);
    }
    if (vm > m) {
      r = m == -INFINITY ? 0.f : (c + r) * exp2_ftz((m - vm) * kLog2e);
      c = 0.f;
      m = vm;
    }
    if (m != -INFINITY) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const bool top = v[i] == m;
        c += top ? 1.f : 0.f;
        r += top ? 0.f : exp2_ftz((v[i] - m) * kLog2e);
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), c2 = __shfl_xor_sync(0xffffffffu, c, o),
                r2 = __shfl_xor_sync(0xffffffffu, r, o);
    lse_merge(m, c, r, m2, c2, r2);
    sumx += __shfl_xor_sync(0xffffffffu, sumx, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[warp] = m;
    sc[warp] = c;
    sr[warp] = r;
    sx[warp] = sumx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w) {
      lse_merge(m, c, r, sm[w], sc[w], sr[w]);
      sumx += sx[w];
    }
    const float log_sum = c > 0.f ? logf(c) + log1pf(r / c) : logf(r);  // log(c + r)
    const float lse = m + log_sum;
    const int64_t t = target[row];
    lse_out[row] = lse;
    if (t == padding_idx) {
      loss[row] = 0.f;
      nll[row] = 0.f;
    } else {
      const float eps_i = epsilon / (vocab - 1);
      const float n = (m - to_f(x[t])) + log_sum;
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
