// dropout: the keep-mask a dropout call draws, written out. It fuses nothing and is not on the
// training path. No op stores a byte mask (a backward draws the keep-bits again from the
// forward's Philox state, or reads the bits its forward stored, where LightSeq2 keeps a byte
// per element); this kernel writes one for tests, inspection and scripts/parity_ls_masks, from
// the same keep_run that every fused kernel calls.
#include "common.cuh"

namespace ls {

// Thread i writes elements 8i .. 8i + 7 (one Philox call), the last thread the tail.
__global__ void dropout_keep_mask_kernel(RngState rng, int64_t n, float p, uint8_t* __restrict__ out) {
  const int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= n) return;
  bool keep[8];
  if (e + 8 <= n) {
    keep_run<8>(rng, e, p, keep);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[e + i] = keep[i];
  } else {
    for (int64_t i = e; i < n; ++i) out[i] = keep1(rng, i, p);
  }
}

void dropout_keep_mask(RngState rng, int64_t n, float p, uint8_t* out, cudaStream_t stream) {
  if (n == 0) return;
  dropout_keep_mask_kernel<<<ceil_div(ceil_div(n, 8), 256), 256, 0, stream>>>(rng, n, p, out);
}

}  // namespace ls
