// Helpers shared by the strategy tests: seeded models and token batches.
#ifndef SHARDTRAIN_TESTS_WORKER_ENGINE_STRATEGY_STRATEGY_TEST_UTIL_H_
#define SHARDTRAIN_TESTS_WORKER_ENGINE_STRATEGY_STRATEGY_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>

#include "worker/engine/model/gpt2.h"
#include "worker/engine/model/gpt2_config.h"

namespace shardtrain::test {

// A model of `spec` initialised from `seed` (identical on every rank).
inline Gpt2 MakeModel(const std::string& spec, uint64_t seed) {
  absl::StatusOr<Gpt2Config> config = ParseModelSpec(spec);
  EXPECT_TRUE(config.ok()) << config.status();
  absl::StatusOr<Gpt2> model = CreateGpt2(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  return *model;
}

// `steps` global batches of `rows` windows of seq_len + 1 tokens in [0, vocab).
inline torch::Tensor MakeBatches(int64_t steps, int64_t rows, int64_t seq_len,
                                 int64_t vocab) {
  torch::manual_seed(1234);
  return torch::randint(0, vocab, {steps, rows, seq_len + 1}, torch::kInt64);
}

// Rows [first, first + count) of global batch `step` as (inputs, targets).
inline std::pair<torch::Tensor, torch::Tensor> Slice(
    const torch::Tensor& batches, int64_t step, int64_t first, int64_t count) {
  const int64_t seq_len = batches.size(2) - 1;
  torch::Tensor rows = batches[step].narrow(0, first, count);
  return {rows.narrow(1, 0, seq_len).contiguous(),
          rows.narrow(1, 1, seq_len).contiguous()};
}

}  // namespace shardtrain::test

#endif  // SHARDTRAIN_TESTS_WORKER_ENGINE_STRATEGY_STRATEGY_TEST_UTIL_H_
