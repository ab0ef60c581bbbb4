// The strategy table (train/strategy_kinds.h) and the factory agree: every
// row can be built, under its own name, and is refused where it cannot run.
#include "worker/engine/strategy/strategy_factory.h"

#include <gtest/gtest.h>

#include <string>

#include "core/run/strategy_kinds.h"
#include "tests/fakes/in_process_communicator.h"

namespace shardtrain {
namespace strategy_factory_test {

TEST(StrategyFactoryTest, BuildsEveryStrategyOfTheTableUnderItsName) {
  ASSERT_FALSE(StrategyKinds().empty());
  for (const StrategyKind& kind : StrategyKinds()) {
    SCOPED_TRACE(kind.name);
    EXPECT_TRUE(HasStrategyFactory(kind.name));
    TrainConfig config;
    config.strategy = kind.name;
    RunRanks(1, [&](int64_t rank, Communicator& comm) {
      StrategyOptions options;
      options.rank = rank;
      absl::StatusOr<std::unique_ptr<Strategy>> strategy =
          CreateStrategy(config, options, kind.distributed ? &comm : nullptr);
      ASSERT_TRUE(strategy.ok()) << strategy.status();
      EXPECT_EQ((*strategy)->name(), kind.name);
    });
  }
  EXPECT_EQ(StrategyNameList(), "single, ddp, fsdp, hsdp");
  EXPECT_STREQ(FindStrategyKind("fsdp")->display_name, "FSDP");
  EXPECT_EQ(FindStrategyKind("zero3"), nullptr);
}

TEST(StrategyFactoryTest, RefusesUnknownNamesAndMissingCommunicators) {
  TrainConfig config;
  config.strategy = "zero3";
  absl::StatusOr<std::unique_ptr<Strategy>> unknown =
      CreateStrategy(config, StrategyOptions{}, nullptr);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("allowed: single, ddp, fsdp"),
            std::string::npos);
  config.strategy = "ddp";
  EXPECT_FALSE(CreateStrategy(config, StrategyOptions{}, nullptr).ok());
  config.strategy = "single";
  StrategyOptions two;
  two.world_size = 2;
  EXPECT_FALSE(CreateStrategy(config, two, nullptr).ok());
}

}  // namespace strategy_factory_test
}  // namespace shardtrain
