// adam: one update of the whole parameter workspace (LightSeq2's workspace
// optimizer), and the global gradient norm that clipping and overflow checks need.
// adam_step fuses: loss-scale division (grad_scale, optionally times a device
// scalar so the host never reads it), L2 or decoupled weight decay, both moment
// updates, bias correction (step_size from the host's step count), and the
// write-back to fp16/bf16 parameters and/or the fp32 master copy. Math in fp32.
// Without a master copy the write-back may round stochastically (Philox words
// from torch's generator, one per element), so that updates smaller than half a
// unit of the parameter's precision are not all lost to rounding.
// A non-zero device noop flag (an overflow found by grad_norm's caller) turns
// the step into a no-op without a host synchronisation. Any length: a 16-byte
// vector body and a scalar tail, nothing read past the end.
// grad_norm: one launch. Sums of squares in fixed-size blocks; the last block to
// finish adds the partials in order (deterministic) and, given an epilogue, makes
// the mixed-precision step's decision on the device: the true norm (unscaled),
// the overflow flag (inf/NaN), the factor the update multiplies gradients by
// (1 / loss scale x host factor x clip coefficient), Adam's step count (not
// advanced by a skipped step) and the dynamic loss scale (halved on overflow,
// doubled after scale_window good steps). The host never reads any of it.
// Never written to memory: the unscaled, clipped or weight-decayed gradient, the bias-corrected
// moments, the fp32 update of a parameter kept without a master copy; each lives in registers
// between one read and one write of the workspace.
#include "common.cuh"

namespace ls {

__device__ __forceinline__ void adam_one(float& p, float g, float& m, float& v, const AdamArgs& a, float gs) {
  g *= gs;
  if (!a.decoupled) g += a.weight_decay * p;
  m = a.beta1 * m + (1.f - a.beta1) * g;
  v = a.beta2 * v + (1.f - a.beta2) * g * g;
  if (a.decoupled) p -= a.lr * a.weight_decay * p;
  p -= a.step_size * m / (sqrtf(v) + a.eps);
}

// V values for elements e .. e + V - 1, rounded stochastically: element e's word is
// word e % 4 of Philox group e / 4, however the elements are grouped into accesses
// (V a multiple of 4 comes with e a multiple of 4: whole groups).
template <typename T, int V>
__device__ __forceinline__ void store_stochastic(T* p, const float (&v)[V], const RngState& rng, int64_t e) {
  Pack<T, V> pk;
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const uint4 r = random4(rng, uint64_t(e + i) >> 2);
      const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) pk.v[i + j] = round_stochastic<T>(v[i + j], w[j]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const uint4 r = random4(rng, uint64_t(e + i) >> 2);
      const unsigned w[4] = {r.x, r.y, r.z, r.w};
      pk.v[i] = round_stochastic<T>(v[i], w[(e + i) & 3]);
    }
  }
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

template <typename T, int V>
__global__ void adam_kernel(T* __restrict__ param, const T* __restrict__ grad, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, float* __restrict__ master, int64_t n, AdamArgs a) {
  if (a.noop_flag && *a.noop_flag != 0.f) return;
  if (a.step_ptr) {
    const float t = *a.step_ptr;
    a.step_size = a.lr * sqrtf(1.f - powf(a.beta2, t)) / (1.f - powf(a.beta1, t));
  }
  const float gs = a.grad_scale * (a.grad_scale_ptr ? *a.grad_scale_ptr : 1.f);
  for (int64_t base = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; base < n;
       base += int64_t(gridDim.x) * blockDim.x * V) {
    if (base + V <= n) {
      float p[V], g[V], m[V], v[V];
      load<T, V>(grad + base, g);
      if (master)
        load<float, V>(master + base, p);
      else
        load<T, V>(param + base, p);
      load<float, V>(exp_avg + base, m);
      load<float, V>(exp_avg_sq + base, v);
#pragma unroll
      for (int i = 0; i < V; ++i) adam_one(p[i], g[i], m[i], v[i], a, gs);
      store<float, V>(exp_avg + base, m);
      store<float, V>(exp_avg_sq + base, v);
      if (master) store<float, V>(master + base, p);
      if (a.stochastic_rounding)
        store_stochastic<T, V>(param + base, p, a.rng, base);
      else
        store<T, V>(param + base, p);
    } else {
      for (int64_t e = base; e < n; ++e) {
        float p = master ? master[e] : to_f(param[e]), m = exp_avg[e], v = exp_avg_sq[e];
        adam_one(p, to_f(grad[e]), m, v, a, gs);
        exp_avg[e] = m;
        exp_avg_sq[e] = v;
        if (master) master[e] = p;
        float q[1] = {p};
        if (a.stochastic_rounding)
          store_stochastic<T, 1>(param + e, q, a.rng, e);
        else
          param[e] = from_f<T>(p);
      }
    }
  }
}

__device__ void scaler_epilogue(float sum_squares, const NormEpilogue& e) {
  float* st = e.state;
  const float scale = st[0];
  const float norm = sqrtf(sum_squares) * e.factor / scale;
  const bool overflow = !isfinite(norm);
  // fairseq's clip_grad_norm: coefficient max_norm / (norm + 1e-6), at most 1
  const float clip = e.max_norm > 0.f ? fminf(1.f, e.max_norm / (norm + 1e-6f)) : 1.f;
  st[2] = norm;
  st[3] = e.factor / scale * clip;
  st[4] = overflow ? 1.f : 0.f;
  if (!overflow) st[5] += 1.f;
  if (e.scale_window > 0.f) {
    if (overflow) {
      st[0] = fmaxf(scale * 0.5f, e.scale_floor);
      st[1] = 0.f;
    } else if (st[1] + 1.f >= e.scale_window) {
      st[0] = scale * 2.f;
      st[1] = 0.f;
    } else {
      st[1] += 1.f;
    }
  }
}

// V elements per load (16 bytes when x is aligned), four loads per thread in flight, then the
// elements past the last whole vector one by one, so that the whole workspace (~426 MB for
// transformer-big in fp16) is read at copy speed; 2-byte loads reach a fraction of it.
template <typename T, int V>
__global__ void grad_norm_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ partial,
                                 unsigned* __restrict__ counter, float* __restrict__ out, NormEpilogue e) {
  __shared__ bool last;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / V;
  float s = 0.f;
#pragma unroll 4
  for (int64_t i = first; i < vectors; i += stride) {
    float v[V];
    load<T, V>(x + i * V, v);
#pragma unroll
    for (int k = 0; k < V; ++k) s += v[k] * v[k];
  }
  for (int64_t i = vectors * V + first; i < n; i += stride) {
    const float v = to_f(x[i]);
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = s;
    last = arrive(counter) == gridDim.x - 1;  // the partial is visible before the counter says so
  }
  __syncthreads();
  if (!last) return;
  s = 0.f;
  for (int i = threadIdx.x; i < gridDim.x; i += blockDim.x) s += __ldcg(partial + i);
  s = block_sum(s);
  if (threadIdx.x == 0) {
    *out = sqrtf(s);
    if (e.state) scaler_epilogue(s, e);
    *counter = 0u;
  }
}

void grad_norm(DType dt, const void* grad, int64_t n, float* partial, unsigned* counter, float* out,
               const NormEpilogue* epilogue, cudaStream_t stream) {
  const NormEpilogue e = epilogue ? *epilogue : NormEpilogue{};
  LS_DISPATCH(dt, {
    if (aligned16(grad))
      grad_norm_kernel<T, kVec<T>><<<kNormBlocks, 512, 0, stream>>>((const T*)grad, n, partial, counter, out, e);
    else
      grad_norm_kernel<T, 1><<<kNormBlocks, 512, 0, stream>>>((const T*)grad, n, partial, counter, out, e);
  })
}

void adam_step(DType dt, void* param, const void* grad, float* exp_avg, float* exp_avg_sq, float* master, int64_t n,
               const AdamArgs& args, cudaStream_t stream) {
  if (n == 0) return;
  LS_DISPATCH(dt, {
    constexpr int V = 4;  // four fp32 moments per access: 16 bytes
    const bool vec = aligned16(exp_avg) && aligned16(exp_avg_sq) && (!master || aligned16(master)) &&
                     (reinterpret_cast<uintptr_t>(param) % (V * sizeof(T))) == 0 &&
                     (reinterpret_cast<uintptr_t>(grad) % (V * sizeof(T))) == 0;
    const int64_t blocks = (n + 256 * V - 1) / (256 * V);
    const int grid = int(blocks < 4096 ? blocks : 4096);
    if (vec)
      adam_kernel<T, V><<<grid, 256, 0, stream>>>((T*)param, (const T*)grad, exp_avg, exp_avg_sq, master, n, args);
    else
      adam_kernel<T, 1><<<grid, 256, 0, stream>>>((T*)param, (const T*)grad, exp_avg, exp_avg_sq, master, n, args);
  })
}

}  // namespace ls
