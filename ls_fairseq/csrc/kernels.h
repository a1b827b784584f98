// Launchers of the ls_fairseq kernels: plain pointers and sizes, no torch
// types, so the .cu files compile without torch's headers. bindings.cpp checks
// the tensors and calls these on the current stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ls {

enum class DType { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Where a dropout call's keep-mask comes from: Philox under the key and
// counter offset that torch's CUDA generator hands out, or, when `given` is
// set, that mask (one byte per element), so kernel and reference can be
// compared on the same mask. Inside a CUDA graph capture the generator hands
// out device pointers instead (seed_ptr, offset_ptr: torch rewrites them
// before each replay, so every replay draws new masks) and this call's offset
// within the graph. The keep-bit of element e is a function of the state and e
// alone: a forward kernel draws it and a backward kernel draws it again from
// the same state, so no mask needs to be stored (LightSeq2 keeps a byte per element,
// ~0.6 GiB of transformer-big's activations at 16,384 tokens). With `bits` set, the
// forward also writes its keep-bits there, one bit per element (element e is bit e & 7
// of byte e >> 3: 1/16 of an fp16 activation), and the backward reads them instead of
// drawing. bias_dropout_residual(_layer_norm) do this: their backward is a light
// elementwise pass, which the Philox rounds slowed by more than the read costs
// (docs/perf-log.md, "Kernel design measurements").
struct RngState {
  uint64_t seed;
  uint64_t offset;
  const uint8_t* given;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
  uint8_t* bits = nullptr;
};

// A parameter's gradient a backward kernel produces: written, or, with
// `accumulate`, added to what `ptr` holds (the gradient kept in ls_adam's
// workspace, accumulated in place: no temporary, no separate add).
struct GradOut {
  void* ptr;
  bool accumulate;
};

// layer_norm.cu
void layer_norm_forward(DType dt, const void* x, const void* gamma, const void* beta, void* y, float* mean, float* rstd,
                        int64_t rows, int hidden, float eps, cudaStream_t stream);
void layer_norm_backward(DType dt, const void* dy, const void* x, const void* gamma, const float* mean,
                         const float* rstd, void* dx, GradOut dgamma, GradOut dbeta, float* partial, int64_t rows,
                         int hidden, cudaStream_t stream);
// x = residual + dropout(h + bias) (written), then
// y = LayerNorm(x): bias_dropout_residual then layer_norm in one pass, the same bits
void bias_dropout_residual_layer_norm_forward(DType dt, const void* h, const void* bias, const void* residual,
                                              const void* gamma, const void* beta, void* x, void* y, float* mean,
                                              float* rstd, int64_t rows, int hidden, float eps, float p, RngState rng,
                                              cudaStream_t stream);
// its backward: LayerNorm's (dx, also the residual's gradient; dgamma, dbeta), then
// bias_dropout_residual's (dh = dx * keep / (1 - p), the forward's keep-bits drawn again from rng, dbias);
// partial: 3 x column_chunks(rows) x hidden
void bias_dropout_residual_layer_norm_backward(DType dt, const void* dy, const void* x, const void* gamma,
                                               const float* mean, const float* rstd, const RngState* rng, float p,
                                               void* dx, void* dh, GradOut dgamma, GradOut dbeta, GradOut dbias,
                                               float* partial, int64_t rows, int hidden, cudaStream_t stream);

// bias_dropout_residual.cu
// (a backward takes the forward's RngState and draws its keep-bits again; nullptr: every element kept, as
// relu's backward from its output needs, its dropped elements being zero already)
void bias_dropout_residual_forward(DType dt, const void* x, const void* bias, const void* residual, void* out,
                                   int64_t rows, int hidden, float p, RngState rng, cudaStream_t stream);
void bias_dropout_residual_backward(DType dt, const void* dout, const RngState* rng, void* dx, GradOut dbias,
                                    float* partial, int64_t rows, int hidden, float p, cudaStream_t stream);

// bias_act_dropout.cu; activation 0 = relu, 1 = gelu; backward's bias may be nullptr (zero)
void bias_act_dropout_forward(DType dt, const void* x, const void* bias, void* out, int64_t rows, int hidden,
                              int activation, float p, RngState rng, cudaStream_t stream);
void bias_act_dropout_backward(DType dt, const void* dout, const void* x, const void* bias, const RngState* rng,
                               void* dx, GradOut dbias, float* partial, int64_t rows, int hidden, int activation,
                               float p, cudaStream_t stream);

// Row chunks of the two-stage column reductions behind the bias (and gamma/beta)
// gradients: stage one writes chunks x cols fp32 partial sums, stage two adds them
// up in a fixed order, so the result is deterministic. A chunk holds about 32 rows
// (LayerNorm's strips; the other maps take 64) and there are at most 512 chunks: enough
// blocks in flight to saturate memory, with the partial sums a small part of the traffic.
constexpr int kMaxColumnChunks = 512;
inline int column_chunks(int64_t rows) {
  const int64_t c = (rows + 31) / 32;
  return int(c < 1 ? 1 : (c > kMaxColumnChunks ? kMaxColumnChunks : c));
}

// layer_norm_backward's partial: 2 x column_chunks(rows) x hidden floats

// softmax.cu: scores [B, heads, Tq, Tk]; key_padding [B, Tk] (nullptr: none); lse [B, heads, Tq] fp32,
// each row's log-sum-exp (-inf for a fully masked row), which the backward computes the
// probabilities again from
void softmax_forward(DType dt, const void* scores, const uint8_t* key_padding, bool causal, void* out, float* lse,
                     int batch, int heads, int tq, int tk, float p, RngState rng, cudaStream_t stream);
void softmax_backward(DType dt, const void* dout, const void* scores, const float* lse, const uint8_t* key_padding,
                      bool causal, const RngState* rng, void* dscores, int batch, int heads, int tq, int tk, float p,
                      cudaStream_t stream);

// qkv.cu: x [B, T, parts * d] + bias -> out [parts, B, heads, T, d_head], or with token_major
// [parts, B, T, heads, d_head]
void qkv_forward(DType dt, const void* x, const void* bias, void* out, int batch, int len, int parts, int heads,
                 int head_dim, bool token_major, float first_scale, cudaStream_t stream);
// backward: dy[k] part k's gradient [B, heads, T, d_head] (nullptr: zero), any strides over (B, heads, T) in
// elements with d_head contiguous -> dx [B, T, parts * d]; a launch takes up to kQkvMaxParts parts (their
// pointers and strides travel as a kernel argument), more parts take more launches
constexpr int kQkvMaxParts = 16;
struct PartStrides {
  int64_t batch, head, len;
};
void qkv_backward(DType dt, const void* const* dy, const PartStrides* dy_strides, void* dx, GradOut dbias,
                  float* partial, int batch, int len, int parts, int heads, int head_dim, float first_scale,
                  cudaStream_t stream);

// attention.cu: softmax(q k^T + masks) v with dropout, q k v [B, heads, T, kAttnHeadDim] (any strides over B,
// heads and T in elements, d_head contiguous, rows 16-byte aligned), fp16/bf16, 1 <= Tq, Tk <= kAttnMaxLen;
// key_padding [B, Tk] (nullptr: none); causal: key j hidden from query i when j > i + Tk - Tq. lse [B, heads, Tq]
// (fp32): each query row's log-sum-exp, which the backward recomputes the probabilities from; the keep-bits of
// probability (b, h, i, j) are element ((b * heads + h) * Tq + i) * Tk + j's, as dropout_keep_mask draws them
constexpr int kAttnHeadDim = 64, kAttnMaxLen = 64;
void attention_forward(DType dt, const void* q, PartStrides qs, const void* k, PartStrides ks, const void* v,
                       PartStrides vs, const uint8_t* key_padding, bool causal, void* out, PartStrides os, float* lse,
                       int batch, int heads, int tq, int tk, float p, RngState rng, cudaStream_t stream);
void attention_backward(DType dt, const void* dout, PartStrides dos, const void* q, PartStrides qs, const void* k,
                        PartStrides ks, const void* v, PartStrides vs, const float* lse, const uint8_t* key_padding,
                        bool causal, const RngState* rng, float p, void* dq, PartStrides dqs, void* dk,
                        PartStrides dks, void* dv, PartStrides dvs, int batch, int heads, int tq, int tk,
                        cudaStream_t stream);

// embedding.cu: tokens/positions [n] (int64); pos_weight the learned or sinusoid table
void embedding_forward(DType dt, const int64_t* tokens, const int64_t* positions, const void* weight,
                       const void* pos_weight, void* out, int64_t n, int dim, float scale,
                       int padding_idx, float p, RngState rng, cudaStream_t stream);
// ids: the n token (or position) ids, each below rows (the table's rows, fewer than 2^31);
// workspace: embedding_backward_workspace_bytes(n, rows, dim) bytes (the sort, the chunks' head/tail sums,
// the bitmap of present ids, the dropout's keep-bits); dtable accumulated into, or written whole (absent
// ids' rows: zeros)
size_t embedding_backward_workspace_bytes(int64_t n, int64_t rows, int dim);
void embedding_backward(DType dt, const void* dout, const RngState* rng, const int64_t* ids, void* workspace,
                        GradOut dtable, int64_t n, int64_t rows, int dim, float scale, int padding_idx, float p,
                        cudaStream_t stream);

// dropout.cu: the keep-mask (1 = keep) of n elements that a call with `rng` and p draws, written out (the
// kernels never store it: for tests and inspection)
void dropout_keep_mask(RngState rng, int64_t n, float p, uint8_t* out, cudaStream_t stream);

// cross_entropy.cu: logits [n, vocab]
void cross_entropy_forward(DType dt, const void* logits, const int64_t* target, float* loss, float* nll, float* lse,
                           int64_t n, int vocab, float epsilon, int padding_idx, cudaStream_t stream);
// dloss: row i's at dloss[i * dloss_stride] (0: one value for all rows); dnll: nullptr for none (zero)
void cross_entropy_backward(DType dt, const float* dloss, int64_t dloss_stride, const float* dnll, const void* logits,
                            const int64_t* target, const float* lse, void* dlogits, int64_t n, int vocab,
                            float epsilon, int padding_idx, cudaStream_t stream);

// beam_select.cu: per row of scores [rows, M] (M < 2^32) its k largest entries, largest first, ties in index
// order -> values [rows, k] (scores' dtype), indices [rows, k]; the threshold from `groups` runs' maxima,
// k <= groups <= kBeamSelectMaxGroups
constexpr int kBeamSelectMaxGroups = 1024;
void beam_select(DType dt, const void* scores, void* values, int64_t* indices, int64_t rows, int64_t M, int k,
                 int groups, cudaStream_t stream);

// beam_scores.cu: per row of logits [rows, M] (fp32/fp16/bf16) its log-softmax in fp32 with fairseq's fixes
// (NaN -> -inf, column pad -inf, column unk minus unk_penalty, column eos -inf while the step is below min_len)
// plus cum[row] -> out fp32 [rows, M]; step_on_device, if not null, holds the step (else `step`); vec: the
// logits allow 16-byte loads
void beam_scores(DType dt, const void* logits, const float* cum, int64_t rows, int64_t M, bool vec,
                 const int64_t* step_on_device, int64_t step, int64_t pad, int64_t unk, float unk_penalty, int64_t eos,
                 int64_t min_len, float* out, cudaStream_t stream);

// beam_advance.cu: beam search's bookkeeping after beam_select for `sentences` sentences of k beams
// (k <= kBeamAdvanceMaxBeam), L positions, the step read from device memory; the state in place (shapes in
// ls_fairseq/ops/beam_advance.py)
constexpr int kBeamAdvanceMaxBeam = 32;
void beam_advance(const float* values, const int64_t* indices, const int64_t* step, int64_t* tokens, float* scores,
                  float* cum, bool* done, int64_t* count, int64_t* fin_tokens, float* fin_positional, float* fin_score,
                  int64_t* fin_length, int64_t* parents, int64_t sentences, int k, int L, int64_t eos, int64_t pad,
                  int64_t vocab, double len_penalty, bool normalize, bool advance, cudaStream_t stream);

// decode_attention.cu: one decoding step's self-attention, q [hypotheses, heads, head_dim] (row n at
// n * q_stride) over positions 0..length-1 of a cache written once: position p of hypothesis n is cache
// slot origin[n * origin_stride + p], its keys at keys + p * position_stride + slot * slot_stride +
// head * head_dim (values likewise) -> out [hypotheses, heads, head_dim], contiguous; length_on_device, if
// not null, holds the length (at most `length`) in device memory; new_keys / new_values, if not null, are
// the step's own keys and values (rows like q's, n * new_stride), written into the cache at position
// length - 1 of slot n and attended to there; bias, if not null ([3, heads x head_dim], with the step's
// keys and values only), is added to q, k and v first; q is then scaled by `scaling` (1 for a scaled q)
bool decode_attention_supports(int head_dim);
void decode_attention(DType dt, const void* q, int64_t q_stride, const void* keys, const void* values,
                      int64_t position_stride, int64_t slot_stride, const int* origin, int64_t origin_stride,
                      int64_t hypotheses, int heads, int head_dim, int length, const int64_t* length_on_device,
                      const void* new_keys, const void* new_values, int64_t new_stride, const void* bias,
                      float scaling, void* out, cudaStream_t stream);

// beam_attention.cu: a decoding step's cross-attention of `beams` queries a sentence, q[b, head, j] at
// q + b * sentence + head * head + j * row (strides in elements; `row`: the beam, or for keys the key
// position), against the sentence's keys and values [sentence, heads, length, head_dim] (kv strides; last
// dimension contiguous, 16-byte rows), padding (uint8, nonzero = a padded key; row b at b * padding_stride)
// or null; bias [heads x head_dim] or null added to q, then q scaled by `scaling` (with or without a bias),
// rounded to T as the QKV transform does -> out [sentences, beams, heads, head_dim], contiguous
struct BeamAttentionStrides {
  int64_t sentence, head, row;
};
bool beam_attention_supports(int head_dim);
void beam_attention(DType dt, const void* q, BeamAttentionStrides q_strides, const void* keys, const void* values,
                    BeamAttentionStrides kv_strides, const uint8_t* padding, int64_t padding_stride, const void* bias,
                    float scaling, int sentences, int heads, int beams, int head_dim, int length, void* out,
                    cudaStream_t stream);

// fp8_cast.cu: x [rows, cols] (contiguous) times the scale that its amax history gives, rounded to FP8
// (e4m3, or e5m2 with e5m2) into q [rows, cols] and/or qT [cols, rows] (either may be null, not both);
// state [history + 2] fp32: the amax history, this step's amax (raised to x's finite amax) and the
// inverse scale (written). vec: x is 16-byte aligned.
void fp8_cast(DType dt, const void* x, int64_t rows, int64_t cols, bool vec, float* state, int history, bool e5m2,
              uint8_t* q, uint8_t* qT, cudaStream_t stream);

// adam.cu
constexpr int kNormBlocks = 512;  // partial: kNormBlocks floats
// The loss-scale and clipping decision grad_norm can take on the device once the
// norm is known (ls_fairseq/ops/adam.py, ScalerState, documents the state slots).
struct NormEpilogue {
  float* state;        // [loss_scale, good_steps, grad_norm, grad_scale, overflow, step]
  float factor;        // host multiplier of the gradients (e.g. 1 / sample_size)
  float max_norm;      // clip to this norm; 0: no clipping
  float scale_window;  // double the scale after this many good steps; 0: the scale stays
  float scale_floor;   // the scale never halves below this
};
// counter: one zeroed unsigned int; the kernel leaves it zero again.
void grad_norm(DType dt, const void* grad, int64_t n, float* partial, unsigned* counter, float* out,
               const NormEpilogue* epilogue, cudaStream_t stream);
struct AdamArgs {
  float lr, beta1, beta2, eps, weight_decay, step_size, grad_scale;
  const float* grad_scale_ptr;  // when set, multiplies grad_scale (a device scalar: no host sync)
  const float* noop_flag;       // when set and non-zero (a device scalar), the step changes nothing
  const float* step_ptr;        // when set, the step count t (a device scalar) replaces step_size's
  bool decoupled;
  bool stochastic_rounding;  // round fp16/bf16 parameters stochastically (no master copy), random words from rng
  RngState rng;
};
void adam_step(DType dt, void* param, const void* grad, float* exp_avg, float* exp_avg_sq, float* master, int64_t n,
               const AdamArgs& args, cudaStream_t stream);

}  // namespace ls
