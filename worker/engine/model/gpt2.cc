#include "worker/engine/model/gpt2.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/torch_compat.h"

namespace shardtrain {
namespace {

constexpr double kInitStd = 0.02;
constexpr double kLayerNormEps = 1e-5;

torch::nn::Linear MakeLinear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(true));
}

torch::nn::LayerNorm MakeLayerNorm(int64_t c) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({c}).eps(kLayerNormEps));
}

// Linear layers see activations as [B*T, C]: a 2-D input takes ATen's fused
// addmm path, and the views cost nothing on the contiguous residual stream.
torch::Tensor Flatten(const torch::Tensor& x) {
  return x.reshape({-1, x.size(-1)});
}

}  // namespace

torch::Tensor CausalMask::Get(int64_t t, const torch::Tensor& like) {
  if (!mask_.defined() || mask_.device() != like.device() ||
      mask_.scalar_type() != like.scalar_type()) {
    torch::NoGradGuard no_grad;
    mask_ = torch::full({block_size_, block_size_},
                        -std::numeric_limits<double>::infinity(),
                        like.options().requires_grad(false))
                .triu_(1);
  }
  return mask_.narrow(0, 0, t).narrow(1, 0, t);
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(
    const Gpt2Config& config, std::shared_ptr<CausalMask> mask)
    : n_head_(config.n_head), n_embd_(config.n_embd), mask_(std::move(mask)) {
  c_attn_ = register_module("c_attn", MakeLinear(n_embd_, 3 * n_embd_));
  c_proj_ = register_module("c_proj", MakeLinear(n_embd_, n_embd_));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1);
  const int64_t hs = x.size(2) / n_head_;
  // Tensor parallel: this rank's heads, and its share of C.
  const int64_t heads = tp_ == nullptr ? n_head_ : n_head_ / tp_->size();
  const int64_t c = heads * hs;
  const torch::Tensor in = tp_ == nullptr ? x : tp_->Enter(x);
  // One copy lays q, k and v out head-major: [3, B, nh, T, hs].
  const torch::Tensor qkv = c_attn_(Flatten(in))
                                .view({b, t, 3, heads, hs})
                                .permute({2, 0, 3, 1, 4})
                                .contiguous();
  torch::Tensor y;  // [B, nh, T, hs]
#ifdef SHARDTRAIN_TORCH_HAS_SDPA
  y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{},
                                       /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  const torch::Tensor q = qkv[0].view({b * heads, t, hs});
  const torch::Tensor k = qkv[1].view({b * heads, t, hs});
  const torch::Tensor v = qkv[2].view({b * heads, t, hs});
  // The mask is added by the matrix product itself (beta = 1), so the scores
  // are written once before the softmax.
  const torch::Tensor scores =
      at::baddbmm(mask_->Get(t, x), q, k.transpose(1, 2), /*beta=*/1.0,
                  /*alpha=*/1.0 / std::sqrt(static_cast<double>(hs)));
  y = at::bmm(at::softmax(scores, -1), v).view({b, heads, t, hs});
#endif
  y = y.permute({0, 2, 1, 3}).reshape({b * t, c});
  if (tp_ == nullptr) return c_proj_(y).view({b, t, c});
  // Row-parallel: the partial products summed over the group, then the bias
  // once.
  return (tp_->Leave(at::linear(y, c_proj_->weight)) + c_proj_->bias)
      .view(x.sizes());
}

MlpImpl::MlpImpl(const Gpt2Config& config) {
  c_fc_ = register_module("c_fc", MakeLinear(config.n_embd, 4 * config.n_embd));
  c_proj_ =
      register_module("c_proj", MakeLinear(4 * config.n_embd, config.n_embd));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  if (tp_ != nullptr) {
    const torch::Tensor h = at::gelu(c_fc_(Flatten(tp_->Enter(x))), "tanh");
    return (tp_->Leave(at::linear(h, c_proj_->weight)) + c_proj_->bias)
        .view(x.sizes());
  }
  const torch::Tensor h = at::gelu(c_fc_(Flatten(x)), "tanh");
  return c_proj_(h).view(x.sizes());
}

namespace {

// Which of Megatron's splits a parameter takes, by its name's ending.
enum class TpSplit { kWhole, kRows, kQkvRows, kColumns };

TpSplit TensorParallelSplit(const std::string& name) {
  if (absl::EndsWith(name, "attn.c_attn.weight") ||
      absl::EndsWith(name, "attn.c_attn.bias")) {
    return TpSplit::kQkvRows;
  }
  if (absl::EndsWith(name, "mlp.c_fc.weight") ||
      absl::EndsWith(name, "mlp.c_fc.bias") || name == "wte.weight") {
    return TpSplit::kRows;
  }
  if (absl::EndsWith(name, "attn.c_proj.weight") ||
      absl::EndsWith(name, "mlp.c_proj.weight")) {
    return TpSplit::kColumns;
  }
  return TpSplit::kWhole;
}

}  // namespace

std::vector<FlatRun> TensorParallelRuns(const std::string& name,
                                        const std::vector<int64_t>& global,
                                        int64_t rank, int64_t size) {
  int64_t numel = 1;
  for (int64_t d : global) numel *= d;
  const int64_t row = global.size() > 1 ? numel / global[0] : 1;  // elements
  std::vector<FlatRun> runs;
  switch (TensorParallelSplit(name)) {
    case TpSplit::kWhole:
      runs.push_back({0, numel});
      break;
    case TpSplit::kRows: {
      const int64_t rows = global[0] / size;
      runs.push_back({rank * rows * row, rows * row});
      break;
    }
    case TpSplit::kQkvRows: {
      const int64_t part = global[0] / 3;  // C rows each of q, k, v
      const int64_t rows = part / size;
      for (int64_t p = 0; p < 3; ++p) {
        runs.push_back({(p * part + rank * rows) * row, rows * row});
      }
      break;
    }
    case TpSplit::kColumns: {
      const int64_t columns = global[1] / size;
      for (int64_t i = 0; i < global[0]; ++i) {
        runs.push_back({i * global[1] + rank * columns, columns});
      }
      break;
    }
  }
  return runs;
}

std::vector<int64_t> TensorParallelShape(const std::string& name,
                                         const std::vector<int64_t>& global,
                                         int64_t size) {
  std::vector<int64_t> local = global;
  switch (TensorParallelSplit(name)) {
    case TpSplit::kWhole:
      break;
    case TpSplit::kRows:
    case TpSplit::kQkvRows:
      local[0] /= size;
      break;
    case TpSplit::kColumns:
      local[1] /= size;
      break;
  }
  return local;
}

BlockImpl::BlockImpl(const Gpt2Config& config,
                     std::shared_ptr<CausalMask> mask) {
  ln_1_ = register_module("ln_1", MakeLayerNorm(config.n_embd));
  attn_ = register_module("attn", CausalSelfAttention(config, std::move(mask)));
  ln_2_ = register_module("ln_2", MakeLayerNorm(config.n_embd));
  mlp_ = register_module("mlp", Mlp(config));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = x + attn_(ln_1_(x));
  return y + mlp_(ln_2_(y));
}

Gpt2Impl::Gpt2Impl(const Gpt2Config& config, uint64_t seed) : config_(config) {
  const absl::Status valid = config.Validate();
  TORCH_CHECK(valid.ok(), "Gpt2: invalid config: ", valid.ToString());
  const int64_t c = config.n_embd;
  wte_ =
      register_module("wte", torch::nn::Embedding(config.padded_vocab_size, c));
  wpe_ = register_module("wpe", torch::nn::Embedding(config.block_size, c));
  h_ = register_module("h", torch::nn::ModuleList());
  auto mask = std::make_shared<CausalMask>(config.block_size);
  for (int64_t i = 0; i < config.n_layer; ++i) {
    blocks_.push_back(Block(config, mask));
    h_->push_back(blocks_.back());
  }
  ln_f_ = register_module("ln_f", MakeLayerNorm(c));
  InitWeights(seed);
}

torch::Tensor Gpt2Impl::Embed(const torch::Tensor& idx) {
  TORCH_CHECK(idx.dim() == 2 && idx.scalar_type() == torch::kLong,
              "Gpt2: idx must be [B,T] int64, got ", idx.sizes(), " ",
              idx.scalar_type());
  const int64_t t = idx.size(1);
  TORCH_CHECK(t >= 1 && t <= config_.block_size, "Gpt2: sequence length ", t,
              " must be in [1, block_size = ", config_.block_size, "]");
  CheckWholeVocabulary("Embed");
  // Positions are the first T rows of wpe, broadcast over the batch: no
  // arange tensor and no gather.
  return wte_(idx) + wpe_->weight.narrow(0, 0, t);
}

void Gpt2Impl::CheckWholeVocabulary(const char* what) const {
  TORCH_CHECK(wte_->weight.size(0) == config_.padded_vocab_size, "Gpt2::", what,
              ": wte holds ", wte_->weight.size(0), " of ",
              config_.padded_vocab_size,
              " rows (tensor parallel): the strategy's vocabulary-parallel "
              "embedding and head take the place of Embed and Head");
}

torch::Tensor Gpt2Impl::Head(const torch::Tensor& x) {
  CheckWholeVocabulary("Head");
  const torch::Tensor vocab_rows =
      wte_->weight.narrow(0, 0, config_.vocab_size);  // contiguous view
  const torch::Tensor logits = at::linear(Flatten(ln_f_(x)), vocab_rows);
  return logits.view({x.size(0), x.size(1), config_.vocab_size});
}

torch::Tensor Gpt2Impl::HeadLoss(const torch::Tensor& x,
                                 const torch::Tensor& targets) {
  CheckWholeVocabulary("HeadLoss");
  return LmHeadLoss(ln_f_(x), wte_->weight, config_.vocab_size, targets);
}

namespace {

// Activation checkpointing of one block, as torch.utils.checkpoint's
// re-entrant variant: forward runs the block without a graph (a custom
// Function's forward runs under no-grad) and saves only its input; backward
// runs it again with a graph and backpropagates through that graph, which
// accumulates the parameters' gradients into their leaves as usual and
// yields the input's gradient. GPT-2 here has no dropout, so the
// recomputation is the forward's exact arithmetic.
class RecomputedBlock : public torch::autograd::Function<RecomputedBlock> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& x, int64_t block) {
    ctx->saved_data["block"] = block;
    ctx->saved_data["autocast"] = torch_compat::CudaAutocastEnabled();
    ctx->save_for_backward({x});
    return reinterpret_cast<BlockImpl*>(block)->forward(x);
  }

  static torch::autograd::tensor_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::tensor_list grads) {
    auto* block =
        reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    const bool autocast = ctx->saved_data["autocast"].toBool();
    const torch::Tensor input =
        ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor output;
    {
      torch::AutoGradMode grad_mode(true);
      const bool was_autocast = torch_compat::CudaAutocastEnabled();
      if (autocast != was_autocast) {
        torch_compat::SetCudaAutocast(autocast, at::kBFloat16);
      }
      output = block->forward(input);
      if (autocast != was_autocast) {
        torch_compat::SetCudaAutocast(was_autocast, at::kBFloat16);
        at::autocast::clear_cache();
      }
    }
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor Gpt2Impl::RunBlock(int64_t i, const torch::Tensor& x) {
  Block& block = blocks_.at(static_cast<size_t>(i));
  if (!IsRecomputed(i) || !torch::GradMode::is_enabled()) return block(x);
  return RecomputedBlock::apply(
      x, static_cast<int64_t>(reinterpret_cast<intptr_t>(block.get())));
}

torch::Tensor Gpt2Impl::ForwardLoss(const torch::Tensor& idx,
                                    const torch::Tensor& targets) {
  torch::Tensor x = Embed(idx);
  for (int64_t i = 0; i < num_blocks(); ++i) x = RunBlock(i, x);
  return HeadLoss(x, targets);
}

torch::Tensor Gpt2Impl::forward(const torch::Tensor& idx) {
  torch::Tensor x = Embed(idx);
  for (Block& block : blocks_) x = block(x);
  return Head(x);
}

void Gpt2Impl::InitWeights(uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const double proj_std =
      kInitStd / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  for (auto& named : named_parameters(/*recurse=*/true)) {
    const std::string& name = named.key();
    torch::Tensor& p = named.value();
    if (absl::EndsWith(name, ".bias")) {
      p.zero_();
    } else if (absl::StartsWith(name, "ln_") ||
               absl::StrContains(name, ".ln_")) {
      p.fill_(1.0);
    } else {
      const double std =
          absl::EndsWith(name, "c_proj.weight") ? proj_std : kInitStd;
      // Drawn on the CPU so that every device gets the same numbers.
      if (p.is_cpu() && p.is_contiguous()) {
        p.normal_(0.0, std, gen);
      } else {
        p.copy_(torch::empty(p.sizes(), p.options().device(torch::kCPU))
                    .normal_(0.0, std, gen));
      }
    }
  }
  wte_->weight
      .narrow(0, config_.vocab_size,
              config_.padded_vocab_size - config_.vocab_size)
      .zero_();
}

absl::StatusOr<Gpt2> CreateGpt2(const Gpt2Config& config, uint64_t seed) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  try {
    return Gpt2(config, seed);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("building model ", config.ToSpec(),
                                            ": ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("building model ", config.ToSpec(), ": out of memory (",
                     config.NumParameters(), " parameters)"));
  }
}

// Cross-entropy fused by hand. ATen's log_softmax + nll_loss materialise three
// more [N, V] tensors per step (log-probabilities, nll's dense gradient, the
// gradient of log_softmax); with GPT-2's 50k vocabulary those dominate a small
// model's step on CPU (some 40% of gpt2-tiny's step here). Here the
// forward pass keeps only per-row losses (log_softmax runs on slices of rows)
// and the backward pass writes the one gradient the head needs,
// softmax(logits) - onehot(targets), scaled by grad / N. Matches ATen to float
// rounding (see gpt2_test.cc). Not twice differentiable.
class FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
 public:
  // logits [N, V] floating point, targets [N] int64 -> mean loss, a scalar.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& logits,
                               const torch::Tensor& targets) {
    const int64_t n = logits.size(0), v = logits.size(1);
    // On CPU, about 4 MiB of log-probabilities at a time: they stay in cache
    // and never become a fresh [N, V] allocation. Accelerators take all rows
    // in one kernel.
    const int64_t rows =
        logits.is_cpu() ? std::max<int64_t>(1, (int64_t{1} << 20) / v) : n;
    torch::Tensor row_loss = at::empty({n}, logits.options());
    for (int64_t start = 0; start < n; start += rows) {
      const int64_t len = std::min(rows, n - start);
      const torch::Tensor logp =
          at::log_softmax(logits.narrow(0, start, len), 1);
      torch::Tensor out = row_loss.narrow(0, start, len);
      at::neg_out(out,
                  logp.gather(1, targets.narrow(0, start, len).unsqueeze(1))
                      .squeeze(1));
    }
    ctx->save_for_backward({logits, targets});
    return row_loss.mean();
  }

  static torch::autograd::tensor_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::tensor_list grad_outputs) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& logits = saved[0];
    const torch::Tensor& targets = saved[1];
    const torch::Tensor scale = grad_outputs[0] / logits.size(0);
    torch::Tensor grad = at::softmax(logits, 1).mul_(scale);
    grad.scatter_add_(1, targets.unsqueeze(1),
                      scale.neg().expand({logits.size(0), 1}));
    return {grad, torch::Tensor()};
  }
};

torch::Tensor CrossEntropyLoss(const torch::Tensor& logits,
                               const torch::Tensor& targets) {
  TORCH_CHECK(logits.dim() >= 2 && logits.is_floating_point(),
              "CrossEntropyLoss: logits must be [..., V] floating point, got ",
              logits.sizes());
  TORCH_CHECK(targets.scalar_type() == torch::kLong &&
                  targets.numel() * logits.size(-1) == logits.numel(),
              "CrossEntropyLoss: targets must be int64 with one entry per row "
              "of logits, got ",
              targets.sizes(), " for logits ", logits.sizes());
  return FusedCrossEntropy::apply(Flatten(logits).contiguous(),
                                  targets.reshape({-1}));
}

}  // namespace shardtrain

namespace shardtrain {
namespace {

bool CudaAutocastEnabled() { return torch_compat::CudaAutocastEnabled(); }

// The chunked head: see LmHeadLoss in the header.
class ChunkedLmHead : public torch::autograd::Function<ChunkedLmHead> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& hidden,
                               const torch::Tensor& weight, int64_t vocab_size,
                               const torch::Tensor& targets,
                               int64_t chunk_bytes, bool want_dx,
                               bool want_dw) {
    const int64_t n = hidden.size(0), c = hidden.size(1);
    // Products in the autocast dtype on CUDA (at::mm autocasts); in place
    // into the fp32 gradient elsewhere.
    const bool low_precision = hidden.is_cuda() && CudaAutocastEnabled();
    const torch::Tensor w = weight.narrow(0, 0, vocab_size);  // contiguous
    const int64_t rows = std::max<int64_t>(
        1, chunk_bytes / (vocab_size * static_cast<int64_t>(sizeof(float))));
    torch::Tensor row_loss = at::empty({n}, hidden.options().dtype(at::kFloat));
    torch::Tensor dx, dw;
    if (want_dx) dx = at::empty({n, c}, hidden.options());
    if (want_dw) dw = at::zeros_like(weight);
    const double inv_n = 1.0 / static_cast<double>(n);
    for (int64_t start = 0; start < n; start += rows) {
      const int64_t len = std::min(rows, n - start);
      const torch::Tensor x = hidden.narrow(0, start, len);
      const torch::Tensor t = targets.narrow(0, start, len).unsqueeze(1);
      torch::Tensor logits = at::mm(x, w.t()).to(at::kFloat);  // [len, V]
      // loss = log(sum(exp(l - max))) + max - l[target]. The softmax is
      // exp(l - max) / sum, as softmax computes it: exp(l - logsumexp) would
      // be ~10x less precise, and near-cancelling gradient entries show it.
      const torch::Tensor target_logit = logits.gather(1, t);
      const torch::Tensor max = std::get<0>(logits.max(1, /*keepdim=*/true));
      torch::Tensor e = logits.sub_(max).exp_();
      const torch::Tensor sum = e.sum(1, /*keepdim=*/true);
      torch::Tensor loss = row_loss.narrow(0, start, len);
      at::sub_out(loss, (sum.log() + max).squeeze(1), target_logit.squeeze(1));
      if (!want_dx && !want_dw) continue;
      // d(mean loss)/d(logits) = (softmax - onehot) / N, in place.
      torch::Tensor g = e.div_(sum);
      g.scatter_add_(1, t, at::full({len, 1}, -1.0, g.options()));
      g.mul_(inv_n);
      if (want_dx) {
        torch::Tensor out = dx.narrow(0, start, len);
        if (low_precision) {
          out.copy_(at::mm(g, w));
        } else {
          at::mm_out(out, g, w);
        }
      }
      if (want_dw) {
        torch::Tensor dw_rows = dw.narrow(0, 0, vocab_size);
        if (low_precision) {
          dw_rows.add_(at::mm(g.t(), x));
        } else {
          dw_rows.addmm_(g.t(), x);
        }
      }
    }
    ctx->save_for_backward({dx, dw, weight});
    return row_loss.mean();
  }

  static torch::autograd::tensor_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::tensor_list grad_outputs) {
    // The gradients are scaled in place (a second [V_pad, C] buffer here
    // would raise the step's peak memory), so this runs once.
    TORCH_CHECK(!ctx->saved_data.count("done"),
                "LmHeadLoss: backward through the same graph twice");
    ctx->saved_data["done"] = true;
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& scale = grad_outputs[0];
    torch::Tensor dx = saved[0].defined() ? saved[0].mul_(scale) : saved[0];
    if (saved[1].defined()) {
      // Straight into the leaf's gradient, as AccumulateGrad would: returned
      // to autograd, this [V_pad, C] gradient would wait in the engine's
      // input buffer for the tied embedding's (the last backward of all),
      // holding a second copy of wte's gradient through the whole backward.
      torch::Tensor weight = saved[2];
      torch::Tensor& grad = weight.mutable_grad();
      if (grad.defined()) {
        grad.add_(saved[1].mul_(scale));
      } else {
        grad = saved[1].mul_(scale);
      }
    }
    return {dx,
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

int64_t LmHeadChunkBytes(const torch::Device& device) {
  if (!device.is_cpu()) return HeadChunkBytes(/*accelerator=*/true, 0);
  // SetCpuComputeThreads (train/cpu_threads.h) gives OpenBLAS the threads
  // and ATen one; without OpenBLAS, ATen's threads do the products.
  using GetThreads = int (*)();
  static const auto openblas_threads = reinterpret_cast<GetThreads>(
      dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  const int threads =
      openblas_threads != nullptr ? openblas_threads() : at::get_num_threads();
  return HeadChunkBytes(/*accelerator=*/false, threads);
}

torch::Tensor LmHeadLoss(const torch::Tensor& hidden,
                         const torch::Tensor& weight, int64_t vocab_size,
                         const torch::Tensor& targets, int64_t chunk_bytes) {
  TORCH_CHECK(hidden.dim() >= 2 && hidden.is_floating_point(),
              "LmHeadLoss: hidden must be [..., C] floating point, got ",
              hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == hidden.size(-1) && vocab_size >= 1 &&
                  vocab_size <= weight.size(0),
              "LmHeadLoss: weight must be [V_pad >= vocab_size, C], got ",
              weight.sizes(), " for vocab_size ", vocab_size, " and hidden ",
              hidden.sizes());
  TORCH_CHECK(targets.scalar_type() == torch::kLong &&
                  targets.numel() * hidden.size(-1) == hidden.numel(),
              "LmHeadLoss: targets must be int64 with one entry per row of "
              "hidden, got ",
              targets.sizes(), " for hidden ", hidden.sizes());
  TORCH_CHECK(!weight.requires_grad() || weight.is_leaf(),
              "LmHeadLoss: a weight that requires grad must be a leaf (its "
              "gradient is accumulated into weight.grad() directly)");
  if (chunk_bytes <= 0) chunk_bytes = LmHeadChunkBytes(hidden.device());
  // Inside forward grad mode is always off: decide here whether gradients
  // are wanted (not in evaluation under NoGradGuard, where wte still
  // requires grad).
  const bool grad_mode = at::GradMode::is_enabled();
  return ChunkedLmHead::apply(
      hidden.reshape({-1, hidden.size(-1)}).contiguous(), weight, vocab_size,
      targets.reshape({-1}), chunk_bytes, grad_mode && hidden.requires_grad(),
      grad_mode && weight.requires_grad());
}

absl::Status Gpt2Impl::ShardForTensorParallel(TensorParallelOps* tp) {
  const int64_t size = tp->size();
  if (size < 1 || config_.n_head % size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel: ", size,
                     " ranks do not divide the model's ", config_.n_head,
                     " attention heads (each rank runs whole heads, and "
                     "1/T of the MLP's ",
                     4 * config_.n_embd, " hidden units)"));
  }
  if (config_.padded_vocab_size % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel: ", size, " ranks do not divide the model's ",
        config_.padded_vocab_size,
        " padded vocabulary rows (each rank holds 1/T of the embedding)"));
  }
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    torch::Tensor& p = item.value();
    const std::vector<int64_t> global = p.sizes().vec();
    const std::vector<FlatRun> runs =
        TensorParallelRuns(item.key(), global, tp->rank(), size);
    if (runs.size() == 1 && runs[0].length == p.numel()) continue;
    const torch::Tensor flat = p.detach().reshape({-1});
    std::vector<torch::Tensor> pieces;
    for (const FlatRun& run : runs) {
      pieces.push_back(flat.narrow(0, run.offset, run.length));
    }
    p.set_data(
        torch::cat(pieces).view(TensorParallelShape(item.key(), global, size)));
  }
  for (Block& block : blocks_) {
    block->attn()->set_tensor_parallel(tp);
    block->mlp()->set_tensor_parallel(tp);
  }
  return absl::OkStatus();
}

std::map<std::string, torch::Tensor*> Gpt2Impl::MemberTensors() {
  std::map<std::string, torch::Tensor*> members;
  for (const auto& item : named_modules()) {
    const std::string& prefix = item.key();
    torch::nn::Module& module = *item.value();
    const auto add = [&](const std::string& leaf, torch::Tensor* member) {
      members[prefix.empty() ? leaf : prefix + "." + leaf] = member;
    };
    if (auto* linear = module.as<torch::nn::Linear>()) {
      add("weight", &linear->weight);
      add("bias", &linear->bias);
    } else if (auto* norm = module.as<torch::nn::LayerNorm>()) {
      add("weight", &norm->weight);
      add("bias", &norm->bias);
    } else if (auto* embedding = module.as<torch::nn::Embedding>()) {
      add("weight", &embedding->weight);
    }
  }
  return members;
}

}  // namespace shardtrain
