// FsdpStrategy: Fully Sharded Data Parallel (ZeRO-3) over our Communicator.
//
// Units: one per block of the model (causal_lm.h), a small root unit (the
// other inputs and the final norm) and the tied token embedding; each is an
// FsdpUnit, flattened, padded and sharded.
// A rank holds its shards of the parameters, the gradients and the AdamW
// state — about 1/N of a replica's — plus, transiently, the full parameters
// of the units being computed. The token embedding is sharded by whole rows
// and never
// gathered: the embedding and the LM head + loss run vocabulary-parallel on
// the rows (vocab_parallel.h), so no rank ever holds the full embedding or
// its full gradient, nor the [tokens, vocab] logits.
//
// The units move through UnitSchedule's kPerBlock mode (unit_schedule.h,
// the runtime every sharded mesh shares); this class is the step driver:
// the vocabulary-parallel ends around the blocks. One training micro-step:
//   forward   root gathered (kept until backward: positions, final norm);
//             the vocabulary-parallel embedding; for each block: wait for its
//             all-gather, launch the next block's (prefetch), compute, free
//             the full buffer (reshard after forward) unless
//             reshard_after_forward is false. The last block is kept either
//             way: its backward is the first. Then the final norm and
//             the vocabulary-parallel loss, which adds the embedding's
//             gradient into
//             its shard.
//   backward  a hook on each block's output fires just before that block's
//             backward: re-gather it and launch the all-gather of the block
//             before it. When a unit's flat gradient is complete (a post-hook
//             on its gradient accumulator), it is reduce-scattered (mean over
//             ranks) into the rank's shard gradient and the full parameters
//             and gradient are freed.
// Gradient accumulation reduce-scatters on every micro-step by default and
// accumulates the shard gradients: memory stays sharded at the cost of one
// reduce-scatter per micro-step. With FsdpOptions::no_sync (PyTorch's
// no_sync) the micro-steps with sync = false keep each unit's full gradient
// (fp32, a replica's worth of the blocks and root) and reduce-scatter only on
// the last: less communication, more memory. The embedding's gradient goes
// to its
// shard on every micro-step either way (its communication is in forward).
//
// HSDP (hybrid sharding, PyTorch's HYBRID_SHARD, a 2-D device mesh of
// replicas x shards): with FsdpOptions::shard_group_size G < world size W,
// ranks form W/G shard groups of G consecutive ranks (usually one node) and
// G replica groups (ranks with the same position in their shard group).
// Everything above happens inside the shard group: parameters, gradients and
// AdamW state are sharded over G ranks. On the micro-step that syncs, each
// unit's shard gradient, once final, is all-reduced over its replica group
// (launched as the next unit's backward runs, waited at the end of
// backward) and divided by W/G: the only traffic between shard groups is
// one shard's all-reduce per unit. A rank holds 1/G of a replica's state.
//
// reshard_after_forward is a bool, not PyTorch FSDP2's integer (reshard to a
// smaller group after forward, so backward's all-gather stays inside a
// node); HSDP's shard group is the way to keep the gathers inside a node;
// see docs/strategies.md.
//
// With precision bf16 on CUDA the units are gathered and computed in bf16
// while the shards (the optimizer's master weights) and the reduction stay
// fp32. That path compiles everywhere but is exercised only on CUDA.
//
// Collective failures inside the void/Tensor-returning Strategy calls (a lost
// or stuck peer) are thrown as c10::Error naming the unit and collective.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_FSDP_STRATEGY_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_FSDP_STRATEGY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "worker/engine/comm/mesh_groups.h"
#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/fsdp_unit.h"
#include "worker/engine/strategy/strategy.h"
#include "worker/engine/strategy/unit_schedule.h"
#include "worker/engine/strategy/vocab_parallel.h"
#include "worker/engine/support/tensor_file.h"

namespace shardtrain {

struct FsdpOptions {
  // Free each block's full parameters after its forward and gather them again
  // for backward (all but the last block, whose backward comes first). false
  // keeps them from forward until the block's gradient is reduced (ZeRO-2-like
  // memory, one all-gather per block instead of two).
  bool reshard_after_forward = true;
  // Overlap: launch the next unit's all-gather while the current one computes.
  bool prefetch = true;
  // On accumulation micro-steps (sync = false) keep the blocks' and root's
  // full gradients instead of reduce-scattering them (see above).
  bool no_sync = false;
  // Logits per chunk of the vocabulary-parallel head (0: LmHeadChunkBytes).
  int64_t head_chunk_bytes = 0;
  // HSDP: ranks per shard group, dividing the world size (the strategy is
  // then named "hsdp"); 0: plain FSDP over the whole world.
  int64_t shard_group_size = 0;
};

class FsdpStrategy final : public Strategy {
 public:
  // `comm` (rank and world size must agree with `options`) must outlive the
  // strategy.
  FsdpStrategy(const StrategyOptions& options, Communicator* comm,
               FsdpOptions fsdp = {});
  ~FsdpStrategy() override;
  FsdpStrategy(const FsdpStrategy&) = delete;
  FsdpStrategy& operator=(const FsdpStrategy&) = delete;

  // "hsdp" when built with a shard group size.
  std::string name() const override;
  // Shards `model` and frees its full parameters: afterwards the model's own
  // parameter tensors are empty; the strategy alone holds the weights.
  absl::Status Setup(CausalLm model) override;
  torch::Tensor ForwardBackward(const torch::Tensor& inputs,
                                const torch::Tensor& targets, double loss_scale,
                                bool sync) override;
  void OptimizerStep(double lr) override;
  torch::Tensor ForwardLoss(const torch::Tensor& inputs,
                            const torch::Tensor& targets) override;
  double AllReduceMean(double value) override;
  void Barrier() override;
  int64_t rank() const override { return world_->rank(); }
  int64_t world_size() const override { return world_->world_size(); }
  std::string layout() const override;
  // Ranks per shard group, and shard groups (replicas of the model).
  int64_t shard_group_size() const { return shard_->world_size(); }
  int64_t replicas() const {
    return replicate_ == nullptr ? 1 : replicate_->world_size();
  }
  // The part of each parameter that falls in this rank's shard of its unit
  // (padding excluded); under HSDP the replica groups hold the same parts.
  std::vector<HeldPiece> HeldPieces() override;
  const AdamW& optimizer() const override { return *optimizer_; }
  torch::Device device() const override { return options_.device; }
  CausalLmImpl& model() override { return *model_; }
  int64_t optimizer_steps() const override;
  void set_optimizer_steps(int64_t steps) override;
  // Shard parameters + shard gradients + AdamW state held by this rank.
  int64_t ModelStateBytes() const override;
  CommStats TakeCommStats() override;

  // Full (unsharded) parameters by model name, fp32, on every rank.
  // Collective.
  absl::StatusOr<NamedTensors> GatherFullParameters();

  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  // Bytes of unit `unit`'s full flat buffer (padded, compute dtype), the
  // memory a gather adds.
  int64_t UnitBytes(int64_t unit) const;
  // The largest of the units that are ever gathered (all but the token
  // embedding's).
  int64_t LargestUnitBytes() const;
  // Called synchronously at every FsdpEvent of the units' runtime (on the
  // rank's thread, also from inside backward). Empty to stop.
  void set_observer(std::function<void(const FsdpEvent&)> observer) {
    schedule_->set_observer(std::move(observer));
  }

 private:
  Communicator* placement_world() const override { return world_; }
  // The shard and replica groups of HSDP (none for plain FSDP).
  absl::Status FormGroups();
  // Runs one forward over the units. Returns the mean loss; in training the
  // caller must backpropagate exactly `loss_scale` into it.
  torch::Tensor Forward(const torch::Tensor& inputs,
                        const torch::Tensor& targets, bool training,
                        double loss_scale);

  const StrategyOptions options_;
  Communicator* const world_;  // every rank: losses, barriers
  const FsdpOptions fsdp_;
  // The mesh's groups (comm/mesh_groups.h), made by Setup(); declared
  // before the units that use them.
  std::unique_ptr<MeshGroups> groups_;
  std::unique_ptr<Communicator> own_shard_;  // a shard group of one rank
  Communicator* shard_ = nullptr;      // the world, or this rank's shard group
  Communicator* replicate_ = nullptr;  // HSDP: this rank's replica group
  CausalLm model_;
  // The root's unit (other inputs, the final norm), one per block (1 + i),
  // the token embedding's, an untied head's: the runtime gathers all but
  // the last one or two, which the vocabulary-parallel ends read in place.
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  int64_t embedding_unit_ = -1;
  int64_t head_unit_ = -1;  // embedding_unit_ when the head is tied
  VocabShard vocab_;        // views of the token embedding unit's shard
  VocabShard head_vocab_;   // vocab_, or views of the untied head's shard
  std::unique_ptr<AdamW> optimizer_;
  // The units' runtime; declared last: its hooks go first.
  std::unique_ptr<UnitSchedule> schedule_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_FSDP_STRATEGY_H_
