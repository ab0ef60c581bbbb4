#include "client/compare_report.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/step_metrics_csv.h"
#include "core/data/asset_paths.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace shardtrain::cli {
namespace {

using ::shardtrain::test::ReadFile;
using ::shardtrain::test::RunCommand;
using ::shardtrain::test::TempDir;
using ::shardtrain::test::WriteFile;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::SizeIs;

constexpr int64_t kMiB = 1024 * 1024;

// What one step measured; unnamed fields keep plausible defaults.
struct StepValues {
  double loss = 4.0;
  double grad_norm = 1.0;
  double step_seconds = 0.5;
  double tokens_per_second = 1000;
  double mfu = 0.3;
  int64_t peak_bytes = 100 * kMiB;

  StepValues& Loss(double v) {
    loss = v;
    return *this;
  }
  StepValues& GradNorm(double v) {
    grad_norm = v;
    return *this;
  }
  StepValues& Seconds(double v) {
    step_seconds = v;
    return *this;
  }
  StepValues& TokensPerSecond(double v) {
    tokens_per_second = v;
    return *this;
  }
  StepValues& Mfu(double v) {
    mfu = v;
    return *this;
  }
  StepValues& PeakBytes(int64_t v) {
    peak_bytes = v;
    return *this;
  }
};

v1::StepMetrics Step(int32_t rank, int64_t step, const StepValues& v) {
  v1::StepMetrics m;
  m.set_rank(rank);
  m.set_step(step);
  m.set_total_steps(100);
  m.set_loss(v.loss);
  m.set_grad_norm(v.grad_norm);
  m.set_lr(6e-4);
  m.set_step_seconds(v.step_seconds);
  m.set_tokens(1024);
  m.set_tokens_per_second(v.tokens_per_second);
  m.set_mfu(v.mfu);
  m.set_memory_allocated_bytes(v.peak_bytes / 2);
  m.set_memory_peak_bytes(v.peak_bytes);
  m.set_memory_reserved_bytes(v.peak_bytes);
  m.set_model_state_bytes(v.peak_bytes / 4);
  return m;
}

// A DDP run on 2 ranks with hand-checkable rank-0 figures:
//   step_seconds 2.0 0.5 0.4 0.6 0.5  -> p50 0.5, p95 2.0 (nearest rank)
//   tokens/s     100 1000 1200 800 1000 -> after warm-up: mean 1000,
//                                          population std sqrt(20000)
//   mfu          .01 .30 .36 .24 .30  -> after warm-up: mean 0.30
//   grad norm    1 2 3 4 10           -> mean 4, std sqrt(10), median 3
//   loss         5.0 4.5 4.0 3.5 3.0; val loss 4.6 at step 2, 3.6 at step 4
// Rank 1 reports nonsense for everything but memory (150 MiB at step 3), so
// any use of it other than for peak memory shows. Step 3 is reported twice
// by each rank (a restart replayed it); the first reports are stale.
StrategyRun FiveStepDdpRun() {
  StrategyRun run;
  run.strategy = "ddp";
  run.job_id = "job-ddp";
  run.world_size = 2;
  run.batch_size = 4;
  run.grad_accum = 2;
  run.seq_len = 64;
  run.train_tokens = 4 * 2 * 64 * 2 * 100;  // 100 steps per epoch

  const double seconds[] = {2.0, 0.5, 0.4, 0.6, 0.5};
  const double tps[] = {100, 1000, 1200, 800, 1000};
  const double mfu[] = {0.01, 0.30, 0.36, 0.24, 0.30};
  const double norms[] = {1, 2, 3, 4, 10};
  const double losses[] = {5.0, 4.5, 4.0, 3.5, 3.0};

  // Stale reports from before the restart: must lose to the replay.
  run.steps.push_back(Step(0, 3,
                           StepValues()
                               .Loss(42)
                               .GradNorm(1000)
                               .Seconds(99)
                               .TokensPerSecond(1)
                               .Mfu(0.9)
                               .PeakBytes(900 * kMiB)));
  run.steps.push_back(Step(1, 3, StepValues().PeakBytes(800 * kMiB)));
  for (int i = 4; i >= 0; --i) {  // any order
    v1::StepMetrics m = Step(0, i + 1,
                             StepValues()
                                 .Loss(losses[i])
                                 .GradNorm(norms[i])
                                 .Seconds(seconds[i])
                                 .TokensPerSecond(tps[i])
                                 .Mfu(mfu[i])
                                 .PeakBytes(100 * kMiB));
    if (i + 1 == 2) m.set_val_loss(4.6);
    if (i + 1 == 4) m.set_val_loss(3.6);
    run.steps.push_back(m);
    run.steps.push_back(Step(1, i + 1,
                             StepValues()
                                 .Loss(77)
                                 .GradNorm(77)
                                 .Seconds(77)
                                 .TokensPerSecond(77)
                                 .Mfu(0.77)
                                 .PeakBytes((i + 1 == 3 ? 150 : 120) * kMiB)));
  }
  return run;
}

// ---------------------------------------------------------------------------
// Summarise
// ---------------------------------------------------------------------------

TEST(SummariseTest, ComputesEveryFieldFromRankZeroAndMemoryFromAllRanks) {
  const StrategySummary s = Summarise(FiveStepDdpRun());

  EXPECT_EQ(s.strategy, "ddp");
  EXPECT_EQ(s.world_size, 2);
  EXPECT_EQ(s.steps, 5);
  EXPECT_DOUBLE_EQ(s.final_train_loss, 3.0);
  EXPECT_DOUBLE_EQ(s.final_val_loss, 3.6);
  EXPECT_DOUBLE_EQ(s.step_seconds_p50, 0.5);
  EXPECT_DOUBLE_EQ(s.step_seconds_p95, 2.0);
  EXPECT_NEAR(s.tokens_per_second_mean, 1000, 1e-9);
  EXPECT_NEAR(s.tokens_per_second_std, 141.42135623730951, 1e-9);
  // 95% interval of the mean of 4 steps: t(3) x sample std / sqrt(4).
  EXPECT_EQ(s.timed_steps, 4);
  EXPECT_NEAR(s.tokens_per_second_ci95, 3.182 * std::sqrt(80000.0 / 3) / 2,
              1e-9);
  EXPECT_EQ(s.global_batch, 4 * 2 * 2);
  ASSERT_EQ(s.losses.size(), 5u);
  EXPECT_DOUBLE_EQ(s.losses.at(3), 4.0);  // the replay, not the stale 42
  EXPECT_NEAR(s.mfu_mean, 0.30, 1e-12);
  EXPECT_NEAR(s.grad_norm_mean, 4.0, 1e-12);
  EXPECT_NEAR(s.grad_norm_std, 3.1622776601683795, 1e-12);
  EXPECT_NEAR(s.grad_norm_spike_ratio, 10.0 / 3.0, 1e-12);
  EXPECT_EQ(s.peak_memory_bytes_per_rank, 150 * kMiB);
}

// A mesh's global batch is shared by its data-parallel replicas only: a
// pipeline's stages and the tensor-parallel ranks of a replica see the same
// sequences. single (1 rank), ddp2 (2 replicas of 2), pp2 and tp2 (one
// replica of 2 ranks) and pp2xddp2 (2 replicas of 2 stages) all train on
// 8 sequences a step, and their same losses are the same training.
TEST(SummariseTest, AMeshSharesItsGlobalBatchOverItsReplicasOnly) {
  struct Entry {
    const char* name;
    int world;
    int64_t replicas;
    int64_t batch;
  };
  std::vector<StrategySummary> rows;
  for (const Entry& e :
       {Entry{"single", 1, 0, 8}, Entry{"ddp", 2, 0, 4}, Entry{"pp2", 2, 1, 8},
        Entry{"tp2", 2, 1, 8}, Entry{"pp2xddp2", 4, 2, 4}}) {
    StrategyRun run = FiveStepDdpRun();
    run.strategy = e.name;
    run.world_size = e.world;
    run.replicas = e.replicas;
    run.batch_size = e.batch;
    run.grad_accum = 1;
    rows.push_back(Summarise(run));
    EXPECT_EQ(rows.back().global_batch, 8) << e.name;
  }
  const std::vector<std::string> findings = Findings(rows);
  EXPECT_THAT(findings, Contains(HasSubstr("Same training")));
  EXPECT_THAT(findings, Not(Contains(HasSubstr("not comparable"))));
}

TEST(SummariseTest, PercentilesAreNearestRankNotInterpolated) {
  StrategyRun run;
  run.strategy = "single";
  for (int i = 1; i <= 20; ++i) {
    run.steps.push_back(
        Step(0, i, StepValues().Seconds(static_cast<double>(i))));
  }

  const StrategySummary s = Summarise(run);

  // Interpolation would give 10.5 and 19.05.
  EXPECT_DOUBLE_EQ(s.step_seconds_p50, 10.0);
  EXPECT_DOUBLE_EQ(s.step_seconds_p95, 19.0);
}

TEST(SummariseTest, SingleStepKeepsItsThroughputAndReportsNoSpreadOrEval) {
  StrategyRun run;
  run.strategy = "single";
  run.batch_size = 4;
  run.seq_len = 64;
  run.train_tokens = 0;  // unknown
  run.steps.push_back(
      Step(0, 1, StepValues().GradNorm(2).TokensPerSecond(500).Mfu(0.1)));

  const StrategySummary s = Summarise(run);

  EXPECT_EQ(s.steps, 1);
  EXPECT_DOUBLE_EQ(s.tokens_per_second_mean, 500);
  EXPECT_DOUBLE_EQ(s.tokens_per_second_std, 0);
  EXPECT_DOUBLE_EQ(s.mfu_mean, 0.1);
  EXPECT_DOUBLE_EQ(s.grad_norm_spike_ratio, 1.0);
  EXPECT_EQ(s.timed_steps, 1);
  EXPECT_DOUBLE_EQ(s.tokens_per_second_ci95, 0);
  EXPECT_LT(s.final_val_loss, 0);
}

TEST(SummariseTest, RunWithoutRankZeroHasNoStepsButKeepsPeakMemory) {
  StrategyRun run;
  run.strategy = "fsdp";
  run.steps.push_back(Step(1, 1, StepValues().PeakBytes(7 * kMiB)));

  const StrategySummary s = Summarise(run);

  EXPECT_EQ(s.steps, 0);
  EXPECT_EQ(s.peak_memory_bytes_per_rank, 7 * kMiB);
}

// ---------------------------------------------------------------------------
// Table and findings
// ---------------------------------------------------------------------------

// A row of 50 steps whose loss falls from 5.0 to `loss`, with throughput
// `tokens_per_second` ± `ci` (95%) over 49 timed steps.
StrategySummary Row(const std::string& strategy, double loss,
                    int64_t peak_bytes, double tokens_per_second,
                    double spike_ratio, double ci = 0) {
  StrategySummary s;
  s.strategy = strategy;
  s.world_size = strategy == "single" ? 1 : 2;
  s.global_batch = 8;
  s.steps = 50;
  s.final_train_loss = loss;
  for (int step = 1; step <= 50; ++step) {
    s.losses[step] = 5.0 + (loss - 5.0) * step / 50.0;
  }
  s.peak_memory_bytes_per_rank = peak_bytes;
  s.tokens_per_second_mean = tokens_per_second;
  s.tokens_per_second_ci95 = ci;
  s.timed_steps = 49;
  s.grad_norm_spike_ratio = spike_ratio;
  return s;
}

TEST(FormatSummaryTableTest, HasHeaderAndOneFormattedRowPerStrategy) {
  StrategyRun ddp = FiveStepDdpRun();
  ddp.predicted_peak_bytes_per_rank = 160 * kMiB;  // `shardtrain plan`'s
  StrategySummary fsdp = Row("fsdp", 3.25, 3 * kMiB / 2, 52410.4, 1.5);
  fsdp.timed_steps = 1;
  const std::string table = FormatSummaryTable({Summarise(ddp), fsdp});

  const std::vector<std::string> lines =
      absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_THAT(lines, SizeIs(4));
  // Eleven columns: no extrapolated time per epoch.
  EXPECT_EQ(lines[0],
            "| mesh | world | batch/replica | steps | train loss | val loss "
            "| tokens/s (95% CI) | step p50 | peak mem/rank (plan) | "
            "grad norm | MFU |");
  EXPECT_EQ(lines[1].substr(0, 9), "|---|---:");
  EXPECT_EQ(lines[2],
            "| ddp | 2 | 4 | 5 | 3.0000 | 3.6000 | 1,000 ± 260 | 500 ms | "
            "150.0 MiB (160.0 MiB) | 4.000 | 30.0% |");
  // No eval, no spread, no prediction: shown as "-" or left out, not zeros.
  EXPECT_THAT(lines[3],
              AllOf(HasSubstr("| fsdp | 2 | - | 50 | 3.2500 | - | 52,410 |"),
                    HasSubstr("| 1.5 MiB |")));
}

// The demo's case: equal losses and throughputs apart by less than their
// spread. Equal is called equal, no winner is named, and the recommendation
// takes the leaner of the two equally fast strategies.
TEST(FindingsTest, EqualLossesAndSpeedsWithinNoiseNameNoWinner) {
  std::vector<StrategySummary> rows = {
      Row("single", 3.2, 200 * kMiB, 700, 1.1, 30),
      Row("ddp", 3.2, 200 * kMiB, 1444, 1.1, 300),
      Row("fsdp", 3.2, 100 * kMiB, 1254, 1.1, 150)};
  rows[2].losses[7] *= 1 + 3e-7;  // float summation order
  const std::vector<std::string> findings = Findings(rows);

  EXPECT_THAT(findings,
              Contains(HasSubstr("Same training: the loss curves of "
                                 "single-device, DDP and FSDP agree at every "
                                 "step (largest relative difference 3.0e-07")));
  EXPECT_THAT(findings, Contains("FSDP peak memory per rank was 0.50× DDP's; "
                                 "its throughput 0.87× ± 0.21 DDP's (within "
                                 "run-to-run noise)."));
  EXPECT_THAT(findings, Contains(HasSubstr(
                            "its throughput 0.48× ± 0.10 DDP's (slower beyond "
                            "run-to-run noise)")));
  EXPECT_THAT(findings, Contains("DDP and FSDP were equally fast within "
                                 "run-to-run noise (95% confidence from the "
                                 "step-to-step spread)."));
  EXPECT_THAT(findings, Not(Contains(HasSubstr("lowest"))));
  EXPECT_THAT(findings, Not(Contains(HasSubstr("was the fastest"))));
  EXPECT_EQ(Recommendation(rows, "gpt2-tiny at 2 ranks"),
            "Recommendation for gpt2-tiny at 2 ranks: FSDP: as fast as DDP "
            "within run-to-run noise, at 0.50× its peak memory per rank.");
}

TEST(FindingsTest, ADifferenceBeyondNoiseIsNamedWithItsUncertainty) {
  const std::vector<StrategySummary> rows = {
      Row("ddp", 3.2, 200 * kMiB, 1000, 1.0, 20),
      Row("fsdp", 3.2, 100 * kMiB, 600, 1.0, 12)};
  const std::vector<std::string> findings = Findings(rows);

  EXPECT_THAT(findings, Contains("FSDP peak memory per rank was 0.50× DDP's; "
                                 "its throughput 0.60× ± 0.02 DDP's (slower "
                                 "beyond run-to-run noise)."));
  EXPECT_THAT(findings, Contains(HasSubstr(
                            "DDP was the fastest beyond run-to-run noise, at "
                            "1,000 ± 20 tokens/s")));
  EXPECT_EQ(Recommendation(rows, "gpt2-mini at 2 ranks"),
            "Recommendation for gpt2-mini at 2 ranks: DDP: the fastest, "
            "1.67× ± 0.05 FSDP's tokens/s; when memory is short, FSDP needs "
            "0.50× its memory per rank at 0.60× its speed.");
}

TEST(FindingsTest, LossCurvesApartBeyondSummationOrderAreFlagged) {
  const std::vector<std::string> findings =
      Findings({Row("ddp", 3.0, kMiB, 1000, 1.0, 10),
                Row("fsdp", 3.3, kMiB, 1000, 1.0, 10)});
  EXPECT_THAT(
      findings,
      Contains(HasSubstr("The loss curves differ by up to 10.0% relative")));
  EXPECT_THAT(findings, Not(Contains(HasSubstr("Same training"))));
}

// Under --memory-budget each strategy runs at its own batch: their losses
// are not compared step for step.
TEST(FindingsTest, RunsAtDifferentBatchesAreNotComparedStepForStep) {
  std::vector<StrategySummary> rows = {Row("ddp", 3.0, kMiB, 1000, 1.0, 10),
                                       Row("fsdp", 2.9, kMiB, 1500, 1.0, 10)};
  rows[1].global_batch = 16;
  EXPECT_THAT(Findings(rows),
              Contains(HasSubstr("Losses are not comparable step for step")));
}

TEST(FindingsTest, TooFewStepsToTellSpeedsApartIsSaid) {
  std::vector<StrategySummary> rows = {Row("ddp", 3.0, 2 * kMiB, 1000, 1.0),
                                       Row("fsdp", 3.0, kMiB, 1500, 1.0)};
  for (StrategySummary& row : rows) row.timed_steps = 1;
  EXPECT_THAT(Findings(rows), Contains(HasSubstr("too few timed steps")));
  EXPECT_THAT(Recommendation(rows, ""),
              HasSubstr("too few steps to compare speed"));
}

TEST(FindingsTest, ComparesWithSingleDeviceWhenThereIsNoDdp) {
  const std::vector<std::string> findings =
      Findings({Row("single", 3.0, 400 * kMiB, 1000, 1.0, 10),
                Row("fsdp", 3.0, 100 * kMiB, 1500, 1.0, 15)});

  EXPECT_THAT(findings,
              Contains("FSDP peak memory per rank was 0.25× single-device's; "
                       "its throughput 1.50× ± 0.02 single-device's (faster "
                       "beyond run-to-run noise)."));
  EXPECT_THAT(findings, Not(Contains(HasSubstr("spiked"))));
}

TEST(FindingsTest, NamesAGradientNormSpike) {
  EXPECT_THAT(Findings({Row("ddp", 3.0, kMiB, 1000, 1.0, 10),
                        Row("fsdp", 3.0, kMiB, 1000, 4.5, 10)}),
              Contains(HasSubstr("FSDP's gradient norm spiked to 4.5× its "
                                 "median")));
}

TEST(FindingsTest, StrategiesWithoutStepsAreLeftOut) {
  StrategySummary empty = Row("ddp", 0, 0, 0, 0);
  empty.steps = 0;

  EXPECT_THAT(Findings({empty}), SizeIs(0));
  EXPECT_THAT(Findings({empty, Row("fsdp", 3.0, kMiB, 100, 1.0)}),
              Not(Contains(HasSubstr("DDP"))));
  EXPECT_EQ(Recommendation({empty}, "x"), "");
}

// ---------------------------------------------------------------------------
// WriteCompareReport
// ---------------------------------------------------------------------------

// DDP and FSDP, 2 ranks x 10 steps each, with evals every 5 steps; FSDP's
// loss 0.02 below DDP's unless `same_loss`.
std::vector<StrategyRun> TenStepRuns(bool same_loss = false) {
  std::vector<StrategyRun> runs;
  for (const char* name : {"ddp", "fsdp"}) {
    StrategyRun run;
    run.strategy = name;
    run.job_id = absl::StrCat("job-", name);
    run.world_size = 2;
    run.batch_size = 4;
    run.seq_len = 64;
    run.train_tokens = 4 * 64 * 2 * 50;
    const bool fsdp = run.strategy == "fsdp";
    for (int step = 1; step <= 10; ++step) {
      for (int rank = 1; rank >= 0; --rank) {
        v1::StepMetrics m =
            Step(rank, step,
                 StepValues()
                     .Loss(5.0 - 0.1 * step - (fsdp && !same_loss ? 0.02 : 0))
                     .GradNorm(1.0 + 0.05 * step)
                     .Seconds(fsdp ? 0.55 : 0.5)
                     .TokensPerSecond((fsdp ? 900.0 : 1000.0) + 10 * step)
                     .PeakBytes((fsdp ? 60 : 100) * kMiB + rank * kMiB));
        if (step % 5 == 0) m.set_val_loss(5.1 - 0.1 * step);
        run.steps.push_back(m);
      }
    }
    runs.push_back(run);
  }
  return runs;
}

std::string ChartJsPath() {
  return AssetsDir() + "/node_modules/chart.js/dist/chart.umd.js";
}

TEST(WriteCompareReportTest, WritesMarkdownCsvPerStrategyAndHtml) {
  TempDir tmp;
  const std::string out = tmp / "report";  // created by the call
  CompareOptions options;
  options.title = "gpt2-tiny on brown, world size 2";
  options.chart_js_path = tmp / "chart.umd.js";
  WriteFile(options.chart_js_path, "/* fake chart.js */");

  const absl::Status status = WriteCompareReport(TenStepRuns(), options, out);

  ASSERT_TRUE(status.ok()) << status;
  const std::string md = ReadFile(out + "/report.md");
  EXPECT_THAT(md, HasSubstr("# gpt2-tiny on brown, world size 2"));
  EXPECT_THAT(md, HasSubstr("Strong scaling: the global batch is fixed"));
  EXPECT_THAT(md, HasSubstr("| mesh | world | batch/replica | steps |"));
  EXPECT_THAT(md, HasSubstr("| ddp | 2 | 4 | 10 |"));
  EXPECT_THAT(md, HasSubstr("- FSDP peak memory per rank was 0.60× DDP's"));
  EXPECT_THAT(md, HasSubstr("`ddp.csv`"));
  EXPECT_THAT(md, HasSubstr("`fsdp.csv`"));
  EXPECT_THAT(md, HasSubstr("`job-ddp`"));
  EXPECT_THAT(md, HasSubstr("`job-fsdp`"));

  for (const char* name : {"ddp", "fsdp"}) {
    const std::string csv = ReadFile(absl::StrCat(out, "/", name, ".csv"));
    const std::vector<std::string> lines =
        absl::StrSplit(csv, '\n', absl::SkipEmpty());
    ASSERT_THAT(lines, SizeIs(1 + 2 * 10)) << name;
    EXPECT_EQ(lines[0],
              "step,total_steps,epoch,rank,loss,grad_norm,lr,step_seconds,"
              "tokens,tokens_per_second,mfu,memory_allocated_bytes,"
              "memory_peak_bytes,memory_reserved_bytes,model_state_bytes,"
              "comm_seconds,comm_bytes,comm_inter_group_bytes,"
              "comm_tensor_parallel_bytes,pipeline_stage,"
              "pipeline_bubble_seconds,p2p_bytes,val_loss");
    // Sorted by step, then rank; val_loss empty where no eval ran.
    EXPECT_THAT(lines[1], HasSubstr("1,100,0,0,"));
    EXPECT_EQ(lines[1].back(), ',');
    EXPECT_THAT(lines[2], HasSubstr("1,100,0,1,"));
    EXPECT_THAT(lines[10], HasSubstr("5,100,0,1,"));
    EXPECT_NE(lines[10].back(), ',');
    EXPECT_THAT(lines[20], HasSubstr("10,100,0,1,"));
  }

  const std::string html = ReadFile(out + "/report.html");
  EXPECT_THAT(html, HasSubstr("/* fake chart.js */"));
  EXPECT_THAT(html, Not(HasSubstr("<script src")));
  for (const char* id : {"chart-loss", "chart-loss-time", "chart-grad-norm",
                         "chart-throughput", "chart-memory"}) {
    EXPECT_THAT(html, HasSubstr(absl::StrCat("<canvas id=\"", id, "\">")));
  }
  // Losses 0.02 apart: drawn apart, no note.
  EXPECT_THAT(html, Not(HasSubstr("The loss curves coincide")));
  EXPECT_THAT(html, HasSubstr("<td>fsdp</td>"));
  EXPECT_THAT(html, HasSubstr("animation: false"));
}

// Every step field the ranks report reaches the CSV, the mesh's included:
// tensor-parallel bytes, the pipeline stage (empty without one), its bubble
// and point-to-point bytes.
TEST(StepMetricsCsvTest, CarriesTheMeshFields) {
  v1::StepMetrics m;
  m.set_step(3);
  m.set_comm_tensor_parallel_bytes(1024);
  m.set_pipeline_stage(1);
  m.set_pipeline_bubble_seconds(0.5);
  m.set_p2p_bytes(4096);
  const std::vector<std::string> lines =
      absl::StrSplit(StepMetricsCsv({m}), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[1], HasSubstr(",1024,1,0.5,4096,"));
  m.clear_pipeline_stage();
  EXPECT_THAT(StepMetricsCsv({m}), HasSubstr(",1024,,0.5,4096,"));
}

TEST(WriteCompareReportTest, EscapesInlinedScriptAndTextFromTheData) {
  TempDir tmp;
  std::vector<StrategyRun> runs = TenStepRuns();
  runs[0].job_id = "</script><b>x</b>";
  CompareOptions options;
  options.title = "a <i>title</i> & more";
  options.chart_js_path = tmp / "chart.umd.js";
  WriteFile(options.chart_js_path, "var closer = \"</SCRIPT>\";");

  ASSERT_TRUE(WriteCompareReport(runs, options, tmp.path()).ok());

  const std::string html = ReadFile(tmp / "report.html");
  EXPECT_THAT(html, HasSubstr("var closer = \"<\\/SCRIPT>\";"));
  EXPECT_THAT(html, Not(HasSubstr("<b>x</b>")));
  EXPECT_THAT(html, HasSubstr("&lt;/script&gt;&lt;b&gt;x&lt;/b&gt;"));
  EXPECT_THAT(html, HasSubstr("a &lt;i&gt;title&lt;/i&gt; &amp; more"));
  // Only the four <script> elements the page itself opens are closed.
  const std::string lower = absl::AsciiStrToLower(html);
  int closers = 0;
  for (size_t at = lower.find("</script"); at != std::string::npos;
       at = lower.find("</script", at + 1)) {
    ++closers;
  }
  EXPECT_EQ(closers, 4);
}

TEST(WriteCompareReportTest, MissingChartJsIsNotFoundNamingThePath) {
  TempDir tmp;
  CompareOptions options;
  options.chart_js_path = tmp / "nowhere/chart.umd.js";

  const absl::Status status =
      WriteCompareReport(TenStepRuns(), options, tmp / "report");

  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(options.chart_js_path));
  EXPECT_THAT(status.message(), HasSubstr("scripts/setup"));
  EXPECT_FALSE(std::filesystem::exists(tmp / "report/report.md"));
}

// auto's entry ("auto: tp2", the mesh it picked) names its CSV file without
// the colon and the space, in the file system and in the report.
TEST(WriteCompareReportTest, FileNamesHaveNoColonsOrSpaces) {
  TempDir tmp;
  std::vector<StrategyRun> runs = TenStepRuns();
  runs[1].strategy = "auto: tp2";
  CompareOptions options;
  options.chart_js_path = tmp / "chart.umd.js";
  WriteFile(options.chart_js_path, "");

  ASSERT_TRUE(WriteCompareReport(runs, options, tmp.path()).ok());

  EXPECT_TRUE(std::filesystem::exists(tmp / "auto-tp2.csv"));
  for (const auto& entry : std::filesystem::directory_iterator(tmp.path())) {
    const std::string name = entry.path().filename().string();
    EXPECT_EQ(name.find_first_of(": "), std::string::npos) << name;
  }
  EXPECT_THAT(ReadFile(tmp / "report.md"), HasSubstr("`auto-tp2.csv`"));
  EXPECT_THAT(ReadFile(tmp / "report.html"), HasSubstr("auto-tp2.csv"));
}

TEST(WriteCompareReportTest, DuplicateStrategyIsInvalidArgument) {
  TempDir tmp;
  std::vector<StrategyRun> runs = TenStepRuns();
  runs[1].strategy = "ddp";
  CompareOptions options;
  options.chart_js_path = tmp / "chart.umd.js";
  WriteFile(options.chart_js_path, "");

  EXPECT_EQ(WriteCompareReport(runs, options, tmp.path()).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// report.html in a real browser
// ---------------------------------------------------------------------------

// The text of <pre id="render-check"> in a dumped DOM, unescaped.
std::string RenderCheckText(const std::string& dom) {
  const std::string open = "<pre id=\"render-check\">";
  const size_t begin = dom.find(open);
  if (begin == std::string::npos) return "";
  const size_t end = dom.find("</pre>", begin);
  if (end == std::string::npos) return "";
  return absl::StrReplaceAll(
      dom.substr(begin + open.size(), end - begin - open.size()),
      {{"&lt;", "<"}, {"&gt;", ">"}, {"&amp;", "&"}});
}

TEST(WriteCompareReportTest, CoincidingLossCurvesAreSaidToCoincide) {
  TempDir tmp;
  CompareOptions options;
  options.chart_js_path = tmp / "chart.umd.js";
  WriteFile(options.chart_js_path, "/* fake chart.js */");
  ASSERT_TRUE(
      WriteCompareReport(TenStepRuns(/*same_loss=*/true), options, tmp.path())
          .ok());
  EXPECT_THAT(ReadFile(tmp / "report.html"),
              HasSubstr("The loss curves coincide"));
  EXPECT_THAT(ReadFile(tmp / "report.md"), HasSubstr("Same training"));
}

TEST(WriteCompareReportTest, HtmlDrawsEveryChartInHeadlessChromium) {
  if (RunCommand("command -v chromium").exit_code != 0) {
    GTEST_SKIP() << "chromium is not installed (scripts/setup installs it)";
  }
  TempDir tmp;
  CompareOptions options;  // the chart.js that scripts/setup installed
  options.title = "render check";
  ASSERT_TRUE(std::filesystem::exists(ChartJsPath()))
      << ChartJsPath() << " is missing; run scripts/setup";
  // The losses coincide: the case where curves could hide each other. Three
  // strategies, as the demo's study: single on one rank beside the two.
  std::vector<StrategyRun> runs = TenStepRuns(/*same_loss=*/true);
  StrategyRun single = runs[0];
  single.strategy = "single";
  single.job_id = "job-single";
  single.world_size = 1;
  single.steps.erase(
      std::remove_if(single.steps.begin(), single.steps.end(),
                     [](const v1::StepMetrics& m) { return m.rank() != 0; }),
      single.steps.end());
  runs.push_back(single);
  ASSERT_TRUE(WriteCompareReport(runs, options, tmp / "out").ok());
  const std::string url = "file://" + (tmp / "out/report.html");
  // Its own profile, so parallel tests do not share a locked one; as root
  // Chromium refuses to start without --no-sandbox.
  const std::string chromium = absl::StrCat(
      "chromium --headless --no-sandbox --disable-gpu --hide-scrollbars "
      "--user-data-dir=",
      tmp / "profile", " --virtual-time-budget=5000");

  // A laptop's page: 900 pixels wide.
  const test::CommandResult dom = RunCommand(
      absl::StrCat(chromium, " --window-size=900,1600 --dump-dom ", url));

  ASSERT_EQ(dom.exit_code, 0) << dom.err;
  const std::string check = RenderCheckText(dom.out);
  ASSERT_FALSE(check.empty()) << "the page script did not finish; chromium "
                                 "said:\n"
                              << dom.err;
  const nlohmann::json result = nlohmann::json::parse(check);
  EXPECT_EQ(result["errors"], nlohmann::json::array()) << check;
  for (const char* id : {"chart-loss", "chart-loss-time", "chart-grad-norm",
                         "chart-throughput", "chart-memory"}) {
    SCOPED_TRACE(id);
    ASSERT_TRUE(result["canvases"].contains(id)) << check;
    EXPECT_GT(result["canvases"][id]["painted_pixels"].get<int64_t>(), 1000);
    EXPECT_GT(result["canvases"][id]["data_points"].get<int64_t>(), 0);
  }
  // Loss: 3 x 10 train + 3 x 2 val; memory: 2 + 2 + 1 ranks.
  EXPECT_EQ(result["canvases"]["chart-loss"]["data_points"], 36);
  EXPECT_EQ(result["canvases"]["chart-loss-time"]["data_points"], 36);
  EXPECT_EQ(result["canvases"]["chart-memory"]["data_points"], 5);
  // Coinciding curves stay distinguishable: DDP solid and widest, FSDP
  // dashed and thinner, single dotted and thinnest.
  const nlohmann::json& styles = result["canvases"]["chart-loss"]["styles"];
  ASSERT_GE(styles.size(), 5u) << check;
  EXPECT_EQ(styles[0]["label"], "DDP");
  EXPECT_EQ(styles[0]["dash"], "");
  EXPECT_EQ(styles[2]["label"], "FSDP");
  EXPECT_EQ(styles[2]["dash"], "10,6");
  EXPECT_LT(styles[2]["width"].get<double>(), styles[0]["width"].get<double>());
  // Validation losses are markers, a shape per strategy, never a line that
  // could pass for (or hide under) a training curve.
  std::set<std::string> shapes;
  for (const nlohmann::json& style : styles) {
    const std::string label = style["label"];
    if (label.size() < 6 || label.substr(label.size() - 6) != " (val)") {
      EXPECT_EQ(style["point"], "line") << label;
      continue;
    }
    EXPECT_FALSE(style["line"].get<bool>()) << label;
    EXPECT_NE(style["point"], "line") << label;
    shapes.insert(style["point"].get<std::string>());
  }
  EXPECT_EQ(shapes.size(), 3u) << check;
  // And every one of them can be seen: each strategy's colour is on the
  // plot of every line chart (where one curve hid the others, only its
  // colour was).
  for (const char* id : {"chart-loss", "chart-loss-time", "chart-grad-norm",
                         "chart-throughput"}) {
    const nlohmann::json& seen = result["canvases"][id]["colour_pixels"];
    ASSERT_EQ(seen.size(), 3u) << id << ": " << check;
    for (const auto& [label, pixels] : seen.items()) {
      EXPECT_GT(pixels.get<int64_t>(), 100) << id << ": " << label << " hidden";
    }
  }
  // Throughput: 9 steps after warm-up, each faint and as a running mean.
  EXPECT_EQ(result["canvases"]["chart-throughput"]["data_points"], 3 * 2 * 9);
  // The table fits the page.
  EXPECT_LE(result["table_width"].get<int64_t>(),
            result["page_width"].get<int64_t>())
      << check;

  // Kept for people to look at: build/test-artefacts/compare_report.png.
  const std::string artefacts =
      std::string(SHARDTRAIN_BINARY_DIR) + "/test-artefacts";
  std::filesystem::create_directories(artefacts);
  const std::string png = artefacts + "/compare_report.png";
  std::filesystem::remove(png);
  const test::CommandResult shot = RunCommand(absl::StrCat(
      chromium, " --window-size=1280,2400 --screenshot=", png, " ", url));
  ASSERT_EQ(shot.exit_code, 0) << shot.err;
  ASSERT_TRUE(std::filesystem::exists(png)) << shot.err;
  EXPECT_GT(std::filesystem::file_size(png), 10000u);
}

// ---------------------------------------------------------------------------
// Noise and interference
// ---------------------------------------------------------------------------

HostLoad Load(double other_mean, double other_peak) {
  HostLoad load;
  load.measured = true;
  load.cores = 2;
  load.seconds = 60;
  load.other_cores_mean = other_mean;
  load.other_cores_peak = other_peak;
  load.job_cores_mean = 2 - other_mean;
  return load;
}

TEST(DisturbsTest, OtherUseFromATenthOfTheCoresDisturbs) {
  EXPECT_FALSE(Disturbs(Load(0.05, 0.3)));
  EXPECT_FALSE(Disturbs(Load(0.19, 1.0)));
  EXPECT_TRUE(Disturbs(Load(0.2, 0.4)));
  HostLoad unmeasured = Load(1.5, 2.0);
  unmeasured.measured = false;
  EXPECT_FALSE(Disturbs(unmeasured));
  HostLoad big = Load(1.0, 1.0);
  big.cores = 64;  // a tenth of 64 cores is 6.4
  EXPECT_FALSE(Disturbs(big));
  big.other_cores_mean = 6.4;
  EXPECT_TRUE(Disturbs(big));
}

TEST(ThroughputDriftsTest, AStepDownMidRunDriftsSteadyNoiseDoesNot) {
  double first = 0, second = 0;
  // Steady at 1,500 ± 5%.
  EXPECT_FALSE(ThroughputDrifts(
      {1500, 1430, 1560, 1480, 1520, 1440, 1570, 1500, 1460, 1530}, &first,
      &second));
  // 10% slower in the second half, clearly beyond the spread, but within
  // what a long run's warm caches and evaluation pauses move.
  EXPECT_FALSE(ThroughputDrifts(
      {1500, 1500, 1501, 1499, 1350, 1350, 1351, 1349}, &first, &second));
  // A CPU hog started mid-run: 1,500 -> 500.
  EXPECT_TRUE(
      ThroughputDrifts({1500, 1480, 1520, 1490, 1510, 520, 480, 510, 500, 490},
                       &first, &second));
  EXPECT_NEAR(first, 1500, 1);
  EXPECT_NEAR(second, 500, 1);
  // Noisy halves far apart in mean but within their spread: no claim.
  EXPECT_FALSE(
      ThroughputDrifts({500, 2500, 500, 2500, 500, 2500}, &first, &second));
  // Too few steps for two halves with a spread each.
  EXPECT_FALSE(ThroughputDrifts({1500, 1500, 500, 500}, &first, &second));
}

// DDP clearly faster than FSDP, as TenStepRuns has them.
TEST(FindingsTest, AHostLoadDuringARunWithholdsTheSpeedVerdict) {
  std::vector<StrategyRun> runs = TenStepRuns(/*same_loss=*/true);
  runs[0].host_load = Load(0.04, 0.2);
  runs[1].host_load = Load(0.9, 1.0);  // a hog took a core from FSDP
  std::vector<StrategySummary> rows;
  for (const StrategyRun& run : runs) rows.push_back(Summarise(run));
  ASSERT_THAT(rows[1].disturbances,
              ElementsAre("other processes used 0.9 cores of the host's 2 on "
                          "average during its run (up to 1.0 core)"));
  EXPECT_THAT(rows[0].disturbances, SizeIs(0));

  const std::vector<std::string> findings = Findings(rows);
  EXPECT_THAT(
      findings,
      Contains(HasSubstr("DDP's (the runs were disturbed: not compared)")));
  EXPECT_THAT(findings,
              Contains("Speed findings are disturbed, so no strategy is "
                       "named fastest (FSDP: other processes used 0.9 cores "
                       "of the host's 2 on average during its run (up to 1.0 "
                       "core)). Rerun on an idle host, or with --repeat 3 to "
                       "interleave the strategies' runs."));
  EXPECT_THAT(findings, Not(Contains(HasSubstr("beyond run-to-run noise"))));
  EXPECT_THAT(findings, Not(Contains(HasSubstr("was the fastest"))));
  EXPECT_EQ(Recommendation(rows, "gpt2-tiny at 2 ranks"),
            "Recommendation for gpt2-tiny at 2 ranks: speed not compared, the "
            "runs were disturbed (see the findings); on memory, FSDP needs "
            "the least per rank (61.0 MiB).");

  // The same runs undisturbed name DDP the fastest.
  runs[1].host_load = Load(0.04, 0.2);
  rows.clear();
  for (const StrategyRun& run : runs) rows.push_back(Summarise(run));
  EXPECT_THAT(Findings(rows),
              Contains(HasSubstr("DDP was the fastest beyond run-to-run")));
}

TEST(FindingsTest, AThroughputDriftWithinARunWithholdsTheSpeedVerdict) {
  std::vector<StrategyRun> runs = TenStepRuns(/*same_loss=*/true);
  // No host load measured (a remote coordinator); DDP's steps 6-10 ran at a
  // third of the speed of steps 2-5.
  for (v1::StepMetrics& m : runs[0].steps) {
    if (m.rank() == 0 && m.step() >= 6) {
      m.set_tokens_per_second(m.tokens_per_second() / 3);
    }
  }
  // Halves of the 9 timed steps (4 each): steps 2-5 at 1,020..1,050 (mean
  // 1,035), steps 7-10 at 1,070..1,100 / 3 (mean 361.7).
  std::vector<StrategySummary> rows;
  for (const StrategyRun& run : runs) rows.push_back(Summarise(run));
  ASSERT_THAT(rows[0].disturbances, SizeIs(1));
  EXPECT_THAT(rows[0].disturbances[0],
              HasSubstr("its throughput drifted from 1,035 to 362 tokens/s "
                        "between the first and second half of its run"));
  EXPECT_THAT(Findings(rows),
              Contains(HasSubstr("Speed findings are disturbed")));
  EXPECT_THAT(Recommendation(rows, ""),
              HasSubstr("speed not compared, the runs were disturbed"));
}

TEST(SummariseTest, RepeatsGiveARunToRunIntervalOverTheRunsMeans) {
  std::vector<StrategyRun> runs = TenStepRuns(/*same_loss=*/true);
  // Two more runs of each: DDP's at 900 and 1,200 tokens/s, every step alike
  // (so each run's own spread is 0); run 3 of FSDP peaks higher.
  for (StrategyRun& run : runs) {
    for (double tps : {900.0, 1200.0}) {
      RepeatRun repeat;
      repeat.job_id = absl::StrCat(run.job_id, "-", tps);
      for (int step = 1; step <= 10; ++step) {
        repeat.steps.push_back(
            Step(0, step,
                 StepValues().TokensPerSecond(tps).PeakBytes(
                     (tps > 1000 && run.strategy == "fsdp" ? 70 : 10) * kMiB)));
      }
      repeat.host_load = Load(0.01, 0.1);
      run.repeats.push_back(repeat);
    }
  }
  const StrategySummary ddp = Summarise(runs[0]);
  EXPECT_EQ(ddp.runs, 3);
  // Run 1: 1,020..1,100 after its first step, mean 1,060.
  const double mean = (1060.0 + 900 + 1200) / 3;
  EXPECT_NEAR(ddp.tokens_per_second_mean, mean, 1e-9);
  const double sd =
      std::sqrt((std::pow(1060 - mean, 2) + std::pow(900 - mean, 2) +
                 std::pow(1200 - mean, 2)) /
                2);
  EXPECT_NEAR(ddp.tokens_per_second_ci95, 4.303 * sd / std::sqrt(3.0), 1e-6);
  EXPECT_EQ(ddp.timed_steps, 9);
  EXPECT_EQ(Summarise(runs[1]).peak_memory_bytes_per_rank, 70 * kMiB);
  EXPECT_THAT(ddp.disturbances, SizeIs(0));

  std::vector<StrategySummary> rows = {ddp, Summarise(runs[1])};
  EXPECT_THAT(Findings(rows),
              Contains(HasSubstr("(95% confidence from the spread of 3 "
                                 "interleaved runs)")));

  TempDir tmp;
  CompareOptions options;
  options.chart_js_path = tmp / "chart.umd.js";
  WriteFile(options.chart_js_path, "/* fake chart.js */");
  ASSERT_TRUE(WriteCompareReport(runs, options, tmp / "report").ok());
  const std::string md = ReadFile(tmp / "report/report.md");
  EXPECT_THAT(md, HasSubstr("Each strategy ran 3 times, the strategies' runs "
                            "interleaved"));
  EXPECT_THAT(md, HasSubstr("Other processes on the host used at most 0.0 "
                            "cores of its 2 on average during any run."));
  EXPECT_THAT(md, HasSubstr("`ddp.run3.csv`: run 3, job `job-ddp-1200`"));
  const std::vector<std::string> lines = absl::StrSplit(
      ReadFile(tmp / "report/fsdp.run2.csv"), '\n', absl::SkipEmpty());
  EXPECT_THAT(lines, SizeIs(1 + 10));
}

TEST(WriteCompareReportTest, SaysWhenTheHostLoadWasNotMeasured) {
  TempDir tmp;
  CompareOptions options;
  options.chart_js_path = tmp / "chart.umd.js";
  WriteFile(options.chart_js_path, "/* fake chart.js */");
  ASSERT_TRUE(WriteCompareReport(TenStepRuns(), options, tmp / "r").ok());
  for (const char* file : {"report.md", "report.html"}) {
    const std::string text = ReadFile(tmp / "r" + std::string("/") + file);
    EXPECT_THAT(text, HasSubstr("Each strategy ran once, one after another"))
        << file;
    EXPECT_THAT(text, HasSubstr("Host load was not measured")) << file;
  }
}

}  // namespace
}  // namespace shardtrain::cli
