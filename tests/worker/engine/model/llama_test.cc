// The Llama family against a reference written from Hugging Face's
// modeling_llama.py in plain double-precision loops (RMSNorm, rotate-half
// rotary positions with Llama 3's scaling, grouped-query attention, SwiGLU,
// an untied head, Qwen's attention biases), and the properties a decoder
// must have.
#include "worker/engine/model/llama.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/model/model_config.h"
#include "core/model/safetensors.h"
#include "worker/engine/model/create_model.h"

namespace shardtrain {
namespace llama_test {

ModelConfig Config(const std::string& spec) {
  absl::StatusOr<ModelConfig> config = ParseModelSpec(spec);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// GQA (4 query heads over 2), q/k/v biases, an untied head, and Llama 3's
// scaling with a short original context so that every band of it (kept,
// interpolated, slowed) is exercised at head size 16.
constexpr char kSpec[] =
    "custom-llama:n_layer=2,n_head=4,n_kv_head=2,n_embd=64,"
    "intermediate_size=96,block_size=32,vocab_size=90,tie_embeddings=0,"
    "attention_bias=1,rope_theta=500000,rope_scaling_factor=8,"
    "rope_original_max_position_embeddings=64";

// Hugging Face's inverse frequencies, in double.
std::vector<double> ReferenceInverseFrequencies(const ModelConfig& m) {
  const int64_t hs = m.head_size();
  std::vector<double> inv;
  for (int64_t i = 0; i < hs; i += 2) {
    double f = 1.0 / std::pow(m.rope_theta, static_cast<double>(i) / hs);
    const RopeScaling& r = m.rope_scaling;
    if (r.factor != 0) {
      const double old =
          static_cast<double>(r.original_max_position_embeddings);
      const double wavelen = 2 * M_PI / f;
      if (wavelen > old / r.low_freq_factor) {
        f /= r.factor;
      } else if (wavelen >= old / r.high_freq_factor) {
        const double smooth = (old / wavelen - r.low_freq_factor) /
                              (r.high_freq_factor - r.low_freq_factor);
        f = (1 - smooth) * f / r.factor + smooth * f;
      }
    }
    inv.push_back(f);
  }
  return inv;
}

using Params = std::map<std::string, torch::Tensor>;

Params DoubleParams(LlamaImpl& model) {
  Params p;
  for (const auto& item : model.named_parameters()) {
    p[item.key()] = item.value().detach().to(torch::kDouble);
  }
  return p;
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w,
                      double eps) {
  return x / (x.pow(2).mean(-1, true) + eps).sqrt() * w;
}

// Logits [T, V] of one sequence, element by element where it matters.
torch::Tensor ReferenceLogits(const ModelConfig& m, Params& p,
                              const std::vector<int64_t>& ids) {
  const int64_t t_len = static_cast<int64_t>(ids.size());
  const int64_t c = m.n_embd, hs = m.head_size(), heads = m.n_head;
  const int64_t group = m.n_head / m.n_kv_head;
  const std::vector<double> inv = ReferenceInverseFrequencies(m);
  torch::Tensor x = torch::zeros({t_len, c}, torch::kDouble);
  for (int64_t t = 0; t < t_len; ++t) x[t] = p["embed_tokens.weight"][ids[t]];
  auto linear = [&](const torch::Tensor& in, const std::string& name) {
    torch::Tensor y = in.matmul(p[name + ".weight"].t());
    if (p.count(name + ".bias") != 0) y = y + p[name + ".bias"];
    return y;
  };
  auto rotate = [&](torch::Tensor v) {  // [T, heads, hs]
    torch::Tensor out = v.clone();
    auto a = v.accessor<double, 3>();
    auto o = out.accessor<double, 3>();
    for (int64_t t = 0; t < v.size(0); ++t) {
      for (int64_t h = 0; h < v.size(1); ++h) {
        for (int64_t i = 0; i < hs / 2; ++i) {
          const double angle = static_cast<double>(t) * inv[i];
          const double x1 = a[t][h][i], x2 = a[t][h][i + hs / 2];
          o[t][h][i] = x1 * std::cos(angle) - x2 * std::sin(angle);
          o[t][h][i + hs / 2] = x2 * std::cos(angle) + x1 * std::sin(angle);
        }
      }
    }
    return out;
  };
  for (int64_t l = 0; l < m.n_layer; ++l) {
    const std::string b = "layers." + std::to_string(l) + ".";
    const torch::Tensor h =
        RmsNorm(x, p[b + "input_layernorm.weight"], m.norm_eps);
    const torch::Tensor q =
        rotate(linear(h, b + "self_attn.q_proj").view({t_len, heads, hs}));
    const torch::Tensor k = rotate(
        linear(h, b + "self_attn.k_proj").view({t_len, m.n_kv_head, hs}));
    const torch::Tensor v =
        linear(h, b + "self_attn.v_proj").view({t_len, m.n_kv_head, hs});
    torch::Tensor y = torch::zeros({t_len, heads, hs}, torch::kDouble);
    for (int64_t head = 0; head < heads; ++head) {
      const int64_t kv = head / group;
      for (int64_t t = 0; t < t_len; ++t) {
        std::vector<double> scores;
        double top = -1e300;
        for (int64_t s = 0; s <= t; ++s) {
          scores.push_back((q[t][head] * k[s][kv]).sum().item<double>() /
                           std::sqrt(static_cast<double>(hs)));
          top = std::max(top, scores.back());
        }
        double sum = 0;
        for (double& e : scores) sum += (e = std::exp(e - top));
        for (int64_t s = 0; s <= t; ++s) {
          y[t][head] += scores[s] / sum * v[s][kv];
        }
      }
    }
    x = x + linear(y.view({t_len, c}), b + "self_attn.o_proj");
    const torch::Tensor h2 =
        RmsNorm(x, p[b + "post_attention_layernorm.weight"], m.norm_eps);
    const torch::Tensor gate = linear(h2, b + "mlp.gate_proj");
    x = x + linear(gate * torch::sigmoid(gate) * linear(h2, b + "mlp.up_proj"),
                   b + "mlp.down_proj");
  }
  x = RmsNorm(x, p["norm.weight"], m.norm_eps);
  const torch::Tensor head =
      m.tie_embeddings ? p["embed_tokens.weight"] : p["lm_head.weight"];
  return x.matmul(head.narrow(0, 0, m.vocab_size).t());
}

TEST(LlamaTest, MatchesAReferenceWrittenFromHuggingFacesModel) {
  const ModelConfig m = Config(kSpec);
  Llama model(m, /*seed=*/3);
  {
    // Non-zero biases and norm weights, so that every one of them counts.
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    for (auto& item : model->named_parameters()) {
      if (item.key().find("bias") != std::string::npos ||
          item.key().find("norm") != std::string::npos) {
        item.value().add_(torch::randn_like(item.value()) * 0.1);
      }
    }
  }
  const std::vector<int64_t> ids = {3, 17, 89, 0, 42, 42, 7, 64, 11, 5};
  const torch::Tensor idx = torch::tensor(ids, torch::kLong).view({1, -1});
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(idx)[0].to(torch::kDouble);
  Params p = DoubleParams(*model);
  const torch::Tensor expected = ReferenceLogits(m, p, ids);
  ASSERT_EQ(logits.sizes(), expected.sizes());
  const double scale = expected.abs().max().item<double>();
  EXPECT_LT((logits - expected).abs().max().item<double>() / scale, 2e-5);
}

TEST(LlamaTest, InverseFrequenciesFollowLlama3Scaling) {
  for (const char* spec : {"llama3.2-1b", "llama3.1-8b", kSpec, "llama-tiny"}) {
    const ModelConfig m = Config(spec);
    const RotaryTable table(m);
    const std::vector<double> expected = ReferenceInverseFrequencies(m);
    const torch::Tensor got = table.inverse_frequencies().to(torch::kDouble);
    ASSERT_EQ(got.numel(), static_cast<int64_t>(expected.size())) << spec;
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_NEAR(got[i].item<double>(), expected[i], 1e-6 * expected[i])
          << spec << " frequency " << i;
    }
  }
  // Llama 3.2's scaling leaves the fastest frequency and slows the slowest
  // by its factor 32.
  const ModelConfig m = Config("llama3.2-1b");
  const torch::Tensor inv = RotaryTable(m).inverse_frequencies();
  EXPECT_FLOAT_EQ(inv[0].item<float>(), 1.0f);
  const double slowest =
      1.0 / std::pow(500000.0, static_cast<double>(m.head_size() - 2) /
                                   static_cast<double>(m.head_size()));
  EXPECT_NEAR(inv[-1].item<double>(), slowest / 32, 1e-6 * slowest / 32);
}

// Grouped-query attention is multi-head attention whose key/value heads are
// repeated: a model with 2 key/value heads equals one with 4 whose k and v
// rows repeat each of them for its 2 query heads.
TEST(LlamaTest, GroupedQueryAttentionEqualsRepeatedKeyValueHeads) {
  const std::string base =
      "custom-llama:n_layer=2,n_head=4,n_embd=64,intermediate_size=96,"
      "block_size=32,vocab_size=90";
  Llama grouped(Config(base + ",n_kv_head=2"), 1);
  Llama full(Config(base + ",n_kv_head=4"), 2);
  {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> from;
    for (const auto& item : grouped->named_parameters()) {
      from[item.key()] = item.value();
    }
    for (auto& item : full->named_parameters()) {
      const torch::Tensor& src = from.at(item.key());
      if (item.key().find("k_proj") != std::string::npos ||
          item.key().find("v_proj") != std::string::npos) {
        // [2 heads x 16, 64] -> [4 heads x 16, 64], head h from h / 2.
        item.value().copy_(
            src.view({2, 1, 16, 64}).expand({2, 2, 16, 64}).reshape({64, 64}));
      } else {
        item.value().copy_(src);
      }
    }
  }
  const torch::Tensor idx = torch::randint(0, 90, {2, 12}, torch::kLong);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(
      torch::allclose(grouped->forward(idx), full->forward(idx), 1e-5, 1e-6));
}

TEST(LlamaTest, LaterTokensDoNotChangeEarlierLogits) {
  Llama model(Config(kSpec), 4);
  torch::NoGradGuard no_grad;
  torch::Tensor idx = torch::randint(0, 90, {1, 16}, torch::kLong);
  const torch::Tensor before = model->forward(idx);
  idx[0][10] = (idx[0][10].item<int64_t>() + 1) % 90;
  const torch::Tensor after = model->forward(idx);
  EXPECT_TRUE(torch::equal(before.narrow(1, 0, 10), after.narrow(1, 0, 10)));
  EXPECT_FALSE(
      torch::allclose(before.narrow(1, 10, 6), after.narrow(1, 10, 6)));
}

// The chunked head's loss and gradients are those of the logits' cross-
// entropy, tied and untied.
TEST(LlamaTest, HeadLossEqualsTheLogitsCrossEntropy) {
  for (const std::string tie : {"1", "0"}) {
    const ModelConfig m = Config(
        "custom-llama:n_layer=1,n_head=4,n_kv_head=1,n_embd=32,"
        "intermediate_size=48,block_size=16,vocab_size=50,tie_embeddings=" +
        tie);
    Llama a(m, 6), b(m, 6);
    const torch::Tensor idx = torch::randint(0, 50, {2, 8}, torch::kLong);
    const torch::Tensor targets = torch::randint(0, 50, {2, 8}, torch::kLong);
    const torch::Tensor fused = a->ForwardLoss(idx, targets);
    fused.backward();
    const torch::Tensor plain = torch::nn::functional::cross_entropy(
        b->forward(idx).view({-1, 50}), targets.view({-1}));
    plain.backward();
    EXPECT_NEAR(fused.item<double>(), plain.item<double>(), 1e-5) << tie;
    std::map<std::string, torch::Tensor> grads;
    for (const auto& item : b->named_parameters()) {
      grads[item.key()] = item.value().grad();
    }
    EXPECT_EQ(grads.count("lm_head.weight"), tie == "0" ? 1u : 0u);
    for (const auto& item : a->named_parameters()) {
      const torch::Tensor& expected = grads.at(item.key());
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_TRUE(torch::allclose(item.value().grad(), expected, 1e-4, 1e-6))
          << tie << " " << item.key();
    }
  }
}

TEST(LlamaTest, ExportsHuggingFacesNamesAndVocabularyRows) {
  const ModelConfig m = Config(kSpec);
  absl::StatusOr<CausalLm> model = CreateCausalLm(m, 8);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(ExportedModelFileName(m), "model.safetensors");
  const std::string path = ::testing::TempDir() + "/llama-export.safetensors";
  ASSERT_TRUE((*model)->ExportWeights(path).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsEntry* embed = file->Find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{90, 64}));
  const SafetensorsEntry* head = file->Find("lm_head.weight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->shape, (std::vector<int64_t>{90, 64}));
  for (const char* name :
       {"model.norm.weight", "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.k_proj.bias",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.post_attention_layernorm.weight"}) {
    EXPECT_NE(file->Find(name), nullptr) << name;
  }
  EXPECT_EQ(file->Find("model.layers.0.self_attn.o_proj.bias"), nullptr);
  int64_t numel = 0;
  for (const SafetensorsEntry& e : file->tensors()) numel += e.numel();
  // Every parameter but the embedding's and head's padding rows (96 - 90).
  EXPECT_EQ(numel, m.NumParameters() - 2 * (m.padded_vocab_size - 90) * 64);
  std::filesystem::remove(path);
}

// One block at each Llama preset's width (its heads, key/value heads and
// MLP), over a small vocabulary: the shapes build, run and count as
// NumParameters() says. llama3.1-70b's block alone is 3.4 GB: its shapes
// are checked without building it.
TEST(LlamaTest, EveryPresetWidthBuildsRunsAndCountsItsParameters) {
  for (const std::string& name : ModelConfig::PresetNames()) {
    ModelConfig config = *ModelConfig::FromPreset(name);
    if (!config.is_llama()) continue;
    config.n_layer = 1;
    config.vocab_size = config.padded_vocab_size = 1000;
    ASSERT_TRUE(config.Validate().ok()) << name;
    if (config.n_embd > 4096) continue;
    absl::StatusOr<CausalLm> model = CreateCausalLm(config, 1);
    ASSERT_TRUE(model.ok()) << name << ": " << model.status();
    int64_t total = 0;
    for (const torch::Tensor& p : (*model)->parameters()) total += p.numel();
    EXPECT_EQ(total, config.NumParameters()) << name;
    torch::NoGradGuard no_grad;
    const torch::Tensor logits =
        (*model)->forward(torch::randint(0, 1000, {1, 8}, torch::kLong));
    EXPECT_EQ(logits.sizes(), torch::IntArrayRef({1, 8, 1000})) << name;
    EXPECT_TRUE(logits.isfinite().all().item<bool>()) << name;
  }
}

// One rank of a tensor-parallel group of `size` (no communication: only
// the refusal is looked at).
class LoneOps : public TensorParallelOps {
 public:
  explicit LoneOps(int64_t size) : size_(size) {}
  int64_t rank() const override { return 0; }
  int64_t size() const override { return size_; }
  torch::Tensor Leave(const torch::Tensor& x) override { return x; }
  std::vector<torch::Tensor> EnterLinear(
      const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
      const std::vector<torch::Tensor>& biases) override {
    std::vector<torch::Tensor> out;
    for (size_t i = 0; i < weights.size(); ++i) {
      out.push_back(at::linear(
          x, weights[i], i < biases.size() ? biases[i] : torch::Tensor()));
    }
    return out;
  }
  int64_t overlapped_input_gradients() const override { return 0; }

 private:
  int64_t size_;
};

TEST(LlamaTest, TensorParallelismSplitsKeyValueHeadsOrSaysWhyNot) {
  Llama model(Config("llama-tiny"), 9);  // 4 query heads, 2 key/value heads
  LoneOps four(4);
  const absl::Status refused = model->ShardForTensorParallel(&four);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              testing::HasSubstr("4 ranks do not divide the model's 2 "
                                 "key/value heads"));
  LoneOps two(2);
  ASSERT_TRUE(model->ShardForTensorParallel(&two).ok());
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& item : model->named_parameters()) {
    shapes[item.key()] = item.value().sizes().vec();
  }
  EXPECT_EQ(shapes["layers.0.self_attn.q_proj.weight"],
            (std::vector<int64_t>{64, 128}));
  EXPECT_EQ(shapes["layers.0.self_attn.k_proj.weight"],
            (std::vector<int64_t>{32, 128}));
  EXPECT_EQ(shapes["layers.0.self_attn.o_proj.weight"],
            (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(shapes["layers.0.mlp.down_proj.weight"],
            (std::vector<int64_t>{128, 192}));
  EXPECT_EQ(shapes["embed_tokens.weight"], (std::vector<int64_t>{25152, 128}));
  EXPECT_EQ(shapes["norm.weight"], (std::vector<int64_t>{128}));
}

}  // namespace llama_test
}  // namespace shardtrain
