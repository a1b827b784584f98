// The experiment programs' timing (runs 60, 64, 71): a CUDA graph of 60 launches, launch(it) for
// it = 0 .. 59, replayed `replays` times; the best replay's time per launch, in microseconds.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

static float graph_us(cudaStream_t s, int replays, const std::function<void(int)>& launch) {
  cudaGraph_t g; cudaGraphExec_t ge; cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int it = 0; it < 60; ++it) launch(it);
  CK(cudaStreamEndCapture(s, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
  float best = 1e9;
  for (int t = 0; t < replays; ++t) {
    CK(cudaEventRecord(e0, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms);
  }
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g); cudaEventDestroy(e0); cudaEventDestroy(e1);
  return best * 1000 / 60;
}
