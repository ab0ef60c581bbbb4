#include "worker/engine/model/gpt2.h"

#include "gtest/gtest.h"

namespace shardtrain {
namespace {
TEST(Gpt2Test, Builds) {
  Gpt2 model(*Gpt2Config::FromPreset("gpt2-tiny"));
  for (auto& p : model->named_parameters()) std::cout << p.key() << " " << p.value().sizes() << "\n";
  auto idx = torch::randint(50257, {8, 128}, torch::kLong);
  auto logits = model->forward(idx);
  auto loss = CrossEntropyLoss(logits, idx);
  std::cout << loss.item<float>() << "\n";
}
}  // namespace
}  // namespace shardtrain
