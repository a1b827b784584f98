// Experiment (session 20): the embedding forward and backward (uniform and Zipf ids, keep-bits drawn
// again) of one csrc variant, 8192 x 1024 fp16, vocab 32000, p = 0.1, timed in CUDA graphs.
// nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -I <csrc> embx.cu -o embx
#include <cstdio>
#include <cmath>
#include <vector>
#include <algorithm>
#include <functional>
#include "embedding.cu"
using namespace ls;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

// per-call time of run(0 .. 59) captured in one CUDA graph: the best of `reps` replays
static float graph_us(cudaStream_t s, int reps, const std::function<void(int)>& run) {
  cudaGraph_t g; cudaGraphExec_t ge; cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int it = 0; it < 60; ++it) run(it);
  CK(cudaStreamEndCapture(s, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
  float best = 1e9;
  for (int t = 0; t < reps; ++t) {
    CK(cudaEventRecord(e0, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms);
  }
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  return best * 1000 / 60;
}
using T = __half;
constexpr int N = 8192, D = 1024, VOC = 32000, SETS = 6, PAD = 1, LEN = 64;
int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "?";
  srand(1);
  std::vector<double> cdf(VOC - 4);
  double acc = 0;
  for (int r = 0; r < VOC - 4; ++r) cdf[r] = (acc += 1.0 / (r + 1));
  std::vector<int64_t> tok(N * SETS), ztok(N * SETS), pos(N * SETS);
  for (int i = 0; i < N * SETS; ++i) {
    tok[i] = 4 + rand() % (VOC - 4);
    const double u = double(rand()) / RAND_MAX * acc;
    ztok[i] = 4 + (std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
    pos[i] = 2 + i % LEN;
  }
  for (int i = 0; i < N * SETS; i += 97) tok[i] = ztok[i] = PAD;
  std::vector<__half> hw(int64_t(VOC) * D), hp(1100 * D), hdy(int64_t(N) * D * SETS);
  for (auto& x : hw) x = __float2half((rand() % 2001 - 1000) * 1e-3f);
  for (auto& x : hp) x = __float2half((rand() % 2001 - 1000) * 1e-3f);
  for (auto& x : hdy) x = __float2half((rand() % 2001 - 1000) * 1e-3f);
  int64_t *dtok, *dztok, *dpos; T *dw, *dpw, *dout, *ddy, *dtab; uint8_t* bits; void* ws;
  CK(cudaMalloc(&dtok, N * SETS * 8)); CK(cudaMalloc(&dztok, N * SETS * 8)); CK(cudaMalloc(&dpos, N * SETS * 8));
  CK(cudaMalloc(&dw, int64_t(VOC) * D * 2)); CK(cudaMalloc(&dpw, 1100 * D * 2));
  CK(cudaMalloc(&dout, int64_t(N) * D * 2 * SETS)); CK(cudaMalloc(&ddy, int64_t(N) * D * 2 * SETS));
  CK(cudaMalloc(&dtab, int64_t(VOC) * D * 2 * SETS)); CK(cudaMalloc(&bits, int64_t(N) * D / 8 * SETS));
  const size_t wsb = embedding_backward_workspace_bytes(N, VOC, D);
  CK(cudaMalloc(&ws, wsb * SETS));
  CK(cudaMemcpy(dtok, tok.data(), N * SETS * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dztok, ztok.data(), N * SETS * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dpos, pos.data(), N * SETS * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dpw, hp.data(), hp.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ddy, hdy.data(), hdy.size() * 2, cudaMemcpyHostToDevice));
  cudaStream_t s; CK(cudaStreamCreate(&s));
  auto rng = [&](int set, bool store) {
    RngState r{12345, 678 + uint64_t(set) * 1000, nullptr};
    r.bits = store ? bits + int64_t(set) * N * D / 8 : nullptr;
    return r;
  };
  auto fwd = [&](int set, bool store, const int64_t* t) {
    embedding_forward(DType::kFloat16, t + set * N, dpos + set * N, dw, dpw, dout + int64_t(set) * N * D, N, D, 32.f,
                      PAD, 0.1f, rng(set, store), s);
  };
  auto bwd = [&](int set, bool stored, const int64_t* t) {
    const RngState r = rng(set, stored);
    embedding_backward(DType::kFloat16, ddy + int64_t(set) * N * D, &r, t + set * N, (char*)ws + wsb * set,
                       GradOut{dtab + int64_t(set) * VOC * D, false}, N, VOC, D, 32.f, PAD, 0.1f, s);
  };
  for (int set = 0; set < SETS; ++set) { fwd(set, true, dtok); }
  CK(cudaStreamSynchronize(s));
  if (argc > 2) {  // one pass, twice (ncu -s 9 -c 9 profiles the second): fwd, bwd uniform, bwd Zipf
    for (int k = 0; k < 2; ++k) { fwd(k, true, dtok); bwd(k, false, dtok); bwd(k, false, dztok); }
    CK(cudaStreamSynchronize(s));
    return 0;
  }
  const float f_nobits = graph_us(s, 7, [&](int it) { const int set = it % SETS; fwd(set, false, dtok); });
  const float b_uni = graph_us(s, 7, [&](int it) { const int set = it % SETS; bwd(set, false, dtok); });
  const float b_zipf = graph_us(s, 7, [&](int it) { const int set = it % SETS; bwd(set, false, dztok); });
  std::vector<__half> got(int64_t(VOC) * D);
  double sums[2];
  for (int z = 0; z < 2; ++z) {
    bwd(0, false, z ? dztok : dtok);
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(got.data(), dtab, got.size() * 2, cudaMemcpyDeviceToHost));
    double sum = 0;
    for (size_t i = 0; i < got.size(); ++i) sum += std::fabs(__half2float(got[i])) * (1 + i % 7);
    sums[z] = sum;
  }
  printf("%-20s fwd %6.2f | bwd uniform %6.2f Zipf %6.2f us | checksums %.9e %.9e\n", name, f_nobits, b_uni, b_zipf,
         sums[0], sums[1]);
  return 0;
}
