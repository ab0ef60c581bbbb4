#include "core/plan/pipeline_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain {
namespace {

using Kind = PipelineAction::Kind;

ModelConfig Preset(const char* name) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromPreset(name);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

std::vector<std::pair<int64_t, int64_t>> Blocks(
    const std::vector<PipelineStage>& stages) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const PipelineStage& s : stages) {
    out.push_back({s.first_block, s.end_block});
  }
  return out;
}

// --- Stages ---

TEST(PipelinePartitionTest, TheDefaultCutBalancesTheHeadAgainstBlocks) {
  // GPT-2 small at T = 1024: a block is 24·768² + 4·1024·768 = 17.3 MFLOP
  // per token, the head 2·50304·768 = 77.3 MFLOP (4.47 blocks). Two stages:
  // 8 blocks (138.4) | 4 blocks + head (146.5) beats 9 | 3 + head (155.7).
  const ModelConfig gpt2 = Preset("gpt2");
  absl::StatusOr<std::vector<PipelineStage>> two =
      PartitionPipeline(gpt2, 1024, 2, {});
  ASSERT_TRUE(two.ok()) << two.status();
  const double block = BlockForwardFlopsPerToken(gpt2, 1024);
  const double head = HeadForwardFlopsPerToken(gpt2);
  // Every contiguous cut's costliest stage is at least the chosen one's.
  double chosen = 0;
  for (const PipelineStage& s : *two) {
    chosen = std::max(chosen, s.flops_per_token);
  }
  for (int64_t k = 1; k < 12; ++k) {
    const double worst = std::max(k * block, (12 - k) * block + head);
    EXPECT_LE(chosen, worst * (1 + 1e-12)) << "cut at " << k;
  }
  EXPECT_EQ((*two)[0].first_block, 0);
  EXPECT_EQ((*two)[1].end_block, 12);
  EXPECT_EQ((*two)[0].end_block, 8);  // the head's stage gets fewer blocks
  EXPECT_TRUE((*two)[0].embeddings);
  EXPECT_FALSE((*two)[0].head);
  EXPECT_TRUE((*two)[1].head);
  EXPECT_DOUBLE_EQ(
      (*two)[1].flops_per_token,
      ((*two)[1].end_block - (*two)[1].first_block) * block + head);
}

TEST(PipelinePartitionTest, EveryStageCountCoversEveryBlockOnce) {
  const ModelConfig gpt2 = Preset("gpt2");
  for (int64_t stages = 1; stages <= 12; ++stages) {
    absl::StatusOr<std::vector<PipelineStage>> cut =
        PartitionPipeline(gpt2, 1024, stages, {});
    ASSERT_TRUE(cut.ok()) << cut.status();
    ASSERT_EQ(static_cast<int64_t>(cut->size()), stages);
    int64_t next = 0;
    for (const PipelineStage& s : *cut) {
      EXPECT_EQ(s.first_block, next);
      EXPECT_GT(s.end_block, s.first_block);
      next = s.end_block;
    }
    EXPECT_EQ(next, 12);
  }
}

TEST(PipelinePartitionTest, AGivenSplitIsKeptAndDescribed) {
  const ModelConfig gpt2 = Preset("gpt2");
  absl::StatusOr<std::vector<int64_t>> split = ParsePipelineSplit("4, 8");
  ASSERT_TRUE(split.ok());
  absl::StatusOr<std::vector<PipelineStage>> cut =
      PartitionPipeline(gpt2, 1024, 3, *split);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(Blocks(*cut), (std::vector<std::pair<int64_t, int64_t>>{
                              {0, 4}, {4, 8}, {8, 12}}));
  EXPECT_EQ(DescribeStage((*cut)[0]), "blocks 0-3, embeddings");
  EXPECT_EQ(DescribeStage((*cut)[2]), "blocks 8-11, head");
  absl::StatusOr<std::vector<PipelineStage>> one =
      PartitionPipeline(Preset("gpt2-tiny"), 256, 2, {1});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(DescribeStage((*one)[1]), "block 1, head");
  absl::StatusOr<std::vector<PipelineStage>> whole =
      PartitionPipeline(Preset("gpt2-tiny"), 256, 1, {});
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(DescribeStage((*whole)[0]), "blocks 0-1, embeddings, head");
}

TEST(PipelinePartitionTest, BadStagesAndSplitsAreRefusedWithTheNumbers) {
  const ModelConfig mini = Preset("gpt2-mini");  // 4 blocks
  auto message = [&](int64_t stages, std::vector<int64_t> split) {
    return std::string(
        PartitionPipeline(mini, 512, stages, split).status().message());
  };
  EXPECT_EQ(message(0, {}), "--pipeline-stages: got 0; must be >= 1");
  EXPECT_EQ(message(5, {}),
            "--pipeline-stages 5: more stages than the model's 4 blocks "
            "(every stage needs at least one)");
  EXPECT_EQ(message(2, {1, 2}),
            "--pipeline-split 1,2 cuts the model into 3 stages; "
            "--pipeline-stages is 2");
  EXPECT_EQ(message(3, {2, 2}),
            "--pipeline-split 2,2: stage 1 would hold blocks [2, 2) of the "
            "model's 4; each stage needs at least one block, in increasing "
            "order");
  EXPECT_NE(message(2, {4}).find("stage 1 would hold blocks [4, 4)"),
            std::string::npos);
  EXPECT_NE(message(2, {0}).find("stage 0 would hold blocks [0, 0)"),
            std::string::npos);
  EXPECT_FALSE(ParsePipelineSplit("4;8").ok());
  EXPECT_FALSE(ParsePipelineSplit("").ok());
}

// --- Schedules ---

TEST(PipelineScheduleTest, OneFOneBWarmsUpAlternatesAndDrains) {
  // 4 stages, 6 micro-batches: stage 0 warms up with 3 forwards.
  const std::vector<PipelineAction> stage0 =
      StageActions(PipelineSchedule::kOneFOneB, 4, 0, 6);
  const std::vector<PipelineAction> expected = {
      {Kind::kForward, 0},  {Kind::kForward, 1},  {Kind::kForward, 2},
      {Kind::kForward, 3},  {Kind::kBackward, 0}, {Kind::kForward, 4},
      {Kind::kBackward, 1}, {Kind::kForward, 5},  {Kind::kBackward, 2},
      {Kind::kBackward, 3}, {Kind::kBackward, 4}, {Kind::kBackward, 5}};
  EXPECT_EQ(stage0, expected);
  // The last stage has no warm-up: forward, backward, forward, ...
  const std::vector<PipelineAction> last =
      StageActions(PipelineSchedule::kOneFOneB, 4, 3, 2);
  EXPECT_EQ(last, (std::vector<PipelineAction>{{Kind::kForward, 0},
                                               {Kind::kBackward, 0},
                                               {Kind::kForward, 1},
                                               {Kind::kBackward, 1}}));
}

TEST(PipelineScheduleTest, EveryMicroBatchIsForwardedThenBackwardedOnce) {
  for (PipelineSchedule schedule :
       {PipelineSchedule::kGpipe, PipelineSchedule::kOneFOneB}) {
    for (int64_t stages = 1; stages <= 6; ++stages) {
      for (int64_t m = 1; m <= 9; ++m) {
        for (int64_t s = 0; s < stages; ++s) {
          std::set<int64_t> forwarded, backwarded;
          for (const PipelineAction& a : StageActions(schedule, stages, s, m)) {
            if (a.kind == Kind::kForward) {
              EXPECT_TRUE(forwarded.insert(a.micro_batch).second);
            } else {
              EXPECT_TRUE(forwarded.count(a.micro_batch));
              EXPECT_TRUE(backwarded.insert(a.micro_batch).second);
            }
          }
          EXPECT_EQ(static_cast<int64_t>(forwarded.size()), m);
          EXPECT_EQ(static_cast<int64_t>(backwarded.size()), m);
        }
      }
    }
  }
}

TEST(PipelineScheduleTest, BothFlushWithTheIdealBubbleAndNoDeadlock) {
  for (PipelineSchedule schedule :
       {PipelineSchedule::kGpipe, PipelineSchedule::kOneFOneB}) {
    for (int64_t stages = 1; stages <= 8; ++stages) {
      for (int64_t m : {1, 2, 3, 4, 8, 16}) {
        // Backward twice the forward, as for a transformer.
        absl::StatusOr<PipelineTimeline> t =
            SimulatePipeline(schedule, stages, m, 1.0, 2.0);
        ASSERT_TRUE(t.ok()) << t.status();
        EXPECT_DOUBLE_EQ(t->makespan, 3.0 * static_cast<double>(m + stages - 1))
            << PipelineScheduleName(schedule) << " S=" << stages << " M=" << m;
        EXPECT_NEAR(t->bubble_fraction,
                    static_cast<double>(stages - 1) /
                        static_cast<double>(m + stages - 1),
                    1e-12);
      }
    }
  }
}

TEST(PipelineScheduleTest, OneFOneBHoldsAtMostTheStagesAheadGpipeEveryBatch) {
  for (int64_t stages : {2, 4}) {
    for (int64_t m : {1, 2, 4, 8, 16}) {
      absl::StatusOr<PipelineTimeline> gpipe =
          SimulatePipeline(PipelineSchedule::kGpipe, stages, m, 1.0, 2.0);
      absl::StatusOr<PipelineTimeline> one_f_one_b =
          SimulatePipeline(PipelineSchedule::kOneFOneB, stages, m, 1.0, 2.0);
      ASSERT_TRUE(gpipe.ok() && one_f_one_b.ok());
      for (int64_t s = 0; s < stages; ++s) {
        EXPECT_EQ(gpipe->peak_in_flight[s], m);
        EXPECT_EQ(one_f_one_b->peak_in_flight[s], std::min(stages - s, m))
            << "S=" << stages << " M=" << m << " stage " << s;
      }
    }
  }
}

// Interleaved 1F1B (Megatron's order): rank 0 of 2, with 2 chunks and 4
// micro-batches, forwards micro-batches 0-1 through chunk 0 and then chunk
// 1 (2(S-1) + (V-1)S = 4 warm-up forwards), alternates, and drains the
// backwards from the last chunk down.
TEST(PipelineScheduleTest, InterleavedOneFOneBRunsGroupsOfSThroughEachChunk) {
  const std::vector<PipelineAction> rank0 =
      StageActions(PipelineSchedule::kOneFOneB, 2, 0, 4, 2);
  const std::vector<PipelineAction> expected = {
      {Kind::kForward, 0, 0},  {Kind::kForward, 1, 0},  {Kind::kForward, 0, 1},
      {Kind::kForward, 1, 1},  {Kind::kForward, 2, 0},  {Kind::kBackward, 0, 1},
      {Kind::kForward, 3, 0},  {Kind::kBackward, 1, 1}, {Kind::kForward, 2, 1},
      {Kind::kBackward, 0, 0}, {Kind::kForward, 3, 1},  {Kind::kBackward, 1, 0},
      {Kind::kBackward, 2, 1}, {Kind::kBackward, 3, 1}, {Kind::kBackward, 2, 0},
      {Kind::kBackward, 3, 0}};
  EXPECT_EQ(rank0, expected);
  // The last rank warms up with (V-1)S = 2 forwards only.
  const std::vector<PipelineAction> rank1 =
      StageActions(PipelineSchedule::kOneFOneB, 2, 1, 4, 2);
  EXPECT_EQ(rank1[2], (PipelineAction{Kind::kForward, 0, 1}));
  EXPECT_EQ(rank1[3], (PipelineAction{Kind::kBackward, 0, 1}));
}

// Interleaved, every (micro-batch, chunk) is forwarded once and then
// backwarded once, the transfers the engine posts complete under NCCL's
// rule (the wrap-around pair included), no stage deadlocks, and the bubble
// shrinks toward (S-1)/(V·M+S-1).
TEST(PipelineScheduleTest,
     InterleavedSchedulesCompleteOnNcclAndShrinkTheBubble) {
  for (PipelineSchedule schedule :
       {PipelineSchedule::kOneFOneB, PipelineSchedule::kGpipe}) {
    for (int64_t stages = 2; stages <= 4; ++stages) {
      for (int64_t v = 2; v <= 3; ++v) {
        for (int64_t m : {stages, 2 * stages, 4 * stages}) {
          SCOPED_TRACE(::testing::Message()
                       << PipelineScheduleName(schedule) << " S=" << stages
                       << " V=" << v << " M=" << m);
          std::vector<std::vector<PipelineOp>> ops;
          for (int64_t s = 0; s < stages; ++s) {
            std::set<std::pair<int64_t, int64_t>> forwarded, backwarded;
            for (const PipelineAction& a :
                 StageActions(schedule, stages, s, m, v)) {
              const std::pair<int64_t, int64_t> key{a.micro_batch, a.chunk};
              if (a.kind == Kind::kForward) {
                EXPECT_TRUE(forwarded.insert(key).second);
              } else {
                EXPECT_TRUE(forwarded.count(key));
                EXPECT_TRUE(backwarded.insert(key).second);
              }
            }
            EXPECT_EQ(static_cast<int64_t>(backwarded.size()), m * v);
            absl::StatusOr<std::vector<PipelineOp>> lowered =
                LowerStageActions(schedule, stages, s, m, v);
            ASSERT_TRUE(lowered.ok()) << lowered.status();
            ops.push_back(*lowered);
          }
          EXPECT_TRUE(CheckPointToPointOrder(ops).ok())
              << CheckPointToPointOrder(ops);
          absl::StatusOr<PipelineTimeline> t =
              SimulatePipeline(schedule, stages, m, 1.0, 2.0, v);
          ASSERT_TRUE(t.ok()) << t.status();
          absl::StatusOr<PipelineTimeline> plain =
              SimulatePipeline(schedule, stages, m, 1.0, 2.0);
          ASSERT_TRUE(plain.ok());
          const double ideal = static_cast<double>(stages - 1) /
                               static_cast<double>(v * m + stages - 1);
          // Exactly the formula with uniform chunks, against 1F1B's
          // (S-1)/(M+S-1).
          EXPECT_NEAR(t->bubble_fraction, ideal, 1e-12);
          EXPECT_LT(t->bubble_fraction, plain->bubble_fraction);
          // Rank 0 holds its warm-up's chunks and one more (Megatron's
          // 2(S-1) + (V-1)S + 1), GPipe every chunk of every micro-batch.
          EXPECT_EQ(
              t->peak_in_flight[0],
              schedule == PipelineSchedule::kGpipe
                  ? m * v
                  : std::min(m * v, 2 * (stages - 1) + (v - 1) * stages + 1));
        }
      }
    }
  }
}

TEST(PipelineScheduleTest, InterleavingRefusesWhatItCannotRunNamingTheFlags) {
  EXPECT_EQ(CheckVirtualStages(PipelineSchedule::kOneFOneB, 2, 3, 2).message(),
            "--virtual-stages 2 under 1f1b runs micro-batches in groups of "
            "--pipeline-stages 2: --micro-batches must be a multiple of 2, "
            "got 3");
  EXPECT_EQ(CheckVirtualStages(PipelineSchedule::kOneFOneB, 1, 4, 2).message(),
            "--virtual-stages 2 interleaves pipeline stages: it needs "
            "--pipeline-stages of 2 or more, got 1");
  EXPECT_EQ(CheckVirtualStages(PipelineSchedule::kGpipe, 2, 0 + 3, 0).message(),
            "--virtual-stages: got 0; must be >= 1");
  EXPECT_TRUE(CheckVirtualStages(PipelineSchedule::kGpipe, 2, 3, 2).ok());
  EXPECT_EQ(SimulatePipeline(PipelineSchedule::kOneFOneB, 2, 3, 1, 2, 2)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A model of 4 blocks cuts into at most 4 model stages.
  const ModelConfig mini = Preset("gpt2-mini");
  absl::StatusOr<std::vector<PipelineStage>> cut =
      PartitionPipeline(mini, 64, 2, {}, 2);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(Blocks(*cut), (std::vector<std::pair<int64_t, int64_t>>{
                              {0, 1}, {1, 2}, {2, 3}, {3, 4}}));
  EXPECT_TRUE(cut->front().embeddings && cut->back().head);
  EXPECT_EQ(PartitionPipeline(mini, 64, 2, {}, 3).status().message(),
            "--pipeline-stages 2 x --virtual-stages 3 = 6 model stages: more "
            "stages than the model's 4 blocks (every stage needs at least "
            "one)");
}

// zb-h1: every micro-batch's F, then its B, then its W, once each on every
// stage; B and F within 1F1B's bounds (F - B <= S - s) and no stage holding
// more micro-batches between F and W than 1F1B's stage 0 does (S).
TEST(PipelineScheduleTest, ZeroBubbleSplitsEveryBackwardWithinOneFOneBsMemory) {
  for (int64_t stages = 2; stages <= 4; ++stages) {
    for (int64_t m = 1; m <= 4 * stages; ++m) {
      for (int64_t s = 0; s < stages; ++s) {
        SCOPED_TRACE(::testing::Message()
                     << "S=" << stages << " M=" << m << " stage " << s);
        const std::vector<PipelineAction> actions =
            StageActions(PipelineSchedule::kZeroBubble, stages, s, m);
        ASSERT_EQ(actions.size(), static_cast<size_t>(3 * m));
        std::vector<int> seen(m, 0);  // 0, then F, then B, then W
        int64_t forwards = 0, backwards = 0, weights = 0;
        int64_t most_unbackwarded = 0, most_held = 0;
        for (const PipelineAction& a : actions) {
          const int want = a.kind == Kind::kForward    ? 0
                           : a.kind == Kind::kBackward ? 1
                                                       : 2;
          ASSERT_EQ(seen[a.micro_batch], want)
              << "micro-batch " << a.micro_batch;
          ++seen[a.micro_batch];
          forwards += a.kind == Kind::kForward;
          backwards += a.kind == Kind::kBackward;
          weights += a.kind == Kind::kWeight;
          most_unbackwarded = std::max(most_unbackwarded, forwards - backwards);
          most_held = std::max(most_held, forwards - weights);
        }
        EXPECT_LE(most_unbackwarded, std::min(stages - s, m));
        EXPECT_LE(most_held, std::min(stages, m));
      }
    }
  }
}

// On paper, with B and W each half a backward of twice a forward, zb-h1
// idles at most two thirds of what 1F1B does (measured: S = 2, M = 4 1/13
// of the step against 1/5; S = 4, M = 8 5/29 against 3/11); its transfers
// complete on NCCL (SimulatePipeline checks them).
TEST(PipelineScheduleTest, ZeroBubbleIdlesLessThanOneFOneB) {
  for (int64_t stages = 2; stages <= 4; ++stages) {
    for (int64_t m = 1; m <= 4 * stages; ++m) {
      SCOPED_TRACE(::testing::Message() << "S=" << stages << " M=" << m);
      const absl::StatusOr<PipelineTimeline> zb =
          SimulatePipeline(PipelineSchedule::kZeroBubble, stages, m, 1.0, 2.0);
      ASSERT_TRUE(zb.ok()) << zb.status();
      const absl::StatusOr<PipelineTimeline> one =
          SimulatePipeline(PipelineSchedule::kOneFOneB, stages, m, 1.0, 2.0);
      ASSERT_TRUE(one.ok());
      EXPECT_LT(zb->makespan, one->makespan);
      EXPECT_LT(zb->bubble_fraction, one->bubble_fraction);
      // 1F1B idles 3(S - 1) units beside its 3M of work; zb-h1 at most
      // two thirds of that.
      EXPECT_DOUBLE_EQ(one->makespan, 3.0 * (m + stages - 1));
      EXPECT_LE(zb->makespan, 3.0 * m + 2.0 * (stages - 1));
      if ((stages == 2 || stages == 4) && m == 2 * stages) {
        std::printf("zb-h1 S=%ld M=%ld: bubble %.3f (1f1b %.3f)\n",
                    static_cast<long>(stages), static_cast<long>(m),
                    zb->bubble_fraction, one->bubble_fraction);
      }
    }
  }
  EXPECT_EQ(
      CheckVirtualStages(PipelineSchedule::kZeroBubble, 2, 4, 2).message(),
      "--virtual-stages 2: zb-h1 does not interleave; use "
      "--virtual-stages 1 or --pipeline-schedule 1f1b");
}

TEST(PipelineScheduleTest, SchedulesAreNamedAndUnknownOnesRefused) {
  EXPECT_EQ(*ParsePipelineSchedule("1f1b"), PipelineSchedule::kOneFOneB);
  EXPECT_EQ(*ParsePipelineSchedule("gpipe"), PipelineSchedule::kGpipe);
  EXPECT_EQ(*ParsePipelineSchedule("zb-h1"), PipelineSchedule::kZeroBubble);
  EXPECT_STREQ(PipelineScheduleName(PipelineSchedule::kZeroBubble), "zb-h1");
  EXPECT_EQ(ParsePipelineSchedule("zb").status().message(),
            "--pipeline-schedule: 'zb' is not one of gpipe, 1f1b, zb-h1");
}

// --- Point-to-point order ---

std::vector<std::vector<PipelineOp>> Naive(PipelineSchedule schedule,
                                           int64_t stages, int64_t micro) {
  std::vector<std::vector<PipelineOp>> ops;
  for (int64_t s = 0; s < stages; ++s) {
    ops.push_back(NaiveStageOps(schedule, stages, s, micro));
  }
  return ops;
}

std::vector<std::vector<PipelineOp>> Lowered(PipelineSchedule schedule,
                                             int64_t stages, int64_t micro) {
  std::vector<std::vector<PipelineOp>> ops;
  for (int64_t s = 0; s < stages; ++s) {
    absl::StatusOr<std::vector<PipelineOp>> stage =
        LowerStageActions(schedule, stages, s, micro);
    EXPECT_TRUE(stage.ok()) << stage.status();
    ops.push_back(stage.ok() ? *stage : std::vector<PipelineOp>{});
  }
  return ops;
}

// Posting each transfer where its compute needs it (the order the engine
// once used) deadlocks 1F1B on NCCL: at S = 2, M = 2 stage 0 sends a0, a1
// and then waits for g0 while stage 1 sends g0 before it receives a1. GPipe
// happens to pair up.
TEST(PipelineOrderTest, TheNaiveOneFOneBOrderDeadlocksOnNccl) {
  const absl::Status naive =
      CheckPointToPointOrder(Naive(PipelineSchedule::kOneFOneB, 2, 2));
  EXPECT_EQ(naive.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(naive.message().find("stage 0's next transfer is send a1 to 1"),
            std::string::npos)
      << naive;
  EXPECT_NE(naive.message().find("stage 1's is send g0 to 0"),
            std::string::npos)
      << naive;
  EXPECT_TRUE(
      CheckPointToPointOrder(Naive(PipelineSchedule::kGpipe, 2, 2)).ok());
}

// Lowered, every schedule completes under NCCL's rule for S in 2..4 and M
// in 1..2S, and keeps the schedule's compute order.
TEST(PipelineOrderTest, LoweredSchedulesCompleteOnNcclAndKeepTheirCompute) {
  for (PipelineSchedule schedule :
       {PipelineSchedule::kOneFOneB, PipelineSchedule::kGpipe,
        PipelineSchedule::kZeroBubble}) {
    for (int64_t stages = 2; stages <= 4; ++stages) {
      for (int64_t m = 1; m <= 2 * stages; ++m) {
        SCOPED_TRACE(::testing::Message() << PipelineScheduleName(schedule)
                                          << " S=" << stages << " M=" << m);
        const auto ops = Lowered(schedule, stages, m);
        EXPECT_TRUE(CheckPointToPointOrder(ops).ok())
            << CheckPointToPointOrder(ops);
        for (int64_t s = 0; s < stages; ++s) {
          std::vector<PipelineAction> compute;
          int64_t posted_early = 0;
          for (const PipelineOp& op : ops[s]) {
            if (op.kind == PipelineOp::Kind::kForward) {
              compute.push_back({Kind::kForward, op.micro_batch});
            } else if (op.kind == PipelineOp::Kind::kBackward) {
              compute.push_back({Kind::kBackward, op.micro_batch});
            } else if (op.kind == PipelineOp::Kind::kWeight) {
              compute.push_back({Kind::kWeight, op.micro_batch});
            }
          }
          EXPECT_EQ(compute, StageActions(schedule, stages, s, m));
          // Each transfer once: an activation and a gradient per micro-batch
          // on each side that has a neighbour.
          for (const PipelineOp& op : ops[s]) {
            posted_early += op.kind == PipelineOp::Kind::kPostRecv ||
                            op.kind == PipelineOp::Kind::kPostSend;
          }
          EXPECT_EQ(posted_early, 2 * m * ((s > 0) + (s + 1 < stages)));
        }
      }
    }
  }
}

// The checker also catches a pair whose orders match in kind but not in
// content: NCCL would hand one micro-batch's activation to another's
// receive (same shapes, so nothing would fail, only the numbers).
TEST(PipelineOrderTest, TransfersMatchedOutOfTurnAreNamed) {
  auto ops = Naive(PipelineSchedule::kGpipe, 2, 2);
  // Stage 1 posts its receive of a1 before that of a0.
  ASSERT_EQ(DescribeOp(ops[1][0]), "recv a0 from 0");
  ASSERT_EQ(DescribeOp(ops[1][3]), "recv a1 from 0");
  std::swap(ops[1][0], ops[1][3]);
  const absl::Status status = CheckPointToPointOrder(ops);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("would be matched"), std::string::npos)
      << status;
}

}  // namespace
}  // namespace shardtrain
