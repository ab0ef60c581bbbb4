// PipelineStrategy: model parallelism by layers. The world is a mesh of S
// pipeline stages × D data-parallel replicas (core/run/device_mesh.h):
// stage s holds a contiguous run of the model's blocks (stage 0 also the
// embeddings, the last stage the final norm and the tied LM head; the
// model's PipelineCuts place them), and the ranks of one stage are D
// replicas of it that see different data.
//
// A step's micro-batches (the trainer's accumulation steps, each cut into
// `micro_batches` pieces) flow through the stages in the order the schedule
// gives (GPipe or 1F1B): activations forward and their gradients backward,
// point-to-point to the same replica's neighbouring stage, sends posted
// asynchronously so no stage waits on its own send. Then, once per step:
//   - the tied weight: the token embedding is held by stage 0 and the last
//     stage (the head); their gradients are summed between the two, so both
//     copies take the same update and stay one parameter in value, and the
//     training math is single-device's (Megatron's embedding group);
//   - data parallelism: each stage's gradients are averaged over its D
//     replicas in DDP's buckets (GradientBuckets), launched as the step's
//     last backward completes them, so the reduction overlaps it (with
//     tensor ranks: one coalesced all-reduce after the schedule);
//   - the gradient norm is summed over the stages (the tied weight counted
//     once).
// Checkpoints hold every tensor by its global name (stage 0 writes the tied
// weight, the
// replicas of a stage an even share each), so they load at any mesh.
//
// With FSDP as the data-parallel part, a stage's D ranks shard it instead of
// replicating it: each of the stage's blocks is an FsdpUnit over the stage's
// replica group, and so are the token embedding (alone, so that the first
// and last stage shard it alike and sum their gradient shard by shard) and
// the stage's other tensors outside the blocks. A rank keeps 1/D of its
// stage's parameters, gradients and AdamW state between steps. Within a step
// the stage's units are gathered once, before the first micro-batch, and
// kept until its last backward (FSDP without resharding after forward, as
// pipelined FSDP is run elsewhere: gathering per micro-batch would repeat
// every all-gather M times). Each unit's gradient is reduce-scattered (mean
// over the replicas) into its shard as soon as the step's last backward has
// completed it, while that backward goes on through the stage's earlier
// blocks; the full buffers are freed after the schedule.
//
// With HSDP, the stage's D ranks are D / G shard groups of G consecutive
// ranks (the mesh's replicate x shard dimensions): each group shards the
// stage as FSDP does, and after the reduce-scatter the ranks holding the
// same shard in the stage's groups average it (one all-reduce per unit), so
// only that traffic crosses groups. A shard group of one rank replicates the
// stage, as DDP does.
//
// With tensor parallelism (PipelineOptions::tensor_parallel T > 1, Megatron's
// 3-D layout without the sharding), each replica of a stage is T ranks that
// split its blocks as TensorParallelStrategy does (the mesh is stages x
// replicas x tensor ranks, the tensor ranks innermost): the first stage's
// embedding and the last stage's head are vocabulary-parallel over the T
// ranks' rows of the token embedding, the blocks run Megatron's f and g over
// the stage's
// tensor group, and tensor rank t of a stage exchanges activations and their
// gradients with tensor rank t of its neighbours (each holds them whole
// after g). The tied gradient is summed between the end stages' ranks
// holding the same rows; replicas average as with DDP, or shard the
// stage's slices as FSDP within a stage does (PP x TP x FSDP); HSDP within
// them is not built.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_PIPELINE_STRATEGY_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_PIPELINE_STRATEGY_H_

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/pipeline_plan.h"
#include "core/run/device_mesh.h"
#include "worker/engine/comm/mesh_groups.h"
#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/fsdp_unit.h"
#include "worker/engine/strategy/gradient_buckets.h"
#include "worker/engine/strategy/strategy.h"
#include "worker/engine/strategy/tensor_parallel_layer.h"
#include "worker/engine/strategy/unit_schedule.h"
#include "worker/engine/strategy/vocab_parallel.h"

namespace shardtrain {

struct PipelineOptions {
  int64_t stages = 2;
  std::vector<int64_t> split;  // empty: balanced (PartitionPipeline)
  int64_t micro_batches = 1;   // per trainer micro-batch; must divide its rows
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  // Chunks per rank (interleaved schedules): the model is cut into stages x
  // virtual_stages model stages, rank s running s, s + S, ... in turn.
  int64_t virtual_stages = 1;
  int64_t seq_len = 1024;  // for the balanced cut's costs
  // The data-parallel part's name ("single": one replica, "ddp", "fsdp",
  // "hsdp").
  std::string data_parallel = "single";
  // hsdp: ranks per shard group, dividing the stage's ranks (0: the default
  // of DefaultShardGroupSize over the stage's ranks).
  int64_t shard_group_size = 0;
  // Tensor-parallel ranks per stage replica (1: none).
  int64_t tensor_parallel = 1;
  // Replicated stages: the gradient buckets' size (--bucket-mb).
  double bucket_mb = 25;
  // What activations and their gradients cross between stages in: the
  // compute dtype (ComputeDtype: bf16 under CUDA mixed precision, else fp32)
  // when Undefined. A stage computes as before whatever crosses: it makes a
  // received activation fp32 (the residual stream's dtype) on arrival, and
  // sends what it made cast to this.
  torch::ScalarType wire_dtype = torch::ScalarType::Undefined;
  // How the schedule becomes every stage's ops in the order each posts them
  // (index = stage); LowerAllStages when empty. Whatever it gives is run
  // under NCCL's rule first (CheckPointToPointOrder): Setup refuses an order
  // whose transfers would not complete. Tests hand in one that would not.
  std::function<absl::StatusOr<std::vector<std::vector<PipelineOp>>>(
      PipelineSchedule schedule, int64_t stages, int64_t micro_batches,
      int64_t virtual_stages)>
      lower;
};

class PipelineStrategy final : public Strategy {
 public:
  // `world` (all S × D ranks) must outlive the strategy.
  PipelineStrategy(const StrategyOptions& options, Communicator* world,
                   PipelineOptions pipeline);
  ~PipelineStrategy() override;

  std::string name() const override { return pipeline_.data_parallel; }
  int64_t rank() const override { return options_.rank; }
  int64_t world_size() const override { return options_.world_size; }
  std::string layout() const override { return layout_; }
  int64_t data_parallel_rank() const override;
  int64_t data_parallel_size() const override;
  int64_t pipeline_stage() const override { return stage_; }

  absl::Status Setup(CausalLm model) override;
  torch::Tensor ForwardBackwardStep(const std::vector<Batch>& batches) override;
  // One accumulation micro-batch through the whole pipeline (its own fill
  // and drain); gradients synchronised when `sync`.
  torch::Tensor ForwardBackward(const torch::Tensor& inputs,
                                const torch::Tensor& targets, double loss_scale,
                                bool sync) override;
  void OptimizerStep(double lr) override;
  torch::Tensor ForwardLoss(const torch::Tensor& inputs,
                            const torch::Tensor& targets) override;
  double AllReduceMean(double value) override;
  void Barrier() override;
  std::vector<HeldPiece> HeldPieces() override;
  const AdamW& optimizer() const override { return *optimizer_; }
  torch::Device device() const override { return options_.device; }
  CausalLmImpl& model() override { return *model_; }
  int64_t optimizer_steps() const override;
  void set_optimizer_steps(int64_t steps) override;
  int64_t ModelStateBytes() const override;
  CommStats TakeCommStats() override;

  // A replicated stage's last reduction: when each bucket launched against
  // when the schedule ended (empty without replica buckets).
  GradientBuckets::OverlapTrace replica_overlap_trace() const {
    return replica_buckets_ != nullptr ? replica_buckets_->last_overlap_trace()
                                       : GradientBuckets::OverlapTrace{};
  }
  // A sharded stage's last reduction: when each unit's reduce-scatter
  // launched (in launch order; those the last backward completed first)
  // against when the schedule ended.
  using ShardOverlapTrace = UnitSchedule::OverlapTrace;
  ShardOverlapTrace shard_overlap_trace() const {
    return unit_schedule_ != nullptr ? unit_schedule_->trace()
                                     : ShardOverlapTrace{};
  }
  // A sharded stage's last step, in order: "unit NAME ready" as the forward
  // waited for each unit's gather, "block I" as a block's forward started
  // while gathers were still outstanding.
  std::vector<std::string> gather_trace() const {
    return unit_schedule_ != nullptr ? unit_schedule_->gather_trace()
                                     : std::vector<std::string>{};
  }

  // zb-h1: how many layers' weight gradients the last step's B left for
  // its W (0 under the other schedules).
  int64_t deferred_weight_gradients() const {
    return deferred_weight_gradients_;
  }

  // The stage this rank runs and what it holds (after Setup).
  int64_t stage() const { return stage_; }
  const std::vector<PipelineStage>& stages() const { return partition_; }

 private:
  struct InFlight;  // a micro-batch between its forward and its backward

  Communicator* placement_world() const override { return world_; }

  // Whether this rank holds the embeddings (model stage 0) or the head (the
  // last model stage).
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ + 1 == pipeline_.stages; }
  int64_t chunks() const { return pipeline_.virtual_stages; }
  // The model stage this rank runs as its chunk `chunk`, and what it holds.
  int64_t ModelStage(int64_t chunk) const {
    return ModelStageOf(pipeline_.stages, stage_, chunk);
  }
  const PipelineStage& Chunk(int64_t chunk) const {
    return partition_[ModelStage(chunk)];
  }
  bool EmbedsIn(int64_t chunk) const { return ModelStage(chunk) == 0; }
  bool HeadIn(int64_t chunk) const {
    return ModelStage(chunk) + 1 == static_cast<int64_t>(partition_.size());
  }
  // The parameters this stage holds, by global name.
  bool Owns(const std::string& name) const { return Holds(stage_, name); }
  // Whether pipeline rank `stage` holds global parameter `name` in any of
  // its chunks (its place in the model and the cut).
  bool Holds(int64_t stage, const std::string& name) const;
  bool IsTokenEmbedding(const std::string& name) const;
  // The chunk of this rank that holds a parameter at `place` (one this
  // rank owns): its block's, else the embeddings' or the head's.
  int64_t ChunkHolding(const ParamPlace& place) const;
  // `batch` cut into the pipeline's micro-batches.
  std::vector<Batch> Split(const Batch& batch) const;
  // Runs `micro` through the schedule, each loss's gradient scaled by
  // `scale`; returns this replica's mean loss, on every stage. With
  // `reduce`, a replicated stage's buckets start reducing over its replicas
  // during the last backward (SynchronizeGradients finishes them).
  torch::Tensor RunSchedule(const std::vector<Batch>& micro, double scale,
                            bool reduce);
  // This stage's ops for `count` micro-batches, lowered once (every
  // stage's, so that their transfers are checked against each other under
  // NCCL's rule before any is posted); FailedPrecondition naming the two
  // transfers that would face each other forever.
  absl::StatusOr<const std::vector<PipelineOp>*> StageOps(int64_t count);
  // `scale`: the gradient scale the last stage's loss will be
  // backpropagated with (the vocabulary-parallel head applies it in
  // forward).
  void Forward(InFlight& m, const Batch& batch, double scale, int64_t chunk);
  // The first stage's embeddings and the last stage's loss, whole or
  // vocabulary-parallel (tensor parallelism).
  torch::Tensor Embed(const torch::Tensor& inputs);
  torch::Tensor HeadLoss(const torch::Tensor& x, const torch::Tensor& targets,
                         double scale);
  int64_t tensor_parallel() const { return pipeline_.tensor_parallel; }
  void Backward(InFlight& m, double scale, int64_t chunk);
  // Sum of the token embedding's gradient between the first and last stage; the
  // average of every gradient over the stage's replicas.
  void SynchronizeGradients();
  // FSDP within the stage: the stage's parameters made into units sharded
  // over its replicas (Setup); all units gathered for a step's computation;
  // their gradients reduce-scattered into the shards and the units freed.
  absl::Status ShardStage();
  bool sharded() const { return !units_.empty(); }
  // zb-h1: each backward is B, then W apart.
  bool SplitsBackward() const {
    return pipeline_.schedule == PipelineSchedule::kZeroBubble;
  }
  // Within a step, the units are gathered as the stage's first forward
  // needs them, and each reduce-scattered as its chunk's last backward
  // completes it (unit_schedule_). They stay gathered until the step's
  // last backward (no resharding between micro-batches).
  // Waits for the units before `end` (in unit order) and points the model
  // at each; nothing when they are ready or the stage is not sharded.
  void NeedUnits(size_t end);
  // A unit just gathered: the vocabulary-parallel ends or the leaf over
  // the embedding's or head's rows pointed at it.
  void UseGatheredUnit(FsdpUnit* unit);
  // Every unit, now (evaluation).
  void GatherUnits();
  // How many units the forward needs before block `i` runs: those before
  // its unit, or with `through`, its unit too (every unit if it has none).
  size_t UnitsForBlock(int64_t i, bool through) const;
  void ReduceScatterAndFreeUnits();
  // The units freed (and the vocabulary-parallel view of the embedding's
  // rows with
  // them).
  void FreeUnits();
  void Check(std::unique_ptr<CommWork> work, const char* what);
  // A training step's point-to-point traffic: `tensor` sent to stage
  // `stage`, posted without waiting and counted; the sends whose receives
  // have taken them released; a posted receive waited for, the wait counted
  // as bubble time.
  void PostSend(torch::Tensor tensor, int64_t stage, int64_t tag);
  void ReleaseCompletedSends();
  void WaitReceive(std::unique_ptr<CommWork>& work);
  // A [rows, T, C] buffer in the wire dtype on the device, for a receive.
  torch::Tensor Activation(int64_t rows, int64_t seq) const;
  // The point-to-point tag of a transfer between model stages `boundary`
  // and boundary + 1 (both ends compute the same one).
  enum class TagKind { kActivation, kGradient, kEvaluation };
  static int64_t TransferTag(TagKind kind, int64_t boundary);

  const StrategyOptions options_;
  Communicator* const world_;
  const PipelineOptions pipeline_;
  // The run's mesh (BuildRunMesh); empty with mesh_error_ when refused.
  std::optional<DeviceMesh> mesh_;
  absl::Status mesh_error_;
  int64_t stage_ = 0;
  std::vector<PipelineStage> partition_;
  std::string layout_;
  // The same replica's stages (rank = stage); the ranks of its stage it
  // averages gradients with (ddp) or shards the stage over (fsdp; hsdp: its
  // shard group); hsdp: the ranks holding the same shard in the stage's
  // other shard groups; the first and last stage of the replica (the tied
  // weight's group; first/last only). Null where the group would be this rank
  // alone. All the mesh's groups (comm/mesh_groups.h), made in Setup.
  std::unique_ptr<MeshGroups> groups_;
  Communicator* pipe_ = nullptr;
  // Tensor parallelism: the stage replica's T ranks, f and g over them, and
  // the vocabulary-parallel view of the embedding's rows (end stages).
  Communicator* tensor_ = nullptr;
  std::unique_ptr<TensorParallelOps> tensor_ops_;
  VocabParallelEnds ends_;  // tensor ranks: the embedding's and head's rows
  Communicator* replicas_ = nullptr;
  // A replicated stage without tensor ranks: its gradients averaged over
  // replicas_ as the step's last backward runs.
  std::unique_ptr<GradientBuckets> replica_buckets_;
  // This stage's lowered schedule, per micro-batch count: StageOps.
  std::map<int64_t, std::vector<PipelineOp>> lowered_;
  // Per chunk: the indices into owned_ of the parameters it completes.
  std::vector<std::vector<int64_t>> chunk_params_;
  Communicator* across_groups_ = nullptr;
  Communicator* tied_ = nullptr;
  CausalLm model_;
  // This stage's parameters (replicated) or their units (sharded); the token
  // embedding's unit is null unless the stage holds it.
  std::vector<std::string> owned_names_;
  std::vector<torch::Tensor> owned_;
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  FsdpUnit* embedding_unit_ = nullptr;
  // When the units move within a step; armed per chunk for that chunk's
  // last backward (a unit's group is the chunk whose backward completes
  // it).
  std::unique_ptr<UnitSchedule> unit_schedule_;
  // Without tensor ranks: the token embedding's and an untied head's units,
  // and the leaf over each one's rows while it is gathered for training.
  std::vector<std::pair<FsdpUnit*, torch::Tensor>> leaves_;
  std::unique_ptr<AdamW> optimizer_;
  // Sends posted this step, waited at its end (tensors kept alive).
  std::deque<std::pair<std::unique_ptr<CommWork>, torch::Tensor>> sends_;
  // Since the last TakeCommStats(): point-to-point bytes sent and seconds
  // spent waiting on the neighbours in training steps.
  int64_t p2p_bytes_ = 0;
  double bubble_seconds_ = 0;
  int64_t deferred_weight_gradients_ = 0;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_PIPELINE_STRATEGY_H_
