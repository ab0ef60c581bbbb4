// TensorParallelStrategy: model parallelism within every layer (Megatron-LM's
// tensor parallelism). The world is a mesh of D data-parallel replicas x T
// tensor-parallel ranks (core/run/device_mesh.h: the T ranks of a replica
// are neighbours, on one node where they can be). Within a replica each rank
// holds its slices of every block under the model's tensor-parallel plan
// (CausalLmImpl::TensorParallelRuns; e.g. 1/T of the attention
// heads and 4C / T of the MLP's hidden units: rows of the column-parallel
// layers, columns of the row-parallel ones). Per block and step, one
// all-reduce of the [B, T, C] activations forward after each row-parallel
// layer (g) and one of their gradients backward before each column-parallel
// layer (f), as Megatron's operators do; a replica's ranks see the same
// batch. With D > 1 (DDP), each rank's gradients are then averaged with the
// ranks holding the same slices in the other replicas, in buckets launched as
// backward produces them (gradient_buckets.h).
//
// The embedding and head are vocabulary-parallel (strategy/vocab_
// parallel.h with shared_batch): each rank holds 1/T of the token
// embedding's rows (and of an untied head's), looks up the ids it owns (one
// all-reduce sums the lookups) and scores its columns of the vocabulary (the
// softmax statistics are all-gathered, the hidden states' gradient
// all-reduced); the logits are never whole on any rank.
//
// What stays whole on every rank: what the plan does not split (norms, the
// row-parallel layers' biases, added once after the sum, learned positions).
// Their inputs and the gradients reaching them are the same on every rank
// (f's all-reduce makes them so), so their gradients agree without any
// reduction and the ranks' copies stay equal bit for bit (checked by the
// tests); sequence parallelism, which splits them, is not built.
//
// With FSDP (TensorParallelStrategy's `shard_over_replicas`, strategy fsdp,
// torchtitan's 2-D "FSDP + TP"), each rank's slices are sharded over the D
// ranks that hold the same slices (the replicas group): FsdpUnits per
// block, one for the rest outside the blocks, one for the token embedding's
// rows. A rank keeps
// 1/D of its slices' fp32 master weights, gradients and AdamW state: 1/(T D)
// of a replica's. Within a step the units move as the sharded stages of a
// pipeline's do (unit_schedule.h): every gather launched at the step's
// start and each waited for as the first micro-step's forward reaches its
// block; each unit's gradient reduce-scattered (the mean over the
// replicas) as soon as the last micro-step's backward completes it, while
// that backward goes on; the units freed after the step. One all-gather
// and one reduce-scatter of the slices a step, no gradient all-reduce, and
// the slices whole only within the step.
//
// Checkpoints hold every tensor by its global name and shape: a rank writes
// the runs of the global tensor its slices are (TensorParallelRuns), the
// whole tensors rank 0 alone; so a TP checkpoint loads at any other layout
// and back. Export gathers the slices on rank 0.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_TENSOR_PARALLEL_STRATEGY_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_TENSOR_PARALLEL_STRATEGY_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "worker/engine/comm/mesh_groups.h"
#include "worker/engine/strategy/fsdp_unit.h"
#include "worker/engine/strategy/gradient_buckets.h"
#include "worker/engine/strategy/strategy.h"
#include "worker/engine/strategy/tensor_parallel_layer.h"
#include "worker/engine/strategy/unit_schedule.h"
#include "worker/engine/strategy/vocab_parallel.h"

namespace shardtrain {

class TensorParallelStrategy final : public Strategy {
 public:
  // `world` (all D x T ranks) must outlive the strategy; `tensor_parallel`
  // (T) must divide its size. `shard_over_replicas`: FSDP over the replicas
  // (D >= 2) instead of DDP; with `shard_group_size` G (2 <= G < D,
  // dividing D), HSDP: sharded within groups of G replicas, the D / G
  // groups averaging their shards.
  TensorParallelStrategy(const StrategyOptions& options, Communicator* world,
                         int64_t tensor_parallel,
                         bool shard_over_replicas = false,
                         double bucket_mb = 25, int64_t shard_group_size = 0);
  ~TensorParallelStrategy() override;

  // The data-parallel part: "single" (one replica), "ddp", "fsdp" or
  // "hsdp".
  std::string name() const override;
  int64_t rank() const override { return options_.rank; }
  int64_t world_size() const override { return options_.world_size; }
  std::string layout() const override;
  // f and g over the tensor group (after Setup): how many input-gradient
  // sums its backward overlapped with the weights' gradients.
  const TensorParallelOps* tensor_parallel_ops() const { return ops_.get(); }
  // Sharded (TP x FSDP), the last step's: when each unit's reduce-scatter
  // launched against when the backward ended; the gathers as the forward
  // waited for them (UnitSchedule).
  UnitSchedule::OverlapTrace shard_overlap_trace() const {
    return unit_schedule_ != nullptr ? unit_schedule_->trace()
                                     : UnitSchedule::OverlapTrace{};
  }
  std::vector<std::string> gather_trace() const {
    return unit_schedule_ != nullptr ? unit_schedule_->gather_trace()
                                     : std::vector<std::string>{};
  }
  // The replica this rank belongs to; its T ranks see the same batch.
  int64_t data_parallel_rank() const override;
  int64_t data_parallel_size() const override;

  absl::Status Setup(CausalLm model) override;
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

 private:
  Communicator* placement_world() const override { return world_; }
  // The mean loss of the replica's batch: the vocabulary-parallel embedding,
  // the blocks, the vocabulary-parallel head. When training, the token
  // embedding's gradient is added in forward with grad_scale, which backward
  // must then use.
  torch::Tensor Forward(const torch::Tensor& inputs,
                        const torch::Tensor& targets, double grad_scale);
  // The gradients averaged over the replicas (D > 1).
  void AverageOverReplicas();
  // replica_buckets_'s views made every parameter's .grad() again, and the
  // vocabulary-parallel view of the embedding's gradient pointed at its
  // view.
  void AttachGradViews();
  // Sharded: the units into one FsdpUnit each (collective over replicas_).
  absl::Status ShardOverReplicas();
  // Sharded: every unit's gather launched at the step's start (and for an
  // evaluation); NeedUnits waits for those before `end` as the forward
  // reaches them and points the modules (and the vocabulary-parallel ends)
  // at each; with grad mode on, the embedding's gradient buffer made.
  void LaunchGathers();
  void NeedUnits(size_t end);
  // Sharded: the gradients reduce-scattered into the shards (the mean over
  // the replicas), the units freed.
  void ReduceScatterAndFreeUnits();
  // Sharded: the units freed without a reduction (after an evaluation).
  void FreeUnits();
  bool sharded() const { return shard_over_replicas_; }
  // Sharded within groups smaller than the replicas (HSDP).
  bool in_groups() const {
    return sharded() && shard_group_size_ > 0 &&
           shard_group_size_ < data_parallel_size();
  }

  const StrategyOptions options_;
  Communicator* const world_;
  const int64_t tensor_parallel_;
  const bool shard_over_replicas_;
  const int64_t shard_group_size_;
  const int64_t bucket_bytes_;  // replicas' gradient buckets (--bucket-mb)
  // The replica's T ranks (a group of its own even when D = 1, so that its
  // traffic is counted apart) and, with D > 1, the ranks holding the same
  // slices in the other replicas.
  // The mesh's groups (comm/mesh_groups.h): the replica's tensor ranks,
  // and the ranks holding the same slices in the other replicas.
  std::unique_ptr<MeshGroups> groups_;
  Communicator* tensor_ = nullptr;
  Communicator* replicas_ = nullptr;  // sharded: the shard group
  Communicator* across_ = nullptr;    // HSDP: the same shards' other groups
  // Replicated slices (DDP x TP): their gradients averaged over replicas_ in
  // DDP's buckets, launched as the sync micro-step's backward completes them.
  std::unique_ptr<GradientBuckets> replica_buckets_;
  std::unique_ptr<TensorParallelOps> ops_;  // f and g over tensor_
  CausalLm model_;
  std::unique_ptr<AdamW> optimizer_;
  VocabParallelEnds ends_;  // this rank's rows of the embedding and head
  // Sharded: the units (the embedding's among them), whether they are
  // gathered (from the step's first micro-step to its last), and when they
  // move within the step.
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  bool gathered_ = false;
  std::unique_ptr<UnitSchedule> unit_schedule_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_TENSOR_PARALLEL_STRATEGY_H_
