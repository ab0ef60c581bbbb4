#include "core/run/strategy_kinds.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

// The strategy table's rows say what the planner, the studies and the flag
// help derive from them (core/run/strategy_kinds.h).

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

}  // namespace
}  // namespace shardtrain

namespace shardtrain {
namespace {

TEST(StudyEntryTest, StrategiesAndPipelineMeshesAreNamedInOneNotation) {
  absl::StatusOr<StudyEntry> ddp = ParseStudyEntry("ddp");
  ASSERT_TRUE(ddp.ok());
  EXPECT_EQ(ddp->strategy, "ddp");
  EXPECT_EQ(ddp->pipeline_stages, 1);
  absl::StatusOr<StudyEntry> pp2 = ParseStudyEntry("pp2");
  ASSERT_TRUE(pp2.ok());
  EXPECT_EQ(pp2->strategy, "single");
  EXPECT_EQ(pp2->pipeline_stages, 2);
  EXPECT_EQ(pp2->replicas, 0);
  absl::StatusOr<StudyEntry> mesh = ParseStudyEntry("pp4xddp2");
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(mesh->name, "pp4xddp2");
  EXPECT_EQ(mesh->strategy, "ddp");
  EXPECT_EQ(mesh->pipeline_stages, 4);
  EXPECT_EQ(mesh->replicas, 2);
  // Every strategy composes with stages: HSDP shards each stage in groups.
  absl::StatusOr<StudyEntry> hsdp = ParseStudyEntry("pp2xhsdp4");
  ASSERT_TRUE(hsdp.ok());
  EXPECT_EQ(hsdp->strategy, "hsdp");
  EXPECT_EQ(hsdp->replicas, 4);
  absl::StatusOr<StudyEntry> open = ParseStudyEntry("pp2xddp");
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(open->replicas, 0);  // from the world size
}

TEST(StudyEntryTest, BadEntriesSayWhatIsWrongAndTheNotation) {
  auto message = [](const char* entry) {
    return std::string(ParseStudyEntry(entry).status().message());
  };
  EXPECT_EQ(message("zero3").substr(0, 32), "--strategies: 'zero3' is not one");
  EXPECT_NE(message("zero3").find("[ppS x] [<strategy>[D]] [x tpT]"),
            std::string::npos);
  EXPECT_NE(message("pp").find("names no number of stages"), std::string::npos);
  EXPECT_NE(message("pp1").find("names no number of stages"),
            std::string::npos);
  EXPECT_TRUE(ParseStudyEntry("pp2xfsdp2").ok());
  EXPECT_NE(message("pp2xsingle2").find("gives single more than one replica"),
            std::string::npos);
  EXPECT_NE(message("pp2xddp0").find("names no valid replica count"),
            std::string::npos);
  EXPECT_NE(message("pp2xzz").find("names no strategy after 'x'"),
            std::string::npos);
  // A typo is named with the strategy it is nearest to.
  EXPECT_EQ(message("fdsp").substr(0, 56),
            "--strategies: 'fdsp' is not one (did you mean fsdp?); an");
  EXPECT_NE(message("pp2xdpp2")
                .find("names no strategy after 'x' (did you "
                      "mean ddp?)"),
            std::string::npos);
  EXPECT_NE(message("atuo").find("(did you mean auto?)"), std::string::npos);
  EXPECT_EQ(message("zero3").find("did you mean"), std::string::npos);
  EXPECT_NE(message("tp1").find("names no number of tensor-parallel ranks"),
            std::string::npos);
  EXPECT_NE(message("ddp2xtp0").find("names no number of tensor-parallel"),
            std::string::npos);
  EXPECT_NE(message("ddpxfsdpxtp2").find("names more than one strategy"),
            std::string::npos);
  EXPECT_NE(message("single2xtp2").find("gives single more than one replica"),
            std::string::npos);
}

// Tensor parallelism's meshes are named as plan --fit names them: the
// tensor-parallel ranks last.
TEST(StudyEntryTest, TensorParallelMeshesTakeTheirRanksLast) {
  struct Case {
    const char* entry;
    const char* strategy;
    int64_t stages, replicas, tensor;
  };
  for (const Case& c :
       {Case{"tp2", "single", 1, 0, 2}, Case{"ddp2xtp2", "ddp", 1, 2, 2},
        Case{"fsdpxtp4", "fsdp", 1, 0, 4}, Case{"pp2xtp2", "single", 2, 0, 2},
        Case{"pp2xfsdp2xtp2", "fsdp", 2, 2, 2}}) {
    absl::StatusOr<StudyEntry> e = ParseStudyEntry(c.entry);
    ASSERT_TRUE(e.ok()) << c.entry << ": " << e.status();
    EXPECT_EQ(e->name, c.entry);
    EXPECT_EQ(e->strategy, c.strategy) << c.entry;
    EXPECT_EQ(e->pipeline_stages, c.stages) << c.entry;
    EXPECT_EQ(e->replicas, c.replicas) << c.entry;
    EXPECT_EQ(e->tensor_parallel, c.tensor) << c.entry;
  }
}

}  // namespace
}  // namespace shardtrain
