#include "core/plan/step_time_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "core/model/family_shapes.h"
#include "core/model/model_config.h"
#include "core/plan/pipeline_plan.h"
#include "core/run/strategy_kinds.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

constexpr int64_t kFloatBytes = 4;
constexpr int64_t kIdBytes = 8;  // token ids travel as int64

// One kind of collective a rank issues `calls` times in a step, over a group
// of `ranks`, each carrying `bytes` (the full tensor: an all-reduce's, an
// all-gather's output, a reduce-scatter's input; a send's message).
enum class Op { kAllReduce, kAllGather, kReduceScatter, kSend };

struct Traffic {
  int64_t calls = 0;
  int64_t counted = 0;
  int64_t wire = 0;
  int64_t latency_steps = 0;

  void Add(Op op, int64_t ranks, int64_t calls_, double bytes_each) {
    if (ranks <= 1 && op != Op::kSend) return;
    const double n = static_cast<double>(ranks);
    const double b = bytes_each * static_cast<double>(calls_);
    calls += calls_;
    switch (op) {
      case Op::kAllReduce:  // ring: reduce-scatter then all-gather
        counted += static_cast<int64_t>(b);
        wire += static_cast<int64_t>(2 * (n - 1) / n * b);
        latency_steps += calls_ * 2 * (ranks - 1);
        break;
      case Op::kAllGather:  // the rank's input is 1/n of the output
        counted += static_cast<int64_t>(b / n);
        wire += static_cast<int64_t>((n - 1) / n * b);
        latency_steps += calls_ * (ranks - 1);
        break;
      case Op::kReduceScatter:
        counted += static_cast<int64_t>(b);
        wire += static_cast<int64_t>((n - 1) / n * b);
        latency_steps += calls_ * (ranks - 1);
        break;
      case Op::kSend:
        counted += static_cast<int64_t>(b);
        wire += static_cast<int64_t>(b);
        latency_steps += calls_;
        break;
    }
  }
};

MeshTraffic Finish(const std::string& dimension, int64_t ranks,
                   const Traffic& t, const LinkRates& link, double slowdown) {
  MeshTraffic out;
  out.dimension = dimension;
  out.ranks = ranks;
  out.calls = t.calls;
  out.counted_bytes = t.counted;
  out.wire_bytes = t.wire;
  out.seconds = (static_cast<double>(t.latency_steps) * link.latency_seconds +
                 static_cast<double>(t.wire) / link.bytes_per_second) *
                slowdown;
  return out;
}

int64_t BlockParameters(const ModelConfig& m) { return m.BlockParameters(); }

// What tensor parallelism keeps whole on every rank of the group (the
// input side, e.g. GPT-2's wpe, what the family keeps whole in each block,
// the final norm); their gradients are all-reduced over the group once per
// step.
int64_t TensorParallelReplicated(const ModelConfig& m) {
  const FamilyShapes f = ShapesOf(m);
  return m.InputParameters() + m.n_layer * f.block_whole_params +
         f.final_norm_params;
}

// FSDP over `ranks` of units of `unit_params` each (the blocks), the root
// (`root_params`, gathered once and kept) and the vocabulary-parallel wte
// over the same ranks, for one micro-step of `tokens` per rank; reduce the
// gradients when `reduce`.
void AddFsdp(Traffic* t, int64_t ranks, int64_t blocks, int64_t block_params,
             int64_t root_params, bool reshard, bool reduce, int64_t tokens,
             int64_t c, int64_t head_chunks, bool embeddings, bool head) {
  const double block_bytes = static_cast<double>(block_params * kFloatBytes);
  const double root_bytes = static_cast<double>(root_params * kFloatBytes);
  const int64_t gathers = blocks * (reshard ? 2 : 1);
  t->Add(Op::kAllGather, ranks, gathers, block_bytes);
  t->Add(Op::kAllGather, ranks, 1, root_bytes);
  if (reduce) {
    t->Add(Op::kReduceScatter, ranks, blocks, block_bytes);
    t->Add(Op::kReduceScatter, ranks, 1, root_bytes);
  }
  const double n = static_cast<double>(ranks);
  const double rows = static_cast<double>(tokens) * n;  // every rank's
  const double hidden = rows * static_cast<double>(c * kFloatBytes);
  if (embeddings) {
    t->Add(Op::kAllGather, ranks, 1, rows * kIdBytes);  // token ids
    t->Add(Op::kReduceScatter, ranks, 1, hidden);       // the lookups
    t->Add(Op::kAllGather, ranks, 1, hidden);           // their gradient
  }
  if (head) {
    t->Add(Op::kAllGather, ranks, 1, hidden);           // hidden states
    t->Add(Op::kAllGather, ranks, 1, rows * kIdBytes);  // targets
    t->Add(Op::kAllGather, ranks, head_chunks,
           3.0 * rows * kFloatBytes / static_cast<double>(head_chunks));
    t->Add(Op::kReduceScatter, ranks, 1, hidden);  // their gradient
  }
}

}  // namespace

absl::Status HostRates::Check() const {
  auto missing = [&](const char* what) {
    return absl::FailedPreconditionError(
        absl::StrCat("host rates for ", device, " lack ", what,
                     "; measure them with `shardtrain-train --calibrate`"));
  };
  if (cores < 1) return missing("the core count");
  if (!(flops_per_thread > 0)) return missing("the compute rate");
  if (!(optimizer_seconds_per_parameter > 0)) return missing("AdamW's rate");
  if (!intra_node.known() || intra_node.latency_seconds < 0) {
    return missing("the collectives' latency and bandwidth");
  }
  return absl::OkStatus();
}

std::string HostRates::ToJson() const {
  nlohmann::json j = {
      {"device", device},
      {"cores", cores},
      {"flops_per_thread", flops_per_thread},
      {"compute_model", compute_model},
      {"gradient_seconds_per_parameter", gradient_seconds_per_parameter},
      {"optimizer_seconds_per_parameter", optimizer_seconds_per_parameter},
      {"pass_overhead_seconds", pass_overhead_seconds},
      {"intra_node",
       {{"latency_seconds", intra_node.latency_seconds},
        {"bytes_per_second", intra_node.bytes_per_second}}},
      {"measured_at", measured_at}};
  if (inter_node.known()) {
    j["inter_node"] = {{"latency_seconds", inter_node.latency_seconds},
                       {"bytes_per_second", inter_node.bytes_per_second}};
  }
  return j.dump();
}

absl::StatusOr<HostRates> HostRates::FromJson(const std::string& text) {
  // Rates nest two levels (the links); deeper text is not parsed.
  if (absl::Status s = CheckJsonNesting(text, 4, "host rates"); !s.ok()) {
    return s;
  }
  nlohmann::json j =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError("host rates: not a JSON object");
  }
  try {
    HostRates r;
    r.device = j.value("device", std::string("cpu"));
    r.cores = j.value("cores", int64_t{1});
    r.flops_per_thread = j.value("flops_per_thread", 0.0);
    r.compute_model = j.value("compute_model", std::string());
    r.gradient_seconds_per_parameter =
        j.value("gradient_seconds_per_parameter", 0.0);
    r.optimizer_seconds_per_parameter =
        j.value("optimizer_seconds_per_parameter", 0.0);
    r.pass_overhead_seconds = j.value("pass_overhead_seconds", 0.0);
    r.measured_at = j.value("measured_at", std::string());
    for (auto [key, link] : {std::pair{"intra_node", &r.intra_node},
                             std::pair{"inter_node", &r.inter_node}}) {
      if (!j.contains(key)) continue;
      link->latency_seconds = j[key].value("latency_seconds", 0.0);
      link->bytes_per_second = j[key].value("bytes_per_second", 0.0);
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host rates: a field has the wrong type (", e.what(), ")"));
  }
}

std::string HostRatesCachePath() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::filesystem::path dir =
      xdg != nullptr && *xdg != '\0'
          ? std::filesystem::path(xdg)
          : std::filesystem::path(home != nullptr ? home : "/tmp") / ".cache";
  return (dir / "shardtrain" / "host_rates.json").string();
}

namespace {

// The cache holds a few devices' rates: kilobytes, nested four deep.
constexpr int64_t kMaxCacheBytes = 1 << 20;
constexpr int kMaxCacheNesting = 8;

// The cache as an object; empty when there is none. One that cannot be read
// (a FIFO, a device, too large) or parsed (truncated, nested too deep) is
// ignored with a warning, so its rates are measured again and it is
// rewritten.
nlohmann::json ReadCache() {
  const std::string path = HostRatesCachePath();
  absl::StatusOr<std::string> text =
      ReadOwnFile(path, kMaxCacheBytes, "the calibration cache");
  if (absl::IsNotFound(text.status())) return nlohmann::json::object();
  absl::Status problem = text.status();
  if (problem.ok()) {
    problem = CheckJsonNesting(*text, kMaxCacheNesting, path);
  }
  nlohmann::json cache;
  if (problem.ok()) {
    cache = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (!cache.is_object()) {
      problem = absl::InvalidArgumentError(
          absl::StrCat(path, " is not a JSON object"));
    }
  }
  if (!problem.ok()) {
    std::cerr << "shardtrain: warning: ignoring the calibration cache: "
              << problem.message() << "; its rates are measured again\n";
    return nlohmann::json::object();
  }
  return cache;
}

}  // namespace

absl::StatusOr<HostRates> LoadHostRates(const std::string& device,
                                        const std::string& model) {
  const nlohmann::json cache = ReadCache();
  if (!cache.contains(device) || !cache[device].is_object() ||
      cache[device].empty()) {
    return absl::NotFoundError(absl::StrCat(
        "no measured rates for ", device, " in ", HostRatesCachePath(),
        "; `shardtrain-train --calibrate` measures them"));
  }
  const nlohmann::json& models = cache[device];
  const nlohmann::json& entry =
      models.contains(model) ? models[model] : models.begin().value();
  absl::StatusOr<HostRates> rates = HostRates::FromJson(entry.dump());
  if (!rates.ok()) return rates.status();
  if (absl::Status s = rates->Check(); !s.ok()) return s;
  return rates;
}

absl::Status SaveHostRates(const HostRates& rates) {
  nlohmann::json cache = ReadCache();
  cache[rates.device][rates.compute_model] =
      nlohmann::json::parse(rates.ToJson());
  const std::filesystem::path path(HostRatesCachePath());
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  return WriteFileAtomically(path.string(), cache.dump(2) + "\n");
}

std::vector<std::string> CalibrationArguments(const TrainConfig& config) {
  const bool gpu = config.device.rfind("cuda", 0) == 0;
  const std::string largest = gpu ? "gpt2" : "gpt2-mini";
  absl::StatusOr<ModelConfig> model = ParseModelSpec(config.model);
  absl::StatusOr<ModelConfig> cap = ParseModelSpec(largest);
  const bool small =
      model.ok() && cap.ok() && model->NumParameters() <= cap->NumParameters();
  const int64_t seq =
      std::min<int64_t>(256, small ? std::min(config.seq_len, model->block_size)
                                   : config.seq_len);
  // The rendezvous waits while rank 0 measures compute.
  return {"--calibrate",
          "--model",
          small ? config.model : largest,
          "--seq-len",
          absl::StrCat(std::max<int64_t>(1, seq)),
          "--batch-size",
          gpu ? "8" : "4",
          "--device",
          config.device,
          "--comm-timeout",
          "1800"};
}

int64_t StepTimePlan::counted_bytes() const {
  int64_t total = 0;
  for (const MeshTraffic& t : traffic) total += t.counted_bytes;
  return total;
}

std::string StepTimePlan::Bottleneck() const {
  std::string name = "compute";
  double most = compute_seconds;
  if (optimizer_seconds > most) {
    most = optimizer_seconds;
    name = "AdamW and dense gradients";
  }
  if (bubble_seconds > most) {
    most = bubble_seconds;
    name = "the pipeline bubble";
  }
  for (const MeshTraffic& t : traffic) {
    if (t.seconds > most) {
      most = t.seconds;
      name = t.dimension + " traffic";
    }
  }
  return name;
}

namespace {

// The mesh and batch of the step PlanStepTime models.
struct StepMesh {
  ModelConfig model;
  int64_t stages = 1, tp = 1, data = 1, micro = 1, c = 0, accum = 1;
  // Tokens a rank (a replica's ranks, together) computes per micro-step.
  int64_t tokens = 0;
  int64_t every = 0;  // ActivationCheckpointEvery
  // Interleaved, a rank runs V chunks (model stages r, r + S, ...): what it
  // holds and computes is theirs together.
  int64_t chunks = 1;
  std::vector<PipelineStage> cut;  // the model stages
};

// PlanStepTime's refusals, in its order, and the mesh of the rest.
absl::StatusOr<StepMesh> ParseStepMesh(const TrainConfig& config,
                                       int64_t world_size,
                                       const HostRates& rates) {
  if (absl::Status s = rates.Check(); !s.ok()) return s;
  absl::StatusOr<ModelConfig> model = ParseModelSpec(config.model);
  if (!model.ok()) return model.status();
  const StrategyKind* kind = FindStrategyKind(config.strategy);
  if (kind == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy: unknown '", config.strategy, "'"));
  }
  if (config.ModelParallelSize() > 1) {
    if (absl::Status s = config.CheckMeshWorld(world_size); !s.ok()) return s;
  } else if (!kind->distributed && world_size != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: ", config.strategy, " runs on one rank, not ",
                     world_size));
  }
  StepMesh mesh;
  mesh.stages = std::max<int64_t>(1, config.pipeline_stages);
  mesh.tp = std::max<int64_t>(1, config.tensor_parallel);
  mesh.data = config.DataParallelSize(world_size);
  mesh.micro = mesh.stages > 1 ? std::max<int64_t>(1, config.micro_batches) : 1;
  mesh.c = model->n_embd;
  mesh.accum = std::max<int64_t>(1, config.grad_accum);
  mesh.tokens = config.batch_size * config.seq_len;
  absl::StatusOr<int64_t> every =
      ActivationCheckpointEvery(config.activation_checkpointing);
  if (!every.ok()) return every.status();
  mesh.every = *every;
  std::vector<int64_t> split;
  if (mesh.stages > 1 && !config.pipeline_split.empty()) {
    absl::StatusOr<std::vector<int64_t>> parsed =
        ParsePipelineSplit(config.pipeline_split);
    if (!parsed.ok()) return parsed.status();
    split = *std::move(parsed);
  }
  mesh.chunks =
      mesh.stages > 1 ? std::max<int64_t>(1, config.virtual_stages) : 1;
  absl::StatusOr<std::vector<PipelineStage>> cut = PartitionPipeline(
      *model, config.seq_len, mesh.stages, split, mesh.chunks);
  if (!cut.ok()) return cut.status();
  mesh.cut = *std::move(cut);
  mesh.model = *std::move(model);
  return mesh;
}

// Per rank: its blocks (as one run), its ends, its compute per token
// (3x the forward, once more for recomputed blocks) and the directions
// its activations cross to other ranks, per micro-batch.
struct RankLoads {
  std::vector<PipelineStage> held;
  std::vector<double> rank_flops;
  std::vector<int64_t> rank_directions;
  double stage_flops = 0;  // per token, the slowest rank
  double all_stage_flops = 0;
  int64_t slowest_rank = 0;
  const PipelineStage& slowest() const { return held[slowest_rank]; }
};

RankLoads LoadRanks(const StepMesh& mesh, int64_t seq_len) {
  const int64_t stages = mesh.stages;
  const std::vector<PipelineStage>& cut = mesh.cut;
  const double block_flops = BlockForwardFlopsPerToken(mesh.model, seq_len);
  RankLoads loads;
  loads.held.resize(stages);
  loads.rank_flops.assign(stages, 0);
  loads.rank_directions.assign(stages, 0);
  for (size_t k = 0; k < cut.size(); ++k) {
    const PipelineStage& stage = cut[k];
    const int64_t r = static_cast<int64_t>(k) % stages;
    int64_t recomputed = 0;
    for (int64_t b = stage.first_block; b < stage.end_block; ++b) {
      if (mesh.every > 0 && (b + 1) % mesh.every == 0) ++recomputed;
    }
    loads.rank_flops[r] += 3 * stage.flops_per_token +
                           static_cast<double>(recomputed) * block_flops;
    PipelineStage& held = loads.held[r];
    held.end_block += stage.end_block - stage.first_block;
    held.embeddings = held.embeddings || stage.embeddings;
    held.head = held.head || stage.head;
    held.flops_per_token += stage.flops_per_token;
    loads.rank_directions[r] += (k > 0 ? 1 : 0) + (k + 1 < cut.size() ? 1 : 0);
  }
  for (int64_t r = 0; r < stages; ++r) {
    loads.all_stage_flops += loads.rank_flops[r];
    if (loads.rank_flops[r] > loads.stage_flops) {
      loads.stage_flops = loads.rank_flops[r];
      loads.slowest_rank = r;
    }
  }
  return loads;
}

// The rank's rate: its threads, or its share of the host's cores. A
// stage faster than the slowest waits (blocked, off the cores) for the
// rest of the step: the cores are shared by the ranks' busy time, the
// stages' work over the slowest's.
struct RankRate {
  bool gpu = false;
  int64_t host_ranks = 1;
  int64_t threads_per_rank = 1;
  double share = 1.0;
  double rate = 0;  // FLOP/s
  // Contention slows what runs on the cores: collectives on CPU too.
  double slowdown = 1.0;
};

RankRate ComputeRankRate(const TrainConfig& config, int64_t world_size,
                         int64_t ranks_per_host, const HostRates& rates,
                         const StepMesh& mesh, const RankLoads& loads) {
  RankRate r;
  r.gpu = config.device.rfind("cuda", 0) == 0;
  r.host_ranks = std::max<int64_t>(1, std::min(ranks_per_host, world_size));
  r.threads_per_rank = r.gpu ? 1 : config.ThreadsPerRank(r.host_ranks);
  if (!r.gpu) {
    const double busy = static_cast<double>(r.host_ranks) *
                        loads.all_stage_flops /
                        (static_cast<double>(mesh.stages) * loads.stage_flops);
    r.share =
        std::min(1.0, static_cast<double>(rates.cores) /
                          (busy * static_cast<double>(r.threads_per_rank)));
  }
  r.rate = rates.flops_per_thread * static_cast<double>(r.threads_per_rank) *
           r.share;
  r.slowdown = r.gpu ? 1.0 : 1.0 / r.share;
  return r;
}

// Compute: the slowest stage's forward (3x with the backward, once more
// for recomputed blocks), 1/T of it under tensor parallelism; and the
// pipeline's bubble.
// zb-h1's idle time against 1F1B's, on paper (SimulatePipeline) at even
// stages and a backward twice a forward: what runs W in 1F1B's drain.
double ZeroBubbleIdleShare(int64_t stages, int64_t micro_batches) {
  absl::StatusOr<PipelineTimeline> zb = SimulatePipeline(
      PipelineSchedule::kZeroBubble, stages, micro_batches, 1.0, 2.0);
  absl::StatusOr<PipelineTimeline> one = SimulatePipeline(
      PipelineSchedule::kOneFOneB, stages, micro_batches, 1.0, 2.0);
  if (!zb.ok() || !one.ok() || one->bubble_fraction <= 0) return 1.0;
  const double busy = 3.0 * static_cast<double>(micro_batches);
  return (zb->makespan - busy) / (one->makespan - busy);
}

void AddComputeSeconds(const TrainConfig& config, const StepMesh& mesh,
                       const RankLoads& loads, const RankRate& rate,
                       const HostRates& rates, StepTimePlan* plan) {
  const double step_flops = loads.stage_flops *
                            static_cast<double>(mesh.tokens * mesh.accum) /
                            static_cast<double>(mesh.tp);
  // Each micro-batch's pass pays the measured overhead, the rank's share of
  // the model's work of it (its operators are as many under tensor
  // parallelism, only smaller); on a shared core, slower as the FLOPs are.
  const double pass_overhead = rates.pass_overhead_seconds / rate.share;
  const double stage_share = loads.stage_flops / loads.all_stage_flops;
  const double passes = static_cast<double>(mesh.micro * mesh.accum);
  plan->compute_seconds =
      step_flops / rate.rate + passes * pass_overhead * stage_share;
  if (mesh.stages > 1) {
    // A step's M x accum micro-batches flow through the stages once: the
    // slowest stage sets the pace, and the others' time on one micro-batch
    // fills and drains the pipe (t = (M - 1) t_max + sum of t_s); in
    // chunks of 1/V of it when interleaved ((S-1)/(V·M+S-1) of the step
    // with uniform stages, SimulatePipeline).
    plan->bubble_seconds =
        (loads.all_stage_flops - loads.stage_flops) *
            static_cast<double>(mesh.tokens) /
            static_cast<double>(mesh.micro * mesh.tp * mesh.chunks) /
            rate.rate +
        pass_overhead * (1 - stage_share) / static_cast<double>(mesh.chunks);
    // zb-h1 runs weight gradients where 1F1B waits: the share of 1F1B's
    // idle time its order leaves.
    if (config.pipeline_schedule == "zb-h1") {
      plan->bubble_seconds *=
          ZeroBubbleIdleShare(mesh.stages, mesh.micro * mesh.accum);
    }
  }
}

// Parameters the rank keeps and updates (the slowest stage's).
struct KeptParameters {
  int64_t blocks = 0;
  int64_t block_params = 0;
  int64_t wte = 0;
  int64_t root = 0;
  bool has_wte = false;
  int64_t kept = 0;
  bool fsdp = false;  // FSDP or HSDP
  int64_t shard_ranks = 1;
};

KeptParameters CountKeptParameters(const TrainConfig& config,
                                   const StepMesh& mesh,
                                   const PipelineStage& slowest,
                                   int64_t host_ranks) {
  const ModelConfig& model = mesh.model;
  KeptParameters k;
  k.blocks = slowest.end_block - slowest.first_block;
  k.block_params = BlockParameters(model);
  k.wte = model.padded_vocab_size * mesh.c;
  k.root =
      (mesh.stages == 1 || slowest.embeddings ? model.InputParameters() : 0) +
      (slowest.head ? model.OutputParameters() : 0);
  k.has_wte = slowest.embeddings || (slowest.head && model.tied_head());
  k.kept = k.blocks * k.block_params + k.root + (k.has_wte ? k.wte : 0);
  if (mesh.tp > 1) {
    const int64_t replicated = TensorParallelReplicated(model);
    k.kept = (k.kept - replicated) / mesh.tp + replicated;
  }
  const std::string& dp = config.strategy;
  k.fsdp = dp == "fsdp" || dp == "hsdp";
  if (k.fsdp && mesh.data > 1) {
    // HSDP's groups as the engine forms them (the default: two replicas on
    // one host).
    k.shard_ranks = dp == "hsdp"
                        ? ResolveShardGroupSize(config.shard_group_size,
                                                mesh.data, host_ranks)
                        : mesh.data;
  }
  return k;
}

// AdamW updates the rank's shard; the gradients are made whole for the
// gathered units (all but FSDP's vocabulary-parallel wte, which has only
// its rows').
double OptimizerSeconds(const StepMesh& mesh, const KeptParameters& k,
                        const HostRates& rates, const RankRate& rate) {
  const int64_t sharded_wte =
      k.fsdp && mesh.stages == 1 && mesh.tp == 1 && k.shard_ranks > 1 ? k.wte
                                                                      : 0;
  const int64_t gradient_params =
      k.kept - sharded_wte + sharded_wte / k.shard_ranks;
  return (static_cast<double>(k.kept / k.shard_ranks) *
              rates.optimizer_seconds_per_parameter +
          static_cast<double>(gradient_params) *
              rates.gradient_seconds_per_parameter) /
         (static_cast<double>(rate.threads_per_rank) * rate.share);
}

constexpr int64_t kHeadChunks = 1;

// The links a group's collectives run over, and how much slower than
// measured they run (RankRate::slowdown).
struct Links {
  const LinkRates* intra = nullptr;
  const LinkRates* inter = nullptr;
  int64_t ranks_per_host = 1;
  double slowdown = 1.0;
  // A group whose ranks span hosts runs at the slower link.
  const LinkRates& For(int64_t stride, int64_t ranks) const {
    return stride * ranks > ranks_per_host ? *inter : *intra;
  }
};

// The data-parallel dimension's traffic: DDP's buckets, or FSDP's and
// HSDP's units (and HSDP's average across its groups).
void AddDataParallelTraffic(const TrainConfig& config, const StepMesh& mesh,
                            const KeptParameters& k, const Links& links,
                            StepTimePlan* plan) {
  const int64_t data = mesh.data;
  if (data <= 1) return;
  Traffic t;
  const int64_t dp_stride = mesh.tp;  // data ranks lie outside the tensor ones
  if (config.strategy == "ddp") {
    const double bytes = static_cast<double>(k.kept * kFloatBytes);
    const double bucket = std::max(1.0, config.bucket_mb * 1024 * 1024);
    const int64_t buckets =
        std::max<int64_t>(1, static_cast<int64_t>(std::ceil(bytes / bucket)));
    t.Add(Op::kAllReduce, data, buckets, bytes / buckets);
    plan->traffic.push_back(Finish("data-parallel", data, t,
                                   links.For(dp_stride, data), links.slowdown));
    return;
  }
  if (!k.fsdp) return;
  if (mesh.stages > 1 || mesh.tp > 1) {
    // Within a stage (or of a tensor-parallel rank's slices) every
    // unit, wte too, is gathered once per step and its gradient
    // reduce-scattered once.
    const double stage_bytes = static_cast<double>(k.kept * kFloatBytes);
    const int64_t units = k.blocks + 1 + (k.has_wte ? 1 : 0);
    t.Add(Op::kAllGather, k.shard_ranks, units, stage_bytes / units);
    t.Add(Op::kReduceScatter, k.shard_ranks, units, stage_bytes / units);
  } else {
    for (int64_t a = 0; a < mesh.accum; ++a) {
      const bool reduce = !config.fsdp_no_sync || a + 1 == mesh.accum;
      AddFsdp(&t, k.shard_ranks, k.blocks, k.block_params, k.root,
              config.reshard_after_forward, reduce, mesh.tokens, mesh.c,
              kHeadChunks, /*embeddings=*/true, /*head=*/true);
    }
  }
  t.Add(Op::kAllReduce, k.shard_ranks, 1, kFloatBytes);  // grad norm
  plan->traffic.push_back(Finish(
      k.shard_ranks == data ? "data-parallel" : "shard-group", k.shard_ranks, t,
      links.For(dp_stride, k.shard_ranks), links.slowdown));
  if (k.shard_ranks < data) {
    Traffic across;
    const int64_t replicas = data / k.shard_ranks;
    across.Add(Op::kAllReduce, replicas, k.blocks + 2,
               static_cast<double>(k.kept * kFloatBytes) /
                   static_cast<double>(k.shard_ranks * (k.blocks + 2)));
    plan->traffic.push_back(
        Finish("replica", replicas, across,
               links.For(dp_stride * k.shard_ranks, replicas), links.slowdown));
  }
}

// What of the tensor group's traffic can hide: f's backward sums, behind
// the column-parallel weights' gradients.
struct TensorOverlap {
  double f_seconds = 0;
  double column_weight_gradient_seconds = 0;
};

// The column-parallel matrices' forward FLOPs per token of one block.
double ColumnParallelFlops(const ModelConfig& model) {
  return 2.0 * static_cast<double>(model.n_embd) *
         static_cast<double>(ShapesOf(model).column_parallel_width);
}

TensorOverlap AddTensorParallelTraffic(const StepMesh& mesh,
                                       const KeptParameters& k,
                                       const PipelineStage& slowest,
                                       int64_t act_bytes, double rate,
                                       const Links& links, StepTimePlan* plan) {
  TensorOverlap overlap;
  const int64_t tp = mesh.tp;
  if (tp <= 1) return overlap;
  Traffic t;
  const int64_t recomputed =
      mesh.every > 0 ? (slowest.end_block - slowest.first_block) / mesh.every
                     : 0;
  const double act = static_cast<double>(act_bytes);
  for (int64_t a = 0; a < mesh.accum; ++a) {
    // Megatron's g forward and f backward, per attention and MLP.
    t.Add(Op::kAllReduce, tp, 4 * k.blocks + 2 * recomputed, act);
    if (slowest.embeddings || mesh.stages == 1) {
      t.Add(Op::kAllReduce, tp, 1, act);  // the embeddings' lookups
    }
    if (slowest.head || mesh.stages == 1) {
      t.Add(Op::kAllGather, tp, kHeadChunks,
            3.0 * static_cast<double>(tp * mesh.tokens * kFloatBytes) /
                static_cast<double>(kHeadChunks));
      const double head_dx =
          static_cast<double>(mesh.tokens * mesh.c * kFloatBytes);
      t.Add(Op::kAllReduce, tp, 1, head_dx);
    }
  }
  const double replicated =
      static_cast<double>(TensorParallelReplicated(mesh.model) * kFloatBytes);
  t.Add(Op::kAllReduce, tp, 1, replicated);
  plan->traffic.push_back(
      Finish("tensor-parallel", tp, t, links.For(1, tp), links.slowdown));
  // f's sums of the input gradient (two per block) go while the
  // column-parallel weights' gradients are computed (EnterLinear): the
  // time they can hide behind is those products', a forward's worth of
  // the column-parallel matrices per token.
  Traffic f;
  f.Add(Op::kAllReduce, tp, 2 * k.blocks * mesh.accum, act);
  overlap.f_seconds =
      Finish("f", tp, f, links.For(1, tp), links.slowdown).seconds;
  overlap.column_weight_gradient_seconds =
      ColumnParallelFlops(mesh.model) *
      static_cast<double>(k.blocks * mesh.tokens * mesh.accum) /
      static_cast<double>(tp) / rate;
  return overlap;
}

void AddPipelineTraffic(const StepMesh& mesh, const RankLoads& loads,
                        const KeptParameters& k, int64_t act_bytes,
                        const Links& links, StepTimePlan* plan) {
  if (mesh.stages <= 1) return;
  Traffic t;
  const int64_t stride = mesh.tp * mesh.data;
  // Activations forward and their gradients backward, per micro-batch,
  // for a middle stage both ways (each chunk's, interleaved); the tied
  // wte between the end stages.
  const int64_t directions = loads.rank_directions[loads.slowest_rank];
  t.Add(Op::kSend, 2, mesh.micro * mesh.accum * directions,
        static_cast<double>(act_bytes) / static_cast<double>(mesh.micro));
  if (k.has_wte) {
    t.Add(Op::kAllReduce, 2, 1,
          static_cast<double>(k.wte / mesh.tp * kFloatBytes /
                              (k.fsdp ? k.shard_ranks : 1)));
  }
  plan->traffic.push_back(Finish("pipeline", mesh.stages, t,
                                 links.For(stride, mesh.stages),
                                 links.slowdown));
}

// What `plan`'s traffic adds to the step.
//
// On GPUs (NCCL) the data-parallel traffic runs beside the computation
// where the engine launches it during it:
//   - DDP, FSDP and HSDP alone: the backward that reduces (buckets,
//     per-unit reduce-scatters and prefetched gathers): every micro-step's
//     for FSDP and HSDP, the last one's for DDP and under --fsdp-no-sync;
//   - with pipeline stages or tensor ranks: the step's last micro-batch's
//     backward (under zb-h1 its W), by the replicated stages' and DDP x TP's
//     buckets, and by
//     the sharded meshes' (PP x FSDP, TP x FSDP) per-unit reduce-scatters;
//     those meshes' all-gathers, launched at the step's start and waited
//     for block by block, beside its first micro-batch's forward (both
//     UnitSchedule); a pipeline's HSDP average across groups, after the
//     schedule, stays exposed;
//   - of the tensor group's own traffic, f's backward sums behind the
//     column-parallel weights' gradients.
// Each overlapped part keeps its last call exposed (the computation it
// hides behind ends before it can).
double ExposedCommSeconds(const StepTimePlan& plan, const StepMesh& mesh,
                          bool gpu, bool fsdp, bool reduces_every_micro_step,
                          bool split_backward, const TensorOverlap& overlap) {
  double backward_window = 0, forward_window = 0;
  bool composed_shards = false;
  if (gpu) {
    const bool alone = mesh.stages == 1 && mesh.tp == 1;
    const double pieces = alone && reduces_every_micro_step
                              ? 1.0
                              : static_cast<double>(mesh.micro * mesh.accum);
    // zb-h1 arms the reduction at the last W: the weights' half of the
    // last micro-batch's backward.
    backward_window =
        plan.compute_seconds * 2 / 3 / pieces / (split_backward ? 2 : 1);
    forward_window = plan.compute_seconds / 3 / pieces;
    composed_shards = fsdp && !alone;
  }
  // What hides of `seconds` (over `calls` collectives) behind `window`.
  const auto exposed = [](double seconds, int64_t calls, double window) {
    return std::max(seconds - window,
                    seconds / static_cast<double>(std::max<int64_t>(1, calls)));
  };
  double comm = 0;
  for (const MeshTraffic& t : plan.traffic) {
    const bool reduction = t.dimension == "data-parallel" ||
                           t.dimension == "replica" ||
                           t.dimension == "shard-group";
    if (backward_window > 0 && reduction && composed_shards) {
      if (t.dimension == "replica" && mesh.stages > 1) {
        comm += t.seconds;  // HSDP's average after a pipeline's schedule
      } else {
        // Half all-gathers, half reduce-scatters, unit by unit.
        const int64_t calls = std::max<int64_t>(1, t.calls / 2);
        comm += exposed(t.seconds / 2, calls, forward_window) +
                exposed(t.seconds / 2, calls, backward_window);
      }
    } else if (backward_window > 0 && reduction) {
      comm += exposed(t.seconds, t.calls, backward_window);
    } else if (gpu && t.dimension == "tensor-parallel") {
      comm += t.seconds - std::min(overlap.f_seconds,
                                   overlap.column_weight_gradient_seconds);
    } else {
      comm += t.seconds;
    }
  }
  return comm;
}

}  // namespace

absl::StatusOr<StepTimePlan> PlanStepTime(const TrainConfig& config,
                                          int64_t world_size,
                                          int64_t ranks_per_host,
                                          const HostRates& rates) {
  absl::StatusOr<StepMesh> mesh = ParseStepMesh(config, world_size, rates);
  if (!mesh.ok()) return mesh.status();
  StepTimePlan plan;
  plan.mesh = MeshName(config, world_size);
  plan.world_size = world_size;
  plan.data_parallel = mesh->data;
  plan.tensor_parallel = mesh->tp;
  plan.pipeline_stages = mesh->stages;
  plan.micro_batches = mesh->micro;
  plan.tokens_per_step = mesh->tokens * mesh->accum * mesh->data;

  const RankLoads loads = LoadRanks(*mesh, config.seq_len);
  const RankRate rate =
      ComputeRankRate(config, world_size, ranks_per_host, rates, *mesh, loads);
  plan.threads_per_rank = rate.threads_per_rank;
  AddComputeSeconds(config, *mesh, loads, rate, rates, &plan);
  const KeptParameters kept =
      CountKeptParameters(config, *mesh, loads.slowest(), rate.host_ranks);
  plan.optimizer_seconds = OptimizerSeconds(*mesh, kept, rates, rate);

  // Traffic, per dimension.
  const Links links{
      &rates.intra_node,
      rates.inter_node.known() ? &rates.inter_node : &rates.intra_node,
      ranks_per_host, rate.slowdown};
  const int64_t act_bytes =
      mesh->tokens * mesh->c *
      (config.precision == "bf16" && rate.gpu ? 2 : kFloatBytes);
  AddDataParallelTraffic(config, *mesh, kept, links, &plan);
  const TensorOverlap overlap = AddTensorParallelTraffic(
      *mesh, kept, loads.slowest(), act_bytes, rate.rate, links, &plan);
  AddPipelineTraffic(*mesh, loads, kept, act_bytes, links, &plan);

  plan.exposed_comm_seconds = ExposedCommSeconds(
      plan, *mesh, rate.gpu, kept.fsdp, kept.fsdp && !config.fsdp_no_sync,
      mesh->stages > 1 && config.pipeline_schedule == "zb-h1", overlap);
  plan.step_seconds = plan.compute_seconds + plan.bubble_seconds +
                      plan.optimizer_seconds + plan.exposed_comm_seconds;
  plan.tokens_per_second =
      static_cast<double>(plan.tokens_per_step) / plan.step_seconds;
  return plan;
}

std::string MeasuredAgainstPrediction(double predicted, double measured) {
  if (predicted <= 0) return "no prediction";
  const double off = measured / predicted - 1;
  if (std::abs(off) < 0.01) return "within 1% of the prediction";
  return absl::StrFormat("%.0f%% %s the prediction", 100 * std::abs(off),
                         off < 0 ? "below" : "above");
}

}  // namespace shardtrain
