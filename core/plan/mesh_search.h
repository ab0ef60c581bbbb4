// Which mesh to train on: every way of using the devices (data-parallel
// strategies, pipeline stages, tensor parallelism, each with and without
// activation checkpointing), its memory planned (memory_plan.h) against a
// budget and its step time predicted (step_time_plan.h), ranked fastest
// first. `shardtrain plan --fit` prints the ranking; `--strategy auto`
// trains the first. Torch-free.
#ifndef SHARDTRAIN_CORE_PLAN_MESH_SEARCH_H_
#define SHARDTRAIN_CORE_PLAN_MESH_SEARCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/memory_plan.h"
#include "core/plan/step_time_plan.h"
#include "core/run/train_config.h"

namespace shardtrain {

// What a search weighs at most, so that any input is answered (or refused
// naming the bound) within a second: devices, sequences per optimizer step,
// micro-batches per step.
inline constexpr int64_t kMaxSearchDevices = int64_t{1} << 16;
inline constexpr int64_t kMaxSearchGlobalBatch = int64_t{1} << 20;
inline constexpr int64_t kMaxSearchMicroBatches = int64_t{1} << 12;

struct MeshSearchOptions {
  int64_t devices = 1;         // every mesh uses all of them (single: one)
  int64_t ranks_per_host = 0;  // 0: all devices on one host
  int64_t budget = 0;          // bytes a rank may plan to (0: no limit)
  // Sequences per optimizer step, the same for every mesh (each replica's
  // share cut into the largest micro-batch that fits, accumulated); 0: each
  // mesh at the largest batch per replica that fits, no accumulation.
  int64_t global_batch = 0;
  // Only meshes whose data-parallel part is this strategy ("": those a
  // study at their data-parallel size includes; a strategy given is
  // included at any size it runs at).
  std::string strategy;
  // With `strategy`: also its meshes of one replica (stages or tensor ranks
  // over "single"), what an elastic job of that strategy may continue as.
  bool one_replica_too = false;
  // With global_batch: a rank's batch (sequences per micro-step) at most
  // this (0: any that fits the budget).
  int64_t max_batch = 0;
  bool checkpointing = true;  // also weigh activation checkpointing
  // Single on one device beside the meshes over all of them.
  bool single_too = false;
  // Meshes with pipeline stages and tensor parallelism; false: the
  // data-parallel strategies alone. pipeline_stages / tensor_parallel > 1:
  // only meshes of that many stages / tensor ranks.
  bool model_parallel = true;
  int64_t pipeline_stages = 0;
  int64_t tensor_parallel = 0;
};

struct MeshCandidate {
  // The base config with the mesh's strategy, pipeline_stages,
  // micro_batches, tensor_parallel, activation_checkpointing, batch_size and
  // grad_accum set: what a run of this mesh trains with.
  TrainConfig config;
  int64_t world_size = 1;
  std::string name;  // MeshName, + " +ckpt" with activation checkpointing
  bool fits = false;
  MemoryPlan memory;  // at config.batch_size (the smallest tried when !fits)
  StepTimePlan time;  // predicted, when rates were given
};

// InvalidArgument naming the bound a search past kMaxSearch* would cross
// (checked by SearchMeshes too; callers check first to refuse before any
// calibration).
absl::Status CheckSearchBounds(const TrainConfig& base,
                               const MeshSearchOptions& options);

// The candidates. With `rates`: those that fit first, fastest (most tokens
// per second) first, then those that do not, least memory first; without
// (nullptr), no time is predicted and they stay in the order the meshes are
// listed (strategies, pipelines, tensor parallelism; each without, then
// with activation checkpointing). Errors: a model spec that does not parse;
// rates that fail HostRates::Check().
absl::StatusOr<std::vector<MeshCandidate>> SearchMeshes(
    const TrainConfig& base, const MeshSearchOptions& options,
    const HostRates* rates);

// Why the first candidate wins over the second, in a sentence: "fsdp2 is
// 1.31x ddp2: it moves 2.1 MiB per step where ddp2 moves 26.1 MiB
// (data-parallel traffic 0.41 s of its 0.92 s step)".
std::string WhyFirstWins(const std::vector<MeshCandidate>& ranked);

// `--strategy auto`: the fastest mesh of `world_size` ranks
// (`ranks_per_host` per host) for `config`'s model and global batch
// (batch_size x grad_accum x world_size sequences per step) within
// config.memory_cap per rank (the plan's 98%; no limit when 0), over
// `rates`. InvalidArgument naming the least memory any mesh needs when none
// fits, or when no mesh can share the batch; SearchMeshes's errors.
absl::StatusOr<std::vector<MeshCandidate>> RankMeshesForAuto(
    const TrainConfig& config, int64_t world_size, int64_t ranks_per_host,
    const HostRates& rates);

// What `--strategy auto` can be refused for before any rates are known (at
// submit): no mesh of `world_size` ranks shares the global batch, or none
// fits config.memory_cap; InvalidArgument naming the least memory any mesh
// needs, as RankMeshesForAuto words it.
absl::Status CheckAutoCanFit(const TrainConfig& config, int64_t world_size);

// An elastic job continuing at `world` ranks (shrunk for another job,
// grown back, or after losing devices): the mesh it trains there.
struct ElasticMeshChoice {
  // The job's config with the mesh's fields, batch_size and grad_accum
  // set: the same global batch as at the job's own world size.
  TrainConfig config;
  std::string name;  // MeshName, + " +ckpt" with activation checkpointing
  // With rates: the step-time model's tokens/s for it; 0 without.
  double predicted_tokens_per_second = 0;
  // How it was chosen, in a sentence, for the job's events and logs.
  std::string why;
  // The meshes of that world size that fit, the chosen one among them (1:
  // nothing to choose, rates or not).
  int64_t candidates = 1;
};

// At `job_world` (the job's own world size) its own mesh, unchanged. Else
// the meshes of `world` ranks for the job's global batch (batch_size x
// grad_accum x its data-parallel size at `job_world`; strategy auto:
// x `job_world`, as auto counts it) within config.memory_cap per rank, else
// `device_memory` (0: no limit): those whose data-parallel part is the
// job's strategy, or one replica (auto: every strategy), with any pipeline
// stages and tensor ranks, with or without recomputing every block (weighed
// when memory is capped or the job recomputes), at no more sequences per
// rank than the job's batch_size; ranked by `rates` (the fastest that fits)
// or, with none, the job's own stages and tensor ranks first where they
// divide `world`, then in SearchMeshes's order. FailedPrecondition naming
// the numbers when no mesh of `world` ranks shares the batch or fits;
// SearchMeshes's errors.
absl::StatusOr<ElasticMeshChoice> ChooseElasticMesh(const TrainConfig& job,
                                                    int64_t job_world,
                                                    int64_t world,
                                                    const HostRates* rates,
                                                    int64_t device_memory = 0);

// The world sizes from `min_world` to `job_world` at which an elastic job
// with `job`'s config can continue (ChooseElasticMesh finds a mesh without
// rates), ascending.
std::vector<int64_t> ElasticWorldSizes(const TrainConfig& job,
                                       int64_t job_world, int64_t min_world,
                                       int64_t device_memory = 0);

// The mesh's fields as a YAML flow mapping ("{strategy: fsdp,
// pipeline-stages: 1, ...}") that ApplyYamlTrainConfig sets on a config:
// how a launcher hands its choice to its ranks.
std::string MeshFieldsYaml(const TrainConfig& chosen);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_PLAN_MESH_SEARCH_H_
