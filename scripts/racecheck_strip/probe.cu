// racecheck_strip.sh's program: LayerNorm's backward strip kernel (fp16, hidden 512 and 1,024: SPLIT = 2),
// with and without the bias-dropout-residual tail, on rows whose strips split evenly and unevenly
// over the row groups, on the build of layer_norm.cu the script includes as layer_norm_probe.cu.
#include <cstdio>
#include <vector>
#include "layer_norm_probe.cu"
int main() {
  for (int hidden : {512, 1024}) for (int64_t rows : {256, 7, 37, 1001}) for (int bdr : {0, 1}) {
    const int64_t n = rows * hidden;
    __half *dy, *x, *gamma, *dx, *dh; float *mean, *rstd, *dg, *db, *dbias, *partial;
    cudaMalloc(&dy, n * 2); cudaMalloc(&x, n * 2); cudaMalloc(&dx, n * 2); cudaMalloc(&dh, n * 2);
    cudaMalloc(&gamma, hidden * 2); cudaMalloc(&mean, rows * 4); cudaMalloc(&rstd, rows * 4);
    cudaMalloc(&dg, hidden * 4); cudaMalloc(&db, hidden * 4); cudaMalloc(&dbias, hidden * 4);
    cudaMalloc(&partial, 3 * ls::column_chunks(rows) * hidden * 4);
    std::vector<__half> h(n); for (int64_t i = 0; i < n; ++i) h[i] = __float2half(float((i * 7919) % 97) / 97.f - 0.5f);
    cudaMemcpy(dy, h.data(), n * 2, cudaMemcpyHostToDevice); cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(gamma, h.data(), hidden * 2, cudaMemcpyHostToDevice);
    std::vector<float> s(rows, 1.f); cudaMemcpy(rstd, s.data(), rows * 4, cudaMemcpyHostToDevice);
    cudaMemset(mean, 0, rows * 4);
    if (bdr) {
      ls::RngState rng{1234, 0, nullptr};
      ls::bias_dropout_residual_layer_norm_backward(ls::DType::kFloat16, dy, x, gamma, mean, rstd, &rng, 0.1f, dx, dh,
                                                    ls::GradOut{dg, false}, ls::GradOut{db, false},
                                                    ls::GradOut{dbias, false}, partial, rows, hidden, 0);
    } else {
      ls::layer_norm_backward(ls::DType::kFloat16, dy, x, gamma, mean, rstd, dx, ls::GradOut{dg, false},
                              ls::GradOut{db, false}, partial, rows, hidden, 0);
    }
    printf("hidden %d rows %ld bdr %d: %s\n", hidden, long(rows), bdr, cudaGetErrorString(cudaDeviceSynchronize()));
    cudaFree(dy); cudaFree(x); cudaFree(dx); cudaFree(dh); cudaFree(gamma); cudaFree(mean); cudaFree(rstd);
    cudaFree(dg); cudaFree(db); cudaFree(dbias); cudaFree(partial);
  }
  return 0;
}
