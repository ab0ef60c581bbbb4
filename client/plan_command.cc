#include "client/plan_command.h"

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/exit_code.h"
#include "client/output_format.h"
#include "nlohmann/json.hpp"
#include "worker/engine/train/memory_plan.h"
#include "worker/engine/train/step_metrics.h"
#include "worker/engine/train/strategy_kinds.h"
#include "worker/engine/train/train_config.h"

namespace shardtrain::cli {
namespace {

struct PlanOptions {
  TrainConfig config;    // model, batch, seq_len, device, precision, FSDP knobs
  std::string strategy;  // empty: every strategy
  int64_t world_size = 2;
  std::string scaling = "strong";
  std::string format = "table";
};

int RunPlan(const PlanOptions& options) {
  TrainConfig base = options.config;
  base.data = "-";  // not needed to plan
  base.strategy = options.strategy.empty() ? "ddp" : options.strategy;
  if (absl::Status s = base.Validate(); !s.ok()) return ReportFailure(s);
  if (options.world_size < 1) {
    return ReportFailure(
        absl::StrCat("world-size: got ", options.world_size, "; must be >= 1"));
  }
  if (!options.strategy.empty() &&
      !FindStrategyKind(options.strategy)->distributed &&
      options.world_size != 1) {
    return ReportFailure(absl::StrCat(
        "strategy ", options.strategy,
        " runs at world size 1 (omit --strategy to compare all strategies)"));
  }
  std::vector<std::string> strategies =
      options.strategy.empty() ? StrategyNames()
                               : std::vector<std::string>{options.strategy};

  std::vector<MemoryPlan> plans;
  std::vector<int64_t> batches;
  for (const std::string& strategy : strategies) {
    TrainConfig config = base;
    config.strategy = strategy;
    int64_t world = options.world_size;
    if (!FindStrategyKind(strategy)->distributed && world > 1) {
      // As `shardtrain compare`: strong scaling gives single-device the
      // global batch, weak scaling the per-device one.
      if (options.scaling == "strong") config.batch_size *= world;
      world = 1;
    }
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, world);
    if (!plan.ok()) return ReportFailure(plan.status());
    plans.push_back(*plan);
    batches.push_back(config.batch_size);
  }

  if (options.format == "json" || options.format == "yaml") {
    nlohmann::json out = {{"model", base.model},
                          {"seq_len", base.seq_len},
                          {"precision", base.precision},
                          {"device", base.device},
                          {"plans", nlohmann::json::array()}};
    for (size_t i = 0; i < plans.size(); ++i) {
      nlohmann::json parts = nlohmann::json::object();
      for (const auto& [name, bytes] : plans[i].Parts()) parts[name] = bytes;
      out["plans"].push_back({{"strategy", plans[i].strategy},
                              {"world_size", plans[i].world_size},
                              {"batch_size", batches[i]},
                              {"bytes_per_rank", parts},
                              {"total_bytes_per_rank", plans[i].total()}});
    }
    std::cout << (options.format == "json" ? out.dump(2) + "\n"
                                           : JsonToYaml(out.dump()));
    return kExitOk;
  }

  std::vector<std::string> header = {"per rank"};
  for (size_t i = 0; i < plans.size(); ++i) {
    header.push_back(absl::StrFormat("%s (world %d, batch %d)",
                                     plans[i].strategy, plans[i].world_size,
                                     batches[i]));
  }
  std::vector<std::vector<std::string>> rows;
  for (size_t part = 0; part < plans[0].Parts().size(); ++part) {
    std::vector<std::string> row = {plans[0].Parts()[part].first};
    for (const MemoryPlan& plan : plans) {
      row.push_back(FormatBytes(plan.Parts()[part].second));
    }
    rows.push_back(row);
  }
  std::vector<std::string> total = {"total"};
  for (const MemoryPlan& plan : plans)
    total.push_back(FormatBytes(plan.total()));
  rows.push_back(total);
  const MemoryPlan* ddp = nullptr;
  for (const MemoryPlan& plan : plans) {
    if (plan.strategy == "ddp") ddp = &plan;
  }
  if (ddp != nullptr && plans.size() > 1) {
    std::vector<std::string> ratio = {"vs ddp"};
    for (const MemoryPlan& plan : plans) {
      ratio.push_back(absl::StrFormat(
          "%.2fx", static_cast<double>(plan.total()) / ddp->total()));
    }
    rows.push_back(ratio);
  }
  std::cout << absl::StrFormat(
                   "predicted peak tensor memory per rank: %s, seq %d, %s on "
                   "%s\n",
                   base.model, base.seq_len, base.precision, base.device)
            << FormatTable(header, rows);
  return kExitOk;
}

}  // namespace

void AddPlanCommand(CLI::App* app, int* exit_code) {
  auto options = std::make_shared<PlanOptions>();
  CLI::App* plan = app->add_subcommand(
      "plan",
      "Predict each rank's peak tensor memory by part (parameters, gradients, "
      "optimizer state, gathered units, activations, logits, communication) "
      "for single, DDP and FSDP, before launching (local, no daemon needed)");
  TrainConfig& c = options->config;
  plan->add_option("--model", c.model, "preset or custom:...")
      ->capture_default_str();
  plan->add_option("--strategy", options->strategy,
                   "single | ddp | fsdp (default: all three)")
      ->check(CLI::IsMember(StrategyNames()));
  plan->add_option("--world-size", options->world_size, "ranks")
      ->capture_default_str();
  plan->add_option("--batch-size", c.batch_size,
                   "sequences per rank per micro-step")
      ->capture_default_str();
  plan->add_option("--seq-len", c.seq_len, "tokens per sequence")
      ->capture_default_str();
  plan->add_option("--grad-accum", c.grad_accum, "micro-steps per step")
      ->capture_default_str();
  plan->add_option("--device", c.device, "cpu | cuda")->capture_default_str();
  plan->add_option("--precision", c.precision, "fp32 | bf16 (CUDA)")
      ->capture_default_str();
  plan->add_option("--reshard-after-forward", c.reshard_after_forward,
                   "FSDP: free gathered parameters after forward")
      ->capture_default_str();
  plan->add_option("--fsdp-no-sync", c.fsdp_no_sync,
                   "FSDP: keep full gradients over accumulation micro-steps")
      ->capture_default_str();
  plan->add_option("--scaling", options->scaling,
                   "strong: single-device gets world x batch (as compare); "
                   "weak: the per-rank batch")
      ->check(CLI::IsMember({"strong", "weak"}))
      ->capture_default_str();
  AddOutputFlag(plan, &options->format);
  plan->callback([options, exit_code] { *exit_code = RunPlan(*options); });
}

}  // namespace shardtrain::cli
