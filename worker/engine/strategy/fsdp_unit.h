// FsdpUnit: one FSDP (ZeRO-3) unit — a group of module parameters (one
// block of the model, or its token embedding, or its other inputs and final
// norm) flattened into one buffer, padded to a multiple of the world size
// and sharded over the ranks.
//
// What a rank holds for good: its shard of the flat parameters (fp32, the
// optimizer's master copy), the shard of the gradient, and the optimizer state
// of the parameter pieces that fall in its shard. The full flat buffer
// `full()` is a leaf tensor whose storage exists only between a gather and
// Reshard(); while the unit is in use, the modules' weight/bias members are
// views of it, so autograd records those views and the unit's whole gradient
// arrives as one tensor, full().grad(). Freeing and re-allocating the storage
// underneath the views keeps every autograd graph that holds them valid
// (verified on LibTorch 1.13; see DESIGN.md).
//
// Not thread-safe; one unit is driven by one rank's thread (autograd hooks run
// while that thread is inside backward()).
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_FSDP_UNIT_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_FSDP_UNIT_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/model/causal_lm.h"
#include "worker/engine/support/adamw.h"

namespace shardtrain {

class FsdpUnit {
 public:
  // A parameter handed to Create(): its name in the model, its current value
  // (identical on every rank; rank 0's wins) and the module member that the
  // module's forward() reads (e.g. &linear->weight).
  struct Source {
    std::string name;
    torch::Tensor value;
    torch::Tensor* member = nullptr;
  };

  // Where a parameter lives in the flat buffer.
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    int64_t offset = 0;
    int64_t numel = 0;
    torch::Tensor* member = nullptr;
  };

  // Flattens `sources` (in order) into one buffer on `device`, broadcasts it
  // from rank 0 so every rank shards the same values, keeps this rank's shard
  // and frees the sources' storage: afterwards each source's value is an empty
  // tensor and its member is undefined until the unit is gathered. The full
  // buffer is kept in `compute_dtype` (bf16 for mixed precision on CUDA), the
  // shard always in fp32. The padding makes the buffer a multiple of
  // world size * `align` elements, so with align = a row's length every
  // shard is whole rows (the row-sharded token embedding). `comm` must outlive
  // the unit. Collective.
  static absl::StatusOr<std::unique_ptr<FsdpUnit>> Create(
      std::string name, std::vector<Source> sources, Communicator* comm,
      const torch::Device& device, torch::ScalarType compute_dtype,
      int64_t align = 1);

  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<Param>& params() const { return params_; }
  int64_t numel() const { return numel_; }                // without padding
  int64_t padded_numel() const { return padded_numel_; }  // multiple of world
  int64_t shard_numel() const { return padded_numel_ / world_size_; }
  // Where this rank's shard starts in the flat buffer.
  int64_t shard_offset() const { return rank_ * shard_numel(); }
  // Bytes of the full flat buffer while gathered.
  int64_t FullBytes() const;
  // Bytes of the shard and its gradient (always held).
  int64_t ShardBytes() const;

  // Gather: allocates the full buffer and launches the all-gather of the
  // shards into it. Both do nothing when the unit is already gathered or a
  // gather is in flight; WaitGather launches one when none is.
  absl::Status LaunchGather();
  absl::Status WaitGather();
  bool gather_in_flight() const { return state_ == State::kGathering; }
  bool gathered() const { return state_ == State::kGathered; }

  // Points the modules' members at views of the gathered full buffer (one
  // split_with_sizes, so backward produces the flat gradient in one
  // concatenation). Under grad mode autograd records the views.
  void UseFullParams();
  // Points the members at views of `flat` (padded_numel() elements) instead;
  // for consolidation, e.g. export.
  void PointMembersAt(const torch::Tensor& flat);
  // Frees the full buffer's storage and resets the members. The unit must
  // not have a gather in flight.
  void Reshard();

  // Moves full().grad() out of the leaf and launches its reduce-scatter; the
  // wait adds this rank's part, divided by the world size (the mean over
  // ranks), to the shard gradient. Gradients held back by
  // HoldUnshardedGradient() are reduced with it. Nothing happens when there
  // is neither.
  absl::Status LaunchReduceScatter();
  // Hands the unit `grad`, the gradient of its only parameter (a
  // parameter whose users add its gradient themselves, e.g. the
  // vocabulary-parallel token embedding), as full()'s gradient, padded with
  // zeros, for the next LaunchReduceScatter().
  void SetParameterGradient(const torch::Tensor& grad);
  // Gradient accumulation without communication (FSDP's no_sync): adds
  // full().grad() into an fp32 full-size buffer kept until the next
  // LaunchReduceScatter() and frees the leaf's gradient.
  void HoldUnshardedGradient();
  bool holds_unsharded_gradient() const { return held_grad_.defined(); }
  // Drops a held gradient (after a failed step).
  void DropUnshardedGradient() { held_grad_ = torch::Tensor(); }
  absl::Status WaitReduceScatter();
  bool reduce_scatter_in_flight() const { return rs_work_ != nullptr; }

  // Gathers the fp32 master shards into a new full flat tensor on every rank,
  // without touching the unit's own buffer. Collective.
  absl::StatusOr<torch::Tensor> GatherMaster();

  // The leaf whose gradient receives the unit's gradient.
  const torch::Tensor& full() const { return full_; }
  torch::Tensor& shard() { return shard_; }
  const torch::Tensor& shard() const { return shard_; }
  torch::Tensor& shard_grad() { return shard_grad_; }
  const torch::Tensor& shard_grad() const { return shard_grad_; }

  // The parts of the shard that hold real parameters, one view per parameter
  // (padding excluded), each with .grad() set to the matching view of
  // shard_grad(): what the optimizer updates. Split as WeightDecayGroups
  // splits whole parameters: pieces of matrices decay, of vectors do not.
  const std::vector<torch::Tensor>& decay_pieces() const {
    return decay_pieces_;
  }
  const std::vector<torch::Tensor>& no_decay_pieces() const {
    return no_decay_pieces_;
  }

 private:
  enum class State { kFreed, kGathering, kGathered };

  FsdpUnit() = default;

  std::string name_;
  std::vector<Param> params_;
  Communicator* comm_ = nullptr;
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
  int64_t numel_ = 0;
  int64_t padded_numel_ = 0;

  torch::Tensor shard_;       // [shard_numel] fp32, the master copy
  torch::Tensor shard_grad_;  // [shard_numel] fp32
  torch::Tensor full_;        // [padded_numel] compute dtype, requires grad
  std::vector<torch::Tensor> decay_pieces_;
  std::vector<torch::Tensor> no_decay_pieces_;

  State state_ = State::kFreed;
  // Kept alive until the collective completes, as the Communicator requires.
  std::unique_ptr<CommWork> gather_work_;
  torch::Tensor gather_input_;
  torch::Tensor gather_output_;
  std::unique_ptr<CommWork> rs_work_;
  torch::Tensor rs_input_;
  torch::Tensor rs_output_;
  torch::Tensor held_grad_;  // [padded_numel] fp32, see HoldUnshardedGradient
};

// HSDP's average over the replica groups that hold the same shards: each
// unit's shard gradient all-reduced across the groups as soon as its
// reduce-scatter has landed (Launch, once per unit and step), then waited
// for and divided by the number of groups (Finish). With one group (no
// `across`) both do nothing. Standalone HSDP, a pipeline's HSDP stages and
// TP x HSDP all average through it.
class GroupAverage {
 public:
  GroupAverage() = default;
  // `across` (nullptr: one group) must outlive this; `units`: how many.
  GroupAverage(Communicator* across, size_t units, std::string strategy);

  bool active() const { return across_ != nullptr; }
  // Unit `u`'s shard gradient's all-reduce, unless launched this step.
  void Launch(FsdpUnit& unit, size_t u);
  // Waits for every launched all-reduce and divides by the groups. Throws
  // c10::Error naming the unit whose all-reduce failed.
  void Finish();
  // A failed step: what was launched is waited for and forgotten.
  void Drop();

 private:
  Communicator* across_ = nullptr;
  std::string strategy_;
  std::vector<bool> launched_;
  std::vector<std::pair<FsdpUnit*, std::unique_ptr<CommWork>>> works_;
};

// What a strategy that holds its parameters in FsdpUnits (FSDP, HSDP, the
// sharded stages of a pipeline) needs besides the units.

// The optimizer's two groups over the units' shard pieces: pieces of
// matrices decay, of vectors do not.
std::vector<AdamW::Group> ShardWeightDecayGroups(
    const std::vector<std::unique_ptr<FsdpUnit>>& units, double weight_decay);

// A model's parameters (name, value) grouped into the units the strategies
// shard: the token embedding alone (named by its module, ModulePath), an
// untied head alone (the same), each block's together (BlockName), the rest
// (other inputs, the final norm) together ("root"), in the order each unit's
// first parameter comes. A parameter that is not a module member in `members`
// is refused, `who` naming the strategy.
struct UnitSources {
  std::string name;
  std::vector<FsdpUnit::Source> sources;
};
absl::StatusOr<std::vector<UnitSources>> GroupIntoUnits(
    const CausalLmImpl& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
    const std::map<std::string, torch::Tensor*>& members,
    const std::string& who);

// The module path of parameter `name`: "embed" of "embed.weight".
std::string ModulePath(const std::string& name);

// Calls `visit(param, offset, piece, grad)` for each parameter with elements
// in this rank's shard of `unit`: `piece` is the shard's memory holding them
// (what the optimizer updates), `grad` the same range of shard_grad(),
// `offset` where they start in the flattened parameter.
void ForEachShardPiece(
    FsdpUnit& unit,
    const std::function<void(const FsdpUnit::Param& param, int64_t offset,
                             const torch::Tensor& piece,
                             const torch::Tensor& grad)>& visit);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_FSDP_UNIT_H_
