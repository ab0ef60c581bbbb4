// The strategy comparison study's report: the same job run under several
// strategies, summarised side by side from the step metrics the coordinator
// stored. Writes report.md (the table and findings), one CSV of every step
// per strategy, and report.html (self-contained: chart code inlined from the
// chart.js npm package, nothing fetched when opened). Torch-free, no gRPC.
#ifndef SHARDTRAIN_CLIENT_COMPARE_REPORT_H_
#define SHARDTRAIN_CLIENT_COMPARE_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/host_load.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain::cli {

// One more run of a strategy's job (--repeat), as stored by the coordinator.
struct RepeatRun {
  std::string job_id;
  std::vector<v1::StepMetrics> steps;
  double wall_seconds = 0;
  HostLoad host_load;
};

// One strategy's job, as stored by the coordinator: its first run, and the
// runs repeated after it (interleaved with the other strategies' runs).
struct StrategyRun {
  // The entry's mesh: "single", "ddp", "pp2xfsdp2", "auto: tp4".
  std::string strategy;
  std::string job_id;
  int world_size = 1;
  // Data-parallel replicas, which share the global batch (a replica's
  // pipeline stages and tensor-parallel ranks see the same sequences); 0:
  // world_size, every rank a replica.
  int64_t replicas = 0;
  int64_t batch_size = 0;  // per replica per micro-step
  int64_t grad_accum = 1;
  int64_t seq_len = 0;
  std::vector<v1::StepMetrics> steps;  // every rank's steps, any order
  double wall_seconds = 0;             // job start to end
  int64_t train_tokens = 0;            // tokens in train.bin (one epoch)
  // `shardtrain plan`'s prediction of the peak per rank; 0 when unknown.
  int64_t predicted_peak_bytes_per_rank = 0;
  HostLoad host_load;  // other processes on the host while it ran
  std::vector<RepeatRun> repeats;
};

// One row of the table; all figures computed from StrategyRun::steps.
struct StrategySummary {
  std::string strategy;
  int world_size = 1;
  int64_t batch_size = 0;            // per rank per micro-step; 0: unknown
  int64_t global_batch = 0;          // sequences per optimizer step; 0: unknown
  int64_t steps = 0;                 // optimizer steps (rank 0)
  double final_train_loss = 0;       // rank 0's last step
  double final_val_loss = -1;        // last eval, < 0 when none
  std::map<int64_t, double> losses;  // rank 0's train loss by step
  // Rank 0, steps after the first; with repeats, the mean of the runs'
  // means.
  double tokens_per_second_mean = 0;
  double tokens_per_second_std = 0;
  // Half-width of the 95% confidence interval of the mean (Student's t):
  // over the runs' means when there are several runs, else over the timed
  // steps' spread; 0 with fewer than two of either.
  double tokens_per_second_ci95 = 0;
  int64_t timed_steps = 0;  // steps behind the throughput figures (run 1)
  int runs = 1;             // the first and its repeats
  // What makes this strategy's speed unsafe to compare, one clause each
  // (another process's CPU use on the host, step time drifting within a
  // run); empty when nothing was seen.
  std::vector<std::string> disturbances;
  double step_seconds_p50 = 0;
  double step_seconds_p95 = 0;
  int64_t peak_memory_bytes_per_rank = 0;     // max over ranks and steps
  int64_t predicted_peak_bytes_per_rank = 0;  // 0: not predicted
  double grad_norm_mean = 0;
  double grad_norm_std = 0;
  double grad_norm_spike_ratio = 0;  // max / median
  double mfu_mean = 0;
};

struct CompareOptions {
  std::string scaling = "strong";  // strong | weak (shown in the report)
  std::string title;               // e.g. "gpt2-tiny on brown, world size 2"
  std::string subject;  // for the recommendation: "gpt2-tiny at 2 ranks"
  // The conditions every run shared (threads per rank ...), one sentence
  // under the scaling's in the report's header; "" for none.
  std::string conditions;
  // Where chart.js's dist/chart.umd.js is read from; empty: the assets dir
  // that scripts/setup fills (AssetsDir()/node_modules/chart.js/...).
  std::string chart_js_path;
};

StrategySummary Summarise(const StrategyRun& run);

// The summary table as GitHub markdown (also what `compare` prints).
std::string FormatSummaryTable(const std::vector<StrategySummary>& rows);

// Whether the tokens/s of `values` (one run's timed steps, in order) drift:
// the means of the first and second half differ by more than their 95%
// intervals allow and by more than 20%. Fills the halves' means when so.
bool ThroughputDrifts(const std::vector<double>& values, double* first_half,
                      double* second_half);

// Findings computed from the rows, one sentence per line: whether the
// strategies trained the same (loss curves step by step), each one's memory
// and throughput against DDP's (or single-device's) with the throughput's
// uncertainty, and whether a difference is beyond run-to-run noise.
std::vector<std::string> Findings(const std::vector<StrategySummary>& rows);

// One line a user can act on: the strategy to use for `subject` (e.g.
// "gpt2-tiny at 2 ranks") and why, from the same figures. "" without rows.
std::string Recommendation(const std::vector<StrategySummary>& rows,
                           const std::string& subject);

// Writes out_dir/report.md, out_dir/<strategy>.csv and out_dir/report.html
// (out_dir is created). NotFound names chart.umd.js when it is missing.
absl::Status WriteCompareReport(const std::vector<StrategyRun>& runs,
                                const CompareOptions& options,
                                const std::string& out_dir);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_COMPARE_REPORT_H_
