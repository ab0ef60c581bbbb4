#include "worker/engine/model/gpt2.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
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
#include "absl/strings/numbers.h"
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

CausalSelfAttentionImpl::CausalSelfAttentionImpl(
    const ModelConfig& config, std::shared_ptr<CausalMask> mask)
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
  // Tensor parallel: f and this rank's columns of c_attn in one, so that
  // backward overlaps the input gradient's sum with c_attn's own.
  const torch::Tensor projected =
      tp_ == nullptr
          ? ProjectLinear(Flatten(x), c_attn_->weight, c_attn_->bias)
          : tp_->EnterLinear(Flatten(x), {c_attn_->weight}, {c_attn_->bias})[0];
  // One copy lays q, k and v out head-major: [3, B, nh, T, hs].
  const torch::Tensor qkv = projected.view({b, t, 3, heads, hs})
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
  if (tp_ == nullptr) {
    return ProjectLinear(y, c_proj_->weight, c_proj_->bias).view({b, t, c});
  }
  // Row-parallel: the partial products summed over the group, then the bias
  // once.
  return (tp_->Leave(at::linear(y, c_proj_->weight)) + c_proj_->bias)
      .view(x.sizes());
}

MlpImpl::MlpImpl(const ModelConfig& config) {
  c_fc_ = register_module("c_fc", MakeLinear(config.n_embd, 4 * config.n_embd));
  c_proj_ =
      register_module("c_proj", MakeLinear(4 * config.n_embd, config.n_embd));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  if (tp_ != nullptr) {
    const torch::Tensor h = at::gelu(
        tp_->EnterLinear(Flatten(x), {c_fc_->weight}, {c_fc_->bias})[0],
        "tanh");
    return (tp_->Leave(at::linear(h, c_proj_->weight)) + c_proj_->bias)
        .view(x.sizes());
  }
  const torch::Tensor h =
      at::gelu(ProjectLinear(Flatten(x), c_fc_->weight, c_fc_->bias), "tanh");
  return ProjectLinear(h, c_proj_->weight, c_proj_->bias).view(x.sizes());
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

std::vector<FlatRun> Gpt2Impl::TensorParallelRuns(
    const std::string& name, const std::vector<int64_t>& global, int64_t rank,
    int64_t size) const {
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

std::vector<int64_t> Gpt2Impl::TensorParallelShape(
    const std::string& name, const std::vector<int64_t>& global,
    int64_t size) const {
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

BlockImpl::BlockImpl(const ModelConfig& config,
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

Gpt2Impl::Gpt2Impl(const ModelConfig& config, uint64_t seed) : config_(config) {
  const absl::Status valid = config.Validate();
  TORCH_CHECK(valid.ok(), "Gpt2: invalid config: ", valid.ToString());
  TORCH_CHECK(!config.is_llama(), "Gpt2: config ", config.ToSpec(),
              " is of family ", ModelFamilyName(config.family));
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

torch::Tensor Gpt2Impl::BlockForward(int64_t i, const torch::Tensor& x) {
  return blocks_.at(static_cast<size_t>(i))(x);
}

ModelDims Gpt2Impl::dims() const {
  return {config_.vocab_size, config_.padded_vocab_size, config_.n_embd,
          config_.block_size, static_cast<int64_t>(blocks_.size())};
}

torch::Tensor Gpt2Impl::FinishEmbedding(const torch::Tensor& tokens) {
  return tokens + wpe_->weight.narrow(0, 0, tokens.size(1));
}

ParamPlace Gpt2Impl::PlaceOf(const std::string& name) const {
  if (name == "wte.weight") return {ParamRole::kTokenEmbedding};
  if (absl::StartsWith(name, "ln_f.")) return {ParamRole::kOutput};
  int64_t block = 0;
  const size_t end = name.find('.', 2);
  if (absl::StartsWith(name, "h.") && end != std::string::npos &&
      absl::SimpleAtoi(name.substr(2, end - 2), &block)) {
    return {ParamRole::kBlock, block};
  }
  return {ParamRole::kInput};
}

std::string Gpt2Impl::BlockName(int64_t i) const {
  return absl::StrCat("h.", i);
}

std::string Gpt2Impl::DescribeTensorParallel(int64_t t) const {
  return absl::StrCat(config_.n_head / t, " of ", config_.n_head, " heads and ",
                      4 * config_.n_embd / t, " of ", 4 * config_.n_embd,
                      " MLP units of every block and ",
                      config_.padded_vocab_size / t, " of ",
                      config_.padded_vocab_size, " vocabulary rows");
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

absl::StatusOr<Gpt2> CreateGpt2(const ModelConfig& config, uint64_t seed) {
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
  SliceForTensorParallel(*this, tp->rank(), size);
  for (Block& block : blocks_) {
    block->attn()->set_tensor_parallel(tp);
    block->mlp()->set_tensor_parallel(tp);
  }
  return absl::OkStatus();
}

std::map<std::string, torch::Tensor*> Gpt2Impl::MemberTensors() {
  return LinearNormEmbeddingMembers(*this);
}

}  // namespace shardtrain
