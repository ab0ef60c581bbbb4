#include "core/plan/mesh_search.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/model/model_config.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain {
namespace {

struct Mesh {
  std::string strategy;  // the data-parallel part
  int64_t stages = 1;
  int64_t tensor_parallel = 1;
  int64_t world = 1;
};

std::vector<Mesh> Meshes(const ModelConfig& model,
                         const MeshSearchOptions& options) {
  const int64_t n = options.devices;
  std::vector<Mesh> meshes;
  if (n == 1 || options.single_too) meshes.push_back({"single", 1, 1, 1});
  if (n == 1) return meshes;
  // The data-parallel strategies at `d` ranks: a study's, or the one asked
  // for wherever it runs.
  auto data_parallel = [&](int64_t d) {
    std::vector<std::string> names;
    if (!options.strategy.empty()) {
      const StrategyKind* kind = FindStrategyKind(options.strategy);
      if (kind != nullptr && kind->distributed == (d > 1)) {
        names.push_back(options.strategy);
      } else if (d == 1 && options.one_replica_too) {
        names.push_back("single");
      }
      return names;
    }
    for (const std::string& name : StudyStrategyNames(d)) {
      if (FindStrategyKind(name)->distributed == (d > 1)) {
        names.push_back(name);
      }
    }
    return names;
  };
  const bool only_stages = options.pipeline_stages > 1;
  const bool only_tensor = options.tensor_parallel > 1;
  if (!only_stages && !only_tensor) {
    for (const std::string& name : data_parallel(n)) {
      meshes.push_back({name, 1, 1, n});
    }
  }
  if (!options.model_parallel) return meshes;
  // Stages and tensor ranks: 1, 2, 4, 8, ... or the count asked for.
  auto counts = [&](int64_t asked, int64_t most) {
    std::vector<int64_t> out;
    if (asked > 1) {
      out.push_back(asked);
    } else {
      for (int64_t k = 1; k <= most; k *= 2) out.push_back(k);
    }
    return out;
  };
  // Pipelines first, then tensor parallelism, then both (3-D meshes).
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (stages, tensor)
  for (int64_t s :
       counts(options.pipeline_stages, std::min(n, model.n_layer))) {
    if (s > 1 && !only_tensor) shapes.emplace_back(s, 1);
  }
  for (int64_t t : counts(options.tensor_parallel, n)) {
    if (t > 1 && !only_stages) shapes.emplace_back(1, t);
  }
  for (int64_t s :
       counts(options.pipeline_stages, std::min(n, model.n_layer))) {
    for (int64_t t : counts(options.tensor_parallel, n)) {
      if (s > 1 && t > 1) shapes.emplace_back(s, t);
    }
  }
  for (const auto& [s, t] : shapes) {
    if (n % (s * t) != 0 || s > model.n_layer || model.n_head % t != 0 ||
        model.kv_heads() % t != 0 || model.mlp_hidden() % t != 0 ||
        model.padded_vocab_size % t != 0) {
      continue;
    }
    const int64_t d = n / (s * t);
    if (t == 1) {
      for (const std::string& name : data_parallel(d)) {
        meshes.push_back({name, s, 1, n});
      }
      continue;
    }
    // Tensor parallelism composes with one replica, DDP's or FSDP's.
    for (const char* name : {"single", "ddp", "fsdp"}) {
      if ((d == 1) != (std::string(name) == "single")) continue;
      if (options.strategy.empty() || options.strategy == name ||
          (options.one_replica_too && d == 1)) {
        meshes.push_back({name, s, t, n});
      }
    }
  }
  return meshes;
}

bool Fits(const MemoryPlan& plan, int64_t budget) {
  return budget <= 0 || plan.total() <= budget;
}

// A budget given (> 0) stays a limit however small.
int64_t Plannable(int64_t memory) {
  return memory > 0 ? std::max<int64_t>(1, PlannableBytes(memory)) : 0;
}

// The divisors of n > 0, largest first, in O(sqrt(n)).
std::vector<int64_t> DivisorsDescending(int64_t n) {
  std::vector<int64_t> small, large;
  for (int64_t k = 1; k * k <= n; ++k) {
    if (n % k != 0) continue;
    small.push_back(k);
    if (k != n / k) large.push_back(n / k);
  }
  std::vector<int64_t> out(large.begin(), large.end());
  out.insert(out.end(), small.rbegin(), small.rend());
  return out;
}

// Whether `a` ranks before `b`: fitting first, then faster, or (neither
// fitting) smaller.
bool Ahead(const MeshCandidate& a, const MeshCandidate& b) {
  if (a.fits != b.fits) return a.fits;
  if (a.fits) return a.time.tokens_per_second > b.time.tokens_per_second;
  return a.memory.total() < b.memory.total();
}

// `mesh` with `checkpointing` and `micro` micro-batches per step: its batch
// (the largest of the tries that fits), memory and (with rates) predicted
// step; none when no batch suits it or the plan cannot model it.
std::optional<MeshCandidate> EvaluateMesh(const TrainConfig& base,
                                          const MeshSearchOptions& options,
                                          const HostRates* rates,
                                          int64_t per_host, const Mesh& mesh,
                                          const char* checkpointing,
                                          int64_t micro) {
  // zb-h1 does not run beside tensor ranks (TrainConfig refuses it).
  if (mesh.stages > 1 && mesh.tensor_parallel > 1 &&
      base.pipeline_schedule == "zb-h1") {
    return std::nullopt;
  }
  MeshCandidate c;
  c.world_size = mesh.world;
  c.config = base;
  TrainConfig& config = c.config;
  config.strategy = mesh.strategy;
  config.pipeline_stages = mesh.stages;
  // Interleaving (--virtual-stages) applies to the meshes with stages.
  config.virtual_stages = mesh.stages > 1 ? base.virtual_stages : 1;
  config.tensor_parallel = mesh.tensor_parallel;
  config.micro_batches = micro;
  config.activation_checkpointing = checkpointing;
  if (mesh.strategy != "hsdp") config.shard_group_size = 0;
  const int64_t data = config.DataParallelSize(mesh.world);
  // The batches to try, largest first, each a multiple of the
  // micro-batches: a share of the global batch that divides it, or (no
  // global batch) the largest that fits.
  std::vector<std::pair<int64_t, int64_t>> tries;  // (batch, accum)
  if (options.global_batch > 0) {
    if (options.global_batch % data != 0) return std::nullopt;
    const int64_t share = options.global_batch / data;
    for (int64_t b : DivisorsDescending(share)) {
      if (options.max_batch > 0 && b > options.max_batch) continue;
      if (b % config.micro_batches == 0) tries.emplace_back(b, share / b);
    }
  } else if (options.budget > 0) {
    config.grad_accum = 1;
    absl::StatusOr<int64_t> largest =
        LargestFittingBatch(config, mesh.world, options.budget);
    if (!largest.ok()) return std::nullopt;  // a mesh the plan cannot model
    tries.emplace_back(std::max(*largest, config.micro_batches), 1);
  } else {
    tries.emplace_back(base.batch_size, std::max<int64_t>(1, base.grad_accum));
  }
  bool planned = false;
  for (const auto& [batch, accum] : tries) {
    config.batch_size = batch;
    config.grad_accum = accum;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, mesh.world);
    if (!plan.ok()) break;  // a mesh the plan cannot model
    planned = true;
    c.memory = *plan;
    if (Fits(*plan, options.budget)) {
      c.fits = true;
      break;
    }
  }
  if (!planned) return std::nullopt;
  c.name = MeshName(config, mesh.world);
  if (std::string(checkpointing) == "all") absl::StrAppend(&c.name, " +ckpt");
  if (rates != nullptr) {
    absl::StatusOr<StepTimePlan> time =
        PlanStepTime(config, mesh.world, per_host, *rates);
    // A mesh the time model cannot price keeps its row, untimed (0
    // tokens/s: ranked after the timed ones).
    if (time.ok()) c.time = *time;
  }
  return c;
}

}  // namespace

absl::Status CheckSearchBounds(const TrainConfig& base,
                               const MeshSearchOptions& options) {
  if (options.devices < 1 || options.devices > kMaxSearchDevices) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: ", options.devices, "; a search weighs 1 to ",
                     kMaxSearchDevices, " devices"));
  }
  if (options.global_batch < 0 ||
      options.global_batch > kMaxSearchGlobalBatch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "global batch: ", options.global_batch,
        " sequences; a search weighs up to ", kMaxSearchGlobalBatch));
  }
  if (base.micro_batches > kMaxSearchMicroBatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batches: ", base.micro_batches,
                     "; a search weighs up to ", kMaxSearchMicroBatches));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<MeshCandidate>> SearchMeshes(
    const TrainConfig& base, const MeshSearchOptions& options,
    const HostRates* rates) {
  if (rates != nullptr) {
    if (absl::Status s = rates->Check(); !s.ok()) return s;
  }
  absl::StatusOr<ModelConfig> model = ParseModelSpec(base.model);
  if (!model.ok()) return model.status();
  if (absl::Status s = CheckSearchBounds(base, options); !s.ok()) return s;
  const int64_t per_host =
      options.ranks_per_host > 0 ? options.ranks_per_host : options.devices;
  std::vector<MeshCandidate> out;
  for (const Mesh& mesh : Meshes(*model, options)) {
    for (const char* checkpointing : {"none", "all"}) {
      if (!options.checkpointing && std::string(checkpointing) == "all") {
        continue;
      }
      // A pipeline's micro-batches: as given, else (with rates to weigh
      // them) S, 2S or 4S, the fastest kept: more shrink the bubble
      // ((S-1)/(M+S-1)) and the micro-batches with it.
      std::vector<int64_t> micro_counts = {1};
      if (mesh.stages > 1) {
        if (base.micro_batches > 1) {
          micro_counts = {base.micro_batches};
        } else if (rates != nullptr) {
          micro_counts = {mesh.stages, 2 * mesh.stages, 4 * mesh.stages};
        } else {
          micro_counts = {mesh.stages};
        }
      }
      std::optional<MeshCandidate> best;
      for (int64_t micro : micro_counts) {
        std::optional<MeshCandidate> c = EvaluateMesh(
            base, options, rates, per_host, mesh, checkpointing, micro);
        if (c.has_value() && (!best.has_value() || Ahead(*c, *best))) {
          best = std::move(c);
        }
      }
      if (best.has_value()) out.push_back(std::move(*best));
    }
  }
  if (rates == nullptr) return out;
  std::stable_sort(out.begin(), out.end(), Ahead);
  return out;
}

std::string WhyFirstWins(const std::vector<MeshCandidate>& ranked) {
  if (ranked.empty() || !ranked[0].fits) return "";
  const MeshCandidate& a = ranked[0];
  if (ranked.size() < 2 || !ranked[1].fits) {
    return absl::StrCat(a.name, " is the only mesh that fits");
  }
  const MeshCandidate& b = ranked[1];
  // The part of the step where the runner-up loses most.
  struct Part {
    std::string name;
    double a, b;
  };
  auto traffic = [](const StepTimePlan& p) { return p.exposed_comm_seconds; };
  std::vector<Part> parts = {
      {"compute", a.time.compute_seconds, b.time.compute_seconds},
      {"AdamW and dense gradients", a.time.optimizer_seconds,
       b.time.optimizer_seconds},
      {"the pipeline bubble", a.time.bubble_seconds, b.time.bubble_seconds},
      {"collectives", traffic(a.time), traffic(b.time)}};
  const Part* worst = &parts[0];
  for (const Part& p : parts) {
    if (p.b - p.a > worst->b - worst->a) worst = &p;
  }
  const double ratio = a.time.tokens_per_second / b.time.tokens_per_second;
  // Steps of different global batches are compared per 1,000 tokens.
  const bool same_batch = a.time.tokens_per_step == b.time.tokens_per_step;
  const auto per = [&](double seconds, const MeshCandidate& m) {
    if (same_batch) return FormatDuration(seconds);
    return absl::StrCat(
        FormatDuration(seconds * 1000.0 /
                       std::max<int64_t>(1, m.time.tokens_per_step)),
        " per 1,000 tokens");
  };
  const std::string steps =
      same_batch ? absl::StrFormat("%s vs %s per step",
                                   FormatDuration(a.time.step_seconds),
                                   FormatDuration(b.time.step_seconds))
                 : absl::StrFormat(
                       "%s tokens/s vs %s",
                       FormatThousands(std::llround(a.time.tokens_per_second)),
                       FormatThousands(std::llround(b.time.tokens_per_second)));
  if (ratio < 1.02) {
    return absl::StrFormat(
        "%s and %s are predicted within %.1f%% of each other (%s), closer "
        "than the model can tell apart: measure both (shardtrain compare)",
        a.name, b.name, 100 * (ratio - 1), steps);
  }
  std::string why = absl::StrFormat(
      "%s predicts %.2fx the tokens/s of %s (%s): %s takes %s of %s's step "
      "and %s of %s's",
      a.name, ratio, b.name, steps, worst->name, per(worst->b, b), b.name,
      per(worst->a, a), a.name);
  if (worst->name == "collectives") {
    absl::StrAppend(&why, " (", b.name, " moves ",
                    FormatBytes(b.time.counted_bytes()), " per step, ", a.name,
                    " ", FormatBytes(a.time.counted_bytes()), ")");
  }
  // Where the model is known to err by more than the gap, say so.
  const auto model_parallel = [](const MeshCandidate& m) {
    return m.time.pipeline_stages > 1 || m.time.tensor_parallel > 1;
  };
  if (ratio < 1 + kComposedMeshModelError &&
      (model_parallel(a) || model_parallel(b))) {
    absl::StrAppend(
        &why,
        absl::StrFormat("; the step-time model has been off by up to %.0f%% on "
                        "meshes with pipeline stages or tensor parallelism "
                        "(bench/RESULTS.md), more than this gap: measure both "
                        "(shardtrain compare)",
                        100 * kComposedMeshModelError));
  }
  return why;
}

namespace {

// Refused unless some candidate of `ranked` fits (or, empty, when no mesh
// shares the batch), naming the least memory any needs.
absl::Status AutoCandidatesFit(const std::vector<MeshCandidate>& ranked,
                               const TrainConfig& config, int64_t world_size,
                               int64_t global_batch) {
  if (ranked.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strategy auto: no mesh of ", world_size,
        " ranks can share a global batch of ", global_batch, " sequences"));
  }
  const MeshCandidate* least = nullptr;
  for (const MeshCandidate& m : ranked) {
    if (m.fits) return absl::OkStatus();
    if (least == nullptr || m.memory.total() < least->memory.total()) {
      least = &m;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "strategy auto: no mesh of ", world_size, " ranks fits memory_cap ",
      FormatBytes(config.memory_cap), " (98% of it planned); the least is ",
      least->name, " at ", FormatBytes(least->memory.total()), " per rank, ",
      "batch ", least->config.batch_size));
}

MeshSearchOptions AutoSearch(const TrainConfig& config, int64_t world_size,
                             int64_t ranks_per_host) {
  MeshSearchOptions search;
  search.devices = world_size;
  search.ranks_per_host = ranks_per_host;
  search.budget = Plannable(config.memory_cap);
  search.global_batch =
      config.batch_size * std::max<int64_t>(1, config.grad_accum) * world_size;
  return search;
}

}  // namespace

absl::StatusOr<std::vector<MeshCandidate>> RankMeshesForAuto(
    const TrainConfig& config, int64_t world_size, int64_t ranks_per_host,
    const HostRates& rates) {
  const MeshSearchOptions search =
      AutoSearch(config, world_size, ranks_per_host);
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      SearchMeshes(config, search, &rates);
  if (!ranked.ok()) return ranked.status();
  if (absl::Status s =
          AutoCandidatesFit(*ranked, config, world_size, search.global_batch);
      !s.ok()) {
    return s;
  }
  return ranked;
}

absl::Status CheckAutoCanFit(const TrainConfig& config, int64_t world_size) {
  const MeshSearchOptions search = AutoSearch(config, world_size, 0);
  if (absl::Status s = CheckSearchBounds(config, search); !s.ok()) return s;
  absl::StatusOr<std::vector<MeshCandidate>> meshes =
      SearchMeshes(config, search, nullptr);
  if (!meshes.ok()) return meshes.status();
  return AutoCandidatesFit(*meshes, config, world_size, search.global_batch);
}

absl::StatusOr<ElasticMeshChoice> ChooseElasticMesh(const TrainConfig& job,
                                                    int64_t job_world,
                                                    int64_t world,
                                                    const HostRates* rates,
                                                    int64_t device_memory) {
  ElasticMeshChoice choice;
  const bool any_strategy = job.strategy == kAutoStrategy;
  if (world == job_world && !any_strategy) {
    choice.config = job;
    choice.name = MeshName(job, job_world);
    choice.why = "its own mesh at its own world size";
    if (rates != nullptr) {
      absl::StatusOr<StepTimePlan> time =
          PlanStepTime(job, job_world, job_world, *rates);
      if (time.ok())
        choice.predicted_tokens_per_second = time->tokens_per_second;
    }
    return choice;
  }
  // Auto counts every rank a data-parallel one (AutoSearch).
  const int64_t global =
      job.batch_size * std::max<int64_t>(1, job.grad_accum) *
      (any_strategy ? job_world : job.DataParallelSize(job_world));
  const int64_t memory = job.memory_cap > 0 ? job.memory_cap : device_memory;
  MeshSearchOptions search;
  search.devices = world;
  search.budget = Plannable(memory);
  search.global_batch = global;
  // Strategy auto: every strategy, as at its start.
  search.strategy = any_strategy ? "" : job.strategy;
  search.one_replica_too = !any_strategy;
  // Recomputation only costs time: weighed when memory may call for it.
  search.checkpointing = memory > 0 || job.activation_checkpointing != "none";
  // No larger a batch per rank than the job ran at: its activations fit
  // there.
  search.max_batch = job.batch_size;
  TrainConfig base = job;
  base.micro_batches = 1;  // each mesh's own (SearchMeshes)
  absl::StatusOr<std::vector<MeshCandidate>> found =
      SearchMeshes(base, search, rates);
  if (!found.ok()) return found.status();
  std::vector<MeshCandidate> ranked;
  for (MeshCandidate& c : *found) {
    if (c.fits && c.config.CheckMeshWorld(world).ok()) {
      ranked.push_back(std::move(c));
    }
  }
  if (ranked.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no ", any_strategy ? "" : job.strategy + " ", "mesh of ", world,
        " ranks shares the ", global, " sequences per step at ", job.batch_size,
        " or fewer per rank",
        job.memory_cap > 0
            ? absl::StrCat(" within memory_cap ", FormatBytes(job.memory_cap))
        : memory > 0 ? absl::StrCat(" within a device's ", FormatBytes(memory))
                     : ""));
  }
  const bool timed = rates != nullptr && ranked.front().time.step_seconds > 0;
  if (!timed) {
    // Its own stages and tensor ranks where they divide the ranks.
    std::stable_partition(
        ranked.begin(), ranked.end(), [&](const MeshCandidate& c) {
          return c.config.pipeline_stages == job.pipeline_stages &&
                 c.config.tensor_parallel == job.tensor_parallel;
        });
  }
  const MeshCandidate& chosen = ranked.front();
  choice.candidates = static_cast<int64_t>(ranked.size());
  choice.config = chosen.config;
  choice.config.memory_cap = job.memory_cap;
  choice.name = chosen.name;
  if (ranked.size() == 1) {
    choice.why = absl::StrCat("the only mesh of ", world,
                              world == 1 ? " rank" : " ranks", " that shares ",
                              global, " sequences per step");
    if (timed) {
      choice.predicted_tokens_per_second = chosen.time.tokens_per_second;
    }
  } else if (timed) {
    choice.predicted_tokens_per_second = chosen.time.tokens_per_second;
    const std::string why = WhyFirstWins(ranked);
    choice.why = absl::StrCat(
        "the fastest of ", ranked.size(), " meshes of ", world,
        " ranks that fit, by the step-time model (rates of ", rates->device,
        " measured ", rates->measured_at, ")", why.empty() ? "" : ": ", why);
  } else {
    choice.why = absl::StrCat(
        "no measured rates (shardtrain-train --calibrate): its own stages "
        "and tensor ranks where they divide ",
        world, " ranks, else the first of ", ranked.size(), " meshes that fit");
  }
  return choice;
}

std::vector<int64_t> ElasticWorldSizes(const TrainConfig& job,
                                       int64_t job_world, int64_t min_world,
                                       int64_t device_memory) {
  std::vector<int64_t> worlds;
  for (int64_t w = std::max<int64_t>(1, min_world); w <= job_world; ++w) {
    if (ChooseElasticMesh(job, job_world, w, nullptr, device_memory).ok()) {
      worlds.push_back(w);
    }
  }
  return worlds;
}

std::string MeshFieldsYaml(const TrainConfig& c) {
  return absl::StrCat(
      "{strategy: ", c.strategy, ", pipeline-stages: ", c.pipeline_stages,
      ", tensor-parallel: ", c.tensor_parallel,
      ", micro-batches: ", c.micro_batches,
      ", activation-checkpointing: ", c.activation_checkpointing,
      ", batch-size: ", c.batch_size, ", grad-accum: ", c.grad_accum,
      ", shard-group-size: ", c.shard_group_size, "}");
}

}  // namespace shardtrain
