// Our GPT-2 against the PyTorch reference (bench/reference/gpt2_reference.py),
// run by Debian's /usr/bin/python3 (python3-torch). The two exchange weights
// and gradients as llm.c model files, as llm.c's own test_gpt2 does, and the
// comparison prints llm.c-style "OK, maxdiff" lines.
#include <stdio.h>
#include <stdlib.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/checkpoint/checkpoint_export.h"
#include "core/model/hf_gpt2.h"
#include "core/model/model_config.h"
#include "gtest/gtest.h"
#include "tests/worker/engine/model/python_reference.h"
#include "worker/engine/model/gpt2.h"
#include "worker/engine/model/llmc_checkpoint.h"

namespace shardtrain {
namespace gpt2_reference_parity_test {

using test::ReadText;
using test::WriteTokens;

class Gpt2ReferenceParityTest : public test::PythonReferenceTest {
 protected:
  nlohmann::json RunReference(const std::string& args) {
    return PythonReferenceTest::RunReference("gpt2_reference.py", args);
  }
};

// Logits the reference wrote (raw fp32) as [b, t, vocab]; empty when the
// file does not hold exactly that many.
torch::Tensor ReadLogits(const std::string& path, int64_t b, int64_t t,
                         int64_t vocab) {
  const std::string bytes = ReadText(path);
  if (static_cast<int64_t>(bytes.size()) != b * t * vocab * 4) return {};
  return torch::from_blob(const_cast<char*>(bytes.data()), {b, t, vocab},
                          torch::kFloat)
      .clone();
}

// llm.c's check_tensor: prints the largest absolute difference and whether it
// is within `tolerance`.
bool CheckTensor(const torch::Tensor& ours, const torch::Tensor& reference,
                 const std::string& label, double tolerance) {
  const double maxdiff =
      (ours.to(torch::kDouble) - reference.to(torch::kDouble))
          .abs()
          .max()
          .item<double>();
  const bool ok = maxdiff <= tolerance;
  std::cout << std::left << std::setw(32) << label << (ok ? " OK" : " NOT OK")
            << ", maxdiff " << std::scientific << std::setprecision(3)
            << maxdiff << " (tolerance " << tolerance << ")\n"
            << std::defaultfloat;
  return ok;
}

TEST_F(Gpt2ReferenceParityTest, LogitsLossAndGradientsMatchPytorch) {
  // Arrange: a seeded model as an llm.c file, and token sequences.
  const ModelConfig config = *ModelConfig::FromPreset("gpt2-tiny");
  Gpt2 model(config, /*seed=*/1337);
  ASSERT_TRUE(SaveLlmcCheckpoint(model, Path("model.bin")).ok());
  const int64_t b = 4, t = 64;
  torch::manual_seed(42);
  const torch::Tensor tokens =
      torch::randint(config.vocab_size, {b, t + 1}, torch::kLong);
  WriteTokens(tokens, Path("tokens.txt"));

  // Act: the reference's forward and backward, then ours.
  const nlohmann::json ref =
      RunReference("--check-parity --model-bin " + Path("model.bin") +
                   " --tokens " + Path("tokens.txt") + " --logits-out " +
                   Path("logits.f32") + " --grads-out " + Path("grads.bin"));
  ASSERT_FALSE(ref.is_null());
  std::cout << "reference: torch " << ref["torch_version"].get<std::string>()
            << ", attention " << ref["attention"].get<std::string>() << "\n";

  const torch::Tensor logits = model->forward(tokens.narrow(1, 0, t));
  const torch::Tensor loss = CrossEntropyLoss(logits, tokens.narrow(1, 1, t));
  loss.backward();

  // Assert: loss within 1e-5 relative, logits within 1e-4 absolute.
  const double ref_loss = ref["loss"].get<double>();
  const double rel = std::abs(loss.item<double>() - ref_loss) / ref_loss;
  std::cout << "loss: ours " << std::setprecision(8) << loss.item<double>()
            << ", reference " << ref_loss << ", relative diff "
            << std::scientific << rel << std::defaultfloat << "\n";
  EXPECT_LE(rel, 1e-5);

  const torch::Tensor ref_logits =
      ReadLogits(Path("logits.f32"), b, t, config.vocab_size);
  ASSERT_TRUE(ref_logits.defined()) << "the reference's logits file";
  EXPECT_TRUE(CheckTensor(logits.detach(), ref_logits, "logits", 1e-4));

  // Gradients travel as an llm.c file too: load them as a model's weights and
  // compare parameter by parameter. Summation order alone moves them by
  // ~1e-8 here; 1e-6 absolute leaves room for other BLAS builds.
  Gpt2 ref_grads(config);
  ASSERT_TRUE(LoadLlmcCheckpoint(Path("grads.bin"), ref_grads).ok());
  const auto ours = model->named_parameters();
  const auto theirs = ref_grads->named_parameters();
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TRUE(CheckTensor(ours[i].value().grad(), theirs[i].value(),
                            "grad " + ours[i].key(), 1e-6));
  }
}

// Export to Hugging Face's format, read back by a reader written in Python
// from the safetensors specification, run in the reference under Hugging
// Face's names (Conv1D weights transposed back): the same logits as ours.
// And the import of that directory gives back our weights bit for bit.
TEST_F(Gpt2ReferenceParityTest, HuggingFaceExportGivesTheReferenceOurLogits) {
  const ModelConfig config = *ModelConfig::FromPreset("gpt2-tiny");
  Gpt2 model(config, /*seed=*/4242);
  ASSERT_TRUE(SaveLlmcCheckpoint(model, Path("model.bin")).ok());
  absl::StatusOr<ModelWeights> weights = OpenModelWeights(Path("model.bin"));
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_TRUE(WriteHfGpt2(config, weights->read, Path("hf")).ok());
  const int64_t b = 2, t = 48;
  torch::manual_seed(7);
  const torch::Tensor tokens =
      torch::randint(config.vocab_size, {b, t + 1}, torch::kLong);
  WriteTokens(tokens, Path("tokens.txt"));

  const std::string command =
      std::string(test::kReferencePython) + " " + SHARDTRAIN_SOURCE_DIR +
      "/tests/python/hf_reference_logits.py --hf " + Path("hf") + " --tokens " +
      Path("tokens.txt") + " --logits-out " + Path("logits.f32") + " >" +
      Path("hf.json") + " 2>" + Path("hf.err");
  ASSERT_EQ(std::system(command.c_str()), 0) << ReadText(Path("hf.err"));
  const nlohmann::json info = nlohmann::json::parse(ReadText(Path("hf.json")));
  EXPECT_EQ(info["tensors"].get<int>(), 4 + 12 * config.n_layer);
  EXPECT_EQ(info["metadata"]["format"], "pt");

  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(tokens.narrow(1, 0, t));
  const torch::Tensor theirs =
      ReadLogits(Path("logits.f32"), b, t, config.vocab_size);
  ASSERT_TRUE(theirs.defined()) << "the reference's logits file";
  EXPECT_TRUE(
      CheckTensor(logits, theirs, "logits via model.safetensors", 1e-5));

  absl::StatusOr<ModelWeights> imported = OpenModelWeights(Path("hf"));
  ASSERT_TRUE(imported.ok()) << imported.status();
  Gpt2 back(config, /*seed=*/1);
  ASSERT_TRUE(LoadWeights(imported->read, back).ok());
  const auto a = model->named_parameters();
  const auto c = back->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(CheckTensor(a[i].value(), c[i].value(), a[i].key(), 0.0));
  }
}

TEST_F(Gpt2ReferenceParityTest, SeededInitIsBitIdenticalToPytorch) {
  const std::string spec =
      "custom:n_layer=3,n_head=2,n_embd=32,block_size=64,vocab_size=1000";
  const nlohmann::json ref = RunReference(
      "--init --model " + spec + " --seed 1337 --out " + Path("init.bin"));
  ASSERT_FALSE(ref.is_null());
  const ModelConfig config = *ParseModelSpec(spec);
  EXPECT_EQ(ref["num_parameters"].get<int64_t>(), config.NumParameters());

  Gpt2 ours(config, /*seed=*/1337);
  Gpt2 theirs(config, /*seed=*/0);
  const absl::Status status = LoadLlmcCheckpoint(Path("init.bin"), theirs);
  ASSERT_TRUE(status.ok()) << status;
  const auto a = ours->named_parameters();
  const auto b = theirs->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(CheckTensor(a[i].value(), b[i].value(), a[i].key(), 0.0));
  }
}

}  // namespace gpt2_reference_parity_test
}  // namespace shardtrain
