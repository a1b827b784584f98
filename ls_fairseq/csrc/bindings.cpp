// Python bindings of ls_fairseq._C: every pybind definition and every input
// check lives here; the .cu files hold kernels and their launchers only. Each
// function has the signature of its op's PyTorch reference in ls_fairseq/ops
// (the contract), allocates its outputs, and launches on the current stream of
// the inputs' device. A failed check names the tensor and what was expected.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

using ls::DType;
using torch::Tensor;

#define CHECK_CUDA_OK()                                                                              \
  do {                                                                                               \
    const cudaError_t err = cudaGetLastError();                                                     \
    TORCH_CHECK(err == cudaSuccess, "ls_fairseq kernel launch failed: ", cudaGetErrorString(err)); \
  } while (0)

DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

void check(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_like(const Tensor& t, const Tensor& ref, const char* name, const char* ref_name) {
  check(t, name);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have ", ref_name, "'s dtype ", ref.scalar_type(),
              ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), name, " must be on ", ref_name, "'s device ", ref.device());
}

void check_shape(const Tensor& t, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

void check_mask(const std::optional<Tensor>& mask, const Tensor& like, const char* name) {
  if (!mask) return;
  check(*mask, name);
  TORCH_CHECK(mask->scalar_type() == at::kByte, name, " must be uint8 (1 = keep), got ", mask->scalar_type());
  check_shape(*mask, like.sizes(), name);
}

// each attention row's log-sum-exp, [B, heads, Tq] fp32, as a forward wrote it for its backward
void check_lse(const Tensor& lse, const Tensor& like, int64_t B, int64_t H, int64_t Tq) {
  check(lse, "lse");
  check_shape(lse, {B, H, Tq}, "lse");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "lse must be float32, got ", lse.scalar_type());
  TORCH_CHECK(lse.device() == like.device(), "lse must be on ", like.device(), ", got ", lse.device());
}

void check_probability(double p, const char* op) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, op, ": dropout probability must be in [0, 1), got ", p);
}

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream(); }

// The next (seed, offset) of torch's default CUDA generator (which advances, so --seed reproduces runs);
// under CUDA graph capture, the device state torch updates before every replay.
ls::RngState philox_state() {
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                 at::cuda::detail::getDefaultCUDAGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  const at::PhiloxCudaState st = gen->philox_cuda_state(4);
  if (st.captured_)
    return ls::RngState{0, 0, nullptr, st.seed_.ptr, st.offset_.ptr, uint64_t(st.offset_intragraph_)};
  return ls::RngState{st.seed_.val, st.offset_.val, nullptr};
}

// A dropout call, as its backward needs it: the Philox state its forward drew the keep-bits
// with, which the backward kernel draws again, or the given mask, or the keep-bits the forward
// stored (held here). mask() writes the keep-mask out (for tests and inspection).
struct Dropout {
  ls::RngState rng;
  std::optional<Tensor> given;
  std::vector<int64_t> shape;
  double p;
  c10::Device device;
  std::optional<Tensor> bits;

  Tensor mask() const {
    if (given) return *given;
    const c10::cuda::CUDAGuard guard(device);
    auto out = torch::empty(shape, torch::TensorOptions().dtype(at::kByte).device(device));
    ls::dropout_keep_mask(rng, out.numel(), float(p), out.data_ptr<uint8_t>(), stream());
    CHECK_CUDA_OK();
    return out;
  }
};

// The dropout of a forward call over `like`'s elements: none at p = 0, else the given mask's or the
// next Philox state of torch's generator.
std::optional<Dropout> draw_dropout(const std::optional<Tensor>& given, double p, const Tensor& like) {
  if (p == 0.0) return std::nullopt;
  const std::vector<int64_t> shape(like.sizes().begin(), like.sizes().end());
  if (given) return Dropout{ls::RngState{0, 0, given->data_ptr<uint8_t>()}, given, shape, p, like.device()};
  return Dropout{philox_state(), std::nullopt, shape, p, like.device()};
}

// The dropout of a forward call whose kernel also stores the keep-bits it draws, a bit an element,
// for the backward to read (kernels.h, RngState::bits); a given mask is read as it is.
std::optional<Dropout> draw_dropout_stored(const std::optional<Tensor>& given, double p, const Tensor& like) {
  auto dropout = draw_dropout(given, p, like);
  if (dropout && !given) {
    dropout->bits = torch::empty({(like.numel() + 7) / 8}, like.options().dtype(at::kByte));
    dropout->rng.bits = dropout->bits->data_ptr<uint8_t>();
  }
  return dropout;
}

// The state a forward kernel draws its keep-bits with (unused at p = 0).
ls::RngState rng_of(const std::optional<Dropout>& dropout) { return dropout ? dropout->rng : ls::RngState{}; }

// A dropout over `like`'s elements drawn as the next kernel call would draw it (the generator
// advances alike), for code outside the kernels that must apply the kernels' masks (the
// parity run of stock fairseq with ls_fairseq's masks: scripts/parity_ls_masks).
Dropout next_dropout(const Tensor& like, double p) {
  TORCH_CHECK(like.is_cuda(), "draw_dropout: like must be a CUDA tensor, got one on ", like.device());
  TORCH_CHECK(p > 0.0 && p < 1.0, "draw_dropout: p must be in (0, 1), got ", p);
  const c10::cuda::CUDAGuard guard(like.device());
  return *draw_dropout(std::nullopt, p, like);
}

// The dropout of a forward call that was given `mask` (uint8, 1 = keep) at rate p, as that call's
// backward kernel takes it: a torch.compile graph draws the keep-mask as a tensor and hands it to
// the forward kernel and, through this, to the backward kernel.
Dropout dropout_from_mask(const Tensor& mask, double p) {
  check_mask(mask, mask, "mask");
  TORCH_CHECK(p > 0.0 && p < 1.0, "dropout_from_mask: p must be in (0, 1), got ", p);
  return *draw_dropout(mask, p, mask);
}

// The forward's keep-bits for a backward over `like`'s elements at rate p (nullptr: no dropout
// given, every element kept), checked to be that call's.
const ls::RngState* redrawn(const std::optional<Dropout>& dropout, at::IntArrayRef shape, c10::Device device, double p,
                            const char* op) {
  if (!dropout) return nullptr;
  TORCH_CHECK(dropout->shape == shape, op, ": dropout was drawn over shape ", at::IntArrayRef(dropout->shape),
              ", the gradient has shape ", shape);
  TORCH_CHECK(dropout->device == device, op, ": dropout was drawn on ", dropout->device, ", the gradient is on ",
              device);
  TORCH_CHECK(dropout->p == p, op, ": dropout was drawn at p = ", dropout->p, ", the backward was given p = ", p);
  return &dropout->rng;
}

const ls::RngState* redrawn(const std::optional<Dropout>& dropout, const Tensor& like, double p, const char* op) {
  return redrawn(dropout, like.sizes(), like.device(), p, op);
}

// A parameter's gradient: `into` (checked against `like`'s dtype and device and
// `shape`), which the kernel accumulates into, or a new tensor it writes whole.
std::pair<Tensor, ls::GradOut> grad_out(const std::optional<Tensor>& into, const Tensor& like, at::IntArrayRef shape,
                                        const char* name) {
  if (into) {
    check_like(*into, like, name, "the gradient's input");
    check_shape(*into, shape, name);
    return {*into, ls::GradOut{into->data_ptr(), true}};
  }
  auto t = torch::empty(shape, like.options());
  return {t, ls::GradOut{t.data_ptr(), false}};
}

// fp32 partial sums of the fused column reductions (reduce.cuh) over `rows` rows: k sums of
// `cols` columns in all.
Tensor column_sum_partial(int64_t k, int64_t rows, int64_t cols, const Tensor& like) {
  return torch::empty({k * ls::column_chunks(rows) * cols}, like.options().dtype(at::kFloat));
}

int hidden_of(const Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, name, " must have a non-empty last dimension");
  return int(x.size(-1));
}

// ---- layer_norm ----
std::tuple<Tensor, Tensor, Tensor> layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                                      double eps) {
  check(x, "x");
  const int hidden = hidden_of(x, "x");
  check_like(weight, x, "weight", "x");
  check_like(bias, x, "bias", "x");
  check_shape(weight, {hidden}, "weight");
  check_shape(bias, {hidden}, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  auto stats_shape = x.sizes().slice(0, x.dim() - 1);
  auto mean = torch::empty(stats_shape, x.options().dtype(at::kFloat));
  auto rstd = torch::empty(stats_shape, x.options().dtype(at::kFloat));
  ls::layer_norm_forward(dtype_of(x, "x"), x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(),
                         mean.data_ptr<float>(), rstd.data_ptr<float>(), x.numel() / hidden, hidden, float(eps),
                         stream());
  CHECK_CUDA_OK();
  return {y, mean, rstd};
}

// LayerNorm backward's inputs: dy like x, weight [hidden], mean and rstd float32, one a row; returns the rows.
int64_t check_layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd, int hidden) {
  check(x, "x");
  check_like(dy, x, "dy", "x");
  check_shape(dy, x.sizes(), "dy");
  check_like(weight, x, "weight", "x");
  check_shape(weight, {hidden}, "weight");
  const int64_t rows = x.numel() / hidden;
  for (auto* t : {&mean, &rstd}) {
    check(*t, "mean/rstd");
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows, "mean/rstd must be float32 with ", rows,
                " elements");
  }
  return rows;
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       const std::optional<Tensor>& dweight_into,
                                                       const std::optional<Tensor>& dbias_into) {
  const int hidden = hidden_of(x, "x");
  const int64_t rows = check_layer_norm_backward(dy, x, weight, mean, rstd, hidden);
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = torch::empty_like(x);
  auto [dweight, dweight_out] = grad_out(dweight_into, x, {hidden}, "dweight_into");
  auto [dbias, dbias_out] = grad_out(dbias_into, x, {hidden}, "dbias_into");
  auto partial = column_sum_partial(2, rows, hidden, x);
  ls::layer_norm_backward(dtype_of(x, "x"), dy.data_ptr(), x.data_ptr(), weight.data_ptr(), mean.data_ptr<float>(),
                          rstd.data_ptr<float>(), dx.data_ptr(), dweight_out, dbias_out, partial.data_ptr<float>(),
                          rows, hidden, stream());
  CHECK_CUDA_OK();
  return {dx, dweight, dbias};
}

// ---- bias_dropout_residual ----
std::tuple<Tensor, std::optional<Dropout>> bias_dropout_residual_forward(const Tensor& x, const Tensor& bias,
                                                                         const Tensor& residual, double p,
                                                                         const std::optional<Tensor>& given) {
  check(x, "x");
  const int hidden = hidden_of(x, "x");
  check_like(bias, x, "bias", "x");
  check_shape(bias, {hidden}, "bias");
  check_like(residual, x, "residual", "x");
  check_shape(residual, x.sizes(), "residual");
  check_probability(p, "bias_dropout_residual");
  check_mask(given, x, "mask");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty_like(x);
  auto dropout = draw_dropout_stored(given, p, x);
  ls::bias_dropout_residual_forward(dtype_of(x, "x"), x.data_ptr(), bias.data_ptr(), residual.data_ptr(),
                                    out.data_ptr(), x.numel() / hidden, hidden, float(p),
                                    rng_of(dropout), stream());
  CHECK_CUDA_OK();
  return {out, dropout};
}

std::tuple<Tensor, Tensor> bias_dropout_residual_backward(const Tensor& dout, const std::optional<Dropout>& dropout,
                                                          double p, const std::optional<Tensor>& dbias_into) {
  check(dout, "dout");
  const int hidden = hidden_of(dout, "dout");
  const ls::RngState* rng = redrawn(dropout, dout, p, "bias_dropout_residual");
  const c10::cuda::CUDAGuard guard(dout.device());
  const int64_t rows = dout.numel() / hidden;
  auto dx = torch::empty_like(dout);
  auto [dbias, dbias_out] = grad_out(dbias_into, dout, {hidden}, "dbias_into");
  auto partial = column_sum_partial(1, rows, hidden, dout);
  ls::bias_dropout_residual_backward(dtype_of(dout, "dout"), dout.data_ptr(), rng, dx.data_ptr(), dbias_out,
                                     partial.data_ptr<float>(), rows, hidden, float(p), stream());
  CHECK_CUDA_OK();
  return {dx, dbias};
}

// ---- bias_dropout_residual_layer_norm ----
std::tuple<Tensor, Tensor, Tensor, Tensor, std::optional<Dropout>> bias_dropout_residual_layer_norm_forward(
    const Tensor& h, const Tensor& bias, const Tensor& residual, const Tensor& weight, const Tensor& ln_bias,
    double eps, double p, const std::optional<Tensor>& given) {
  check(h, "h");
  const int hidden = hidden_of(h, "h");
  for (auto [t, name] : {std::pair{&bias, "bias"}, {&weight, "weight"}, {&ln_bias, "ln_bias"}}) {
    check_like(*t, h, name, "h");
    check_shape(*t, {hidden}, name);
  }
  check_like(residual, h, "residual", "h");
  check_shape(residual, h.sizes(), "residual");
  check_probability(p, "bias_dropout_residual_layer_norm");
  check_mask(given, h, "mask");
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t rows = h.numel() / hidden;
  auto x = torch::empty_like(h);
  auto y = torch::empty_like(h);
  auto mean = torch::empty({rows}, h.options().dtype(at::kFloat));
  auto rstd = torch::empty({rows}, h.options().dtype(at::kFloat));
  auto dropout = draw_dropout_stored(given, p, h);
  ls::bias_dropout_residual_layer_norm_forward(dtype_of(h, "h"), h.data_ptr(), bias.data_ptr(), residual.data_ptr(),
                                               weight.data_ptr(), ln_bias.data_ptr(), x.data_ptr(), y.data_ptr(),
                                               mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, hidden,
                                               float(eps), float(p), rng_of(dropout),
                                               stream());
  CHECK_CUDA_OK();
  return {y, x, mean, rstd, dropout};
}

// LayerNorm's backward (dx: the residual's gradient), then bias_dropout_residual's (dh, dbias)
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_residual_layer_norm_backward(
    const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
    const std::optional<Dropout>& dropout, double p, const std::optional<Tensor>& dweight_into,
    const std::optional<Tensor>& dln_bias_into, const std::optional<Tensor>& dbias_into) {
  const int hidden = hidden_of(x, "x");
  const int64_t rows = check_layer_norm_backward(dy, x, weight, mean, rstd, hidden);
  check_probability(p, "bias_dropout_residual_layer_norm");
  const ls::RngState* rng = redrawn(dropout, x, p, "bias_dropout_residual_layer_norm");
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = torch::empty_like(x);
  auto dh = torch::empty_like(x);
  auto [dweight, dweight_out] = grad_out(dweight_into, x, {hidden}, "dweight_into");
  auto [dln_bias, dln_bias_out] = grad_out(dln_bias_into, x, {hidden}, "dln_bias_into");
  auto [dbias, dbias_out] = grad_out(dbias_into, x, {hidden}, "dbias_into");
  auto partial = column_sum_partial(3, rows, hidden, x);
  ls::bias_dropout_residual_layer_norm_backward(dtype_of(x, "x"), dy.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                                mean.data_ptr<float>(), rstd.data_ptr<float>(), rng,
                                                float(p), dx.data_ptr(), dh.data_ptr(), dweight_out, dln_bias_out,
                                                dbias_out, partial.data_ptr<float>(), rows, hidden, stream());
  CHECK_CUDA_OK();
  return {dh, dbias, dx, dweight, dln_bias};
}

// ---- bias_act_dropout ----
int activation_id(const std::string& activation) {
  TORCH_CHECK(activation == "relu" || activation == "gelu", "bias_act_dropout: activation '", activation,
              "' is not supported; choose one of relu, gelu");
  return activation == "relu" ? 0 : 1;
}

std::tuple<Tensor, std::optional<Dropout>> bias_act_dropout_forward(const Tensor& x, const Tensor& bias,
                                                                    const std::string& activation, double p,
                                                                    const std::optional<Tensor>& given) {
  check(x, "x");
  const int hidden = hidden_of(x, "x");
  check_like(bias, x, "bias", "x");
  check_shape(bias, {hidden}, "bias");
  check_probability(p, "bias_act_dropout");
  check_mask(given, x, "mask");
  const int act = activation_id(activation);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty_like(x);
  auto dropout = draw_dropout(given, p, x);
  ls::bias_act_dropout_forward(dtype_of(x, "x"), x.data_ptr(), bias.data_ptr(), out.data_ptr(), x.numel() / hidden,
                               hidden, act, float(p), rng_of(dropout), stream());
  CHECK_CUDA_OK();
  return {out, dropout};
}

std::tuple<Tensor, Tensor> bias_act_dropout_backward(const Tensor& dout, const Tensor& x,
                                                     const std::optional<Tensor>& bias,
                                                     const std::optional<Dropout>& dropout,
                                                     const std::string& activation,
                                                     double p, const std::optional<Tensor>& dbias_into) {
  check(x, "x");
  const int hidden = hidden_of(x, "x");
  check_like(dout, x, "dout", "x");
  check_shape(dout, x.sizes(), "dout");
  if (bias) {  // none: zero (relu's backward from its output)
    check_like(*bias, x, "bias", "x");
    check_shape(*bias, {hidden}, "bias");
  }
  const ls::RngState* rng = redrawn(dropout, x, p, "bias_act_dropout");
  const int act = activation_id(activation);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.numel() / hidden;
  auto dx = torch::empty_like(x);
  auto [dbias, dbias_out] = grad_out(dbias_into, x, {hidden}, "dbias_into");
  auto partial = column_sum_partial(1, rows, hidden, x);
  ls::bias_act_dropout_backward(dtype_of(x, "x"), dout.data_ptr(), x.data_ptr(), bias ? bias->data_ptr() : nullptr,
                                rng, dx.data_ptr(), dbias_out, partial.data_ptr<float>(), rows, hidden, act,
                                float(p), stream());
  CHECK_CUDA_OK();
  return {dx, dbias};
}

// ---- softmax ----
// fairseq's bool key-padding masks are read as bytes in place (a conversion was a copy per layer and call)
Tensor key_padding_bytes(const std::optional<Tensor>& key_padding_mask, int64_t batch, int64_t tk) {
  if (!key_padding_mask) return Tensor();
  check(*key_padding_mask, "key_padding_mask");
  check_shape(*key_padding_mask, {batch, tk}, "key_padding_mask");
  // one byte a key, 0 or 1 (the kernels gather the bytes' low bits): a bool mask's own bytes
  return (key_padding_mask->scalar_type() == at::kBool ? *key_padding_mask : key_padding_mask->ne(0)).view(at::kByte);
}

// (out, lse, dropout): out the probabilities, or with dropout the kept ones; lse each row's
// log-sum-exp [B, heads, Tq] fp32, which the backward computes the probabilities again from
std::tuple<Tensor, Tensor, std::optional<Dropout>> softmax_forward(const Tensor& scores,
                                                                  const std::optional<Tensor>& key_padding_mask,
                                                                  bool causal, double p,
                                                                  const std::optional<Tensor>& given) {
  check(scores, "scores");
  TORCH_CHECK(scores.dim() == 4, "scores must be [batch, heads, tgt_len, src_len], got ", scores.sizes());
  const int64_t B = scores.size(0), H = scores.size(1), Tq = scores.size(2), Tk = scores.size(3);
  const Tensor kpm = key_padding_bytes(key_padding_mask, B, Tk);
  check_probability(p, "softmax");
  check_mask(given, scores, "mask");
  const c10::cuda::CUDAGuard guard(scores.device());
  auto out = torch::empty_like(scores);
  auto lse = torch::empty({B, H, Tq}, scores.options().dtype(at::kFloat));
  auto dropout = draw_dropout(given, p, scores);
  ls::softmax_forward(dtype_of(scores, "scores"), scores.data_ptr(), key_padding_mask ? kpm.data_ptr<uint8_t>() : nullptr,
                      causal, out.data_ptr(), lse.data_ptr<float>(), int(B), int(H), int(Tq), int(Tk), float(p),
                      rng_of(dropout), stream());
  CHECK_CUDA_OK();
  return {out, lse, dropout};
}

Tensor softmax_backward(const Tensor& dout, const Tensor& scores, const Tensor& lse,
                        const std::optional<Tensor>& key_padding_mask, bool causal,
                        const std::optional<Dropout>& dropout, double p) {
  check(scores, "scores");
  TORCH_CHECK(scores.dim() == 4, "scores must be [batch, heads, tgt_len, src_len], got ", scores.sizes());
  check_like(dout, scores, "dout", "scores");
  check_shape(dout, scores.sizes(), "dout");
  const int64_t B = scores.size(0), H = scores.size(1), Tq = scores.size(2), Tk = scores.size(3);
  check_lse(lse, scores, B, H, Tq);
  const Tensor kpm = key_padding_bytes(key_padding_mask, B, Tk);
  const ls::RngState* rng = redrawn(dropout, scores, p, "softmax");
  const c10::cuda::CUDAGuard guard(scores.device());
  auto ds = torch::empty_like(scores);
  ls::softmax_backward(dtype_of(scores, "scores"), dout.data_ptr(), scores.data_ptr(), lse.data_ptr<float>(),
                       key_padding_mask ? kpm.data_ptr<uint8_t>() : nullptr, causal, rng, ds.data_ptr(), int(B),
                       int(H), int(Tq), int(Tk), float(p), stream());
  CHECK_CUDA_OK();
  return ds;
}

// ---- attention ----
// q, k, v (and the gradients): [B, heads, T, d_head] views with d_head contiguous and rows that 16-byte
// loads can read; a new output [B, heads, T, d_head] is a view of [B, T, heads, d_head] storage (token-major,
// as the output projection merges heads by a view).
ls::PartStrides head_rows(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have q's dtype ", like.scalar_type(), ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 4 && t.size(3) == ls::kAttnHeadDim && t.stride(3) == 1, name,
              " must be [batch, heads, len, ", ls::kAttnHeadDim, "] with d_head contiguous, got sizes ", t.sizes(),
              " strides ", t.strides());
  const int64_t vec = 16 / t.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % vec == 0 && t.stride(1) % vec == 0 &&
                  t.stride(2) % vec == 0,
              name, " rows must start at 16-byte boundaries, got strides ", t.strides());
  return {t.stride(0), t.stride(1), t.stride(2)};
}

Tensor token_major_like(const Tensor& like, int64_t len) {
  return torch::empty({like.size(0), len, like.size(1), like.size(3)}, like.options()).transpose(1, 2);
}

std::tuple<Tensor, Tensor, std::optional<Dropout>> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                    const std::optional<Tensor>& key_padding_mask,
                                                                    bool causal, double p) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "attention: q must be float16 or bfloat16 (the tensor-core path), got ", q.scalar_type());
  const auto qs = head_rows(q, q, "q"), ks = head_rows(k, q, "k"), vs = head_rows(v, q, "v");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && v.sizes() == k.sizes(), "attention: k ", k.sizes(), " and v ",
              v.sizes(), " must be [", B, ", ", H, ", Tk, d_head] like q ", q.sizes());
  TORCH_CHECK(Tq >= 1 && Tk >= 1 && Tq <= ls::kAttnMaxLen && Tk <= ls::kAttnMaxLen, "attention: lengths Tq = ", Tq,
              ", Tk = ", Tk, " must be in [1, ", ls::kAttnMaxLen, "] (longer rows take torch's attention)");
  check_probability(p, "attention");
  const Tensor kpm = key_padding_bytes(key_padding_mask, B, Tk);
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = token_major_like(q, Tq);
  auto lse = torch::empty({B, H, Tq}, q.options().dtype(at::kFloat));
  std::optional<Dropout> dropout;
  if (p > 0.0) dropout = Dropout{philox_state(), std::nullopt, {B, H, Tq, Tk}, p, q.device()};
  ls::attention_forward(dtype_of(q, "q"), q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs,
                        kpm.defined() ? kpm.data_ptr<uint8_t>() : nullptr, causal, out.data_ptr(),
                        {out.stride(0), out.stride(1), out.stride(2)}, lse.data_ptr<float>(), int(B), int(H), int(Tq),
                        int(Tk), float(p), rng_of(dropout), stream());
  CHECK_CUDA_OK();
  return {out, lse, dropout};
}

std::tuple<Tensor, Tensor, Tensor> attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                      const Tensor& v, const Tensor& lse,
                                                      const std::optional<Tensor>& key_padding_mask, bool causal,
                                                      const std::optional<Dropout>& dropout, double p) {
  const auto qs = head_rows(q, q, "q"), ks = head_rows(k, q, "k"), vs = head_rows(v, q, "v");
  const auto dos = head_rows(dout, q, "dout");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2);
  check_shape(dout, q.sizes(), "dout");
  check_lse(lse, q, B, H, Tq);
  const Tensor kpm = key_padding_bytes(key_padding_mask, B, Tk);
  const ls::RngState* rng = redrawn(dropout, {B, H, Tq, Tk}, q.device(), p, "attention");
  const c10::cuda::CUDAGuard guard(q.device());
  auto dq = token_major_like(q, Tq), dk = token_major_like(k, Tk), dv = token_major_like(v, Tk);
  ls::attention_backward(dtype_of(q, "q"), dout.data_ptr(), dos, q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs,
                         lse.data_ptr<float>(), kpm.defined() ? kpm.data_ptr<uint8_t>() : nullptr, causal, rng,
                         float(p), dq.data_ptr(), {dq.stride(0), dq.stride(1), dq.stride(2)}, dk.data_ptr(),
                         {dk.stride(0), dk.stride(1), dk.stride(2)}, dv.data_ptr(),
                         {dv.stride(0), dv.stride(1), dv.stride(2)}, int(B), int(H), int(Tq), int(Tk), stream());
  CHECK_CUDA_OK();
  return {dq, dk, dv};
}

// ---- qkv ----
// The head-split kernels index tokens (batch x len) with 32-bit integers.
void check_tokens(int64_t batch, int64_t len) {
  TORCH_CHECK(batch * len < (int64_t(1) << 31), "qkv: batch x len must be below 2^31 tokens, got ", batch, " x ", len);
}

Tensor qkv_forward(const Tensor& x, const Tensor& bias, int64_t num_heads, int64_t num_parts, double first_scale,
                   bool token_major) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [batch, len, parts * d], got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  TORCH_CHECK(num_parts > 0 && num_heads > 0 && C % (num_parts * num_heads) == 0, "x's width ", C,
              " must be divisible by parts (", num_parts, ") x heads (", num_heads, ")");
  check_like(bias, x, "bias", "x");
  check_shape(bias, {C}, "bias");
  const int64_t D = C / num_parts / num_heads;
  check_tokens(B, T);
  const c10::cuda::CUDAGuard guard(x.device());
  // [parts, B, heads, T, d_head] either way: token-major as a view of [parts, B, T, heads, d_head]
  auto out = token_major ? torch::empty({num_parts, B, T, num_heads, D}, x.options()).transpose(2, 3)
                         : torch::empty({num_parts, B, num_heads, T, D}, x.options());
  ls::qkv_forward(dtype_of(x, "x"), x.data_ptr(), bias.data_ptr(), out.data_ptr(), int(B), int(T), int(num_parts),
                  int(num_heads), int(D), token_major, float(first_scale), stream());
  CHECK_CUDA_OK();
  return out;
}

std::tuple<Tensor, Tensor> qkv_backward(const std::vector<std::optional<Tensor>>& dys, double first_scale,
                                        const std::optional<Tensor>& dbias_into) {
  const Tensor* like = nullptr;
  for (const auto& g : dys)
    if (g && !like) like = &*g;
  TORCH_CHECK(like, "qkv_backward: no part has a gradient (got ", dys.size(), " parts, all None)");
  TORCH_CHECK(like->dim() == 4, "each part's dy must be [batch, heads, len, d_head], got ", like->sizes());
  std::vector<const void*> parts;
  std::vector<ls::PartStrides> strides;
  for (const auto& g : dys) {
    if (g) {
      // any layout of (batch, heads, len) as long as each row of d_head is contiguous
      TORCH_CHECK(g->is_cuda(), "dy must be a CUDA tensor, got one on ", g->device());
      TORCH_CHECK(g->scalar_type() == like->scalar_type() && g->device() == like->device(),
                  "every part's dy must have the first given part's dtype ", like->scalar_type(), " and device ",
                  like->device(), ", got ", g->scalar_type(), " on ", g->device());
      check_shape(*g, like->sizes(), "dy");
      TORCH_CHECK(g->stride(3) == 1 || g->size(3) == 1, "each part's dy must have contiguous rows of d_head "
                  "(stride 1 in the last dimension), got strides ", g->strides());
    }
    parts.push_back(g ? g->data_ptr() : nullptr);
    strides.push_back(g ? ls::PartStrides{g->stride(0), g->stride(1), g->stride(2)} : ls::PartStrides{0, 0, 0});
  }
  const int64_t P = int64_t(dys.size()), B = like->size(0), H = like->size(1), T = like->size(2), D = like->size(3);
  check_tokens(B, T);
  const c10::cuda::CUDAGuard guard(like->device());
  auto dx = torch::empty({B, T, P * H * D}, like->options());
  auto [dbias, dbias_out] = grad_out(dbias_into, *like, {P * H * D}, "dbias_into");
  auto partial = column_sum_partial(1, B * T, P * H * D, *like);
  ls::qkv_backward(dtype_of(*like, "dy"), parts.data(), strides.data(), dx.data_ptr(), dbias_out,
                   partial.data_ptr<float>(), int(B), int(T), int(P), int(H), int(D), float(first_scale), stream());
  CHECK_CUDA_OK();
  return {dx, dbias};
}

// ---- embedding ----
void check_ids(const Tensor& ids, const char* name) {
  check(ids, name);
  TORCH_CHECK(ids.scalar_type() == at::kLong, name, " must be int64, got ", ids.scalar_type());
}

std::tuple<Tensor, std::optional<Dropout>> embedding_forward(const Tensor& tokens, const Tensor& positions,
                                                            const Tensor& weight, const Tensor& pos_weight,
                                                            double scale, int64_t padding_idx, double p,
                                                            const std::optional<Tensor>& given) {
  check_ids(tokens, "tokens");
  check_ids(positions, "positions");
  check_shape(positions, tokens.sizes(), "positions");
  check(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be [vocab, dim], got ", weight.sizes());
  const int64_t dim = weight.size(1);
  check_like(pos_weight, weight, "pos_weight", "weight");
  TORCH_CHECK(pos_weight.dim() == 2 && pos_weight.size(1) == dim, "pos_weight must be [positions, ", dim, "], got ",
              pos_weight.sizes());
  check_probability(p, "embedding");
  std::vector<int64_t> out_shape(tokens.sizes().begin(), tokens.sizes().end());
  out_shape.push_back(dim);
  const c10::cuda::CUDAGuard guard(weight.device());
  auto out = torch::empty(out_shape, weight.options());
  check_mask(given, out, "mask");
  auto dropout = draw_dropout(given, p, out);
  ls::embedding_forward(dtype_of(weight, "weight"), tokens.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
                        weight.data_ptr(), pos_weight.data_ptr(), out.data_ptr(), tokens.numel(), int(dim),
                        float(scale), int(padding_idx), float(p), rng_of(dropout), stream());
  CHECK_CUDA_OK();
  return {out, dropout};
}

Tensor table_gradient(const Tensor& dout, const ls::RngState* rng, const Tensor& ids, int64_t rows,
                      double scale, int64_t padding_idx, double p, const std::optional<Tensor>& into,
                      const char* name) {
  const int64_t dim = dout.size(-1);
  auto [dtable, dtable_out] = grad_out(into, dout, {rows, dim}, name);
  TORCH_CHECK(rows < (int64_t(1) << 31) && ids.numel() < (int64_t(1) << 31), name,
              ": the table's rows and the number of ids must be below 2^31, got ", rows, " and ", ids.numel());
  const auto flat = ids.reshape({-1}).contiguous();
  auto workspace = torch::empty({int64_t(ls::embedding_backward_workspace_bytes(flat.numel(), rows, int(dim)))},
                                dout.options().dtype(at::kByte));
  ls::embedding_backward(dtype_of(dout, "dout"), dout.data_ptr(), rng, flat.data_ptr<int64_t>(),
                         workspace.data_ptr(), dtable_out, flat.numel(), rows, int(dim), float(scale),
                         int(padding_idx), float(p), stream());
  CHECK_CUDA_OK();
  return dtable;
}

std::tuple<Tensor, std::optional<Tensor>> embedding_backward(const Tensor& dout, const Tensor& tokens,
                                                             const Tensor& positions,
                                                             const std::optional<Dropout>& dropout, double scale,
                                                             int64_t padding_idx, double p, int64_t num_embeddings,
                                                             int64_t num_positions,
                                                             const std::optional<Tensor>& dweight_into,
                                                             const std::optional<Tensor>& dpos_into) {
  check(dout, "dout");
  check_ids(tokens, "tokens");
  check_ids(positions, "positions");
  const ls::RngState* rng = redrawn(dropout, dout, p, "embedding");
  const c10::cuda::CUDAGuard guard(dout.device());
  auto dweight = table_gradient(dout, rng, tokens, num_embeddings, scale, padding_idx, p, dweight_into, "dweight_into");
  std::optional<Tensor> dpos;
  if (num_positions > 0)
    dpos = table_gradient(dout, rng, positions, num_positions, 1.0, padding_idx, p, dpos_into, "dpos_into");
  return {dweight, dpos};
}

// ---- cross_entropy ----
std::tuple<Tensor, Tensor, Tensor> cross_entropy_forward(const Tensor& logits, const Tensor& target, double epsilon,
                                                         int64_t padding_idx) {
  check(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 2, "logits must be [tokens, vocab >= 2], got ", logits.sizes());
  check_ids(target, "target");
  check_shape(target, {logits.size(0)}, "target");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto f32 = logits.options().dtype(at::kFloat);
  auto loss = torch::empty({logits.size(0)}, f32), nll = torch::empty({logits.size(0)}, f32),
       lse = torch::empty({logits.size(0)}, f32);
  ls::cross_entropy_forward(dtype_of(logits, "logits"), logits.data_ptr(), target.data_ptr<int64_t>(),
                            loss.data_ptr<float>(), nll.data_ptr<float>(), lse.data_ptr<float>(), logits.size(0),
                            int(logits.size(1)), float(epsilon), int(padding_idx), stream());
  CHECK_CUDA_OK();
  return {loss, nll, lse};
}

// out: where the gradient goes (the logits themselves when the caller no longer needs them); none: a new tensor.
// dloss: a float32 a row, or the gradient of their sum as autograd gives it (one value seen by every row: stride
// 0), read as it is; dnll: none when the nll loss took no gradient
Tensor cross_entropy_backward(const Tensor& dloss, const std::optional<Tensor>& dnll, const Tensor& logits,
                              const Tensor& target, const Tensor& lse, double epsilon, int64_t padding_idx,
                              const std::optional<Tensor>& out) {
  check(logits, "logits");
  check_ids(target, "target");
  const int64_t n = logits.size(0);
  TORCH_CHECK(dloss.is_cuda() && dloss.device() == logits.device(), "dloss must be on logits' device ",
              logits.device());
  TORCH_CHECK(dloss.scalar_type() == at::kFloat && dloss.dim() == 1 && dloss.numel() == n &&
                  (n <= 1 || dloss.stride(0) == 0 || dloss.stride(0) == 1),
              "dloss must be float32 with ", n, " elements, contiguous or one value for all, got ",
              dloss.scalar_type(), " ", dloss.sizes(), " with strides ", dloss.strides());
  for (const Tensor* t : {dnll ? &*dnll : nullptr, &lse}) {
    if (!t) continue;
    check(*t, "dnll/lse");
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n, "dnll/lse must be float32 with ", n, " elements");
  }
  if (out) {
    check_like(*out, logits, "out", "logits");
    check_shape(*out, logits.sizes(), "out");
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  auto grad = out ? *out : torch::empty_like(logits);
  ls::cross_entropy_backward(dtype_of(logits, "logits"), dloss.data_ptr<float>(), n > 1 ? dloss.stride(0) : 1,
                             dnll ? dnll->data_ptr<float>() : nullptr, logits.data_ptr(), target.data_ptr<int64_t>(),
                             lse.data_ptr<float>(), grad.data_ptr(),
                             logits.size(0), int(logits.size(1)), float(epsilon), int(padding_idx), stream());
  CHECK_CUDA_OK();
  return grad;
}

// ---- beam_select ----
std::tuple<Tensor, Tensor> beam_select(const Tensor& scores, int64_t k, int64_t groups) {
  check(scores, "scores");
  TORCH_CHECK(scores.dim() == 2, "beam_select: scores must be [rows, entries], got ", scores.sizes());
  const int64_t rows = scores.size(0), entries = scores.size(1);
  TORCH_CHECK(entries < (int64_t(1) << 32), "beam_select: rows of ", entries, " entries; fewer than 2^32 expected");
  TORCH_CHECK(1 <= k && k <= entries, "beam_select: k = ", k, " must be within 1..", entries);
  const int64_t runs = std::max(std::min(groups, entries), k);
  TORCH_CHECK(runs <= ls::kBeamSelectMaxGroups, "beam_select: ", runs, " runs (max(min(groups, entries), k)); at most ",
              ls::kBeamSelectMaxGroups);
  const c10::cuda::CUDAGuard guard(scores.device());
  auto values = torch::empty({rows, k}, scores.options());
  auto indices = torch::empty({rows, k}, scores.options().dtype(at::kLong));
  ls::beam_select(dtype_of(scores, "scores"), scores.data_ptr(), values.data_ptr(), indices.data_ptr<int64_t>(), rows,
                  entries, int(k), int(runs), stream());
  CHECK_CUDA_OK();
  return {values, indices};
}

// ---- beam_scores ----
// logits [rows, M] contiguous, cum fp32 [rows], step: a one-element int64 tensor on the logits' device or
// None (then step_value) -> fp32 [rows, M]
Tensor beam_scores(const Tensor& logits, const Tensor& cum, const std::optional<Tensor>& step, int64_t step_value,
                   int64_t pad, int64_t unk, double unk_penalty, int64_t eos, int64_t min_len) {
  check(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "beam_scores: logits must be [rows, vocabulary], got ", logits.sizes());
  const int64_t rows = logits.size(0), M = logits.size(1);
  check(cum, "cum");
  TORCH_CHECK(cum.scalar_type() == at::kFloat && cum.numel() == rows && cum.device() == logits.device(),
              "beam_scores: cum must be fp32 [", rows, "] on ", logits.device());
  for (int64_t column : {pad, unk, eos})
    TORCH_CHECK(0 <= column && column < M, "beam_scores: column ", column, " outside the vocabulary of ", M);
  if (step) {
    TORCH_CHECK(step->is_cuda() && step->device() == logits.device() && step->scalar_type() == at::kLong &&
                    step->numel() == 1,
                "beam_scores: step must be one int64 on ", logits.device());
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  auto out = torch::empty({rows, M}, logits.options().dtype(at::kFloat));
  ls::beam_scores(dtype_of(logits, "logits"), logits.data_ptr(), cum.data_ptr<float>(), rows, M,
                  reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0,
                  step ? step->data_ptr<int64_t>() : nullptr, step_value, pad, unk, float(unk_penalty), eos, min_len,
                  out.data_ptr<float>(), stream());
  CHECK_CUDA_OK();
  return out;
}

// ---- fp8_cast ----
// x [rows, cols] contiguous, state fp32 [history + 2] contiguous on x's device (updated in place) ->
// [q [rows, cols] or empty, qT [cols, rows] or empty], float8_e4m3fn (float8_e5m2 with e5m2)
std::vector<Tensor> fp8_cast(const Tensor& x, const Tensor& state, bool e5m2, bool rowwise, bool transposed) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 2, "fp8_cast: x must be [rows, cols], got ", x.sizes());
  check(state, "state");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 1 && state.numel() >= 3 &&
                  state.device() == x.device(),
              "fp8_cast: state must be fp32 [history + 2] (history >= 1) on ", x.device(), ", got ",
              state.scalar_type(), " ", state.sizes(), " on ", state.device());
  TORCH_CHECK(rowwise || transposed, "fp8_cast: asked for neither layout (rowwise, transposed)");
  const int64_t rows = x.size(0), cols = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto fp8 = x.options().dtype(e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
  auto q = torch::empty({rowwise ? rows : 0, rowwise ? cols : 0}, fp8);
  auto qT = torch::empty({transposed ? cols : 0, transposed ? rows : 0}, fp8);
  if (x.numel() > 0) {
    ls::fp8_cast(dtype_of(x, "x"), x.data_ptr(), rows, cols, reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
                 state.data_ptr<float>(), int(state.numel() - 2), e5m2,
                 rowwise ? static_cast<uint8_t*>(q.data_ptr()) : nullptr,
                 transposed ? static_cast<uint8_t*>(qT.data_ptr()) : nullptr, stream());
    CHECK_CUDA_OK();
  }
  return {q, qT};
}

// ---- beam_advance ----
// values fp32 [B, 2k], indices int64 [B, 2k], step int64 [1], the state (ops/beam_advance.py's shapes), all
// contiguous on one device; updated in place
void beam_advance(const Tensor& values, const Tensor& indices, const Tensor& step, const Tensor& tokens,
                  const Tensor& scores, const Tensor& cum, const Tensor& done, const Tensor& count,
                  const Tensor& fin_tokens, const Tensor& fin_positional, const Tensor& fin_score,
                  const Tensor& fin_length, const Tensor& parents, int64_t eos, int64_t pad, int64_t vocab,
                  double len_penalty, bool normalize, bool advance) {
  check(values, "values");
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.dim() == 2 && values.size(1) % 2 == 0,
              "beam_advance: values must be fp32 [sentences, 2 x beam], got ", values.scalar_type(), " ",
              values.sizes());
  const int64_t B = values.size(0), k = values.size(1) / 2, N = B * k, L = fin_tokens.dim() == 3 ? fin_tokens.size(2) : 0;
  TORCH_CHECK(1 <= k && k <= ls::kBeamAdvanceMaxBeam, "beam_advance: beam ", k, " must be within 1..",
              ls::kBeamAdvanceMaxBeam);
  TORCH_CHECK(vocab > 0, "beam_advance: vocab must be positive, got ", vocab);
  const struct {
    const Tensor& t;
    const char* name;
    at::ScalarType type;
    std::vector<int64_t> shape;
  } expected[] = {
      {indices, "indices", at::kLong, {B, 2 * k}},   {step, "step", at::kLong, {1}},
      {tokens, "tokens", at::kLong, {N, L + 1}},     {scores, "scores", at::kFloat, {N, L}},
      {cum, "cum", at::kFloat, {N}},                 {done, "done", at::kBool, {B}},
      {count, "count", at::kLong, {B}},              {fin_tokens, "fin_tokens", at::kLong, {B, k + 1, L}},
      {fin_positional, "fin_positional", at::kFloat, {B, k + 1, L}},
      {fin_score, "fin_score", at::kFloat, {B, k + 1}}, {fin_length, "fin_length", at::kLong, {B, k + 1}},
      {parents, "parents", at::kLong, {N}},
  };
  for (const auto& e : expected) {
    check(e.t, e.name);
    TORCH_CHECK(e.t.device() == values.device(), "beam_advance: ", e.name, " must be on ", values.device());
    TORCH_CHECK(e.t.scalar_type() == e.type, "beam_advance: ", e.name, " must be ", e.type, ", got ",
                e.t.scalar_type());
    check_shape(e.t, e.shape, e.name);
  }
  TORCH_CHECK(L >= 1 && L < (int64_t(1) << 31), "beam_advance: ", L, " positions; 1..2^31 - 1 expected");
  const c10::cuda::CUDAGuard guard(values.device());
  ls::beam_advance(values.data_ptr<float>(), indices.data_ptr<int64_t>(), step.data_ptr<int64_t>(),
                   tokens.data_ptr<int64_t>(), scores.data_ptr<float>(), cum.data_ptr<float>(), done.data_ptr<bool>(),
                   count.data_ptr<int64_t>(), fin_tokens.data_ptr<int64_t>(), fin_positional.data_ptr<float>(),
                   fin_score.data_ptr<float>(), fin_length.data_ptr<int64_t>(), parents.data_ptr<int64_t>(), B, int(k),
                   int(L), eos, pad, vocab, len_penalty, normalize, advance, stream());
  CHECK_CUDA_OK();
}

// ---- decode_attention ----
// q [N, heads, 1, d_head] (rows of heads x d_head contiguous), cache [capacity, 2 x layers, slots, heads,
// d_head] contiguous, origin int32 [>= N, >= length] with unit stride along positions -> [N, heads, 1, d_head];
// length_on_device: a one-element int64 tensor holding the length (clamped to `length`), read by the kernel;
// k, v (both or neither): the step's keys and values, laid out as q, written into the cache at position
// length - 1 of slots 0..N-1 (and attended to); bias [3 x heads x d_head] (with k and v only): q, k and v
// are the projection's output without it, which the kernel adds; q is then scaled by `scaling`
Tensor decode_attention(const Tensor& q, const Tensor& cache, int64_t layer, const Tensor& origin, int64_t length,
                        const std::optional<Tensor>& length_on_device, const std::optional<Tensor>& k,
                        const std::optional<Tensor>& v, const std::optional<Tensor>& bias, double scaling) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor, got one on ", q.device());
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be [hypotheses, heads, 1, d_head], got ",
              q.sizes());
  const int64_t N = q.size(0), H = q.size(1), D = q.size(3);
  TORCH_CHECK(q.stride(3) == 1 && q.stride(1) == D, "decode_attention: q's heads x d_head must be contiguous");
  TORCH_CHECK((q.stride(0) * q.element_size()) % 16 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
              "decode_attention: q's rows must be 16-byte aligned");
  check_like(cache, q, "cache", "q");
  TORCH_CHECK(cache.dim() == 5 && cache.size(3) == H && cache.size(4) == D,
              "decode_attention: cache must be [capacity, 2 x layers, slots, ", H, ", ", D, "], got ", cache.sizes());
  TORCH_CHECK(0 <= layer && 2 * layer + 1 < cache.size(1), "decode_attention: layer ", layer, " outside the cache's ",
              cache.size(1) / 2);
  TORCH_CHECK(1 <= length && length <= cache.size(0), "decode_attention: length ", length, " must be within 1..",
              cache.size(0));
  TORCH_CHECK(ls::decode_attention_supports(int(D)), "decode_attention: d_head ", D, " is not 32, 64, 128 or 256");
  TORCH_CHECK(origin.is_cuda() && origin.device() == q.device(), "origin must be on ", q.device());
  TORCH_CHECK(origin.scalar_type() == at::kInt, "origin must be int32, got ", origin.scalar_type());
  TORCH_CHECK(origin.dim() == 2 && origin.size(0) >= N && origin.size(1) >= length && origin.stride(1) == 1,
              "decode_attention: origin must be [>= ", N, ", >= ", length, "] with unit stride along positions, got ",
              origin.sizes());
  TORCH_CHECK(cache.size(0) * cache.stride(0) < (int64_t(1) << 62), "decode_attention: cache too large");
  if (length_on_device) {
    TORCH_CHECK(length_on_device->is_cuda() && length_on_device->device() == q.device(), "length must be on ",
                q.device());
    TORCH_CHECK(length_on_device->scalar_type() == at::kLong && length_on_device->numel() == 1,
                "decode_attention: length must be one int64, got ", length_on_device->scalar_type(), " ",
                length_on_device->sizes());
  }
  TORCH_CHECK(k.has_value() == v.has_value(), "decode_attention: the step's k and v come together");
  if (k) {
    for (const Tensor* t : {&*k, &*v}) {
      TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->scalar_type() == q.scalar_type(),
                  "decode_attention: k and v must be ", q.scalar_type(), " on ", q.device());
      TORCH_CHECK(t->sizes() == q.sizes() && t->stride(3) == 1 && t->stride(1) == D && t->stride(0) == k->stride(0),
                  "decode_attention: k and v must be laid out as q ", q.sizes(), " with one row stride, got ",
                  t->sizes(), " strides ", t->strides());
    }
    TORCH_CHECK(N <= cache.size(2), "decode_attention: ", N, " hypotheses' keys written into ", cache.size(2),
                " slots");
  }
  if (bias) {
    TORCH_CHECK(k.has_value(), "decode_attention: a bias comes with the step's k and v");
    check_like(*bias, q, "bias", "q");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == 3 * H * D && bias->is_contiguous(),
                "decode_attention: bias must be [", 3 * H * D, "] contiguous, got ", bias->sizes());
  }
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = torch::empty({N, H, 1, D}, q.options());
  const char* base = static_cast<const char*>(cache.data_ptr());
  const int64_t layer_bytes = cache.stride(1) * cache.element_size();
  ls::decode_attention(dtype_of(q, "q"), q.data_ptr(), q.stride(0), base + 2 * layer * layer_bytes,
                       base + (2 * layer + 1) * layer_bytes, cache.stride(0), cache.stride(2),
                       origin.data_ptr<int>(), origin.stride(0), N, int(H), int(D), int(length),
                       length_on_device ? length_on_device->data_ptr<int64_t>() : nullptr,
                       k ? k->data_ptr() : nullptr, v ? v->data_ptr() : nullptr, k ? k->stride(0) : 0,
                       bias ? bias->data_ptr() : nullptr, float(scaling), out.data_ptr(), stream());
  CHECK_CUDA_OK();
  return out;
}

// ---- beam_attention ----
// q [B, heads, beams, d_head] (unit stride along d_head), k, v [B, heads, S, d_head] contiguous and 16-byte
// aligned, key_padding_mask bool [B, S] (True = pad) contiguous or None, bias [heads x d_head] or None (then
// q is only scaled) -> [B, heads, beams, d_head], a view of token-major [B, beams, heads, d_head] storage
Tensor beam_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& key_padding_mask,
                      const std::optional<Tensor>& bias, double scaling) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor, got one on ", q.device());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "beam_attention: q and k must be 4-d, got ", q.sizes(), " and ",
              k.sizes());
  const int64_t B = q.size(0), H = q.size(1), beams = q.size(2), D = q.size(3), S = k.size(2);
  check_like(k, q, "k", "q");
  check_like(v, q, "v", "q");
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(),
              "beam_attention: k and v must be [", B, ", ", H, ", S, ", D, "], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(ls::beam_attention_supports(int(D)), "beam_attention: d_head ", D, " is not 32, 64, 128 or 256");
  TORCH_CHECK(S >= 1, "beam_attention: no keys");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(),
              "beam_attention: q, k and v need a unit stride along d_head and k, v the same strides");
  const int64_t vec = 16 / k.element_size();
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(k.stride(i) % vec == 0, "beam_attention: k and v rows must be 16-byte aligned, strides ", k.strides());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
              "beam_attention: k and v must be 16-byte aligned");
  TORCH_CHECK(B < (int64_t(1) << 31) && H * beams < (int64_t(1) << 31) && S < (int64_t(1) << 31),
              "beam_attention: too many sentences, heads or keys");
  const uint8_t* padding = nullptr;
  int64_t padding_stride = 0;
  if (key_padding_mask) {
    check(*key_padding_mask, "key_padding_mask");
    TORCH_CHECK(key_padding_mask->scalar_type() == at::kBool && key_padding_mask->device() == q.device() &&
                    key_padding_mask->dim() == 2 && key_padding_mask->size(0) == B &&
                    key_padding_mask->size(1) == S && key_padding_mask->stride(1) == 1,
                "beam_attention: key_padding_mask must be bool [", B, ", ", S, "] on ", q.device(),
                " with unit stride along the keys, got ", key_padding_mask->scalar_type(), " ",
                key_padding_mask->sizes());
    padding = reinterpret_cast<const uint8_t*>(key_padding_mask->data_ptr());
    padding_stride = key_padding_mask->stride(0);
  }
  if (bias) {
    check_like(*bias, q, "bias", "q");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == H * D && bias->is_contiguous(), "beam_attention: bias must be [",
                H * D, "] contiguous, got ", bias->sizes());
  }
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = torch::empty({B, beams, H, D}, q.options());
  ls::beam_attention(dtype_of(q, "q"), q.data_ptr(), {q.stride(0), q.stride(1), q.stride(2)}, k.data_ptr(),
                     v.data_ptr(), {k.stride(0), k.stride(1), k.stride(2)}, padding, padding_stride,
                     bias ? bias->data_ptr() : nullptr, float(scaling), int(B), int(H), int(beams), int(D), int(S),
                     out.data_ptr(), stream());
  CHECK_CUDA_OK();
  return out.transpose(1, 2);
}

// ---- adam ----
void check_f32_like(const Tensor& t, const Tensor& param, const char* name) {
  check(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == param.numel(), name, " must have ", param.numel(), " elements, got ", t.numel());
}

const float* device_scalar(const Tensor& t, const Tensor& param, const char* name) {
  check(t, name);
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat, name, " must be a float32 scalar");
  TORCH_CHECK(t.device() == param.device(), name, " must be on the parameters' device ", param.device());
  return t.data_ptr<float>();
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const std::optional<Tensor>& master, double lr, double beta1, double beta2, double eps,
               double weight_decay, const py::object& step, const py::object& grad_scale, bool decoupled,
               const std::optional<Tensor>& noop_flag, bool stochastic_rounding) {
  check(param, "param");
  check_like(grad, param, "grad", "param");
  TORCH_CHECK(grad.numel() == param.numel(), "grad must have ", param.numel(), " elements");
  check_f32_like(exp_avg, param, "exp_avg");
  check_f32_like(exp_avg_sq, param, "exp_avg_sq");
  if (master) check_f32_like(*master, param, "master");
  const c10::cuda::CUDAGuard guard(param.device());
  ls::AdamArgs a{};
  a.lr = float(lr);
  a.beta1 = float(beta1);
  a.beta2 = float(beta2);
  a.eps = float(eps);
  a.weight_decay = float(weight_decay);
  a.decoupled = decoupled;
  TORCH_CHECK(!stochastic_rounding || (!master && param.scalar_type() != at::kFloat),
              "adam_step: stochastic rounding is for fp16/bf16 parameters without an fp32 master copy");
  a.stochastic_rounding = stochastic_rounding;
  if (stochastic_rounding) a.rng = philox_state();
  Tensor step_tensor;
  if (THPVariable_Check(step.ptr())) {
    step_tensor = THPVariable_Unpack(step.ptr()).to(at::kFloat).contiguous();
    a.step_ptr = device_scalar(step_tensor, param, "step");
  } else {
    const int64_t t = step.cast<int64_t>();
    TORCH_CHECK(t >= 1, "adam_step: step must be at least 1, got ", t);
    a.step_size = float(lr * std::sqrt(1.0 - std::pow(beta2, double(t))) / (1.0 - std::pow(beta1, double(t))));
  }
  Tensor scale_tensor;
  if (THPVariable_Check(grad_scale.ptr())) {
    scale_tensor = THPVariable_Unpack(grad_scale.ptr()).to(at::kFloat).contiguous();
    a.grad_scale = 1.f;
    a.grad_scale_ptr = device_scalar(scale_tensor, param, "grad_scale");
  } else {
    a.grad_scale = grad_scale.cast<float>();
  }
  Tensor flag;
  if (noop_flag) {
    flag = noop_flag->to(at::kFloat).contiguous();
    a.noop_flag = device_scalar(flag, param, "noop_flag");
  }
  ls::adam_step(dtype_of(param, "param"), param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr<float>(),
                exp_avg_sq.data_ptr<float>(), master ? master->data_ptr<float>() : nullptr, param.numel(), a,
                stream());
  CHECK_CUDA_OK();
}

Tensor grad_norm(const Tensor& grad) {
  check(grad, "grad");
  const c10::cuda::CUDAGuard guard(grad.device());
  auto partial = torch::empty({ls::kNormBlocks}, grad.options().dtype(at::kFloat));
  auto counter = torch::zeros({1}, grad.options().dtype(at::kInt));
  auto out = torch::empty({}, grad.options().dtype(at::kFloat));
  ls::grad_norm(dtype_of(grad, "grad"), grad.data_ptr(), grad.numel(), partial.data_ptr<float>(),
                reinterpret_cast<unsigned*>(counter.data_ptr<int>()), out.data_ptr<float>(), nullptr, stream());
  CHECK_CUDA_OK();
  return out;
}

// state: ops/adam.py's ScalerState slots; its last slot is the kernel's zeroed block counter.
void scaled_grad_norm(const Tensor& grad, const Tensor& state, double factor, double max_norm, double scale_window,
                      double scale_floor) {
  check(grad, "grad");
  check(state, "state");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 1 && state.numel() == 7,
              "scaled_grad_norm: state must be a float32 vector of 7 slots, got ", state.scalar_type(), " ",
              state.sizes());
  TORCH_CHECK(state.device() == grad.device(), "scaled_grad_norm: state must be on grad's device ", grad.device());
  const c10::cuda::CUDAGuard guard(grad.device());
  auto partial = torch::empty({ls::kNormBlocks}, grad.options().dtype(at::kFloat));
  float* st = state.data_ptr<float>();
  const ls::NormEpilogue e{st, float(factor), float(max_norm), float(scale_window), float(scale_floor)};
  ls::grad_norm(dtype_of(grad, "grad"), grad.data_ptr(), grad.numel(), partial.data_ptr<float>(),
                reinterpret_cast<unsigned*>(st + 6), st + 2, &e, stream());
  CHECK_CUDA_OK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ls_fairseq fused CUDA kernels (see ls_fairseq/ops for each op's contract)";
  py::class_<Dropout>(m, "Dropout", "A dropout call's keep-bits, as its backward finds them: drawn again, or stored a bit an element")
      .def_property_readonly("p", [](const Dropout& d) { return d.p; })
      .def("mask", &Dropout::mask, "the keep-mask (uint8, 1 = keep) the call drew, written out");
  m.def("draw_dropout", &next_dropout, "the Dropout the next kernel call over like's shape at rate p would draw");
  m.def("dropout_from_mask", &dropout_from_mask, "the Dropout of a forward call given mask (uint8, 1 = keep) at rate p");
  m.def("layer_norm_forward", &layer_norm_forward);
  m.def("layer_norm_backward", &layer_norm_backward);
  m.def("bias_dropout_residual_layer_norm_forward", &bias_dropout_residual_layer_norm_forward);
  m.def("bias_dropout_residual_layer_norm_backward", &bias_dropout_residual_layer_norm_backward);
  m.def("bias_dropout_residual_forward", &bias_dropout_residual_forward);
  m.def("bias_dropout_residual_backward", &bias_dropout_residual_backward);
  m.def("bias_act_dropout_forward", &bias_act_dropout_forward);
  m.def("bias_act_dropout_backward", &bias_act_dropout_backward);
  m.def("softmax_forward", &softmax_forward);
  m.def("softmax_backward", &softmax_backward);
  m.attr("attention_head_dim") = ls::kAttnHeadDim;
  m.attr("attention_max_len") = ls::kAttnMaxLen;
  m.def("attention_forward", &attention_forward);
  m.def("attention_backward", &attention_backward);
  m.def("qkv_forward", &qkv_forward);
  m.def("qkv_backward", &qkv_backward);
  m.def("embedding_forward", &embedding_forward);
  m.def("embedding_backward", &embedding_backward);
  m.def("cross_entropy_forward", &cross_entropy_forward);
  m.def("cross_entropy_backward", &cross_entropy_backward);
  m.attr("beam_select_max_groups") = ls::kBeamSelectMaxGroups;
  m.def("beam_select", &beam_select);
  m.def("beam_scores", &beam_scores);
  m.attr("beam_advance_max_beam") = ls::kBeamAdvanceMaxBeam;
  m.def("beam_advance", &beam_advance);
  m.def("decode_attention", &decode_attention);
  m.def("beam_attention", &beam_attention);
  m.def("fp8_cast", &fp8_cast);
  m.def("adam_step", &adam_step);
  m.def("grad_norm", &grad_norm);
  m.def("scaled_grad_norm", &scaled_grad_norm);
}
