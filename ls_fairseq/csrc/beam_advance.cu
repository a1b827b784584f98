// beam_advance: beam search's bookkeeping after beam_select, one block a sentence (LightSeq
// technique: the whole search stays on the device in fused kernels, arXiv 2010.13887). It fuses
// fairseq's finalize_hypos (the end-of-sentence candidates among the first k, of a sentence not yet
// done, written whole into the sentence's free slots with the length-penalised score) and
// active_hypos (the first k candidates that do not end the sentence continue: parents, the token
// histories and positional scores reordered into the new beam order, the new token and cumulative
// score) into one launch, where the search's torch ops took some 60 small kernels a step. Nothing
// but the search's state is written: no candidate masks, ranks or reordered copies; the k rows of a
// sentence pass through shared memory a chunk of positions at a time, so the reorder is in place.
// ls_fairseq/ops/beam_advance.py is the contract and its reference.
#include <cmath>
#include <cstdint>

#include "common.cuh"

namespace ls {

namespace {

constexpr int kAdvanceThreads = 128;
constexpr int kChunk = 128;  // positions of a sentence's k rows held in shared memory at a time

__global__ void __launch_bounds__(kAdvanceThreads)
    beam_advance_kernel(const float* __restrict__ values, const int64_t* __restrict__ indices,
                        const int64_t* __restrict__ step, int64_t* __restrict__ tokens, float* __restrict__ scores,
                        float* __restrict__ cum, bool* __restrict__ done, int64_t* __restrict__ count,
                        int64_t* __restrict__ fin_tokens, float* __restrict__ fin_positional,
                        float* __restrict__ fin_score, int64_t* __restrict__ fin_length, int64_t* __restrict__ parents,
                        int k, int L, int64_t eos, int64_t pad, int64_t vocab, double len_penalty, bool normalize,
                        bool advance) {
  extern __shared__ int64_t chunk[];  // [k][kChunk]: tokens, then scores (as floats)
  __shared__ int slot_of[kBeamAdvanceMaxBeam];    // candidate j < k: its finished slot, or -1
  __shared__ int beam_of[2 * kBeamAdvanceMaxBeam];  // candidate j: the beam (of this sentence) it extends
  __shared__ int active[kBeamAdvanceMaxBeam];     // new hypothesis i: the candidate it is
  const int b = blockIdx.x, k2 = 2 * k, tid = threadIdx.x;
  const int64_t t = *step, first = int64_t(b) * k;
  const float* v = values + int64_t(b) * k2;
  const int64_t* ix = indices + int64_t(b) * k2;
  if (tid == 0) {
    auto ends = [&](int j) { return ix[j] % vocab == eos && v[j] != -INFINITY; };
    const bool was_done = done[b];
    const int64_t before = count[b];
    int64_t seen = 0, kept = 0;  // new end-of-sentence candidates, and those that found a slot
    for (int j = 0; j < k; ++j) {
      int slot = -1;
      if (ends(j) && !was_done) {
        const int64_t rank = before + seen++;
        if (rank < k) {
          slot = int(rank);
          ++kept;
        }
      }
      slot_of[j] = slot;
    }
    for (int j = 0; j < k2; ++j) beam_of[j] = int(ix[j] / vocab);
    count[b] = before + kept;
    done[b] = was_done || before + kept >= k;
    int n = 0;  // the candidates that do not end the sentence first, then those that do, each in order
    for (int j = 0; j < k2 && n < k; ++j)
      if (!ends(j)) active[n++] = j;
    for (int j = 0; j < k2 && n < k; ++j)
      if (ends(j)) active[n++] = j;
  }
  __syncthreads();

  // finish: each kept candidate's hypothesis, its parent's history before the step, EOS at it
  const float penalty = normalize ? float(pow(double(t + 1), len_penalty)) : 1.f;
  for (int j = 0; j < k; ++j) {
    const int slot = slot_of[j];
    if (slot < 0) continue;
    const int64_t row = first + beam_of[j], out = (int64_t(b) * (k + 1) + slot) * L;
    for (int p = tid; p < L; p += kAdvanceThreads) {
      fin_tokens[out + p] = p < t ? tokens[row * (L + 1) + p + 1] : (p == t ? eos : pad);
      fin_positional[out + p] = p < t ? scores[row * L + p] : (p == t ? v[j] : 0.f);
    }
    if (tid == 0) {
      fin_score[int64_t(b) * (k + 1) + slot] = normalize ? v[j] / penalty : v[j];
      fin_length[int64_t(b) * (k + 1) + slot] = t + 1;
    }
  }
  if (!advance) return;
  __syncthreads();  // the histories read above before any row is rewritten

  // advance: row i of the sentence becomes its parent's, a chunk of positions at a time
  for (int p0 = 0; p0 < L + 1; p0 += kChunk) {
    for (int e = tid; e < k * kChunk; e += kAdvanceThreads) {
      const int i = e / kChunk, p = p0 + e % kChunk;
      if (p < L + 1) chunk[e] = tokens[(first + i) * (L + 1) + p];
    }
    __syncthreads();
    for (int e = tid; e < k * kChunk; e += kAdvanceThreads) {
      const int i = e / kChunk, p = p0 + e % kChunk;
      if (p < L + 1) tokens[(first + i) * (L + 1) + p] = chunk[beam_of[active[i]] * kChunk + p - p0];
    }
    __syncthreads();
  }
  float* fchunk = reinterpret_cast<float*>(chunk);
  for (int p0 = 0; p0 < L; p0 += kChunk) {
    for (int e = tid; e < k * kChunk; e += kAdvanceThreads) {
      const int i = e / kChunk, p = p0 + e % kChunk;
      if (p < L) fchunk[e] = scores[(first + i) * L + p];
    }
    __syncthreads();
    for (int e = tid; e < k * kChunk; e += kAdvanceThreads) {
      const int i = e / kChunk, p = p0 + e % kChunk;
      if (p < L) scores[(first + i) * L + p] = fchunk[beam_of[active[i]] * kChunk + p - p0];
    }
    __syncthreads();
  }
  if (tid < k) {
    const int j = active[tid];
    const int64_t n = first + tid;
    parents[n] = first + beam_of[j];
    tokens[n * (L + 1) + t + 1] = ix[j] % vocab;
    cum[n] = v[j];
    scores[n * L + t] = v[j];
  }
}

}  // namespace

void beam_advance(const float* values, const int64_t* indices, const int64_t* step, int64_t* tokens, float* scores,
                  float* cum, bool* done, int64_t* count, int64_t* fin_tokens, float* fin_positional, float* fin_score,
                  int64_t* fin_length, int64_t* parents, int64_t sentences, int k, int L, int64_t eos, int64_t pad,
                  int64_t vocab, double len_penalty, bool normalize, bool advance, cudaStream_t stream) {
  if (sentences == 0) return;
  const size_t bytes = size_t(k) * kChunk * sizeof(int64_t);
  beam_advance_kernel<<<unsigned(sentences), kAdvanceThreads, bytes, stream>>>(
      values, indices, step, tokens, scores, cum, done, count, fin_tokens, fin_positional, fin_score, fin_length,
      parents, k, L, eos, pad, vocab, len_penalty, normalize, advance);
}

}  // namespace ls
