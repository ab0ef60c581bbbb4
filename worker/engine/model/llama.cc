#include "worker/engine/model/llama.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/model/safetensors.h"
#include "worker/engine/torch_compat.h"

namespace shardtrain {
namespace {

constexpr double kLlamaInitStd = 0.02;

torch::nn::Linear LlamaLinear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

torch::Tensor TokenRows(const torch::Tensor& x) {
  return x.reshape({-1, x.size(-1)});
}

// [B*T, heads*hs] -> [B, heads, T, hs].
torch::Tensor SplitHeads(const torch::Tensor& x, int64_t b, int64_t t,
                         int64_t heads, int64_t hs) {
  return x.view({b, t, heads, hs}).transpose(1, 2);
}

}  // namespace

RmsNormImpl::RmsNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

torch::Tensor RmsNormImpl::forward(const torch::Tensor& x) {
  const torch::Tensor x32 = x.to(torch::kFloat);
  const torch::Tensor normed =
      x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

RotaryTable::RotaryTable(const ModelConfig& config) {
  const int64_t hs = config.head_size();
  // Hugging Face: 1 / theta^(2i / hs) in fp32.
  inv_freq_ =
      1.0 / torch::pow(config.rope_theta,
                       torch::arange(0, hs, 2, torch::kLong).to(torch::kFloat) /
                           static_cast<double>(hs));
  const RopeScaling& r = config.rope_scaling;
  if (r.factor != 0) {
    // Llama 3: wavelengths longer than the original context / low_freq_factor
    // slowed by `factor`, shorter than / high_freq_factor kept, the band
    // between interpolated.
    const double old_len =
        static_cast<double>(r.original_max_position_embeddings);
    const double low_wavelen = old_len / r.low_freq_factor;
    const double high_wavelen = old_len / r.high_freq_factor;
    const torch::Tensor wavelen = 2 * M_PI / inv_freq_;
    torch::Tensor scaled =
        torch::where(wavelen > low_wavelen, inv_freq_ / r.factor, inv_freq_);
    const torch::Tensor smooth = (old_len / wavelen - r.low_freq_factor) /
                                 (r.high_freq_factor - r.low_freq_factor);
    const torch::Tensor smoothed =
        (1 - smooth) * scaled / r.factor + smooth * scaled;
    const torch::Tensor medium =
        (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv_freq_ = torch::where(medium, smoothed, scaled);
  }
}

std::pair<torch::Tensor, torch::Tensor> RotaryTable::Get(
    int64_t t, const torch::Tensor& like) {
  if (!cos_.defined() || cos_.size(0) != t || cos_.device() != like.device() ||
      cos_.scalar_type() != like.scalar_type()) {
    torch::NoGradGuard no_grad;
    const torch::Tensor positions =
        torch::arange(0, t, torch::kLong).to(torch::kFloat);
    const torch::Tensor freqs = at::outer(positions, inv_freq_);  // [t, hs/2]
    const torch::Tensor emb = torch::cat({freqs, freqs}, -1);     // [t, hs]
    cos_ = emb.cos().to(like.options().requires_grad(false));
    sin_ = emb.sin().to(like.options().requires_grad(false));
  }
  return {cos_, sin_};
}

torch::Tensor ApplyRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const torch::Tensor rotated =
      torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

LlamaAttentionImpl::LlamaAttentionImpl(const ModelConfig& config,
                                       std::shared_ptr<RotaryTable> rotary,
                                       std::shared_ptr<CausalMask> mask)
    : n_head_(config.n_head),
      n_kv_head_(config.n_kv_head),
      head_size_(config.head_size()),
      rotary_(std::move(rotary)),
      mask_(std::move(mask)) {
  const int64_t c = config.n_embd;
  const bool bias = config.attention_bias;
  q_proj_ =
      register_module("q_proj", LlamaLinear(c, n_head_ * head_size_, bias));
  k_proj_ =
      register_module("k_proj", LlamaLinear(c, n_kv_head_ * head_size_, bias));
  v_proj_ =
      register_module("v_proj", LlamaLinear(c, n_kv_head_ * head_size_, bias));
  o_proj_ =
      register_module("o_proj", LlamaLinear(n_head_ * head_size_, c, false));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), hs = head_size_;
  // Tensor parallel: this rank's query heads and key/value heads.
  const int64_t size = tp_ == nullptr ? 1 : tp_->size();
  const int64_t heads = n_head_ / size, kv_heads = n_kv_head_ / size;
  const int64_t group = heads / kv_heads;
  // Tensor parallel: f and this rank's columns of q, k and v in one, so
  // that backward overlaps the input gradient's sum with their own.
  const torch::Tensor in = TokenRows(x);
  std::vector<torch::Tensor> qkv =
      tp_ == nullptr
          ? std::vector<torch::Tensor>{ProjectLinear(in, q_proj_->weight,
                                                     q_proj_->bias),
                                       ProjectLinear(in, k_proj_->weight,
                                                     k_proj_->bias),
                                       ProjectLinear(in, v_proj_->weight,
                                                     v_proj_->bias)}
          : tp_->EnterLinear(
                in, {q_proj_->weight, k_proj_->weight, v_proj_->weight},
                {q_proj_->bias, k_proj_->bias, v_proj_->bias});
  auto [cos, sin] = rotary_->Get(t, x);
  torch::Tensor q = SplitHeads(qkv[0], b, t, heads, hs);
  torch::Tensor k = SplitHeads(qkv[1], b, t, kv_heads, hs);
  torch::Tensor v = SplitHeads(qkv[2], b, t, kv_heads, hs);
  if (q.scalar_type() != cos.scalar_type()) {
    cos = cos.to(q.scalar_type());
    sin = sin.to(q.scalar_type());
  }
  q = ApplyRotary(q, cos, sin);
  k = ApplyRotary(k, cos, sin);
  if (group > 1) {
    // Query head h reads key/value head h / group (repeat_kv).
    k = k.unsqueeze(2)
            .expand({b, kv_heads, group, t, hs})
            .reshape({b, heads, t, hs});
    v = v.unsqueeze(2)
            .expand({b, kv_heads, group, t, hs})
            .reshape({b, heads, t, hs});
  }
  torch::Tensor y;  // [B, heads, T, hs]
#ifdef SHARDTRAIN_TORCH_HAS_SDPA
  y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{},
                                       /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  const torch::Tensor scores =
      at::baddbmm(mask_->Get(t, q), q.reshape({b * heads, t, hs}),
                  k.reshape({b * heads, t, hs}).transpose(1, 2), /*beta=*/1.0,
                  /*alpha=*/1.0 / std::sqrt(static_cast<double>(hs)));
  y = at::bmm(at::softmax(scores, -1), v.reshape({b * heads, t, hs}))
          .view({b, heads, t, hs});
#endif
  y = y.transpose(1, 2).reshape({b * t, heads * hs});
  if (tp_ == nullptr) {
    return ProjectLinear(y, o_proj_->weight, o_proj_->bias).view(x.sizes());
  }
  return tp_->Leave(at::linear(y, o_proj_->weight)).view(x.sizes());
}

LlamaMlpImpl::LlamaMlpImpl(const ModelConfig& config) {
  const int64_t c = config.n_embd, h = config.intermediate_size;
  gate_proj_ = register_module("gate_proj", LlamaLinear(c, h, false));
  up_proj_ = register_module("up_proj", LlamaLinear(c, h, false));
  down_proj_ = register_module("down_proj", LlamaLinear(h, c, false));
}

torch::Tensor LlamaMlpImpl::forward(const torch::Tensor& x) {
  const torch::Tensor in = TokenRows(x);
  std::vector<torch::Tensor> gate_up =
      tp_ == nullptr
          ? std::vector<torch::Tensor>{ProjectLinear(in, gate_proj_->weight,
                                                     gate_proj_->bias),
                                       ProjectLinear(in, up_proj_->weight,
                                                     up_proj_->bias)}
          : tp_->EnterLinear(in, {gate_proj_->weight, up_proj_->weight}, {});
  const torch::Tensor h = at::silu(gate_up[0]) * gate_up[1];
  if (tp_ == nullptr) {
    return ProjectLinear(h, down_proj_->weight, down_proj_->bias)
        .view(x.sizes());
  }
  return tp_->Leave(at::linear(h, down_proj_->weight)).view(x.sizes());
}

LlamaBlockImpl::LlamaBlockImpl(const ModelConfig& config,
                               std::shared_ptr<RotaryTable> rotary,
                               std::shared_ptr<CausalMask> mask) {
  input_layernorm_ = register_module("input_layernorm",
                                     RmsNorm(config.n_embd, config.norm_eps));
  self_attn_ = register_module(
      "self_attn", LlamaAttention(config, std::move(rotary), std::move(mask)));
  post_attention_layernorm_ = register_module(
      "post_attention_layernorm", RmsNorm(config.n_embd, config.norm_eps));
  mlp_ = register_module("mlp", LlamaMlp(config));
}

torch::Tensor LlamaBlockImpl::forward(const torch::Tensor& x) {
  const torch::Tensor y = x + self_attn_(input_layernorm_(x));
  return y + mlp_(post_attention_layernorm_(y));
}

LlamaImpl::LlamaImpl(const ModelConfig& config, uint64_t seed)
    : config_(config) {
  const absl::Status valid = config.Validate();
  TORCH_CHECK(valid.ok(), "Llama: invalid config: ", valid.ToString());
  TORCH_CHECK(config.is_llama(), "Llama: config ", config.ToSpec(),
              " is of family ", ModelFamilyName(config.family));
  const int64_t c = config.n_embd;
  embed_tokens_ = register_module(
      "embed_tokens", torch::nn::Embedding(config.padded_vocab_size, c));
  layers_ = register_module("layers", torch::nn::ModuleList());
  auto rotary = std::make_shared<RotaryTable>(config);
  auto mask = std::make_shared<CausalMask>(config.block_size);
  for (int64_t i = 0; i < config.n_layer; ++i) {
    blocks_.push_back(LlamaBlock(config, rotary, mask));
    layers_->push_back(blocks_.back());
  }
  norm_ = register_module("norm", RmsNorm(c, config.norm_eps));
  if (!config.tied_head()) {
    lm_head_ = register_module("lm_head",
                               LlamaLinear(c, config.padded_vocab_size, false));
  }
  InitWeights(seed);
}

void LlamaImpl::InitWeights(uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (auto& named : named_parameters(/*recurse=*/true)) {
    const std::string& name = named.key();
    torch::Tensor& p = named.value();
    if (absl::EndsWith(name, ".bias")) {
      p.zero_();
    } else if (absl::EndsWith(name, "norm.weight")) {
      p.fill_(1.0);
    } else if (p.is_cpu() && p.is_contiguous()) {
      p.normal_(0.0, kLlamaInitStd, gen);
    } else {
      p.copy_(torch::empty(p.sizes(), p.options().device(torch::kCPU))
                  .normal_(0.0, kLlamaInitStd, gen));
    }
  }
  const int64_t pad = config_.padded_vocab_size - config_.vocab_size;
  embed_tokens_->weight.narrow(0, config_.vocab_size, pad).zero_();
  if (!lm_head_.is_empty()) {
    lm_head_->weight.narrow(0, config_.vocab_size, pad).zero_();
  }
}

ModelDims LlamaImpl::dims() const {
  return {config_.vocab_size, config_.padded_vocab_size, config_.n_embd,
          config_.block_size, static_cast<int64_t>(blocks_.size())};
}

void LlamaImpl::CheckWholeVocabulary(const char* what,
                                     const torch::Tensor& weight) const {
  TORCH_CHECK(weight.size(0) == config_.padded_vocab_size, "Llama::", what,
              ": its weight holds ", weight.size(0), " of ",
              config_.padded_vocab_size,
              " rows (tensor parallel): the strategy's vocabulary-parallel "
              "embedding and head take the place of Embed and HeadLoss");
}

torch::Tensor LlamaImpl::Embed(const torch::Tensor& idx) {
  TORCH_CHECK(idx.dim() == 2 && idx.scalar_type() == torch::kLong,
              "Llama: idx must be [B,T] int64, got ", idx.sizes(), " ",
              idx.scalar_type());
  const int64_t t = idx.size(1);
  TORCH_CHECK(t >= 1 && t <= config_.block_size, "Llama: sequence length ", t,
              " must be in [1, block_size = ", config_.block_size, "]");
  CheckWholeVocabulary("Embed", embed_tokens_->weight);
  return embed_tokens_(idx);
}

torch::Tensor& LlamaImpl::head_weight() {
  return lm_head_.is_empty() ? embed_tokens_->weight : lm_head_->weight;
}

std::string LlamaImpl::head_weight_name() const {
  return lm_head_.is_empty() ? token_embedding_name() : "lm_head.weight";
}

torch::Tensor LlamaImpl::HeadLoss(const torch::Tensor& x,
                                  const torch::Tensor& targets) {
  CheckWholeVocabulary("HeadLoss", head_weight());
  return LmHeadLoss(norm_(x), head_weight(), config_.vocab_size, targets);
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx) {
  torch::Tensor x = Embed(idx);
  for (LlamaBlock& block : blocks_) x = block(x);
  const torch::Tensor rows =
      head_weight().narrow(0, 0, config_.vocab_size);  // contiguous view
  return at::linear(TokenRows(norm_(x)), rows)
      .view({idx.size(0), idx.size(1), config_.vocab_size});
}

torch::Tensor LlamaImpl::BlockForward(int64_t i, const torch::Tensor& x) {
  return blocks_.at(static_cast<size_t>(i))(x);
}

ParamPlace LlamaImpl::PlaceOf(const std::string& name) const {
  if (name == "embed_tokens.weight") return {ParamRole::kTokenEmbedding};
  if (absl::StartsWith(name, "norm.") || absl::StartsWith(name, "lm_head.")) {
    return {ParamRole::kOutput};
  }
  int64_t block = 0;
  const size_t end = name.find('.', 7);
  if (absl::StartsWith(name, "layers.") && end != std::string::npos &&
      absl::SimpleAtoi(name.substr(7, end - 7), &block)) {
    return {ParamRole::kBlock, block};
  }
  return {ParamRole::kInput};
}

std::string LlamaImpl::BlockName(int64_t i) const {
  return absl::StrCat("layers.", i);
}

namespace {

enum class LlamaTpSplit { kWhole, kRows, kColumns };

LlamaTpSplit LlamaTensorParallelSplit(const std::string& name) {
  for (const char* rows :
       {"self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.",
        "mlp.gate_proj.", "mlp.up_proj."}) {
    if (absl::StrContains(name, rows)) return LlamaTpSplit::kRows;
  }
  if (name == "embed_tokens.weight" || name == "lm_head.weight") {
    return LlamaTpSplit::kRows;
  }
  if (absl::EndsWith(name, "self_attn.o_proj.weight") ||
      absl::EndsWith(name, "mlp.down_proj.weight")) {
    return LlamaTpSplit::kColumns;
  }
  return LlamaTpSplit::kWhole;
}

}  // namespace

// Rows of q_proj are head-major (head h: rows h*hs ... h*hs + hs - 1), as are
// k_proj's and v_proj's by key/value head: a rank's contiguous 1/T of the
// rows is its heads.
std::vector<FlatRun> LlamaImpl::TensorParallelRuns(
    const std::string& name, const std::vector<int64_t>& global, int64_t rank,
    int64_t size) const {
  int64_t numel = 1;
  for (int64_t d : global) numel *= d;
  const int64_t row = global.size() > 1 ? numel / global[0] : 1;
  std::vector<FlatRun> runs;
  switch (LlamaTensorParallelSplit(name)) {
    case LlamaTpSplit::kWhole:
      runs.push_back({0, numel});
      break;
    case LlamaTpSplit::kRows: {
      const int64_t rows = global[0] / size;
      runs.push_back({rank * rows * row, rows * row});
      break;
    }
    case LlamaTpSplit::kColumns: {
      const int64_t columns = global[1] / size;
      for (int64_t i = 0; i < global[0]; ++i) {
        runs.push_back({i * global[1] + rank * columns, columns});
      }
      break;
    }
  }
  return runs;
}

std::vector<int64_t> LlamaImpl::TensorParallelShape(
    const std::string& name, const std::vector<int64_t>& global,
    int64_t size) const {
  std::vector<int64_t> local = global;
  switch (LlamaTensorParallelSplit(name)) {
    case LlamaTpSplit::kWhole:
      break;
    case LlamaTpSplit::kRows:
      local[0] /= size;
      break;
    case LlamaTpSplit::kColumns:
      local[1] /= size;
      break;
  }
  return local;
}

absl::Status LlamaImpl::ShardForTensorParallel(TensorParallelOps* tp) {
  const int64_t size = tp->size();
  const ModelConfig& m = config_;
  struct Divides {
    int64_t count;
    const char* what;
  };
  for (const Divides& d :
       {Divides{m.n_head, "attention heads"},
        Divides{m.n_kv_head, "key/value heads"},
        Divides{m.intermediate_size, "MLP hidden units"},
        Divides{m.padded_vocab_size, "padded vocabulary rows"}}) {
    if (size < 1 || d.count % size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor_parallel: ", size, " ranks do not divide the model's ",
          d.count, " ", d.what,
          " (each rank holds 1/T of the query heads, of the key/value heads, "
          "of the MLP and of the vocabulary)"));
    }
  }
  SliceForTensorParallel(*this, tp->rank(), size);
  for (LlamaBlock& block : blocks_) {
    block->self_attn()->set_tensor_parallel(tp);
    block->mlp()->set_tensor_parallel(tp);
  }
  return absl::OkStatus();
}

std::string LlamaImpl::DescribeTensorParallel(int64_t t) const {
  return absl::StrCat(
      config_.n_head / t, " of ", config_.n_head, " query heads, ",
      config_.n_kv_head / t, " of ", config_.n_kv_head, " key/value heads and ",
      config_.intermediate_size / t, " of ", config_.intermediate_size,
      " MLP units of every block and ", config_.padded_vocab_size / t, " of ",
      config_.padded_vocab_size, " vocabulary rows");
}

std::map<std::string, torch::Tensor*> LlamaImpl::MemberTensors() {
  std::map<std::string, torch::Tensor*> members =
      LinearNormEmbeddingMembers(*this);
  for (const auto& item : named_modules()) {
    if (auto* norm = item.value()->as<RmsNorm>()) {
      members[item.key() + ".weight"] = &norm->weight;
    }
  }
  return members;
}

// Hugging Face's names ("model." before every parameter but lm_head) and
// vocab_size rows of the embedding and head (the padding is ours).
absl::Status LlamaImpl::ExportWeights(const std::string& path) {
  std::vector<SafetensorsTensor> tensors;
  std::map<std::string, torch::Tensor*> members = MemberTensors();
  for (const auto& item : named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    torch::Tensor value = *members.at(name);
    if (name == "embed_tokens.weight" || name == "lm_head.weight") {
      value = value.narrow(0, 0, config_.vocab_size);
    }
    std::vector<int64_t> shape = value.sizes().vec();
    std::string hf_name = absl::StartsWith(name, "lm_head.")
                              ? name
                              : absl::StrCat("model.", name);
    tensors.push_back(
        {std::move(hf_name), std::move(shape), [value](float* out) {
           const torch::Tensor cpu =
               value.detach().to(torch::kCPU, torch::kFloat).contiguous();
           std::memcpy(out, cpu.data_ptr<float>(), cpu.numel() * sizeof(float));
           return absl::OkStatus();
         }});
  }
  return WriteSafetensors(path, tensors, {{"format", "pt"}});
}

}  // namespace shardtrain
