#include "client/plan_command.h"

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/exit_code.h"
#include "client/output_format.h"
#include "core/model/gpt2_config.h"
#include "core/train/memory_plan.h"
#include "core/train/step_metrics.h"
#include "core/train/strategy_kinds.h"
#include "core/train/train_config.h"
#include "nlohmann/json.hpp"

namespace shardtrain::cli {
namespace {

struct PlanOptions {
  TrainConfig config;    // model, batch, seq_len, device, precision, FSDP knobs
  std::string strategy;  // empty: every strategy
  int64_t world_size = 2;
  std::string scaling = "strong";
  std::string format = "table";
  // --fit: the largest batch per device that fits.
  bool fit = false;
  int64_t devices = 0;  // 0: --world-size
  std::string memory_per_device;
};

// One row of --fit: a strategy or a pipeline mesh, with or without
// activation checkpointing.
struct FitRow {
  std::string strategy;  // with stages, the data-parallel part
  std::string mesh;      // a study entry ("pp2xddp2"); empty without stages
  int64_t stages = 1;
  int64_t micro_batches = 1;
  std::string checkpointing;  // "none" | "all"
  int64_t world = 1;          // devices the strategy uses
  int64_t replicas = 1;       // of the model: world / stages
  int64_t shard_group_size = 0;
  int64_t batch = 0;  // largest per replica and micro-step; 0: nothing fits
  int64_t peak = 0;   // at `batch`, or at its smallest when nothing fits
  std::string name() const { return mesh.empty() ? strategy : mesh; }
};

// The pipeline meshes --fit weighs on `devices`: S stages (the stages asked
// for, else 2, 4, 8, ... up to the model's blocks) x D = devices / S
// ranks per stage, single for one and the distributed strategies a study
// at D ranks includes for more (only `strategy`'s, when given), each step's
// batch cut into --micro-batches (when more than 1) or S micro-batches.
std::vector<FitRow> PipelineFitRows(const TrainConfig& base, int64_t devices,
                                    const std::string& strategy) {
  std::vector<FitRow> rows;
  absl::StatusOr<Gpt2Config> model = ParseModelSpec(base.model);
  if (!model.ok()) return rows;
  for (int64_t stages = 2; stages <= std::min(devices, model->n_layer);
       stages *= 2) {
    if (base.pipeline_stages > 1 && stages != base.pipeline_stages) continue;
    if (devices % stages != 0) continue;
    const int64_t replicas = devices / stages;
    for (const std::string& name : StudyStrategyNames(replicas)) {
      if (FindStrategyKind(name)->distributed != (replicas > 1)) continue;
      if (!strategy.empty() && strategy != name) continue;
      FitRow row;
      row.stages = stages;
      row.world = devices;
      row.replicas = replicas;
      row.strategy = name;
      row.mesh = replicas == 1
                     ? absl::StrCat("pp", stages)
                     : absl::StrCat("pp", stages, "x", name, replicas);
      row.micro_batches = base.micro_batches > 1 ? base.micro_batches : stages;
      rows.push_back(row);
    }
  }
  return rows;
}

// The fewest devices (doubling from `devices`, at most 4096) on which FSDP
// with activation checkpointing fits one sequence per device; 0 if none.
int64_t DevicesThatFit(TrainConfig config, int64_t devices, int64_t budget) {
  config.strategy = "fsdp";
  config.activation_checkpointing = "all";
  config.batch_size = 1;
  for (int64_t n = std::max<int64_t>(2, devices * 2); n <= 4096; n *= 2) {
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, n);
    if (plan.ok() && plan->total() <= PlannableBytes(budget)) return n;
  }
  return 0;
}

// The longest sequence (halving from seq_len, down to 64) at which FSDP with
// activation checkpointing fits one sequence per device; 0 if none.
int64_t SeqLenThatFits(TrainConfig config, int64_t devices, int64_t budget) {
  config.strategy = "fsdp";
  config.activation_checkpointing = "all";
  config.batch_size = 1;
  for (int64_t seq = config.seq_len / 2; seq >= 64; seq /= 2) {
    config.seq_len = seq;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, devices);
    if (plan.ok() && plan->total() <= PlannableBytes(budget)) return seq;
  }
  return 0;
}

// A plan's parts, total and peak, for JSON and YAML.
nlohmann::json PlanJson(const MemoryPlan& plan) {
  nlohmann::json parts = nlohmann::json::object();
  for (const auto& [name, bytes] : plan.Parts()) parts[name] = bytes;
  nlohmann::json out = {{"strategy", plan.strategy},
                        {"world_size", plan.world_size},
                        {"bytes_per_rank", parts},
                        {"total_bytes_per_rank", plan.total()},
                        {"peak_moment", plan.PeakMomentName()}};
  if (plan.shard_group_size > 0) {
    out["shard_group_size"] = plan.shard_group_size;
  }
  if (plan.tensor_parallel > 1) out["tensor_parallel"] = plan.tensor_parallel;
  if (plan.pipeline_stages > 1) {
    out["pipeline_stages"] = plan.pipeline_stages;
    out["stage"] = plan.stage;
    out["stage_layers"] = plan.stage_layers;
    out["micro_batches_in_flight"] = plan.micro_batches_in_flight;
  }
  return out;
}

int RunFit(const PlanOptions& options, const TrainConfig& base) {
  const int64_t devices =
      options.devices > 0 ? options.devices : options.world_size;
  if (options.memory_per_device.empty()) {
    ReportFailure("--fit needs --memory-per-device SIZE (e.g. 80GiB)");
    return kExitUsage;
  }
  absl::StatusOr<int64_t> budget = ParseBytes(options.memory_per_device);
  if (!budget.ok()) {
    ReportFailure(
        absl::StrCat("--memory-per-device: ", budget.status().message()));
    return kExitUsage;
  }
  std::vector<std::string> strategies =
      options.strategy.empty() ? StrategyNames()
                               : std::vector<std::string>{options.strategy};
  // The meshes: each strategy over every device (single on one), then the
  // pipeline meshes.
  std::vector<FitRow> meshes;
  for (const std::string& strategy : strategies) {
    const bool distributed = FindStrategyKind(strategy)->distributed;
    if (distributed && devices < 2) continue;
    // As in the plan without --fit: a strategy below its study minimum is
    // another row's (HSDP below 4 devices is FSDP or DDP).
    if (options.strategy.empty() &&
        devices < FindStrategyKind(strategy)->min_study_world) {
      continue;
    }
    if (base.pipeline_stages > 1) continue;  // only the meshes asked for
    FitRow row;
    row.strategy = strategy;
    row.world = distributed ? devices : 1;
    row.replicas = row.world;
    meshes.push_back(row);
  }
  // The meshes unless one strategy alone is asked for (without --pp).
  if (options.strategy.empty() || base.pipeline_stages > 1) {
    for (const FitRow& row : PipelineFitRows(base, devices, options.strategy)) {
      meshes.push_back(row);
    }
  }
  std::vector<FitRow> rows;
  for (const FitRow& mesh : meshes) {
    for (const char* checkpointing : {"none", "all"}) {
      TrainConfig config = base;
      config.strategy = mesh.strategy;
      config.pipeline_stages = mesh.stages;
      config.micro_batches = mesh.micro_batches;
      config.activation_checkpointing = checkpointing;
      FitRow row = mesh;
      row.checkpointing = checkpointing;
      absl::StatusOr<int64_t> batch =
          LargestFittingBatch(config, row.world, PlannableBytes(*budget));
      if (!batch.ok()) return ReportFailure(batch.status());
      row.batch = *batch;
      config.batch_size = std::max<int64_t>(mesh.micro_batches, *batch);
      absl::StatusOr<MemoryPlan> plan = PlanMemory(config, row.world);
      if (!plan.ok()) return ReportFailure(plan.status());
      row.peak = plan->total();
      row.shard_group_size = plan->shard_group_size;
      rows.push_back(row);
    }
  }
  // The answer: the most sequences per optimizer step over all devices.
  const FitRow* best = nullptr;
  const FitRow* least = nullptr;  // the smallest need, when nothing fits
  for (const FitRow& row : rows) {
    if (row.batch > 0 &&
        (best == nullptr ||
         row.batch * row.replicas > best->batch * best->replicas)) {
      best = &row;
    }
    if (least == nullptr || row.peak < least->peak) least = &row;
  }
  std::vector<std::string> advice;
  if (best == nullptr) {
    if (int64_t n = DevicesThatFit(base, devices, *budget); n > 0) {
      advice.push_back(
          absl::StrCat("FSDP with activation checkpointing fits "
                       "one sequence per device on ",
                       n, " devices"));
    }
    if (int64_t seq =
            SeqLenThatFits(base, std::max<int64_t>(devices, 2), *budget);
        seq > 0) {
      advice.push_back(absl::StrCat("--seq-len ", seq, " fits on ",
                                    std::max<int64_t>(devices, 2),
                                    " devices with FSDP and activation "
                                    "checkpointing"));
    }
    if (base.device.rfind("cuda", 0) == 0 && base.precision == "fp32") {
      advice.push_back("--precision bf16 halves activations and gathers");
    }
    if (advice.empty()) advice.push_back("a smaller model");
  }

  if (options.format == "json" || options.format == "yaml") {
    nlohmann::json out = {{"model", base.model},
                          {"seq_len", base.seq_len},
                          {"precision", base.precision},
                          {"device", base.device},
                          {"devices", devices},
                          {"memory_per_device_bytes", *budget},
                          {"fits", nlohmann::json::array()}};
    for (const FitRow& row : rows) {
      nlohmann::json j = {{"strategy", row.strategy},
                          {"activation_checkpointing", row.checkpointing},
                          {"world_size", row.world},
                          {"batch_size", row.batch},
                          {"global_batch", row.batch * row.replicas},
                          {"peak_bytes_per_device", row.peak}};
      if (row.shard_group_size > 0) {
        j["shard_group_size"] = row.shard_group_size;
      }
      if (row.stages > 1) {
        j["mesh"] = row.mesh;
        j["pipeline_stages"] = row.stages;
        j["micro_batches"] = row.micro_batches;
      }
      out["fits"].push_back(j);
    }
    if (best != nullptr) {
      out["best"] = {{"strategy", best->strategy},
                     {"activation_checkpointing", best->checkpointing},
                     {"batch_size", best->batch}};
      if (best->stages > 1) out["best"]["mesh"] = best->mesh;
    } else {
      out["advice"] = advice;
    }
    std::cout << (options.format == "json" ? out.dump(2) + "\n"
                                           : JsonToYaml(out.dump()));
    return kExitOk;
  }

  std::vector<std::vector<std::string>> table;
  for (const FitRow& row : rows) {
    std::vector<std::string> notes;
    if (row.stages > 1) {
      notes.push_back(absl::StrCat(row.micro_batches, " micro-batches"));
    }
    if (row.shard_group_size > 0) {
      notes.push_back(absl::StrCat("groups of ", row.shard_group_size));
    }
    std::string name = row.name();
    if (!notes.empty()) {
      absl::StrAppend(&name, " (", absl::StrJoin(notes, ", "), ")");
    }
    table.push_back(
        {name, row.checkpointing == "all" ? "all blocks" : "none",
         absl::StrCat(row.world),
         row.batch > 0 ? absl::StrCat(row.batch) : "does not fit",
         row.batch > 0 ? absl::StrCat(row.batch * row.replicas) : "-",
         absl::StrCat(FormatBytes(row.peak),
                      row.batch > 0
                          ? ""
                          : absl::StrCat(" at batch ", row.micro_batches))});
  }
  std::cout << absl::StrFormat(
                   "largest batch per device whose planned peak is within 98%% "
                   "of %s (the plan's accuracy), on %d devices: %s, seq %d, %s "
                   "on %s\n",
                   FormatBytes(*budget), devices, base.model, base.seq_len,
                   base.precision, base.device)
            << FormatTable({"strategy", "activation ckpt", "devices",
                            "batch per device", "sequences per step",
                            "peak per device"},
                           table);
  if (best != nullptr) {
    std::cout << absl::StrFormat(
        "\nmost per step: %s%s, batch %d per %s (%d sequences per step)\n",
        best->name(),
        best->checkpointing == "all" ? " with activation checkpointing" : "",
        best->batch, best->stages > 1 ? "replica" : "device",
        best->batch * best->replicas);
  } else {
    std::cout << absl::StrFormat(
        "\nnothing fits: the least memory is %s%s at batch %d, %s per device "
        "(%s over 98%% of it)\nto fit: %s\n",
        least->name(),
        least->checkpointing == "all" ? " with activation checkpointing" : "",
        least->micro_batches, FormatBytes(least->peak),
        FormatBytes(least->peak - PlannableBytes(*budget)),
        absl::StrJoin(advice, "; or "));
  }
  return kExitOk;
}

int RunPlan(const PlanOptions& options) {
  TrainConfig base = options.config;
  base.data = "-";  // not needed to plan
  base.strategy = options.strategy.empty() ? "ddp" : options.strategy;
  // The command line is wrong: usage errors (exit 2), as CLI11's own.
  if (absl::Status s = base.Validate(); !s.ok()) {
    ReportFailure(s);
    return kExitUsage;
  }
  if (options.fit) return RunFit(options, base);
  if (options.world_size < 1) {
    ReportFailure(
        absl::StrCat("world-size: got ", options.world_size, "; must be >= 1"));
    return kExitUsage;
  }
  if (!options.strategy.empty() && base.pipeline_stages == 1 &&
      !FindStrategyKind(options.strategy)->distributed &&
      options.world_size != base.ModelParallelSize()) {
    ReportFailure(absl::StrCat(
        "strategy ", options.strategy, " runs at world size ",
        base.ModelParallelSize(),
        base.tensor_parallel > 1 ? " (its tensor-parallel ranks)" : "",
        " (omit --strategy to compare all strategies)"));
    return kExitUsage;
  }
  // Without --strategy, compare's default study at this world size (with
  // stages, of its data-parallel replicas).
  const int64_t stages = base.pipeline_stages;
  const int64_t replicas = base.DataParallelSize(options.world_size);
  if (absl::Status s = base.CheckMeshWorld(options.world_size); !s.ok()) {
    ReportFailure(s);
    return kExitUsage;
  }
  std::vector<std::string> strategies =
      options.strategy.empty() ? StudyStrategyNames(replicas)
                               : std::vector<std::string>{options.strategy};
  if (base.tensor_parallel > 1 && options.strategy.empty()) {
    // Tensor parallelism composes with the replicated strategies.
    strategies.erase(std::remove_if(strategies.begin(), strategies.end(),
                                    [](const std::string& name) {
                                      return FindStrategyKind(name)->layout !=
                                             StateLayout::kReplicated;
                                    }),
                     strategies.end());
  }

  // Every plan, one per pipeline stage with stages; each with its batch.
  std::vector<std::vector<MemoryPlan>> plans;
  std::vector<int64_t> batches;
  for (const std::string& strategy : strategies) {
    TrainConfig config = base;
    config.strategy = strategy;
    int64_t world = options.world_size;
    if (!FindStrategyKind(strategy)->distributed && replicas > 1) {
      // As `shardtrain compare`: strong scaling gives single-device the
      // global batch, weak scaling the per-device one.
      if (options.scaling == "strong") config.batch_size *= replicas;
      world = base.ModelParallelSize();
    }
    absl::StatusOr<std::vector<MemoryPlan>> stage_plans;
    if (stages > 1) {
      stage_plans = PlanPipelineStages(config, world);
    } else if (absl::StatusOr<MemoryPlan> plan = PlanMemory(config, world);
               plan.ok()) {
      stage_plans = std::vector<MemoryPlan>{*plan};
    } else {
      stage_plans = plan.status();
    }
    if (!stage_plans.ok()) return ReportFailure(stage_plans.status());
    plans.push_back(*std::move(stage_plans));
    batches.push_back(config.batch_size);
  }

  if (options.format == "json" || options.format == "yaml") {
    nlohmann::json out = {{"model", base.model},
                          {"seq_len", base.seq_len},
                          {"precision", base.precision},
                          {"device", base.device},
                          {"plans", nlohmann::json::array()}};
    for (size_t i = 0; i < plans.size(); ++i) {
      // The rank that needs the most: the plan's, with stages the largest
      // stage's.
      const MemoryPlan& largest =
          *std::max_element(plans[i].begin(), plans[i].end(),
                            [](const MemoryPlan& a, const MemoryPlan& b) {
                              return a.total() < b.total();
                            });
      nlohmann::json plan = PlanJson(largest);
      plan["batch_size"] = batches[i];
      if (stages > 1) {
        plan["micro_batches"] = base.micro_batches;
        plan["pipeline_schedule"] = base.pipeline_schedule;
        plan["stages"] = nlohmann::json::array();
        for (const MemoryPlan& stage : plans[i]) {
          plan["stages"].push_back(PlanJson(stage));
        }
      }
      out["plans"].push_back(plan);
    }
    std::cout << (options.format == "json" ? out.dump(2) + "\n"
                                           : JsonToYaml(out.dump()));
    return kExitOk;
  }

  // One column per plan: with stages, one per stage.
  std::vector<std::string> header = {"per rank"};
  std::vector<MemoryPlan> columns;
  for (size_t i = 0; i < plans.size(); ++i) {
    for (const MemoryPlan& plan : plans[i]) {
      std::string name =
          plan.shard_group_size > 0
              ? absl::StrFormat("%s (groups of %d)", plan.strategy,
                                plan.shard_group_size)
              : plan.strategy;
      if (plan.tensor_parallel > 1) {
        absl::StrAppend(&name, " x tp ", plan.tensor_parallel);
      }
      header.push_back(
          stages > 1 ? absl::StrFormat("%s stage %d: %s (world %d, batch %d)",
                                       name, plan.stage, plan.stage_layers,
                                       plan.world_size, batches[i])
                     : absl::StrFormat("%s (world %d, batch %d)", name,
                                       plan.world_size, batches[i]));
      columns.push_back(plan);
    }
  }
  std::vector<std::vector<std::string>> rows;
  for (size_t part = 0; part < columns[0].Parts().size(); ++part) {
    std::vector<std::string> row = {columns[0].Parts()[part].first};
    for (const MemoryPlan& plan : columns) {
      row.push_back(FormatBytes(plan.Parts()[part].second));
    }
    rows.push_back(row);
  }
  std::vector<std::string> total = {"total"};
  for (const MemoryPlan& plan : columns) {
    total.push_back(FormatBytes(plan.total()));
  }
  rows.push_back(total);
  std::vector<std::string> moment = {"peak at"};
  bool recomputed = false;
  for (const MemoryPlan& plan : columns) {
    moment.push_back(plan.PeakMomentShortName());
    recomputed |= plan.peak_moment != MemoryPlan::Moment::kHead;
  }
  if (recomputed || stages > 1) rows.push_back(moment);
  if (stages > 1) {
    std::vector<std::string> held = {"micro-batches held"};
    for (const MemoryPlan& plan : columns) {
      held.push_back(absl::StrCat(plan.micro_batches_in_flight));
    }
    rows.push_back(held);
  }
  const MemoryPlan* ddp = nullptr;
  for (const MemoryPlan& plan : columns) {
    if (plan.strategy == "ddp") ddp = &plan;
  }
  if (ddp != nullptr && columns.size() > 1 && stages == 1) {
    std::vector<std::string> ratio = {"vs ddp"};
    for (const MemoryPlan& plan : columns) {
      ratio.push_back(absl::StrFormat(
          "%.2fx", static_cast<double>(plan.total()) / ddp->total()));
    }
    rows.push_back(ratio);
  }
  std::cout << absl::StrFormat(
                   "predicted peak tensor memory per rank: %s, seq %d, %s on "
                   "%s%s\n",
                   base.model, base.seq_len, base.precision, base.device,
                   stages > 1
                       ? absl::StrFormat(", %d pipeline stages, %s with %d "
                                         "micro-batch(es) per batch",
                                         stages, base.pipeline_schedule,
                                         base.micro_batches)
                       : "")
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
      "for single, DDP, FSDP and HSDP, and per stage of a pipeline (--pp), "
      "before launching (local, no daemon needed); --fit: the largest batch "
      "that fits a device");
  TrainConfig& c = options->config;
  plan->add_option("--model", c.model, "preset or custom:...")
      ->capture_default_str();
  plan->add_option("--strategy", options->strategy,
                   StrategyFlagHelp() + " (default: all)")
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
  plan->add_option("--shard-group-size", c.shard_group_size,
                   "HSDP: ranks per shard group (0: half of one node's)")
      ->capture_default_str();
  plan->add_option("--activation-checkpointing", c.activation_checkpointing,
                   "none | all | every-N: recompute blocks in backward")
      ->capture_default_str();
  plan->add_option("--pipeline-stages,--pp", c.pipeline_stages,
                   "pipeline stages (world size = stages x replicas): each "
                   "stage planned")
      ->capture_default_str();
  plan->add_option("--tensor-parallel,--tp", c.tensor_parallel,
                   "tensor-parallel ranks per replica (world size = stages x "
                   "replicas x tp): each rank holds 1/tp of every layer")
      ->capture_default_str();
  plan->add_option("--micro-batches", c.micro_batches,
                   "pipeline: micro-batches per --batch-size")
      ->capture_default_str();
  plan->add_option("--pipeline-schedule", c.pipeline_schedule, "gpipe | 1f1b")
      ->capture_default_str();
  plan->add_option("--pipeline-split", c.pipeline_split,
                   "pipeline: blocks where stages 1, 2, ... start");
  plan->add_flag("--fit", options->fit,
                 "answer what fits: for each strategy, with and without "
                 "activation checkpointing, the largest batch per device "
                 "within --memory-per-device");
  plan->add_option("--devices", options->devices,
                   "--fit: devices to use (default: --world-size)");
  plan->add_option("--memory-per-device", options->memory_per_device,
                   "--fit: memory of one device, e.g. 80GiB");
  plan->add_option("--scaling", options->scaling,
                   "strong: single-device gets world x batch (as compare); "
                   "weak: the per-rank batch")
      ->check(CLI::IsMember({"strong", "weak"}))
      ->capture_default_str();
  AddOutputFlag(plan, &options->format);
  plan->callback([options, exit_code] { *exit_code = RunPlan(*options); });
}

}  // namespace shardtrain::cli
