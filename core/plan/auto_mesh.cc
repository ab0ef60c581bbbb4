#include "core/plan/auto_mesh.h"

#include <algorithm>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/subprocess.h"
#include "core/plan/step_time_plan.h"
#include "core/run/step_metrics.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

std::string RatesDevice(const TrainConfig& config) {
  return config.device.rfind("cuda", 0) == 0 ? "cuda" : "cpu";
}

}  // namespace

absl::StatusOr<HostRates> LoadOrMeasureHostRates(const TrainConfig& config,
                                                 const std::string& calibrator,
                                                 std::ostream& log) {
  absl::StatusOr<HostRates> rates =
      LoadHostRates(RatesDevice(config), config.model);
  if (rates.ok() || !absl::IsNotFound(rates.status()) || calibrator.empty()) {
    return rates;
  }
  std::vector<std::string> argv = CalibrationArguments(config);
  log << "auto: measuring this host once (shardtrain-train "
      << absl::StrJoin(argv, " ") << ")" << std::endl;
  argv.insert(argv.begin(), calibrator);
  absl::StatusOr<CommandResult> run = RunCommand(argv, {}, 600);
  if (!run.ok()) return run.status();
  if (!run->ok()) {
    return absl::InternalError(absl::StrCat(
        "--calibrate failed (", DescribeExit(run->exit_code, run->signal),
        "): ", run->err));
  }
  log << run->out;
  return LoadHostRates(RatesDevice(config), config.model);
}

namespace {

std::string Describe(const MeshCandidate& c) {
  return absl::StrFormat(
      "%s, batch %d x accum %d per %s: %s per step, %s tokens/s predicted "
      "(compute %s, collectives %s, bubble %s, AdamW and gradients %s), peak "
      "%s per rank",
      c.name, c.config.batch_size, c.config.grad_accum,
      c.config.ModelParallelSize() > 1 ? "replica" : "rank",
      FormatDuration(c.time.step_seconds),
      FormatThousands(static_cast<int64_t>(c.time.tokens_per_second)),
      FormatDuration(c.time.compute_seconds),
      FormatDuration(c.time.exposed_comm_seconds),
      FormatDuration(c.time.bubble_seconds),
      FormatDuration(c.time.optimizer_seconds), FormatBytes(c.memory.total()));
}

}  // namespace

absl::Status ResolveAutoStrategy(TrainConfig* config, int64_t world_size,
                                 int64_t ranks_per_host,
                                 const std::string& calibrator,
                                 std::ostream& log, AutoChoice* choice) {
  absl::StatusOr<HostRates> rates =
      LoadOrMeasureHostRates(*config, calibrator, log);
  if (!rates.ok()) {
    return absl::Status(
        rates.status().code(),
        absl::StrCat("strategy auto: ", rates.status().message()));
  }
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      RankMeshesForAuto(*config, world_size, ranks_per_host, *rates);
  if (!ranked.ok()) return ranked.status();
  choice->ranked = *std::move(ranked);
  choice->why = WhyFirstWins(choice->ranked);
  const MeshCandidate& chosen = choice->ranked.front();
  const std::string out = config->out;
  *config = chosen.config;
  config->out = out;
  log << absl::StrFormat(
      "auto: %d meshes of %d ranks weighed for %s, %d sequences per step, "
      "rates of %s measured %s\nauto: chose %s\n",
      choice->ranked.size(), world_size, config->model,
      config->batch_size * config->grad_accum *
          config->DataParallelSize(world_size),
      rates->device, rates->measured_at, Describe(chosen));
  int shown = 0;
  for (size_t i = 1; i < choice->ranked.size() && shown < 3; ++i) {
    if (!choice->ranked[i].fits) break;
    log << "auto: then " << Describe(choice->ranked[i]) << "\n";
    ++shown;
  }
  if (!choice->why.empty()) log << "auto: why: " << choice->why << "\n";
  log.flush();
  return absl::OkStatus();
}

void ReportAutoOutcome(const AutoChoice& choice, const TrainConfig& config,
                       std::ostream& log) {
  if (config.out.empty() || choice.ranked.empty()) return;
  const MeshCandidate& chosen = choice.ranked.front();
  std::ifstream in(config.out + "/metrics.jsonl");
  std::vector<double> rates;
  std::vector<double> steps;
  for (std::string line; std::getline(in, line);) {
    absl::StatusOr<StepMetrics> m = StepMetrics::FromJson(line);
    if (!m.ok() || m->rank != 0 || m->step <= 1) continue;
    rates.push_back(m->tokens_per_second);
    steps.push_back(m->step_seconds);
  }
  nlohmann::json out = {
      {"mesh", chosen.name},
      {"config", nlohmann::json::object()},
      {"predicted",
       {{"step_seconds", chosen.time.step_seconds},
        {"tokens_per_second", chosen.time.tokens_per_second},
        {"compute_seconds", chosen.time.compute_seconds},
        {"collective_seconds", chosen.time.exposed_comm_seconds},
        {"bubble_seconds", chosen.time.bubble_seconds},
        {"optimizer_seconds", chosen.time.optimizer_seconds},
        {"peak_bytes_per_rank", chosen.memory.total()}}},
      {"why", choice.why},
      {"candidates", nlohmann::json::array()}};
  const TrainConfig& c = chosen.config;
  out["config"] = {{"strategy", c.strategy},
                   {"pipeline_stages", c.pipeline_stages},
                   {"tensor_parallel", c.tensor_parallel},
                   {"micro_batches", c.micro_batches},
                   {"activation_checkpointing", c.activation_checkpointing},
                   {"batch_size", c.batch_size},
                   {"grad_accum", c.grad_accum}};
  for (const MeshCandidate& m : choice.ranked) {
    out["candidates"].push_back(
        {{"mesh", m.name},
         {"fits", m.fits},
         {"predicted_tokens_per_second", m.time.tokens_per_second},
         {"peak_bytes_per_rank", m.memory.total()}});
  }
  if (!rates.empty()) {
    std::sort(rates.begin(), rates.end());
    std::sort(steps.begin(), steps.end());
    const double measured = rates[rates.size() / 2];
    const double step = steps[steps.size() / 2];
    out["measured"] = {{"step_seconds", step},
                       {"tokens_per_second", measured},
                       {"steps", rates.size()}};
    log << absl::StrFormat(
        "auto: %s predicted %s tokens/s, measured %s (median of %d steps, "
        "%s per step): %s\n",
        chosen.name,
        FormatThousands(static_cast<int64_t>(chosen.time.tokens_per_second)),
        FormatThousands(static_cast<int64_t>(measured)), rates.size(),
        FormatDuration(step),
        MeasuredAgainstPrediction(chosen.time.tokens_per_second, measured));
  }
  (void)WriteFileAtomically(config.out + "/auto_mesh.json", out.dump(2) + "\n");
}

}  // namespace shardtrain
