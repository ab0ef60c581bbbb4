#include "worker/engine/strategy/fsdp_strategy.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "nlohmann/json.hpp"
#include "worker/engine/strategy/autocast.h"
#include "worker/engine/strategy/distributed_helpers.h"

namespace shardtrain {
namespace {

// Strategy calls that cannot return a Status report collective failures as
// exceptions (see the header).
void Check(const absl::Status& status) {
  ThrowIfFailed(status, "FSDP", "a collective");
}

// 1 + i for the parameters of block i, num_blocks + 1 for the token
// embedding, num_blocks + 2 for an untied head, 0 (the root) for the others.
int64_t UnitOf(const CausalLmImpl& model, const std::string& name) {
  const ParamPlace place = model.PlaceOf(name);
  if (!model.tied_head() && name == model.head_weight_name()) {
    return model.num_blocks() + 2;
  }
  switch (place.role) {
    case ParamRole::kTokenEmbedding:
      return model.num_blocks() + 1;
    case ParamRole::kBlock:
      return 1 + place.block;
    default:
      return 0;
  }
}

}  // namespace

std::string FsdpEvent::ToString() const {
  const char* names[] = {"gather_launch", "gather_done",    "compute_begin",
                         "compute_end",   "backward_begin", "grad_ready",
                         "reshard"};
  return absl::StrCat(names[static_cast<int>(kind)], " ", unit);
}

FsdpStrategy::FsdpStrategy(const StrategyOptions& options, Communicator* comm,
                           FsdpOptions fsdp)
    : options_(options), world_(comm), fsdp_(fsdp) {}

std::string FsdpStrategy::name() const {
  return fsdp_.shard_group_size > 0 ? "hsdp" : "fsdp";
}

std::string FsdpStrategy::layout() const {
  if (replicate_ == nullptr) return "";
  return absl::StrCat(replicas(), " shard groups of ", shard_group_size(),
                      " ranks, replicated across groups");
}

absl::Status FsdpStrategy::FormGroups() {
  // The mesh: shards over the world (FSDP), or shard groups replicated
  // across (HSDP), built and its groups made in one place each.
  RunMeshShape shape;
  shape.data_parallel = fsdp_.shard_group_size > 0 ? "hsdp" : "fsdp";
  shape.shard_group_size = fsdp_.shard_group_size;
  absl::StatusOr<std::unique_ptr<MeshGroups>> groups =
      MeshGroups::Create(world_, shape, options_.ranks_per_node);
  if (!groups.ok()) return groups.status();
  groups_ = *std::move(groups);
  shard_ = groups_->Along(MeshDim::kShard);
  replicate_ = groups_->Along(MeshDim::kReplicate);
  if (shard_ == nullptr) {
    if (world_->world_size() > 1) {
      // Shard groups of one rank: each holds everything, as DDP.
      absl::StatusOr<std::unique_ptr<Communicator>> own = world_->NewGroup(
          absl::StrCat("shard-", world_->rank()), {world_->rank()});
      if (!own.ok()) return own.status();
      own_shard_ = *std::move(own);
      shard_ = own_shard_.get();
    } else {
      shard_ = world_;
    }
  }
  return absl::OkStatus();
}

FsdpStrategy::~FsdpStrategy() = default;

absl::Status FsdpStrategy::Setup(CausalLm model) {
  if (world_ == nullptr) {
    return absl::InvalidArgumentError("fsdp: needs a communicator");
  }
  if (world_->rank() != options_.rank ||
      world_->world_size() != options_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsdp: options say rank ", options_.rank, " of ",
                     options_.world_size, " but the communicator is rank ",
                     world_->rank(), " of ", world_->world_size()));
  }
  if (!units_.empty()) {
    return absl::FailedPreconditionError("fsdp: Setup() called twice");
  }
  if (absl::Status s = FormGroups(); !s.ok()) return s;
  model_ = std::move(model);
  RecordGlobalShapes(*model_);
  const torch::ScalarType compute_dtype = ComputeDtype(options_);
  try {
    const std::map<std::string, torch::Tensor*> members =
        model_->MemberTensors();
    const int64_t num_blocks = model_->num_blocks();
    embedding_unit_ = num_blocks + 1;
    head_unit_ = model_->tied_head() ? embedding_unit_ : num_blocks + 2;
    std::vector<std::vector<FsdpUnit::Source>> sources(
        static_cast<size_t>(std::max(embedding_unit_, head_unit_) + 1));
    for (const auto& item : model_->named_parameters()) {
      const auto member = members.find(item.key());
      if (member == members.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fsdp: parameter '", item.key(),
            "' is not the weight or bias of a Linear, LayerNorm or Embedding, "
            "the modules whose tensors FSDP can point at gathered views"));
      }
      const int64_t u = UnitOf(*model_, item.key());
      if (u >= static_cast<int64_t>(sources.size())) {
        return absl::InternalError(
            absl::StrCat("fsdp: parameter '", item.key(), "' has no unit"));
      }
      sources[u].push_back({item.key(), item.value(), member->second});
    }
    // One unit at a time: each frees its parameters once sharded, so Setup
    // needs the model plus one unit's flat copy at most.
    const int64_t width = model_->dims().hidden_size;
    for (size_t u = 0; u < sources.size(); ++u) {
      const bool embedding = static_cast<int64_t>(u) == embedding_unit_;
      const bool head = static_cast<int64_t>(u) == head_unit_;
      absl::StatusOr<std::unique_ptr<FsdpUnit>> unit = FsdpUnit::Create(
          u == 0      ? "root"
          : embedding ? ModulePath(model_->token_embedding_name())
          : head      ? ModulePath(model_->head_weight_name())
                      : model_->BlockName(static_cast<int64_t>(u) - 1),
          std::move(sources[u]), shard_, options_.device, compute_dtype,
          /*align=*/embedding || head ? width : 1);
      if (!unit.ok()) return unit.status();
      const int64_t index = static_cast<int64_t>(u);
      hooks_.Add((*unit)->full(), [this, index] { OnGradReady(index); });
      units_.push_back(std::move(*unit));
    }
    FsdpUnit& embedding = *units_[embedding_unit_];
    const int64_t rows = embedding.shard_numel() / width;
    if (replicate_ != nullptr) {
      // Every replica starts from replica 0's shards.
      for (const auto& unit : units_) {
        if (absl::Status s = replicate_->Broadcast(unit->shard(), 0)->Wait();
            !s.ok()) {
          return absl::Status(
              s.code(), absl::StrCat("hsdp: broadcast of unit ", unit->name(),
                                     " to its replicas: ", s.message()));
        }
      }
    }
    across_ = GroupAverage(replicate_, units_.size(), "hsdp");
    vocab_.comm = shard_;
    vocab_.weight = embedding.shard().view({rows, width});
    vocab_.grad = embedding.shard_grad().view({rows, width});
    vocab_.row_begin = embedding.shard_offset() / width;
    vocab_.vocab_size = model_->dims().vocab_size;
    vocab_.compute_dtype = compute_dtype;
    vocab_.chunk_bytes = fsdp_.head_chunk_bytes;
    vocab_.anchor = torch::zeros(
        {}, torch::TensorOptions().device(options_.device).requires_grad(true));
    // An untied head: its own rows, sharded and used the same way.
    head_vocab_ = vocab_;
    if (head_unit_ != embedding_unit_) {
      FsdpUnit& head = *units_[head_unit_];
      head_vocab_.weight = head.shard().view({rows, width});
      head_vocab_.grad = head.shard_grad().view({rows, width});
      head_vocab_.row_begin = head.shard_offset() / width;
    }
    optimizer_ = std::make_unique<AdamW>(
        ShardWeightDecayGroups(units_, options_.weight_decay), options_.adamw);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("fsdp: setup: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

void FsdpStrategy::Emit(FsdpEvent::Kind kind, int64_t unit) {
  if (observer_) observer_(FsdpEvent{kind, unit});
}

void FsdpStrategy::LaunchGather(int64_t u) {
  FsdpUnit& unit = *units_[u];
  if (unit.gathered() || unit.gather_in_flight()) return;
  Check(unit.LaunchGather());
  Emit(FsdpEvent::Kind::kGatherLaunch, u);
}

void FsdpStrategy::Unshard(int64_t u) {
  FsdpUnit& unit = *units_[u];
  if (!unit.gathered()) {
    LaunchGather(u);
    Check(unit.WaitGather());
    Emit(FsdpEvent::Kind::kGatherDone, u);
  }
  unit.UseFullParams();
}

void FsdpStrategy::Reshard(int64_t u) {
  units_[u]->Reshard();
  Emit(FsdpEvent::Kind::kReshard, u);
}

torch::Tensor FsdpStrategy::Forward(const torch::Tensor& inputs,
                                    const torch::Tensor& targets, bool training,
                                    double loss_scale) {
  TORCH_CHECK(!units_.empty(), "FSDP: Setup() must come first");
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(1) >= 1 &&
                  inputs.size(1) <= model_->dims().max_seq_len,
              "FSDP: inputs must be [B,T] with 1 <= T <= the model's longest "
              "sequence, ",
              model_->dims().max_seq_len, ", got ", inputs.sizes());
  const int64_t last = model_->num_blocks();  // units 1..last are the blocks
  LaunchGather(0);
  if (fsdp_.prefetch && last >= 1) LaunchGather(1);
  Unshard(0);  // the root stays gathered: the final norm comes last
  ScopedAutocast autocast(options_.device, options_.precision);
  torch::Tensor x =
      model_->FinishEmbedding(VocabParallelEmbedding(inputs, vocab_));
  for (int64_t u = 1; u <= last; ++u) {
    Unshard(u);
    if (fsdp_.prefetch && u < last) LaunchGather(u + 1);
    Emit(FsdpEvent::Kind::kComputeBegin, u);
    x = model_->RunBlock(u - 1, x);
    Emit(FsdpEvent::Kind::kComputeEnd, u);
    if (training) {
      // Fires when the gradient of the block's output is complete, i.e.
      // right before the block's own backward.
      x.register_hook([this, u](const torch::Tensor&) { PreBackward(u); });
    }
    // The last block stays gathered in training: its backward comes right
    // after the head's, so freeing it would only buy a second all-gather.
    if (!training || (fsdp_.reshard_after_forward && u < last)) Reshard(u);
  }
  torch::Tensor loss = VocabParallelLoss(
      model_->FinalNorm(x), targets, head_vocab_, training ? loss_scale : 0.0);
  if (!training) Reshard(0);
  return loss;
}

torch::Tensor FsdpStrategy::ForwardBackward(const torch::Tensor& inputs,
                                            const torch::Tensor& targets,
                                            double loss_scale, bool sync) {
  torch::Tensor loss;
  sync_ = sync;
  try {
    loss = Forward(inputs, targets, /*training=*/true, loss_scale);
    (loss * loss_scale).backward();
    FinishBackward();
  } catch (...) {
    ResetUnits();
    throw;
  }
  return loss.detach();
}

void FsdpStrategy::ResetUnits() {
  pending_reductions_.clear();
  across_.Drop();
  for (const auto& unit : units_) {
    if (unit->gather_in_flight()) (void)unit->WaitGather();
    (void)unit->WaitReduceScatter();
    unit->Reshard();
    unit->full().mutable_grad() = torch::Tensor();
    unit->DropUnshardedGradient();
  }
}

void FsdpStrategy::PreBackward(int64_t u) {
  Emit(FsdpEvent::Kind::kBackwardBegin, u);
  FsdpUnit& unit = *units_[u];
  if (!unit.gathered()) {
    // The graph holds views of the full buffer: refilling its storage is
    // enough, no new views are made.
    LaunchGather(u);
    Check(unit.WaitGather());
    Emit(FsdpEvent::Kind::kGatherDone, u);
  }
  // A recomputed block runs its forward again inside its backward, reading
  // the members: point them at the gathered parameters (new views, whose
  // gradient reaches the same leaf).
  // Backward runs hooks with grad mode off; these views must record their
  // base for the recomputation's gradient to reach it.
  if (model_->IsRecomputed(u - 1)) {
    torch::AutoGradMode grad_mode(true);
    unit.UseFullParams();
  }
  if (fsdp_.prefetch && u > 1) LaunchGather(u - 1);
}

void FsdpStrategy::OnGradReady(int64_t u) {
  Emit(FsdpEvent::Kind::kGradReady, u);
  if (!sync_ && fsdp_.no_sync) {
    units_[u]->HoldUnshardedGradient();
    Reshard(u);
    return;
  }
  Check(units_[u]->LaunchReduceScatter());
  // At most two reductions in flight: the full gradients of the units
  // finished earlier must not pile up while backward goes on.
  for (int64_t earlier : pending_reductions_) {
    Check(units_[earlier]->WaitReduceScatter());
    ReduceAcrossReplicas(earlier);
  }
  pending_reductions_.assign(1, u);
  Reshard(u);
}

void FsdpStrategy::FinishBackward() {
  for (int64_t u : pending_reductions_) Check(units_[u]->WaitReduceScatter());
  pending_reductions_.clear();
  for (int64_t u = 0; u < num_units(); ++u) {
    FsdpUnit& unit = *units_[u];
    const bool hold = !sync_ && fsdp_.no_sync;
    if (hold) {
      unit.HoldUnshardedGradient();  // one that missed its hook
    } else if (unit.full().grad().defined() ||
               unit.holds_unsharded_gradient()) {
      Check(unit.LaunchReduceScatter());
      Check(unit.WaitReduceScatter());
    }
    if (unit.gather_in_flight()) Check(unit.WaitGather());
    if (unit.gathered()) Reshard(u);
  }
  for (int64_t u = 0; u < num_units(); ++u) ReduceAcrossReplicas(u);
  across_.Finish();
}

void FsdpStrategy::ReduceAcrossReplicas(int64_t u) {
  if (sync_) across_.Launch(*units_[u], static_cast<size_t>(u));
}

void FsdpStrategy::OptimizerStep(double lr) {
  optimizer_->Step(lr);
  torch::NoGradGuard no_grad;
  for (const auto& unit : units_) unit->shard_grad().zero_();
}

torch::Tensor FsdpStrategy::ForwardLoss(const torch::Tensor& inputs,
                                        const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  try {
    return Forward(inputs, targets, /*training=*/false, /*loss_scale=*/0.0);
  } catch (...) {
    ResetUnits();
    throw;
  }
}

double FsdpStrategy::AllReduceMean(double value) {
  return shardtrain::AllReduceMean(*world_, value, options_.device, "FSDP");
}

void FsdpStrategy::Barrier() { Check(world_->Barrier()); }

CommStats FsdpStrategy::TakeCommStats() {
  CommStats stats =
      groups_ != nullptr ? groups_->TakeStats() : world_->TakeStats();
  if (own_shard_ != nullptr) {
    const CommStats part = own_shard_->TakeStats();
    stats.seconds += part.seconds;
    stats.bytes += part.bytes;
  }
  return stats;
}

std::vector<HeldPiece> FsdpStrategy::HeldPieces() {
  // Each rank holds its shard of every unit; HSDP's replica groups hold the
  // same shards.
  std::vector<HeldPiece> pieces;
  const int64_t replica = replicate_ == nullptr ? 0 : replicate_->rank();
  for (const auto& unit : units_) {
    ForEachShardPiece(
        *unit, [&](const FsdpUnit::Param& p, int64_t offset,
                   const torch::Tensor& piece, const torch::Tensor& grad) {
          pieces.push_back(
              {Placement::Whole(p.name, p.shape)
                   .Narrow(offset, piece.numel())
                   .ReplicatedAlong(MeshDim::kReplicate, replica, replicas()),
               piece, grad});
        });
  }
  return pieces;
}

int64_t FsdpStrategy::optimizer_steps() const {
  return optimizer_->step_count();
}

void FsdpStrategy::set_optimizer_steps(int64_t steps) {
  optimizer_->set_step_count(steps);
}

absl::StatusOr<NamedTensors> FsdpStrategy::GatherFullParameters() {
  NamedTensors params;
  try {
    const std::vector<HeldPiece> pieces = HeldPieces();
    int64_t contributed = 0;
    for (const auto& [name, global] : global_shapes()) {
      params.emplace_back(
          name, GatherWhole(pieces, name, global, world_, options_.device,
                            "fsdp", &contributed));
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(e.what_without_backtrace());
  }
  return params;
}

int64_t FsdpStrategy::ModelStateBytes() const {
  int64_t bytes = optimizer_ == nullptr ? 0 : optimizer_->StateBytes();
  for (const auto& unit : units_) bytes += unit->ShardBytes();
  return bytes;
}

int64_t FsdpStrategy::UnitBytes(int64_t unit) const {
  return units_.at(static_cast<size_t>(unit))->FullBytes();
}

int64_t FsdpStrategy::LargestUnitBytes() const {
  int64_t largest = 0;
  for (int64_t u = 0; u < num_units(); ++u) {
    if (u != embedding_unit_ && u != head_unit_)
      largest = std::max(largest, units_[u]->FullBytes());
  }
  return largest;
}

}  // namespace shardtrain
