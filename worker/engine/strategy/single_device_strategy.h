// SingleDeviceStrategy: one process owns the model, the optimizer and the
// whole batch. The reference the distributed strategies are checked against.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_SINGLE_DEVICE_STRATEGY_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_SINGLE_DEVICE_STRATEGY_H_

#include <memory>

#include "worker/engine/strategy/strategy.h"

namespace shardtrain {

class SingleDeviceStrategy final : public Strategy {
 public:
  explicit SingleDeviceStrategy(const StrategyOptions& options);

  std::string name() const override { return "single"; }
  absl::Status Setup(CausalLm model) override;
  torch::Tensor ForwardBackward(const torch::Tensor& inputs,
                                const torch::Tensor& targets, double loss_scale,
                                bool sync) override;
  void OptimizerStep(double lr) override;
  torch::Tensor ForwardLoss(const torch::Tensor& inputs,
                            const torch::Tensor& targets) override;
  double AllReduceMean(double value) override { return value; }
  std::vector<HeldPiece> HeldPieces() override;
  const AdamW& optimizer() const override { return *optimizer_; }
  torch::Device device() const override { return options_.device; }
  CausalLmImpl& model() override { return *model_; }
  int64_t optimizer_steps() const override;
  void set_optimizer_steps(int64_t steps) override;
  int64_t ModelStateBytes() const override;

 private:
  Communicator* placement_world() const override { return nullptr; }

  StrategyOptions options_;
  CausalLm model_;
  std::unique_ptr<AdamW> optimizer_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_SINGLE_DEVICE_STRATEGY_H_
