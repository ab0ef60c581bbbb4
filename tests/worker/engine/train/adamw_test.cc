#include "worker/engine/support/adamw.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace shardtrain {
namespace {

// LibTorch's own torch::optim::AdamW is the reference.
TEST(AdamWTest, MatchesLibTorchAdamWWithPerGroupWeightDecay) {
  torch::manual_seed(0);
  torch::Tensor w_ours = torch::randn({16, 8}).requires_grad_();
  torch::Tensor b_ours = torch::randn({8}).requires_grad_();
  torch::Tensor w_ref = w_ours.detach().clone().requires_grad_();
  torch::Tensor b_ref = b_ours.detach().clone().requires_grad_();

  AdamW ours({{{w_ours}, 0.1}, {{b_ours}, 0.0}}, {0.9, 0.95, 1e-8});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{w_ref},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-3)
                              .betas({0.9, 0.95})
                              .eps(1e-8)
                              .weight_decay(0.1)));
  groups.emplace_back(std::vector<torch::Tensor>{b_ref},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-3)
                              .betas({0.9, 0.95})
                              .eps(1e-8)
                              .weight_decay(0.0)));
  torch::optim::AdamW reference(groups, torch::optim::AdamWOptions(1e-3));

  for (int step = 0; step < 20; ++step) {
    torch::Tensor gw = torch::randn({16, 8});
    torch::Tensor gb = torch::randn({8});
    w_ours.mutable_grad() = gw.clone();
    b_ours.mutable_grad() = gb.clone();
    w_ref.mutable_grad() = gw.clone();
    b_ref.mutable_grad() = gb.clone();
    ours.Step(1e-3);
    reference.step();
  }
  const double maxdiff = std::max((w_ours - w_ref).abs().max().item<double>(),
                                  (b_ours - b_ref).abs().max().item<double>());
  std::cout << "AdamW vs torch::optim::AdamW: maxdiff " << maxdiff << "\n";
  EXPECT_LT(maxdiff, 1e-6);
  // The update really moved the weights (a no-op optimizer would fail above
  // only if the reference also did nothing).
  EXPECT_GT(
      (w_ours - w_ref.detach().clone().zero_()).abs().max().item<double>(), 0);
  EXPECT_EQ(ours.step_count(), 20);
}

TEST(AdamWTest, StateCopiedThroughStateOfContinuesIdentically) {
  torch::manual_seed(1);
  torch::Tensor a = torch::randn({4, 4}).requires_grad_();
  torch::Tensor b = a.detach().clone().requires_grad_();
  AdamW first({{{a}, 0.1}}, {});
  for (int i = 0; i < 3; ++i) {
    a.mutable_grad() = torch::ones({4, 4}) * (i + 1);
    first.Step(1e-2);
  }
  AdamW second({{{b}, 0.1}}, {});
  {
    torch::NoGradGuard no_grad;
    b.copy_(a);
    const auto [m_from, v_from] = first.StateOf(a);
    const auto [m_to, v_to] = second.StateOf(b);
    ASSERT_TRUE(m_from.defined() && v_to.defined());
    m_to.copy_(m_from);
    v_to.copy_(v_from);
  }
  second.set_step_count(first.step_count());
  EXPECT_EQ(second.step_count(), 3);
  a.mutable_grad() = torch::full({4, 4}, 0.5);
  b.mutable_grad() = torch::full({4, 4}, 0.5);
  first.Step(1e-2);
  second.Step(1e-2);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_EQ(first.StateBytes(), 2 * 16 * 4);
}

// StateOf matches the memory the optimizer updates: a view of a shard is
// found by the view that was handed over, not by another range of it.
TEST(AdamWTest, StateOfFindsOnlyTheTensorsItUpdates) {
  torch::Tensor shard = torch::zeros({10});
  torch::Tensor piece = shard.narrow(0, 4, 6);
  piece.mutable_grad() = torch::zeros({6});
  AdamW optimizer({{{piece}, 0}}, {});
  EXPECT_TRUE(optimizer.StateOf(shard.narrow(0, 4, 6)).first.defined());
  EXPECT_EQ(optimizer.StateOf(shard.narrow(0, 4, 6)).first.numel(), 6);
  EXPECT_FALSE(optimizer.StateOf(shard.narrow(0, 0, 6)).first.defined());
  EXPECT_FALSE(optimizer.StateOf(shard).first.defined());
  EXPECT_FALSE(optimizer.StateOf(torch::zeros({6})).second.defined());
}

}  // namespace
}  // namespace shardtrain
