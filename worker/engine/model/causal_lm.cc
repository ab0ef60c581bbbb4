// The pieces every causal LM shares: activation checkpointing of a block,
// the fused cross-entropy and the chunked LM head.
#include "worker/engine/model/causal_lm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/model/model_config.h"
#include "worker/engine/torch_compat.h"

namespace shardtrain {
namespace {

// Linear layers see activations as [B*T, C]: a 2-D input takes ATen's fused
// addmm path, and the views cost nothing on the contiguous residual stream.
torch::Tensor FlattenRows(const torch::Tensor& x) {
  return x.reshape({-1, x.size(-1)});
}

// Activation checkpointing of one block, as torch.utils.checkpoint's
// re-entrant variant: forward runs the block without a graph (a custom
// Function's forward runs under no-grad) and saves only its input; backward
// runs it again with a graph and backpropagates through that graph, which
// accumulates the parameters' gradients into their leaves as usual and
// yields the input's gradient. The models here have no dropout, so the
// recomputation is the forward's exact arithmetic.
// The thread's WeightGradients store (DeferWeightGradients).
thread_local WeightGradients* current_weight_gradients = nullptr;

class RecomputedBlock : public torch::autograd::Function<RecomputedBlock> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& x, int64_t model,
                               int64_t block) {
    ctx->saved_data["model"] = model;
    ctx->saved_data["block"] = block;
    ctx->saved_data["autocast"] = torch_compat::CudaAutocastEnabled();
    // The recomputation defers weight gradients to the store the forward
    // ran under: backward may run on another thread (CUDA's).
    ctx->saved_data["weight_gradients"] = static_cast<int64_t>(
        reinterpret_cast<intptr_t>(current_weight_gradients));
    ctx->save_for_backward({x});
    return reinterpret_cast<CausalLmImpl*>(model)->BlockForward(block, x);
  }

  static torch::autograd::tensor_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::tensor_list grads) {
    auto* model =
        reinterpret_cast<CausalLmImpl*>(ctx->saved_data["model"].toInt());
    const int64_t block = ctx->saved_data["block"].toInt();
    const bool autocast = ctx->saved_data["autocast"].toBool();
    const torch::Tensor input =
        ctx->get_saved_variables()[0].detach().requires_grad_(true);
    DeferWeightGradients defer(reinterpret_cast<WeightGradients*>(
        ctx->saved_data["weight_gradients"].toInt()));
    torch::Tensor output;
    {
      torch::AutoGradMode grad_mode(true);
      const bool was_autocast = torch_compat::CudaAutocastEnabled();
      if (autocast != was_autocast) {
        torch_compat::SetCudaAutocast(autocast, at::kBFloat16);
      }
      output = model->BlockForward(block, input);
      if (autocast != was_autocast) {
        torch_compat::SetCudaAutocast(was_autocast, at::kBFloat16);
        at::autocast::clear_cache();
      }
    }
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad(), torch::Tensor(), torch::Tensor()};
  }
};

bool CudaAutocastEnabled() { return torch_compat::CudaAutocastEnabled(); }

}  // namespace

// --- Weight gradients apart ---

namespace {

// A projection whose backward makes the input's gradient and leaves the
// weight's and bias's to a WeightGradients store.
class DeferredLinear : public torch::autograd::Function<DeferredLinear> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& x,
                               const torch::Tensor& weight,
                               const torch::Tensor& bias, bool has_bias,
                               int64_t store) {
    // Under CUDA mixed precision the product runs in bf16 as autocast's
    // linear would; W reuses the same casts.
    const bool autocast = x.is_cuda() && torch_compat::CudaAutocastEnabled();
    const at::ScalarType dtype = autocast ? at::kBFloat16 : x.scalar_type();
    const torch::Tensor xc = x.to(dtype);
    const torch::Tensor wc = weight.to(dtype);
    const torch::Tensor bc = has_bias ? bias.to(dtype) : torch::Tensor();
    ctx->saved_data["store"] = store;
    ctx->saved_data["weight"] = weight;
    if (has_bias) ctx->saved_data["bias"] = bias;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->save_for_backward({xc, wc});
    return at::linear(xc, wc, bc);
  }

  static torch::autograd::tensor_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::tensor_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& xc = saved[0];
    const torch::Tensor& wc = saved[1];
    const torch::Tensor g = grads[0].to(wc.scalar_type()).contiguous();
    auto* store =
        reinterpret_cast<WeightGradients*>(ctx->saved_data["store"].toInt());
    store->Add(xc, g, ctx->saved_data["weight"].toTensor(),
               ctx->saved_data.count("bias") > 0
                   ? ctx->saved_data["bias"].toTensor()
                   : torch::Tensor());
    const auto x_dtype =
        static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    return {g.mm(wc).to(x_dtype), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

void WeightGradients::Add(torch::Tensor input, torch::Tensor grad_output,
                          torch::Tensor weight, torch::Tensor bias) {
  deferred_.push_back({std::move(input), std::move(grad_output),
                       std::move(weight), std::move(bias)});
}

std::vector<torch::Tensor> WeightGradients::Tensors() const {
  std::vector<torch::Tensor> tensors;
  for (const Deferred& d : deferred_) {
    tensors.push_back(d.weight);
    if (d.bias.defined()) tensors.push_back(d.bias);
  }
  return tensors;
}

void WeightGradients::Run() {
  if (deferred_.empty()) return;
  // One backward per tensor the weights are views of (an FSDP unit's flat
  // buffer; a replicated weight is its own): its accumulator runs once,
  // with every layer's sum, and only that group's gradients are made at a
  // time.
  std::vector<std::pair<const void*, std::vector<const Deferred*>>> groups;
  for (const Deferred& d : deferred_) {
    const void* key = d.weight.is_view()
                          ? d.weight._base().unsafeGetTensorImpl()
                          : d.weight.unsafeGetTensorImpl();
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.emplace_back(key, std::vector<const Deferred*>{});
      it = groups.end() - 1;
    }
    it->second.push_back(&d);
  }
  for (const auto& [key, members] : groups) {
    std::vector<torch::Tensor> roots, grads;
    {
      torch::NoGradGuard no_grad;
      for (const Deferred* d : members) {
        if (d->weight.requires_grad()) {
          roots.push_back(d->weight);
          grads.push_back(
              d->grad_output.t().mm(d->input).to(d->weight.scalar_type()));
        }
        if (d->bias.defined() && d->bias.requires_grad()) {
          roots.push_back(d->bias);
          grads.push_back(d->grad_output.sum(0).to(d->bias.scalar_type()));
        }
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
  }
  deferred_.clear();
}

DeferWeightGradients::DeferWeightGradients(WeightGradients* store)
    : previous_(current_weight_gradients) {
  current_weight_gradients = store;
}

DeferWeightGradients::~DeferWeightGradients() {
  current_weight_gradients = previous_;
}

torch::Tensor ProjectLinear(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias) {
  if (current_weight_gradients == nullptr || !torch::GradMode::is_enabled()) {
    return at::linear(x, weight, bias);
  }
  TORCH_CHECK(x.dim() == 2, "ProjectLinear: deferred inputs are [N, in], got ",
              x.sizes());
  // LibTorch 1.13's custom functions take no undefined tensor: a linear
  // without bias passes an empty placeholder.
  const bool has_bias = bias.defined();
  return DeferredLinear::apply(
      x, weight, has_bias ? bias : at::empty({0}, weight.options()), has_bias,
      static_cast<int64_t>(
          reinterpret_cast<intptr_t>(current_weight_gradients)));
}

namespace {

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
    // Products in the autocast dtype on CUDA (at::mm autocasts), or in the
    // weight's where it is not fp32 (a compute dtype forced on CPU); in
    // place into the fp32 gradient elsewhere.
    const bool low_precision = (hidden.is_cuda() && CudaAutocastEnabled()) ||
                               weight.scalar_type() != at::kFloat;
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
          out.copy_(at::mm(g.to(w.scalar_type()), w));
        } else {
          at::mm_out(out, g, w);
        }
      }
      if (want_dw) {
        torch::Tensor dw_rows = dw.narrow(0, 0, vocab_size);
        if (low_precision) {
          dw_rows.add_(at::mm(g.t().to(x.scalar_type()), x));
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
  return FusedCrossEntropy::apply(FlattenRows(logits).contiguous(),
                                  targets.reshape({-1}));
}

torch::Tensor CausalMask::Get(int64_t t, const torch::Tensor& like) {
  TORCH_CHECK(t >= 1 && t <= block_size_, "causal mask: sequence length ", t,
              " must be in [1, ", block_size_, "]");
  if (!mask_.defined() || mask_.size(0) < t ||
      mask_.device() != like.device() ||
      mask_.scalar_type() != like.scalar_type()) {
    torch::NoGradGuard no_grad;
    mask_ = torch::full({t, t}, -std::numeric_limits<double>::infinity(),
                        like.options().requires_grad(false))
                .triu_(1);
  }
  return mask_.narrow(0, 0, t).narrow(1, 0, t);
}

torch::Tensor CausalLmImpl::RunBlock(int64_t i, const torch::Tensor& x) {
  if (!IsRecomputed(i) || !torch::GradMode::is_enabled()) {
    return BlockForward(i, x);
  }
  return RecomputedBlock::apply(
      x, static_cast<int64_t>(reinterpret_cast<intptr_t>(this)), i);
}

torch::Tensor CausalLmImpl::ForwardLoss(const torch::Tensor& idx,
                                        const torch::Tensor& targets) {
  torch::Tensor x = Embed(idx);
  for (int64_t i = 0; i < num_blocks(); ++i) x = RunBlock(i, x);
  return HeadLoss(x, targets);
}

void SliceForTensorParallel(CausalLmImpl& model, int64_t rank, int64_t size) {
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    torch::Tensor& p = item.value();
    const std::vector<int64_t> global = p.sizes().vec();
    const std::vector<FlatRun> runs =
        model.TensorParallelRuns(item.key(), global, rank, size);
    if (runs.size() == 1 && runs[0].length == p.numel()) continue;
    const torch::Tensor flat = p.detach().reshape({-1});
    std::vector<torch::Tensor> pieces;
    for (const FlatRun& run : runs) {
      pieces.push_back(flat.narrow(0, run.offset, run.length));
    }
    p.set_data(torch::cat(pieces).view(
        model.TensorParallelShape(item.key(), global, size)));
  }
}

std::map<std::string, torch::Tensor*> LinearNormEmbeddingMembers(
    torch::nn::Module& model) {
  std::map<std::string, torch::Tensor*> members;
  for (const auto& item : model.named_modules()) {
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
