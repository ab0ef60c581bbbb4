// Our Llama family against the PyTorch reference written from Hugging
// Face's LlamaForCausalLM (bench/reference/llama_reference.py), run by
// Debian's /usr/bin/python3 (python3-torch). The reference reads only the
// Hugging Face directory we export: the same loss and logits from those
// files, and training a few steps from them gives the same losses.
#include <stdlib.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/data/token_file.h"
#include "core/model/hf_llama.h"
#include "core/model/model_config.h"
#include "gtest/gtest.h"
#include "tests/worker/engine/model/python_reference.h"
#include "worker/engine/model/llama.h"

namespace shardtrain {
namespace llama_reference_parity_test {

// GQA (4 query heads over 2 key/value heads), an untied head, and Llama 3's
// frequency scaling with a short original context, so that every band of it
// (kept, blended, slowed) is used at head size 16.
constexpr char kLlama[] =
    "custom-llama:n_layer=2,n_head=4,n_kv_head=2,n_embd=64,"
    "intermediate_size=160,block_size=64,vocab_size=300,tie_embeddings=0,"
    "rope_theta=500000,rope_scaling_factor=8,rope_low_freq_factor=1,"
    "rope_high_freq_factor=4,rope_original_max_position_embeddings=32";
// Qwen 2's layout: q/k/v biases, a tied head, no scaling.
constexpr char kQwen[] =
    "custom-llama:n_layer=2,n_head=4,n_kv_head=1,n_embd=64,"
    "intermediate_size=128,block_size=64,vocab_size=300,tie_embeddings=1,"
    "attention_bias=1,rope_theta=1000000";

using test::ReadText;
using test::WriteTokens;

class LlamaReferenceParityTest : public test::PythonReferenceTest {
 protected:
  nlohmann::json RunReference(const std::string& args) {
    return PythonReferenceTest::RunReference("llama_reference.py", args);
  }

  // `model`'s weights as a Hugging Face directory.
  void Export(const ModelConfig& config, Llama& model, const std::string& dir) {
    std::map<std::string, torch::Tensor> params;
    for (const auto& item : model->named_parameters()) {
      params[item.key()] = item.value().detach().contiguous();
    }
    const std::vector<std::string> names = LlamaParameterNames(config);
    const WeightReader read = [&](size_t i, float* out) {
      const torch::Tensor& t = params.at(names[i]);
      std::memcpy(out, t.data_ptr<float>(), t.numel() * sizeof(float));
      return absl::OkStatus();
    };
    ASSERT_TRUE(WriteHfLlama(config, read, dir).ok());
  }
};

TEST_F(LlamaReferenceParityTest, TheExportedFilesGiveTheReferenceOurLoss) {
  for (const char* spec : {kLlama, kQwen}) {
    SCOPED_TRACE(spec);
    const ModelConfig config = *ParseModelSpec(spec);
    Llama model(config, /*seed=*/11);
    {
      // Norm weights and biases away from 1 and 0, so that each counts.
      torch::NoGradGuard no_grad;
      torch::manual_seed(5);
      for (auto& item : model->named_parameters()) {
        if (item.key().find("norm") != std::string::npos ||
            item.key().find("bias") != std::string::npos) {
          item.value().add_(torch::randn_like(item.value()) * 0.1);
        }
      }
    }
    Export(config, model, Path("hf"));
    const int64_t b = 3, t = 48;
    torch::manual_seed(9);
    const torch::Tensor tokens =
        torch::randint(config.vocab_size, {b, t + 1}, torch::kLong);
    WriteTokens(tokens, Path("tokens.txt"));
    const nlohmann::json ref = RunReference(
        "--loss --hf " + Path("hf") + " --tokens " + Path("tokens.txt") +
        " --logits-out " + Path("logits.f32"));
    ASSERT_FALSE(ref.is_null());
    EXPECT_EQ(ref["model_type"], config.attention_bias ? "qwen2" : "llama");

    torch::NoGradGuard no_grad;
    const torch::Tensor logits = model->forward(tokens.narrow(1, 0, t));
    const double loss =
        torch::nll_loss(torch::log_softmax(logits.reshape({b * t, -1}), -1),
                        tokens.narrow(1, 1, t).reshape({-1}))
            .item<double>();
    const double ref_loss = ref["loss"].get<double>();
    const double rel = std::abs(loss - ref_loss) / ref_loss;
    std::cout << "loss: ours " << loss << ", reference " << ref_loss
              << ", relative difference " << rel << "\n";
    EXPECT_LE(rel, 1e-5);
    const std::string bytes = ReadText(Path("logits.f32"));
    ASSERT_EQ(bytes.size(), static_cast<size_t>(b * t * config.vocab_size * 4));
    const torch::Tensor theirs =
        torch::from_blob(const_cast<char*>(bytes.data()),
                         {b, t, config.vocab_size}, torch::kFloat)
            .clone();
    const double maxdiff = (logits - theirs).abs().max().item<double>();
    std::cout << "logits: largest absolute difference " << maxdiff << "\n";
    EXPECT_LE(maxdiff, 1e-4);
  }
}

// shardtrain-train started from the exported files (--init-from) and the
// reference's AdamW loop from the same files, on the same windows (in file
// order), at a constant learning rate: the same losses and gradient norms
// step by step.
TEST_F(LlamaReferenceParityTest,
       TrainingFromTheExportedFilesFollowsTheSameLosses) {
  const ModelConfig config = *ParseModelSpec(kLlama);
  Llama model(config, /*seed=*/21);
  Export(config, model, Path("hf"));
  std::filesystem::create_directories(Path("data"));
  torch::manual_seed(3);
  const torch::Tensor ids =
      torch::randint(config.vocab_size, {4096}, torch::kLong);
  std::vector<uint32_t> tokens(ids.data_ptr<int64_t>(),
                               ids.data_ptr<int64_t>() + ids.numel());
  ASSERT_TRUE(WriteTokenFile32(Path("data/train.bin"), tokens).ok());
  ASSERT_TRUE(WriteTokenFile32(Path("data/val.bin"), tokens).ok());

  constexpr int kSteps = 6;
  const std::string hyper =
      " --batch-size 4 --seq-len 32 --lr 2e-3 --weight-decay 0.1 --beta1 0.9 "
      "--beta2 0.95 --eps 1e-8 --grad-clip 1";
  ASSERT_TRUE(Run(
      std::string(SHARDTRAIN_BINARY_DIR) + "/bin/shardtrain-train --model " +
          kLlama + " --init-from " + Path("hf") + " --data " + Path("data") +
          " --out " + Path("run") + " --max-steps " + std::to_string(kSteps) +
          " --shuffle 0 --warmup-steps 0 --min-lr-ratio 1 "
          "--threads 1" +
          hyper,
      Path("train.log")));
  std::map<int64_t, nlohmann::json> ours;
  std::istringstream lines(ReadText(Path("run/metrics.jsonl")));
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json m = nlohmann::json::parse(line);
    if (m.value("rank", 0) == 0) ours[m["step"].get<int64_t>()] = m;
  }
  const nlohmann::json ref = RunReference(
      "--train --hf " + Path("hf") + " --data " + Path("data/train.bin") +
      " --steps " + std::to_string(kSteps) + hyper);
  ASSERT_FALSE(ref.is_null());
  ASSERT_EQ(ref["steps"].size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(ours.size(), static_cast<size_t>(kSteps));
  double worst_loss = 0, worst_norm = 0;
  for (const nlohmann::json& step : ref["steps"]) {
    const nlohmann::json& mine = ours.at(step["step"].get<int64_t>());
    const double loss = mine["loss"].get<double>();
    const double norm = mine["grad_norm"].get<double>();
    const double ref_loss = step["loss"].get<double>();
    const double ref_norm = step["grad_norm"].get<double>();
    worst_loss = std::max(worst_loss, std::abs(loss - ref_loss) / ref_loss);
    worst_norm = std::max(worst_norm, std::abs(norm - ref_norm) / ref_norm);
    std::cout << "step " << step["step"] << ": loss " << loss << " vs "
              << ref_loss << ", grad norm " << norm << " vs " << ref_norm
              << "\n";
  }
  std::cout << "largest relative difference over " << kSteps << " steps: loss "
            << worst_loss << ", gradient norm " << worst_norm << "\n";
  EXPECT_LE(worst_loss, 1e-5);
  EXPECT_LE(worst_norm, 1e-6);
}

}  // namespace llama_reference_parity_test
}  // namespace shardtrain
