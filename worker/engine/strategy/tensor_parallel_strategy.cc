#include "worker/engine/strategy/tensor_parallel_strategy.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/run/device_mesh.h"
#include "worker/engine/strategy/autocast.h"
#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/vocab_parallel.h"

namespace shardtrain {

TensorParallelStrategy::TensorParallelStrategy(const StrategyOptions& options,
                                               Communicator* world,
                                               int64_t tensor_parallel,
                                               bool shard_over_replicas,
                                               double bucket_mb,
                                               int64_t shard_group_size)
    : options_(options),
      world_(world),
      tensor_parallel_(std::max<int64_t>(1, tensor_parallel)),
      shard_over_replicas_(shard_over_replicas),
      shard_group_size_(shard_group_size),
      bucket_bytes_(std::max<int64_t>(
          1, static_cast<int64_t>(std::llround(bucket_mb * 1024 * 1024)))) {}

TensorParallelStrategy::~TensorParallelStrategy() = default;

// The mesh is replicas x tensor ranks, the tensor ranks innermost.
int64_t TensorParallelStrategy::data_parallel_rank() const {
  return options_.rank / tensor_parallel_;
}

int64_t TensorParallelStrategy::data_parallel_size() const {
  return options_.world_size / tensor_parallel_;
}

std::string TensorParallelStrategy::name() const {
  if (in_groups()) return "hsdp";
  if (sharded()) return "fsdp";
  return data_parallel_size() > 1 ? "ddp" : "single";
}

std::string TensorParallelStrategy::layout() const {
  if (model_.is_empty()) return "";
  const int64_t t = tensor_parallel_;
  std::vector<std::string> groups;
  for (int64_t d = 0; d < data_parallel_size(); ++d) {
    std::vector<int64_t> ranks;
    for (int64_t r = 0; r < t; ++r) ranks.push_back(d * t + r);
    groups.push_back(FormatRanks(ranks));
  }
  const std::string replicas =
      data_parallel_size() > 1
          ? absl::StrCat(name(), " ", data_parallel_size(), " x ")
          : "";
  return absl::StrCat("mesh: ", replicas, "tensor parallel ", t, ": ranks ",
                      absl::StrJoin(groups, " | "), " each run ",
                      model_->DescribeTensorParallel(t));
}

absl::Status TensorParallelStrategy::Setup(CausalLm model) {
  if (world_ == nullptr || world_->rank() != options_.rank ||
      world_->world_size() != options_.world_size) {
    return absl::InvalidArgumentError(
        "tensor parallel: needs a communicator over the options' ranks");
  }
  if (options_.world_size % tensor_parallel_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel: ", tensor_parallel_, " does not divide the world of ",
        options_.world_size, " ranks"));
  }
  if (sharded() && data_parallel_size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel: fsdp shards each slice over the data-parallel "
        "replicas, and a world of ",
        options_.world_size, " ranks holds one replica of ", tensor_parallel_,
        " (use single, or at least ", 2 * tensor_parallel_, " ranks)"));
  }
  if (in_groups() && (shard_group_size_ < 2 ||
                      data_parallel_size() % shard_group_size_ != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel x hsdp: shard groups of ", shard_group_size_,
        " replicas must be 2 or more and divide the ", data_parallel_size(),
        " replicas"));
  }
  // The mesh, replicas (or shards, or groups of shards) x tensor ranks, and
  // its groups, each made in one place (core/run/device_mesh.h,
  // comm/mesh_groups.h).
  RunMeshShape shape;
  shape.tensor_parallel = tensor_parallel_;
  shape.data_parallel = name();
  shape.shard_group_size = in_groups() ? shard_group_size_ : 0;
  absl::StatusOr<std::unique_ptr<MeshGroups>> groups =
      MeshGroups::Create(world_, shape, options_.ranks_per_node);
  if (!groups.ok()) return groups.status();
  groups_ = *std::move(groups);
  tensor_ = groups_->Along(MeshDim::kTensor);
  replicas_ =
      in_groups() ? groups_->Along(MeshDim::kShard) : groups_->DataParallel();
  across_ = in_groups() ? groups_->Along(MeshDim::kReplicate) : nullptr;
  model_ = std::move(model);
  try {
    model_->to(options_.device);
    torch::NoGradGuard no_grad;
    // Every rank starts from rank 0's values.
    RecordGlobalShapes(*model_);
    for (auto& item : model_->named_parameters()) {
      torch::Tensor& p = item.value();
      ThrowIfFailed(world_->Broadcast(p, 0)->Wait(), "tensor parallel",
                    "broadcast of the parameters");
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("tensor parallel: setup: ", e.what_without_backtrace()));
  }
  ops_ = MakeTensorParallelOps(tensor_);
  if (absl::Status s = model_->ShardForTensorParallel(ops_.get()); !s.ok()) {
    return s;
  }
  try {
    // The vocabulary-parallel embedding and head add the token embedding's
    // gradient into its .grad() themselves: it must exist before the first
    // step. Sharded, the units keep its rows; its gradient is made within a
    // step.
    ends_ = VocabParallelEnds(*model_, tensor_, options_,
                              /*rows_held=*/!sharded());
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("tensor parallel: setup: ", e.what_without_backtrace()));
  }
  if (sharded()) return ShardOverReplicas();
  optimizer_ = std::make_unique<AdamW>(
      WeightDecayGroups(model_->parameters(), options_.weight_decay),
      options_.adamw);
  if (replicas_ != nullptr) {
    replica_buckets_ = std::make_unique<GradientBuckets>(
        model_->parameters(), replicas_, bucket_bytes_,
        "tensor parallel x ddp");
    AttachGradViews();
  }
  return absl::OkStatus();
}

absl::Status TensorParallelStrategy::ShardOverReplicas() {
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  for (auto& item : model_->named_parameters()) {
    parameters.emplace_back(item.key(), item.value());
  }
  const std::string who = "tensor parallel x " + name();
  // The token embedding's and the head's rows are read by the
  // vocabulary-parallel paths in fp32.
  absl::StatusOr<std::vector<std::unique_ptr<FsdpUnit>>> units = ShardIntoUnits(
      *model_, parameters, replicas_, across_, options_.device,
      ComputeDtype(options_),
      [this](const std::string& unit) { return ends_.IsEndUnit(unit); }, who);
  if (!units.ok()) return units.status();
  units_ = *std::move(units);
  try {
    ends_.FindUnits(units_);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(who, ": setup: ", e.what_without_backtrace()));
  }
  // Gathered as the forward reaches each block's unit; reduce-scattered as
  // the sync micro-step's backward completes each (one group: the step);
  // HSDP's groups average each unit as its reduce-scatter lands.
  unit_schedule_ = std::make_unique<UnitSchedule>(
      &units_, std::vector<int64_t>(units_.size(), 0),
      BlockUnits(*model_, units_), /*groups=*/1, who, across_);
  optimizer_ = std::make_unique<AdamW>(
      ShardWeightDecayGroups(units_, options_.weight_decay), options_.adamw);
  return absl::OkStatus();
}

void TensorParallelStrategy::LaunchGathers() {
  unit_schedule_->LaunchGathers();
  gathered_ = true;
}

void TensorParallelStrategy::NeedUnits(size_t end) {
  if (unit_schedule_ == nullptr) return;
  // The vocabulary-parallel paths read the ends' rows and add their
  // gradients themselves.
  unit_schedule_->Need(end,
                       [this](FsdpUnit* unit) { ends_.UseGatheredUnit(unit); });
}

void TensorParallelStrategy::ReduceScatterAndFreeUnits() {
  if (!gathered_) return;
  // The ends' gradients, which no hook sees, then every unit no hook
  // launched.
  ends_.HandGradientsToUnits();
  unit_schedule_->FinishReduceScatters();
  FreeUnits();
}

void TensorParallelStrategy::FreeUnits() {
  unit_schedule_->Reshard();
  ends_.ReleaseUnits();
  gathered_ = false;
}

void TensorParallelStrategy::AttachGradViews() {
  replica_buckets_->AttachGradViews();
  // The vocabulary-parallel embedding and head add into the embedding's
  // gradient
  // themselves (outside autograd's accumulation): into the bucket's view.
  ends_.UseGradientViews(*model_);
}

torch::Tensor TensorParallelStrategy::ForwardBackward(
    const torch::Tensor& inputs, const torch::Tensor& targets,
    double loss_scale, bool sync) {
  if (sharded() && !gathered_) LaunchGathers();
  if (sharded()) {
    // Armed for the last micro-step only (a failed step may have left it
    // armed).
    if (sync) {
      unit_schedule_->Arm(0);
    } else {
      unit_schedule_->Disarm();
    }
  }
  if (replica_buckets_ != nullptr) {
    AttachGradViews();
    replica_buckets_->Arm(sync);
  }
  const torch::Tensor loss = Forward(inputs, targets, loss_scale);
  (loss * loss_scale).backward();
  if (sync) {
    torch::NoGradGuard no_grad;
    if (sharded()) {
      ReduceScatterAndFreeUnits();
    } else {
      AverageOverReplicas();
    }
  }
  return loss.detach();
}

torch::Tensor TensorParallelStrategy::Forward(const torch::Tensor& inputs,
                                              const torch::Tensor& targets,
                                              double grad_scale) {
  TORCH_CHECK(optimizer_ != nullptr,
              "tensor parallel: Setup() must come first");
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(1) >= 1 &&
                  inputs.size(1) <= model_->dims().max_seq_len,
              "tensor parallel: inputs must be [B,T] with 1 <= T <= the "
              "model's longest sequence, ",
              model_->dims().max_seq_len, ", got ", inputs.sizes());
  ScopedAutocast autocast(options_.device, options_.precision);
  // Sharded, each unit is waited for as the forward reaches it (nothing
  // once gathered).
  if (unit_schedule_ != nullptr) NeedUnits(unit_schedule_->ForBlock(0, false));
  torch::Tensor x = model_->FinishEmbedding(
      VocabParallelEmbedding(inputs, ends_.embedding()));
  for (int64_t i = 0; i < model_->num_blocks(); ++i) {
    if (unit_schedule_ != nullptr) {
      unit_schedule_->NoteBlock(i);
      NeedUnits(unit_schedule_->ForBlock(i, true));
    }
    x = model_->RunBlock(i, x);
  }
  NeedUnits(units_.size());
  return VocabParallelLoss(model_->FinalNorm(x), targets, ends_.head(),
                           grad_scale);
}

void TensorParallelStrategy::AverageOverReplicas() {
  if (replica_buckets_ != nullptr) replica_buckets_->Finish();
}

void TensorParallelStrategy::OptimizerStep(double lr) {
  optimizer_->Step(lr);
  optimizer_->ZeroGrad();
  torch::NoGradGuard no_grad;
  for (auto& unit : units_) unit->shard_grad().zero_();
}

torch::Tensor TensorParallelStrategy::ForwardLoss(
    const torch::Tensor& inputs, const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  if (!sharded() || gathered_) return Forward(inputs, targets, 0.0);
  LaunchGathers();
  torch::Tensor loss = Forward(inputs, targets, /*grad_scale=*/0.0);
  FreeUnits();
  return loss;
}

double TensorParallelStrategy::AllReduceMean(double value) {
  return shardtrain::AllReduceMean(*world_, value, options_.device,
                                   "tensor parallel");
}

void TensorParallelStrategy::Barrier() {
  ThrowIfFailed(world_->Barrier(), "tensor parallel", "barrier");
}

std::vector<HeldPiece> TensorParallelStrategy::HeldPieces() {
  // Each rank holds its tensor slice of every parameter (whole tensors on
  // every tensor rank alike); replicas hold the same slices, or, sharded,
  // each its part of their flattening.
  std::vector<HeldPiece> pieces;
  const int64_t t = tensor_parallel_;
  if (sharded()) {
    // HSDP: the other groups hold the same shards.
    const int64_t across_rank = across_ == nullptr ? 0 : across_->rank();
    const int64_t across_size = across_ == nullptr ? 1 : across_->world_size();
    for (auto& unit : units_) {
      ForEachShardPiece(*unit, [&](const FsdpUnit::Param& p, int64_t offset,
                                   const torch::Tensor& piece,
                                   const torch::Tensor& grad) {
        pieces.push_back({Placement::TensorParallel(*model_, p.name,
                                                    global_shapes().at(p.name),
                                                    tensor_->rank(), t)
                              .Narrow(offset, piece.numel())
                              .ReplicatedAlong(MeshDim::kReplicate, across_rank,
                                               across_size),
                          piece, grad});
      });
    }
    return pieces;
  }
  for (const auto& item : model_->named_parameters()) {
    pieces.push_back(
        {Placement::TensorParallel(*model_, item.key(),
                                   global_shapes().at(item.key()),
                                   tensor_->rank(), t)
             .ReplicatedAlong(MeshDim::kReplicate, data_parallel_rank(),
                              data_parallel_size()),
         item.value(),
         {}});
  }
  return pieces;
}

int64_t TensorParallelStrategy::optimizer_steps() const {
  return optimizer_->step_count();
}

void TensorParallelStrategy::set_optimizer_steps(int64_t steps) {
  optimizer_->set_step_count(steps);
}

int64_t TensorParallelStrategy::ModelStateBytes() const {
  int64_t bytes = optimizer_->StateBytes();
  for (const auto& unit : units_) bytes += unit->ShardBytes();
  for (const torch::Tensor& p : model_->parameters()) {
    if (sharded()) break;  // their storage is the units'
    bytes += p.nbytes();
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  return bytes;
}

CommStats TensorParallelStrategy::TakeCommStats() {
  return groups_ != nullptr ? groups_->TakeStats() : world_->TakeStats();
}

}  // namespace shardtrain
