#include "worker/engine/strategy/fsdp_strategy.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/strategy/autocast.h"
#include "worker/engine/strategy/distributed_helpers.h"

namespace shardtrain {
namespace {

// Strategy calls that cannot return a Status report collective failures as
// exceptions (see the header).
void Check(const absl::Status& status) {
  ThrowIfFailed(status, "FSDP", "a collective");
}

}  // namespace

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
  const std::string who = name();
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  for (const auto& item : model_->named_parameters()) {
    parameters.emplace_back(item.key(), item.value());
  }
  // One unit at a time: each frees its parameters once sharded, so Setup
  // needs the model plus one unit's flat copy at most. The embedding's and
  // an untied head's shards are whole rows: the vocabulary-parallel ends
  // read them in place.
  const int64_t width = model_->dims().hidden_size;
  absl::StatusOr<std::vector<std::unique_ptr<FsdpUnit>>> made = ShardIntoUnits(
      *model_, parameters, shard_, replicate_, options_.device, compute_dtype,
      /*fp32=*/nullptr, who, /*row_width=*/width);
  if (!made.ok()) return made.status();
  // In the runtime's order: the root, the blocks, then the rows.
  const std::map<int64_t, size_t> blocks = BlockUnits(*model_, *made);
  const std::string embedding_name = ModulePath(model_->token_embedding_name());
  const std::string head_name = ModulePath(model_->head_weight_name());
  std::unique_ptr<FsdpUnit> embedding, head;
  std::vector<std::unique_ptr<FsdpUnit>> block_units;
  for (auto& unit : *made) {
    if (unit->name() == embedding_name) {
      embedding = std::move(unit);
    } else if (!model_->tied_head() && unit->name() == head_name) {
      head = std::move(unit);
    } else if (unit->name() == "root") {
      units_.push_back(std::move(unit));
    }
  }
  if (embedding == nullptr || (!model_->tied_head() && head == nullptr)) {
    return absl::InternalError(
        absl::StrCat(who, ": the model's token embedding or head has no unit"));
  }
  std::map<int64_t, size_t> block_unit;
  for (const auto& [block, u] : blocks) {
    block_unit[block] = units_.size();
    units_.push_back(std::move((*made)[u]));
  }
  const size_t gathered = units_.size();
  embedding_unit_ = static_cast<int64_t>(units_.size());
  units_.push_back(std::move(embedding));
  head_unit_ = embedding_unit_;
  if (head != nullptr) {
    head_unit_ = static_cast<int64_t>(units_.size());
    units_.push_back(std::move(head));
  }
  try {
    UnitSchedule::PerBlock per_block;
    per_block.reshard_after_forward = fsdp_.reshard_after_forward;
    per_block.prefetch = fsdp_.prefetch;
    per_block.no_sync = fsdp_.no_sync;
    per_block.recomputed = [model = model_.ptr()](int64_t block) {
      return model->IsRecomputed(block);
    };
    per_block.gathered = gathered;
    schedule_ = std::make_unique<UnitSchedule>(
        &units_, std::move(block_unit), std::move(per_block), who, replicate_);
    FsdpUnit& rows = *units_[embedding_unit_];
    const int64_t shard_rows = rows.shard_numel() / width;
    vocab_.comm = shard_;
    vocab_.weight = rows.shard().view({shard_rows, width});
    vocab_.grad = rows.shard_grad().view({shard_rows, width});
    vocab_.row_begin = rows.shard_offset() / width;
    vocab_.vocab_size = model_->dims().vocab_size;
    vocab_.compute_dtype = compute_dtype;
    vocab_.chunk_bytes = fsdp_.head_chunk_bytes;
    vocab_.anchor = torch::zeros(
        {}, torch::TensorOptions().device(options_.device).requires_grad(true));
    // An untied head: its own rows, sharded and used the same way.
    head_vocab_ = vocab_;
    if (head_unit_ != embedding_unit_) {
      FsdpUnit& head_rows = *units_[head_unit_];
      head_vocab_.weight = head_rows.shard().view({shard_rows, width});
      head_vocab_.grad = head_rows.shard_grad().view({shard_rows, width});
      head_vocab_.row_begin = head_rows.shard_offset() / width;
    }
    optimizer_ = std::make_unique<AdamW>(
        ShardWeightDecayGroups(units_, options_.weight_decay), options_.adamw);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(who, ": setup: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

torch::Tensor FsdpStrategy::Forward(const torch::Tensor& inputs,
                                    const torch::Tensor& targets, bool training,
                                    double loss_scale) {
  TORCH_CHECK(schedule_ != nullptr, "FSDP: Setup() must come first");
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(1) >= 1 &&
                  inputs.size(1) <= model_->dims().max_seq_len,
              "FSDP: inputs must be [B,T] with 1 <= T <= the model's longest "
              "sequence, ",
              model_->dims().max_seq_len, ", got ", inputs.sizes());
  schedule_->BeginForward();  // the root stays: the final norm comes last
  ScopedAutocast autocast(options_.device, options_.precision);
  torch::Tensor x =
      model_->FinishEmbedding(VocabParallelEmbedding(inputs, vocab_));
  for (int64_t i = 0; i < model_->num_blocks(); ++i) {
    schedule_->BeforeBlock(i);
    x = model_->RunBlock(i, x);
    schedule_->AfterBlock(i, x, training);
  }
  torch::Tensor loss = VocabParallelLoss(
      model_->FinalNorm(x), targets, head_vocab_, training ? loss_scale : 0.0);
  schedule_->EndForward(training);
  return loss;
}

torch::Tensor FsdpStrategy::ForwardBackward(const torch::Tensor& inputs,
                                            const torch::Tensor& targets,
                                            double loss_scale, bool sync) {
  torch::Tensor loss;
  try {
    TORCH_CHECK(schedule_ != nullptr, "FSDP: Setup() must come first");
    schedule_->BeginMicroStep(sync);
    loss = Forward(inputs, targets, /*training=*/true, loss_scale);
    (loss * loss_scale).backward();
    schedule_->FinishBackward();
  } catch (...) {
    if (schedule_ != nullptr) schedule_->Reset();
    throw;
  }
  return loss.detach();
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
    if (schedule_ != nullptr) schedule_->Reset();
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
  for (int64_t u = 0; u < embedding_unit_; ++u) {
    largest = std::max(largest, units_[u]->FullBytes());
  }
  return largest;
}

}  // namespace shardtrain
