#include "worker/engine/model/gpt2.h"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/model/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardtrain {
namespace gpt2_test {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

ModelConfig Tiny() { return *ModelConfig::FromPreset("gpt2-tiny"); }

// Token ids in [0, vocab_size), reproducible.
torch::Tensor RandomTokens(int64_t b, int64_t t, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(50257, {b, t}, torch::kLong);
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

TEST(Gpt2Test, ParametersFollowNanoGptNamesWithTiedHead) {
  Gpt2 model(Tiny());
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  std::vector<std::string> expected = {"wte.weight", "wpe.weight"};
  for (const char* layer : {"h.0.", "h.1."}) {
    for (const char* param :
         {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
          "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
          "mlp.c_proj.bias"}) {
      expected.push_back(std::string(layer) + param);
    }
  }
  expected.push_back("ln_f.weight");
  expected.push_back("ln_f.bias");
  EXPECT_THAT(names, ElementsAreArray(expected));
  // The causal mask is derived, not state.
  EXPECT_TRUE(model->named_buffers().is_empty());
}

TEST(Gpt2Test, LinearWeightsAreOutByIn) {
  Gpt2 model(Tiny());
  BlockImpl& block = *model->block(0);
  EXPECT_EQ(block.attn()->c_attn()->weight.sizes(),
            torch::IntArrayRef({384, 128}));
  EXPECT_EQ(block.mlp()->c_fc()->weight.sizes(),
            torch::IntArrayRef({512, 128}));
  EXPECT_EQ(block.mlp()->c_proj()->weight.sizes(),
            torch::IntArrayRef({128, 512}));
  EXPECT_EQ(model->wte()->weight.sizes(), torch::IntArrayRef({50304, 128}));
}

TEST(Gpt2Test, Gpt2Has124475904ParametersCountedFromItsModules) {
  Gpt2 model(*ModelConfig::FromPreset("gpt2"));
  int64_t total = 0;
  for (const torch::Tensor& p : model->parameters()) total += p.numel();
  EXPECT_EQ(total, 124'475'904);
  EXPECT_EQ(model->config().NumParameters(), total);
}

// Full-depth builds of the larger presets take tens of seconds and gigabytes;
// one block at each preset's width checks the shapes (e.g. gpt2-xl's 25
// heads) and NumParameters() for every preset.
TEST(Gpt2Test, EveryPresetWidthBuildsRunsAndCountsItsParameters) {
  for (const std::string& name : ModelConfig::PresetNames()) {
    ModelConfig config = *ModelConfig::FromPreset(name);
    if (config.is_llama()) continue;  // llama_test.cc
    ASSERT_TRUE(config.Validate().ok()) << name;
    config.n_layer = 1;
    Gpt2 model(config);
    int64_t total = 0;
    for (const torch::Tensor& p : model->parameters()) total += p.numel();
    EXPECT_EQ(total, config.NumParameters()) << name;
    torch::NoGradGuard no_grad;
    const torch::Tensor logits = model->forward(RandomTokens(1, 8, 1));
    EXPECT_EQ(logits.sizes(), torch::IntArrayRef({1, 8, 50257})) << name;
    EXPECT_TRUE(logits.isfinite().all().item<bool>()) << name;
  }
}

TEST(Gpt2Test, ForwardIsEmbedThenBlocksThenHead) {
  Gpt2 model(Tiny(), /*seed=*/7);
  const torch::Tensor idx = RandomTokens(2, 16, 1);
  torch::NoGradGuard no_grad;
  torch::Tensor x = model->Embed(idx);
  EXPECT_EQ(x.sizes(), torch::IntArrayRef({2, 16, 128}));
  for (int64_t i = 0; i < model->num_blocks(); ++i) x = model->block(i)(x);
  EXPECT_TRUE(torch::equal(model->Head(x), model->forward(idx)));
  EXPECT_EQ(model->blocks()->size(), 2u);
}

// What the parallelisms see through the model interface (causal_lm.h): every
// parameter's place, the pieces they run one at a time, the sizes.
TEST(Gpt2Test, TheModelInterfacePlacesEveryParameterAndRunsThePieces) {
  Gpt2 model(Tiny(), /*seed=*/7);
  CausalLm lm = model;  // what a strategy holds
  const ModelDims dims = lm->dims();
  EXPECT_EQ(dims.vocab_size, 50257);
  EXPECT_EQ(dims.padded_vocab_size, 50304);
  EXPECT_EQ(dims.hidden_size, 128);
  EXPECT_EQ(dims.max_seq_len, Tiny().block_size);
  EXPECT_EQ(dims.num_blocks, 2);
  EXPECT_EQ(lm->token_embedding_name(), "wte.weight");
  EXPECT_TRUE(lm->token_embedding().is_same(model->wte()->weight));
  EXPECT_EQ(lm->BlockName(1), "h.1");
  int64_t blocks = 0, tokens = 0, inputs = 0, outputs = 0;
  for (const auto& item : model->named_parameters()) {
    const ParamPlace place = lm->PlaceOf(item.key());
    switch (place.role) {
      case ParamRole::kBlock:
        ++blocks;
        EXPECT_EQ(item.key().rfind(lm->BlockName(place.block) + ".", 0), 0u)
            << item.key();
        break;
      case ParamRole::kTokenEmbedding:
        ++tokens;
        EXPECT_EQ(item.key(), "wte.weight");
        break;
      case ParamRole::kInput:
        ++inputs;
        EXPECT_EQ(item.key(), "wpe.weight");
        break;
      case ParamRole::kOutput:
        ++outputs;
        EXPECT_EQ(item.key().rfind("ln_f.", 0), 0u) << item.key();
        break;
    }
  }
  EXPECT_EQ(blocks, 2 * 12);  // ln_1, c_attn, c_proj, ln_2, c_fc, c_proj
  EXPECT_EQ(tokens, 1);
  EXPECT_EQ(inputs, 1);
  EXPECT_EQ(outputs, 2);
  // The pieces compose to the whole model.
  const torch::Tensor idx = RandomTokens(2, 16, 3);
  torch::NoGradGuard no_grad;
  const torch::Tensor embedded =
      lm->FinishEmbedding(model->wte()->forward(idx));
  EXPECT_TRUE(torch::equal(embedded, model->Embed(idx)));
  torch::Tensor x = embedded;
  for (int64_t i = 0; i < dims.num_blocks; ++i) x = lm->RunBlock(i, x);
  EXPECT_TRUE(torch::equal(lm->FinalNorm(x), model->ln_f()(x)));
  EXPECT_TRUE(torch::allclose(lm->HeadLoss(x, idx), lm->ForwardLoss(idx, idx)));
  // Pipeline cuts come from the model's shapes.
  absl::StatusOr<std::vector<PipelineStage>> cuts =
      lm->PipelineCuts(/*seq_len=*/16, /*stages=*/2, {});
  ASSERT_TRUE(cuts.ok()) << cuts.status();
  ASSERT_EQ(cuts->size(), 2u);
  EXPECT_TRUE((*cuts)[0].embeddings);
  EXPECT_TRUE((*cuts)[1].head);
  EXPECT_EQ((*cuts)[1].end_block, 2);
}

TEST(Gpt2Test, RejectsSequencesLongerThanBlockSizeAndNonInt64Tokens) {
  Gpt2 model(Tiny());
  torch::NoGradGuard no_grad;
  EXPECT_THROW(model->forward(RandomTokens(1, 257, 1)), c10::Error);
  EXPECT_THROW(model->forward(RandomTokens(1, 4, 1).to(torch::kInt)),
               c10::Error);
}

TEST(Gpt2Test, LossAtInitIsLnVocab) {
  Gpt2 model(Tiny(), /*seed=*/1);
  torch::NoGradGuard no_grad;
  const torch::Tensor loss = CrossEntropyLoss(
      model->forward(RandomTokens(8, 128, 2)), RandomTokens(8, 128, 3));
  // Near-uniform predictions: ln(50257) = 10.825, plus a little for the
  // small spread of the initial logits.
  EXPECT_NEAR(loss.item<double>(), std::log(50257.0), 0.1);
}

TEST(Gpt2Test, CrossEntropyMatchesLogSoftmaxNllInValueAndGradient) {
  torch::manual_seed(4);
  const torch::Tensor logits = torch::randn({3, 5, 1000}) * 3;
  const torch::Tensor targets = torch::randint(1000, {3, 5}, torch::kLong);
  const torch::Tensor a = logits.clone().requires_grad_(true);
  const torch::Tensor b = logits.clone().requires_grad_(true);
  const torch::Tensor ours = CrossEntropyLoss(a, targets) * 2.5;
  const torch::Tensor aten =
      torch::nll_loss(torch::log_softmax(b.view({15, 1000}), 1),
                      targets.view({15})) *
      2.5;
  ours.backward();
  aten.backward();
  EXPECT_NEAR(ours.item<double>(), aten.item<double>(),
              1e-6 * std::abs(aten.item<double>()));
  EXPECT_LE(MaxAbsDiff(a.grad(), b.grad()), 1e-8);
}

// Relative error of `got` against `want`, by the largest entry of `want`.
double RelDiff(const torch::Tensor& got, const torch::Tensor& want) {
  return MaxAbsDiff(got, want) / want.abs().max().item<double>();
}

// The chunked head against logits + CrossEntropyLoss: loss, the hidden
// states' gradient and wte's gradient within 1e-6 relative, with chunks of
// 7 rows (so the last chunk is short) and one chunk for everything.
TEST(Gpt2Test, ChunkedHeadLossEqualsFullLogitsInValueAndGradients) {
  Gpt2 model(Tiny(), /*seed=*/3);
  const torch::Tensor idx = RandomTokens(2, 30, 11);
  const torch::Tensor targets = RandomTokens(2, 30, 12);
  torch::Tensor hidden;
  {
    torch::NoGradGuard no_grad;
    hidden = model->Embed(idx);
    for (int64_t i = 0; i < model->num_blocks(); ++i) {
      hidden = model->block(i)(hidden);
    }
    hidden = model->ln_f()(hidden);
  }
  const torch::Tensor& wte = model->wte()->weight;
  const int64_t vocab = Tiny().vocab_size;

  const torch::Tensor ref_x = hidden.clone().requires_grad_(true);
  const torch::Tensor ref_w = wte.detach().clone().requires_grad_(true);
  const torch::Tensor ref_logits = at::linear(ref_x, ref_w.narrow(0, 0, vocab));
  const torch::Tensor ref_loss = CrossEntropyLoss(ref_logits, targets) * 0.5;
  ref_loss.backward();

  for (const int64_t chunk_bytes : {int64_t{7} * vocab * 4, int64_t{1} << 30}) {
    const torch::Tensor x = hidden.clone().requires_grad_(true);
    const torch::Tensor w = wte.detach().clone().requires_grad_(true);
    const torch::Tensor loss =
        LmHeadLoss(x, w, vocab, targets, chunk_bytes) * 0.5;
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(),
                1e-6 * ref_loss.item<double>())
        << chunk_bytes;
    EXPECT_LE(RelDiff(x.grad(), ref_x.grad()), 1e-6) << chunk_bytes;
    EXPECT_LE(RelDiff(w.grad(), ref_w.grad()), 1e-6) << chunk_bytes;
    EXPECT_EQ(w.grad().sizes(), wte.sizes());
    EXPECT_EQ(w.grad().narrow(0, vocab, 47).abs().max().item<float>(), 0.0f);
  }
}

TEST(Gpt2Test, ForwardLossIsHeadLossOfTheBlocksAndMatchesTheLogits) {
  Gpt2 model(Tiny(), /*seed=*/5);
  const torch::Tensor idx = RandomTokens(2, 16, 13);
  const torch::Tensor targets = RandomTokens(2, 16, 14);
  torch::NoGradGuard no_grad;
  const double chunked = model->ForwardLoss(idx, targets).item<double>();
  const double full =
      CrossEntropyLoss(model->forward(idx), targets).item<double>();
  EXPECT_NEAR(chunked, full, 1e-6 * full);
}

TEST(Gpt2Test, ChunkedHeadLossRejectsBadShapesAndTargets) {
  const torch::Tensor hidden = torch::randn({4, 8});
  const torch::Tensor weight = torch::randn({64, 8});
  const torch::Tensor targets = torch::zeros({4}, torch::kLong);
  EXPECT_THROW(LmHeadLoss(hidden, torch::randn({64, 9}), 50, targets),
               c10::Error);
  EXPECT_THROW(LmHeadLoss(hidden, weight, 65, targets), c10::Error);
  EXPECT_THROW(LmHeadLoss(hidden, weight, 50, targets.to(torch::kInt)),
               c10::Error);
  EXPECT_THROW(
      LmHeadLoss(hidden, weight, 50, torch::full({4}, 50, torch::kLong)),
      c10::Error);
}

TEST(Gpt2Test, HeadIsTiedToWteAndNarrowedToTheRealVocab) {
  Gpt2 model(Tiny(), /*seed=*/1);
  for (const auto& p : model->named_parameters()) {
    EXPECT_THAT(p.key(), ::testing::Not(HasSubstr("lm_head")));
  }
  const torch::Tensor idx = RandomTokens(1, 8, 5);
  torch::NoGradGuard no_grad;
  const torch::Tensor before = model->forward(idx);
  EXPECT_EQ(before.size(2), 50257);
  // Move the embedding of a token absent from idx: the hidden states stay the
  // same, so through the tied head exactly that token's logits move. (Not by
  // a constant: ln_f's output sums to ~0, which would hide it.)
  const int64_t row = 123;
  ASSERT_FALSE((idx == row).any().item<bool>());
  model->wte()->weight[row].add_(torch::randn({128}));
  const torch::Tensor after = model->forward(idx);
  const torch::Tensor changed = (after - before).abs().amax({0, 1}) > 1e-3;
  EXPECT_TRUE(changed[row].item<bool>());
  EXPECT_EQ(changed.sum().item<int64_t>(), 1);
}

TEST(Gpt2Test, PaddedVocabRowsStartZeroAndNeverGetGradient) {
  Gpt2 model(Tiny(), /*seed=*/1);
  const torch::Tensor padded = model->wte()->weight.narrow(0, 50257, 47);
  EXPECT_EQ(padded.abs().max().item<float>(), 0.0f);
  const torch::Tensor loss = CrossEntropyLoss(
      model->forward(RandomTokens(4, 32, 6)), RandomTokens(4, 32, 7));
  loss.backward();
  const torch::Tensor grad = model->wte()->weight.grad();
  EXPECT_EQ(grad.narrow(0, 50257, 47).abs().max().item<float>(), 0.0f);
  EXPECT_GT(grad.narrow(0, 0, 50257).abs().max().item<float>(), 0.0f);
}

TEST(Gpt2Test, IsCausalLaterTokensDoNotChangeEarlierLogits) {
  Gpt2 model(Tiny(), /*seed=*/1);
  torch::NoGradGuard no_grad;
  const torch::Tensor idx = RandomTokens(2, 32, 8);
  const torch::Tensor changed_idx = idx.clone();
  const int64_t t = 20;
  changed_idx.select(1, t).fill_(42);
  const torch::Tensor a = model->forward(idx);
  const torch::Tensor b = model->forward(changed_idx);
  EXPECT_LE(MaxAbsDiff(a.narrow(1, 0, t), b.narrow(1, 0, t)), 1e-6);
  EXPECT_GT(MaxAbsDiff(a.select(1, t), b.select(1, t)), 1e-3);
  EXPECT_GT(MaxAbsDiff(a.select(1, 31), b.select(1, 31)), 1e-4);
}

// The sample standard deviation of n normal draws has a standard error of
// about sigma / sqrt(2n); allow 5 of them.
void ExpectNormal(const torch::Tensor& w, double sigma, const char* what) {
  const double n = static_cast<double>(w.numel());
  EXPECT_NEAR(w.std().item<double>(), sigma, 5 * sigma / std::sqrt(2 * n))
      << what;
  EXPECT_NEAR(w.mean().item<double>(), 0.0, 5 * sigma / std::sqrt(n)) << what;
}

TEST(Gpt2Test, InitFollowsGpt2Statistics) {
  Gpt2 model(Tiny(), /*seed=*/3);
  BlockImpl& block = *model->block(1);
  const double proj_sigma = 0.02 / std::sqrt(2.0 * 2);
  ExpectNormal(model->wte()->weight.narrow(0, 0, 50257), 0.02, "wte");
  ExpectNormal(model->wpe()->weight, 0.02, "wpe");
  ExpectNormal(block.attn()->c_attn()->weight, 0.02, "c_attn");
  ExpectNormal(block.mlp()->c_fc()->weight, 0.02, "c_fc");
  ExpectNormal(block.attn()->c_proj()->weight, proj_sigma, "attn.c_proj");
  ExpectNormal(block.mlp()->c_proj()->weight, proj_sigma, "mlp.c_proj");
  EXPECT_TRUE(torch::equal(block.mlp()->c_fc()->bias,
                           torch::zeros_like(block.mlp()->c_fc()->bias)));
  EXPECT_TRUE(torch::equal(block.ln_1()->weight,
                           torch::ones_like(block.ln_1()->weight)));
  EXPECT_TRUE(torch::equal(model->ln_f()->bias,
                           torch::zeros_like(model->ln_f()->bias)));
}

TEST(Gpt2Test, InitIsAPureFunctionOfTheSeed) {
  Gpt2 a(Tiny(), /*seed=*/11);
  Gpt2 b(Tiny(), /*seed=*/12);
  b->InitWeights(11);
  Gpt2 c(Tiny(), /*seed=*/12);
  const auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  bool any_differs = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i], pb[i])) << i;
    any_differs |= !torch::equal(pa[i], pc[i]);
  }
  EXPECT_TRUE(any_differs);
}

TEST(Gpt2Test, CreateGpt2ReportsInvalidConfigsAsStatus) {
  ModelConfig config = Tiny();
  config.n_head = 3;
  absl::StatusOr<Gpt2> model = CreateGpt2(config, /*seed=*/1);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(model.status().message(), HasSubstr("n_head"));
  EXPECT_TRUE(CreateGpt2(Tiny(), /*seed=*/1).ok());
}

}  // namespace gpt2_test
}  // namespace shardtrain
