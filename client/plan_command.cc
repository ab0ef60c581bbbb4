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
#include "common/subprocess.h"
#include "core/model/model_config.h"
#include "core/plan/memory_plan.h"
#include "core/plan/mesh_search.h"
#include "core/plan/step_time_plan.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"
#include "core/run/train_config.h"
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
  int64_t devices = 0;           // 0: --world-size
  int64_t devices_per_host = 0;  // 0: all on one host
  std::string memory_per_device;
  int64_t global_batch = 0;  // 0: each mesh's largest batch
};

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

// This host's rates for the step-time model: the cache's, or measured now
// by `shardtrain-train --calibrate` beside this program (once; seconds).
// An error says why the times are left out.
absl::StatusOr<HostRates> RatesFor(const TrainConfig& base) {
  const std::string device = base.device.rfind("cuda", 0) == 0 ? "cuda" : "cpu";
  absl::StatusOr<HostRates> rates = LoadHostRates(device, base.model);
  if (rates.ok() || !absl::IsNotFound(rates.status())) return rates;
  std::vector<std::string> argv = CalibrationArguments(base);
  std::cerr << "measuring this host once for step times (shardtrain-train "
            << absl::StrJoin(argv, " ") << ") ...\n";
  argv.insert(argv.begin(), SiblingProgram("shardtrain-train"));
  absl::StatusOr<CommandResult> run = RunCommand(argv, {}, 600);
  if (!run.ok()) return run.status();
  if (!run->ok()) {
    return absl::InternalError(absl::StrCat(
        "shardtrain-train --calibrate failed (",
        DescribeExit(run->exit_code, run->signal), "): ", run->err));
  }
  return LoadHostRates(device, base.model);
}

// Prints `out` as JSON, or as YAML for -o yaml.
void PrintJsonOrYaml(const nlohmann::json& out, const std::string& format) {
  std::cout << (format == "json" ? out.dump(2) + "\n" : JsonToYaml(out.dump()));
}

// --fit's question, read from the options: the devices, one device's memory
// and the meshes to weigh on them.
struct FitRequest {
  int64_t devices = 0;
  int64_t budget = 0;  // --memory-per-device, bytes
  MeshSearchOptions search;
};

// The meshes --fit weighs on `devices` devices of `budget` bytes each.
MeshSearchOptions FitSearchOptions(const PlanOptions& options,
                                   const TrainConfig& base, int64_t devices,
                                   int64_t budget) {
  MeshSearchOptions search;
  search.devices = devices;
  search.ranks_per_host = options.devices_per_host;
  search.budget = PlannableBytes(budget);
  search.global_batch = options.global_batch;
  search.strategy = options.strategy;
  search.single_too = options.strategy.empty() || options.strategy == "single";
  // One strategy asked for: its plain rows, unless stages or tensor ranks
  // are asked for too (then only those meshes).
  search.model_parallel = options.strategy.empty() ||
                          base.pipeline_stages > 1 || base.tensor_parallel > 1;
  search.pipeline_stages = base.pipeline_stages;
  search.tensor_parallel = base.tensor_parallel;
  if (search.pipeline_stages > 1 || search.tensor_parallel > 1) {
    search.single_too = false;
  }
  return search;
}

// Reads and checks --fit's options into *request, before any calibration;
// false (the usage error reported) when they are wrong.
bool ReadFitRequest(const PlanOptions& options, const TrainConfig& base,
                    FitRequest* request) {
  const int64_t devices =
      options.devices > 0 ? options.devices : options.world_size;
  if (options.memory_per_device.empty()) {
    ReportFailure("--fit needs --memory-per-device SIZE (e.g. 80GiB)");
    return false;
  }
  absl::StatusOr<int64_t> budget = ParseBytes(options.memory_per_device);
  if (!budget.ok()) {
    ReportFailure(
        absl::StrCat("--memory-per-device: ", budget.status().message()));
    return false;
  }
  if (options.devices_per_host < 0 ||
      (options.devices_per_host > 0 && devices % options.devices_per_host)) {
    ReportFailure(absl::StrCat("--devices-per-host: ", options.devices_per_host,
                               " does not divide the ", devices, " devices"));
    return false;
  }
  request->devices = devices;
  request->budget = *budget;
  request->search = FitSearchOptions(options, base, devices, *budget);
  if (absl::Status s = CheckSearchBounds(base, request->search); !s.ok()) {
    ReportFailure(s);
    return false;
  }
  return true;
}

// The usage error when there is no mesh of `devices` devices to weigh: what
// was asked for, and what a mesh must keep to.
std::string NoMeshToWeigh(const PlanOptions& options, const TrainConfig& base,
                          int64_t devices) {
  return absl::StrCat(
      "no mesh of ", devices, " devices to weigh for ", base.model,
      options.strategy.empty() ? "" : " with --strategy " + options.strategy,
      base.pipeline_stages > 1
          ? absl::StrCat(" in ", base.pipeline_stages, " stages")
          : "",
      base.tensor_parallel > 1
          ? absl::StrCat(" over ", base.tensor_parallel, " tensor ranks")
          : "",
      options.global_batch > 0 ? absl::StrCat(" sharing ", options.global_batch,
                                              " sequences per step")
                               : "",
      " (stages must divide the devices and not exceed the blocks, tensor "
      "ranks divide the devices, heads and vocabulary, the data-parallel "
      "size the global batch)");
}

// A candidate's data-parallel replicas.
int64_t MeshReplicas(const MeshCandidate& c) {
  return c.config.DataParallelSize(c.world_size);
}

// A candidate's batch per device; 0 when it does not fit.
int64_t FitBatch(const MeshCandidate& c) {
  return c.fits ? c.config.batch_size : 0;
}

// A candidate's sequences per optimizer step over all devices.
int64_t SequencesPerStep(const MeshCandidate& c) {
  return FitBatch(c) * c.config.grad_accum * MeshReplicas(c);
}

// What --fit found: the weighed meshes, ranked, and those named below them.
// The pointers point into `rows`, so it is not copied.
struct FitFindings {
  FitFindings() = default;
  FitFindings(const FitFindings&) = delete;
  FitFindings& operator=(const FitFindings&) = delete;

  absl::StatusOr<HostRates> rates;  // an error says why times are left out
  std::vector<MeshCandidate> rows;
  // The most sequences per optimizer step over all devices.
  const MeshCandidate* most = nullptr;
  const MeshCandidate* least = nullptr;    // the smallest need, when none fits
  const MeshCandidate* fastest = nullptr;  // with rates, when the first fits
  std::vector<std::string> advice;         // what would fit, when none does
  std::string why;                         // why the fastest wins
};

// Sets found->most, least and fastest from found->rows.
void PickFitMeshes(FitFindings* found) {
  const std::vector<MeshCandidate>& rows = found->rows;
  for (const MeshCandidate& row : rows) {
    if (row.fits && (found->most == nullptr ||
                     SequencesPerStep(row) > SequencesPerStep(*found->most))) {
      found->most = &row;
    }
    if (found->least == nullptr ||
        row.memory.total() < found->least->memory.total()) {
      found->least = &row;
    }
  }
  found->fastest =
      found->rates.ok() && !rows.empty() && rows[0].fits ? &rows[0] : nullptr;
}

// What would fit when no mesh of `devices` devices fits `budget` bytes.
std::vector<std::string> AdviceToFit(const TrainConfig& base, int64_t devices,
                                     int64_t budget) {
  std::vector<std::string> advice;
  if (int64_t n = DevicesThatFit(base, devices, budget); n > 0) {
    advice.push_back(
        absl::StrCat("FSDP with activation checkpointing fits "
                     "one sequence per device on ",
                     n, " devices"));
  }
  if (int64_t seq = SeqLenThatFits(base, std::max<int64_t>(devices, 2), budget);
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
  return advice;
}

// One weighed mesh for -o json/yaml; with rates, its predicted time when it
// fits.
nlohmann::json FitRowJson(const MeshCandidate& row, bool with_times) {
  const TrainConfig& c = row.config;
  nlohmann::json j = {{"strategy", c.strategy},
                      {"activation_checkpointing", c.activation_checkpointing},
                      {"world_size", row.world_size},
                      {"batch_size", FitBatch(row)},
                      {"grad_accum", c.grad_accum},
                      {"global_batch", SequencesPerStep(row)},
                      {"peak_bytes_per_device", row.memory.total()}};
  if (row.memory.shard_group_size > 0) {
    j["shard_group_size"] = row.memory.shard_group_size;
  }
  if (c.pipeline_stages > 1 || c.tensor_parallel > 1) {
    j["mesh"] =
        row.time.mesh.empty() ? MeshName(c, row.world_size) : row.time.mesh;
  }
  if (c.pipeline_stages > 1) {
    j["pipeline_stages"] = c.pipeline_stages;
    j["micro_batches"] = c.micro_batches;
  }
  if (c.tensor_parallel > 1) j["tensor_parallel"] = c.tensor_parallel;
  if (with_times && row.fits) {
    j["predicted_step_seconds"] = row.time.step_seconds;
    j["predicted_tokens_per_second"] = row.time.tokens_per_second;
    j["predicted_bottleneck"] = row.time.Bottleneck();
  }
  return j;
}

// The mesh with the most sequences per step, for -o json/yaml.
nlohmann::json FitBestJson(const MeshCandidate& most) {
  nlohmann::json best = {
      {"strategy", most.config.strategy},
      {"activation_checkpointing", most.config.activation_checkpointing},
      {"batch_size", FitBatch(most)},
      {"grad_accum", most.config.grad_accum}};
  if (most.config.ModelParallelSize() > 1) {
    best["mesh"] = MeshName(most.config, most.world_size);
  }
  return best;
}

// The fastest mesh and why, for -o json/yaml.
nlohmann::json FitFastestJson(const MeshCandidate& fastest,
                              const std::string& why) {
  return {{"mesh", fastest.name},
          {"strategy", fastest.config.strategy},
          {"pipeline_stages", fastest.config.pipeline_stages},
          {"tensor_parallel", fastest.config.tensor_parallel},
          {"activation_checkpointing", fastest.config.activation_checkpointing},
          {"batch_size", fastest.config.batch_size},
          {"predicted_tokens_per_second", fastest.time.tokens_per_second},
          {"why", why}};
}

// All --fit found, for -o json/yaml.
nlohmann::json FitJson(const TrainConfig& base, const FitRequest& request,
                       const FitFindings& found) {
  nlohmann::json out = {{"model", base.model},
                        {"seq_len", base.seq_len},
                        {"precision", base.precision},
                        {"device", base.device},
                        {"devices", request.devices},
                        {"memory_per_device_bytes", request.budget},
                        {"fits", nlohmann::json::array()}};
  for (const MeshCandidate& row : found.rows) {
    out["fits"].push_back(FitRowJson(row, found.rates.ok()));
  }
  if (found.most != nullptr) {
    out["best"] = FitBestJson(*found.most);
  } else {
    out["advice"] = found.advice;
  }
  if (found.fastest != nullptr) {
    out["fastest"] = FitFastestJson(*found.fastest, found.why);
  }
  if (found.rates.ok()) {
    out["rates"] = nlohmann::json::parse(found.rates->ToJson());
  } else {
    out["no_times"] = std::string(found.rates.status().message());
  }
  return out;
}

// A weighed mesh's name in the table, with its micro-batches, chunks and
// shard groups in parentheses.
std::string FitMeshCell(const MeshCandidate& row) {
  const TrainConfig& c = row.config;
  std::vector<std::string> notes;
  if (c.pipeline_stages > 1) {
    notes.push_back(absl::StrCat(c.micro_batches, " micro-batches"));
    if (c.virtual_stages > 1) {
      notes.push_back(absl::StrCat(c.virtual_stages, " chunks per stage"));
    }
  }
  if (row.memory.shard_group_size > 0) {
    notes.push_back(absl::StrCat("groups of ", row.memory.shard_group_size));
  }
  std::string name =
      c.ModelParallelSize() > 1 ? MeshName(c, row.world_size) : c.strategy;
  if (!notes.empty()) {
    absl::StrAppend(&name, " (", absl::StrJoin(notes, ", "), ")");
  }
  return name;
}

// A weighed mesh's table row; `budget` is the bytes a device may plan to.
std::vector<std::string> FitTableRow(const MeshCandidate& row, bool with_times,
                                     int64_t budget) {
  const TrainConfig& c = row.config;
  std::vector<std::string> cells = {
      FitMeshCell(row),
      c.activation_checkpointing == "all" ? "all blocks" : "none",
      absl::StrCat(row.world_size),
      row.fits
          ? absl::StrCat(
                FitBatch(row),
                c.grad_accum > 1 ? absl::StrCat(" x accum ", c.grad_accum) : "")
          : "does not fit",
      row.fits ? absl::StrCat(SequencesPerStep(row)) : "-",
      absl::StrCat(FormatBytes(row.memory.total()),
                   row.fits
                       ? ""
                       : absl::StrCat(" at batch ", c.batch_size, " (over ",
                                      FormatBytes(budget), ")"))};
  if (with_times) {
    cells.push_back(row.fits ? FormatDuration(row.time.step_seconds) : "-");
    cells.push_back(row.fits ? FormatThousands(static_cast<int64_t>(
                                   row.time.tokens_per_second))
                             : "-");
    cells.push_back(row.fits ? row.time.Bottleneck() : "-");
  }
  return cells;
}

// The table's header; with times, the predicted ones' columns too.
std::vector<std::string> FitTableHeader(bool with_times) {
  std::vector<std::string> header = {"mesh",
                                     "activation ckpt",
                                     "devices",
                                     "batch per device",
                                     "sequences per step",
                                     "peak per device"};
  if (with_times) {
    for (const char* h :
         {"step (predicted)", "tokens/s (predicted)", "bottleneck"}) {
      header.push_back(h);
    }
  }
  return header;
}

// The weighed meshes' table under its title.
void PrintFitTable(const TrainConfig& base, const FitRequest& request,
                   const FitFindings& found) {
  std::vector<std::vector<std::string>> table;
  for (const MeshCandidate& row : found.rows) {
    table.push_back(FitTableRow(row, found.rates.ok(), request.search.budget));
  }
  std::cout << absl::StrFormat(
                   "largest batch per device whose planned peak is within 98%% "
                   "of %s (the plan's accuracy), on %d devices: %s, seq %d, %s "
                   "on %s%s\n",
                   FormatBytes(request.budget), request.devices, base.model,
                   base.seq_len, base.precision, base.device,
                   found.rates.ok() ? ", fastest first" : "")
            << FormatTable(FitTableHeader(found.rates.ok()), table);
}

// Below the table: the mesh with the most per step or, when none fits, the
// one needing the least and what would fit; then the fastest and why, or why
// the times are left out.
void PrintFitVerdict(const FitRequest& request, const FitFindings& found) {
  if (const MeshCandidate* most = found.most; most != nullptr) {
    std::cout << absl::StrFormat(
        "\nmost per step: %s%s, batch %d per %s (%d sequences per step)\n",
        MeshName(most->config, most->world_size),
        most->config.activation_checkpointing == "all"
            ? " with activation checkpointing"
            : "",
        FitBatch(*most),
        most->config.ModelParallelSize() > 1 ? "replica" : "device",
        SequencesPerStep(*most));
  } else {
    const MeshCandidate* least = found.least;
    std::cout << absl::StrFormat(
        "\nnothing fits: the least memory is %s%s at batch %d, %s per device "
        "(%s over 98%% of it)\nto fit: %s\n",
        MeshName(least->config, least->world_size),
        least->config.activation_checkpointing == "all"
            ? " with activation checkpointing"
            : "",
        least->config.batch_size, FormatBytes(least->memory.total()),
        FormatBytes(least->memory.total() - PlannableBytes(request.budget)),
        absl::StrJoin(found.advice, "; or "));
  }
  if (const MeshCandidate* fastest = found.fastest; fastest != nullptr) {
    const HostRates& rates = *found.rates;
    std::cout << absl::StrFormat(
        "fastest (predicted): %s, batch %d per %s, %s tokens/s\nwhy: %s\n"
        "rates: %s, measured %s on %s (%s)\n",
        fastest->name, fastest->config.batch_size,
        fastest->config.ModelParallelSize() > 1 ? "replica" : "device",
        FormatThousands(static_cast<int64_t>(fastest->time.tokens_per_second)),
        found.why, rates.device, rates.measured_at, rates.compute_model,
        HostRatesCachePath());
  } else if (!found.rates.ok()) {
    std::cout << "step times left out: " << found.rates.status().message()
              << "\n";
  }
}

int RunFit(const PlanOptions& options, const TrainConfig& base) {
  FitRequest request;
  if (!ReadFitRequest(options, base, &request)) return kExitUsage;
  FitFindings found;
  found.rates = RatesFor(base);
  absl::StatusOr<std::vector<MeshCandidate>> ranked = SearchMeshes(
      base, request.search, found.rates.ok() ? &*found.rates : nullptr);
  if (!ranked.ok()) return ReportFailure(ranked.status());
  found.rows = *std::move(ranked);
  if (found.rows.empty()) {
    ReportFailure(NoMeshToWeigh(options, base, request.devices));
    return kExitUsage;
  }
  PickFitMeshes(&found);
  if (found.most == nullptr) {
    found.advice = AdviceToFit(base, request.devices, request.budget);
  }
  found.why = found.rates.ok() ? WhyFirstWins(found.rows) : "";
  if (options.format == "json" || options.format == "yaml") {
    PrintJsonOrYaml(FitJson(base, request, found), options.format);
    return kExitOk;
  }
  PrintFitTable(base, request, found);
  PrintFitVerdict(request, found);
  return kExitOk;
}

// The config every plan starts from: the options' with the strategy to plan
// (ddp when all are compared).
TrainConfig PlanBase(const PlanOptions& options) {
  TrainConfig base = options.config;
  base.data = "-";  // not needed to plan
  base.strategy = options.strategy.empty() ? "ddp" : options.strategy;
  return base;
}

// Checks `base` as a run's config; false (the usage error reported) when it
// is wrong. The command line is wrong: usage errors (exit 2), as CLI11's own.
bool CheckPlanConfig(const PlanOptions& options, const TrainConfig& base) {
  // --fit weighs pipeline meshes itself: --micro-batches and
  // --virtual-stages set theirs without --pp.
  TrainConfig checked = base;
  if (options.fit && checked.pipeline_stages == 1) {
    checked.micro_batches = 1;
    checked.virtual_stages = 1;
  }
  if (absl::Status s = checked.Validate(); !s.ok()) {
    ReportFailure(s);
    return false;
  }
  return true;
}

// Checks the world `base` is planned on (without --fit); false (the usage
// error reported) when the command line is wrong.
bool CheckPlanWorld(const PlanOptions& options, const TrainConfig& base) {
  if (options.world_size < 1) {
    ReportFailure(
        absl::StrCat("world-size: got ", options.world_size, "; must be >= 1"));
    return false;
  }
  if (!options.strategy.empty() && base.pipeline_stages == 1 &&
      !FindStrategyKind(options.strategy)->distributed &&
      options.world_size != base.ModelParallelSize()) {
    ReportFailure(absl::StrCat(
        "strategy ", options.strategy, " runs at world size ",
        base.ModelParallelSize(),
        base.tensor_parallel > 1 ? " (its tensor-parallel ranks)" : "",
        " (omit --strategy to compare all strategies)"));
    return false;
  }
  if (absl::Status s = base.CheckMeshWorld(options.world_size); !s.ok()) {
    ReportFailure(s);
    return false;
  }
  return true;
}

// The strategies to plan: --strategy's or, without it, compare's default
// study at this world size (with stages, of its `replicas` data-parallel
// replicas).
std::vector<std::string> PlanStrategies(const PlanOptions& options,
                                        const TrainConfig& base,
                                        int64_t replicas) {
  std::vector<std::string> strategies =
      options.strategy.empty() ? StudyStrategyNames(replicas)
                               : std::vector<std::string>{options.strategy};
  if (base.tensor_parallel > 1 && options.strategy.empty()) {
    // Tensor parallelism composes with the replicated strategies and FSDP
    // (not HSDP's groups).
    strategies.erase(std::remove_if(strategies.begin(), strategies.end(),
                                    [](const std::string& name) {
                                      return FindStrategyKind(name)->layout ==
                                             StateLayout::kShardedInGroups;
                                    }),
                     strategies.end());
  }
  return strategies;
}

// A strategy's plans, one per pipeline stage with stages, and its batch.
struct StrategyPlan {
  std::vector<MemoryPlan> stages;
  int64_t batch_size = 0;
};

// `config`'s plans on `world` ranks: one per pipeline stage with stages.
absl::StatusOr<std::vector<MemoryPlan>> PlanStages(const TrainConfig& config,
                                                   int64_t world) {
  if (config.pipeline_stages > 1) return PlanPipelineStages(config, world);
  absl::StatusOr<MemoryPlan> plan = PlanMemory(config, world);
  if (!plan.ok()) return plan.status();
  return std::vector<MemoryPlan>{*plan};
}

// `strategy` planned on the options' world of `replicas` data-parallel
// replicas.
absl::StatusOr<StrategyPlan> PlanStrategy(const PlanOptions& options,
                                          const TrainConfig& base,
                                          const std::string& strategy,
                                          int64_t replicas) {
  TrainConfig config = base;
  config.strategy = strategy;
  int64_t world = options.world_size;
  if (!FindStrategyKind(strategy)->distributed && replicas > 1) {
    // As `shardtrain compare`: strong scaling gives single-device the
    // global batch, weak scaling the per-device one.
    if (options.scaling == "strong") config.batch_size *= replicas;
    world = base.ModelParallelSize();
  }
  absl::StatusOr<std::vector<MemoryPlan>> stages = PlanStages(config, world);
  if (!stages.ok()) return stages.status();
  return StrategyPlan{*std::move(stages), config.batch_size};
}

// A strategy's plan for -o json/yaml.
nlohmann::json StrategyPlanJson(const TrainConfig& base,
                                const StrategyPlan& plan) {
  // The rank that needs the most: the plan's, with stages the largest
  // stage's.
  const MemoryPlan& largest =
      *std::max_element(plan.stages.begin(), plan.stages.end(),
                        [](const MemoryPlan& a, const MemoryPlan& b) {
                          return a.total() < b.total();
                        });
  nlohmann::json out = PlanJson(largest);
  out["batch_size"] = plan.batch_size;
  if (base.pipeline_stages > 1) {
    out["micro_batches"] = base.micro_batches;
    out["pipeline_schedule"] = base.pipeline_schedule;
    out["virtual_stages"] = base.virtual_stages;
    out["stages"] = nlohmann::json::array();
    for (const MemoryPlan& stage : plan.stages) {
      out["stages"].push_back(PlanJson(stage));
    }
  }
  return out;
}

// Every strategy's plan, for -o json/yaml.
nlohmann::json PlansJson(const TrainConfig& base,
                         const std::vector<StrategyPlan>& plans) {
  nlohmann::json out = {{"model", base.model},
                        {"seq_len", base.seq_len},
                        {"precision", base.precision},
                        {"device", base.device},
                        {"plans", nlohmann::json::array()}};
  for (const StrategyPlan& plan : plans) {
    out["plans"].push_back(StrategyPlanJson(base, plan));
  }
  return out;
}

// The table's columns: one narrow column per plan (with stages, one per
// stage), named by its mesh; what each holds is said below the table.
struct PlanColumns {
  std::vector<std::string> header = {"per rank"};
  std::vector<MemoryPlan> plans;
  std::vector<std::string> legend;
};

PlanColumns PlanTableColumns(const TrainConfig& base,
                             const std::vector<StrategyPlan>& plans) {
  const int64_t stages = base.pipeline_stages;
  PlanColumns columns;
  for (const StrategyPlan& strategy : plans) {
    for (const MemoryPlan& plan : strategy.stages) {
      TrainConfig shape = base;
      shape.strategy = plan.strategy;
      const std::string mesh = MeshName(shape, plan.world_size);
      const std::string name =
          stages > 1 ? absl::StrFormat("%s s%d", mesh, plan.stage) : mesh;
      columns.header.push_back(name);
      std::vector<std::string> about;
      if (stages > 1) about.push_back(plan.stage_layers);
      if (plan.shard_group_size > 0) {
        about.push_back(
            absl::StrFormat("shard groups of %d", plan.shard_group_size));
      }
      about.push_back(absl::StrFormat("%d rank(s), batch %d per replica",
                                      plan.world_size, strategy.batch_size));
      columns.legend.push_back(
          absl::StrCat("  ", name, ": ", absl::StrJoin(about, ", ")));
      columns.plans.push_back(plan);
    }
  }
  return columns;
}

// The table's rows: each part and the total, then where the peak falls,
// the micro-batches held and the ratio to DDP where they tell something.
std::vector<std::vector<std::string>> PlanTableRows(
    const TrainConfig& base, const std::vector<MemoryPlan>& columns) {
  const int64_t stages = base.pipeline_stages;
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
  return rows;
}

// The table's title: the job's shape and, with stages, the pipeline's.
std::string PlanTitle(const TrainConfig& base) {
  const int64_t stages = base.pipeline_stages;
  return absl::StrFormat(
      "predicted peak tensor memory per rank: %s, seq %d, %s on %s%s\n",
      base.model, base.seq_len, base.precision, base.device,
      stages > 1
          ? absl::StrFormat(";\n%d pipeline stages%s, %s with %d "
                            "micro-batch(es) per batch",
                            stages,
                            base.virtual_stages > 1
                                ? absl::StrFormat(" of %d interleaved chunks",
                                                  base.virtual_stages)
                                : "",
                            base.pipeline_schedule, base.micro_batches)
          : "");
}

// The plans' table under its title, then what each column holds.
void PrintPlanTable(const TrainConfig& base,
                    const std::vector<StrategyPlan>& plans) {
  const PlanColumns columns = PlanTableColumns(base, plans);
  std::cout << PlanTitle(base)
            << FormatTable(columns.header, PlanTableRows(base, columns.plans));
  for (const std::string& line : columns.legend) std::cout << line << "\n";
}

// A strategy a study leaves out at this size is named, not dropped.
void PrintLeftOutStrategies(const TrainConfig& base,
                            const std::vector<std::string>& strategies,
                            int64_t replicas) {
  for (const StrategyKind& kind : StrategyKinds()) {
    if (std::find(strategies.begin(), strategies.end(), kind.name) ==
            strategies.end() &&
        replicas < kind.min_study_world &&
        (base.tensor_parallel <= 1 ||
         kind.layout != StateLayout::kShardedInGroups)) {
      std::cout << absl::StrFormat(
          "%s is left out below %d data-parallel replicas (here %d, where "
          "it would be %s); --strategy %s plans it anyway\n",
          kind.name, kind.min_study_world, replicas,
          kind.layout == StateLayout::kShardedInGroups && replicas > 1
              ? "ddp or fsdp"
              : "single",
          kind.name);
    }
  }
}

int RunPlan(const PlanOptions& options) {
  const TrainConfig base = PlanBase(options);
  if (!CheckPlanConfig(options, base)) return kExitUsage;
  if (options.fit) return RunFit(options, base);
  if (!CheckPlanWorld(options, base)) return kExitUsage;
  const int64_t replicas = base.DataParallelSize(options.world_size);
  const std::vector<std::string> strategies =
      PlanStrategies(options, base, replicas);
  std::vector<StrategyPlan> plans;
  for (const std::string& strategy : strategies) {
    absl::StatusOr<StrategyPlan> plan =
        PlanStrategy(options, base, strategy, replicas);
    if (!plan.ok()) return ReportFailure(plan.status());
    plans.push_back(*std::move(plan));
  }
  if (options.format == "json" || options.format == "yaml") {
    PrintJsonOrYaml(PlansJson(base, plans), options.format);
    return kExitOk;
  }
  PrintPlanTable(base, plans);
  if (options.strategy.empty()) {
    PrintLeftOutStrategies(base, strategies, replicas);
  }
  return kExitOk;
}

}  // namespace

void AddPlanCommand(CLI::App* app, int* exit_code) {
  auto options = std::make_shared<PlanOptions>();
  CLI::App* plan = app->add_subcommand(
      "plan",
      absl::StrCat(
          "Predict each rank's peak tensor memory by part (parameters, "
          "gradients, optimizer state, gathered units, activations, logits, "
          "communication) for ",
          StrategyDisplayNames(),
          ", with pipeline stages (--pp, each stage planned) and tensor "
          "parallelism (--tp), before launching (local, no daemon needed); "
          "--fit: the largest batch that fits a device for every mesh, "
          "ranked by predicted tokens/s"));
  TrainConfig& c = options->config;
  plan->add_option("--model", c.model,
                   "preset or custom:... / custom-llama:... (docs/models.md)")
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
  plan->add_option("--pipeline-schedule", c.pipeline_schedule,
                   "gpipe | 1f1b | zb-h1")
      ->capture_default_str();
  plan->add_option("--virtual-stages", c.virtual_stages,
                   "pipeline: interleaved chunks per stage (model stages s, "
                   "s+S, ...)")
      ->capture_default_str();
  plan->add_option("--pipeline-split", c.pipeline_split,
                   "pipeline: blocks where stages 1, 2, ... start");
  plan->add_flag("--fit", options->fit,
                 "answer what fits and what is fastest: for each strategy, "
                 "pipeline and tensor-parallel mesh, with and without "
                 "activation checkpointing, the largest batch per device "
                 "within --memory-per-device and its predicted step time "
                 "(this host's rates, measured once by shardtrain-train "
                 "--calibrate), fastest first");
  plan->add_option("--devices", options->devices,
                   "--fit: devices to use (default: --world-size)");
  plan->add_option("--devices-per-host", options->devices_per_host,
                   "--fit: devices on each host (default: all on one); a "
                   "group spanning hosts moves its bytes at the inter-node "
                   "rates --calibrate measured across hosts");
  plan->add_option("--memory-per-device", options->memory_per_device,
                   "--fit: memory of one device, e.g. 80GiB");
  plan->add_option("--global-batch", options->global_batch,
                   "--fit: sequences per optimizer step, the same for every "
                   "mesh (each replica's share in the largest micro-batch "
                   "that fits, accumulated); default: each mesh's largest "
                   "batch")
      ->check(CLI::PositiveNumber);
  plan->add_option("--scaling", options->scaling,
                   "strong: single-device gets world x batch (as compare); "
                   "weak: the per-rank batch")
      ->check(CLI::IsMember({"strong", "weak"}))
      ->capture_default_str();
  AddOutputFlag(plan, &options->format);
  plan->callback([options, exit_code] { *exit_code = RunPlan(*options); });
}

}  // namespace shardtrain::cli
