#include "core/train/strategy_kinds.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

// The strategy table's rows say what the planner, the studies and the flag
// help derive from them (core/train/strategy_kinds.h).

namespace shardtrain {
namespace {

TEST(StrategyKindsTest, StudiesAndHelpComeFromTheRows) {
  EXPECT_EQ(StudyStrategyNames(1), (std::vector<std::string>{"single"}));
  EXPECT_EQ(StudyStrategyNames(2),
            (std::vector<std::string>{"single", "ddp", "fsdp"}));
  EXPECT_EQ(StudyStrategyNames(4),
            (std::vector<std::string>{"single", "ddp", "fsdp", "hsdp"}));
  const std::string help = StrategyFlagHelp();
  for (const StrategyKind& kind : StrategyKinds()) {
    EXPECT_NE(help.find(std::string(kind.name) + " (" + kind.help + ")"),
              std::string::npos)
        << help;
  }
  EXPECT_EQ(FindStrategyKind("fsdp")->layout, StateLayout::kSharded);
  EXPECT_EQ(FindStrategyKind("hsdp")->layout, StateLayout::kShardedInGroups);
  EXPECT_EQ(FindStrategyKind("ddp")->layout, StateLayout::kReplicated);
}

TEST(StrategyKindsTest, PipelineStagesComposeWithReplicatedStrategies) {
  EXPECT_TRUE(ComposesWithPipelineStages(*FindStrategyKind("single")));
  EXPECT_TRUE(ComposesWithPipelineStages(*FindStrategyKind("ddp")));
  EXPECT_FALSE(ComposesWithPipelineStages(*FindStrategyKind("fsdp")));
  EXPECT_FALSE(ComposesWithPipelineStages(*FindStrategyKind("hsdp")));
  EXPECT_EQ(PipelineStrategyNameList(), "single and ddp");
  EXPECT_EQ(NonPipelineStrategyDisplayNames(), "FSDP and HSDP");
}

}  // namespace
}  // namespace shardtrain
