#include "worker/engine/strategy/ddp_strategy.h"

#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/strategy/distributed_helpers.h"

namespace shardtrain {
namespace {

// A collective failed: the step cannot go on with partial gradients.
void CheckCollective(const absl::Status& status, const char* what) {
  ThrowIfFailed(status, "ddp", what);
}

}  // namespace

DdpStrategy::DdpStrategy(const StrategyOptions& options, Communicator* comm,
                         double bucket_mb)
    : options_(options),
      comm_(comm),
      bucket_bytes_(std::max<int64_t>(
          1, static_cast<int64_t>(std::llround(bucket_mb * 1024 * 1024)))),
      local_(options) {}

DdpStrategy::~DdpStrategy() = default;

absl::Status DdpStrategy::Setup(CausalLm model) {
  if (absl::Status s = local_.Setup(model); !s.ok()) return s;
  RecordGlobalShapes(*model);
  try {
    buckets_ = std::make_unique<GradientBuckets>(model->parameters(), comm_,
                                                 bucket_bytes_, "ddp");
    if (absl::Status s = buckets_->BroadcastFromRankZero(); !s.ok()) return s;
    torch::NoGradGuard no_grad;
    for (torch::Tensor& buffer : model->buffers()) {
      CheckCollective(comm_->Broadcast(buffer, 0)->Wait(), "broadcast");
    }
    buckets_->AttachGradViews();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("ddp setup: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

torch::Tensor DdpStrategy::ForwardBackward(const torch::Tensor& inputs,
                                           const torch::Tensor& targets,
                                           double loss_scale, bool sync) {
  buckets_->AttachGradViews();
  buckets_->Arm(sync);
  torch::Tensor loss =
      local_.ForwardBackward(inputs, targets, loss_scale, sync);
  if (sync) buckets_->Finish();
  return loss;
}

void DdpStrategy::OptimizerStep(double lr) { local_.OptimizerStep(lr); }

torch::Tensor DdpStrategy::ForwardLoss(const torch::Tensor& inputs,
                                       const torch::Tensor& targets) {
  return local_.ForwardLoss(inputs, targets);
}

double DdpStrategy::AllReduceMean(double value) {
  return shardtrain::AllReduceMean(*comm_, value, options_.device, "ddp");
}

void DdpStrategy::Barrier() { CheckCollective(comm_->Barrier(), "barrier"); }

std::vector<HeldPiece> DdpStrategy::HeldPieces() {
  // Every replica holds the whole model.
  std::vector<HeldPiece> pieces = local_.HeldPieces();
  for (HeldPiece& piece : pieces) {
    piece.placement = piece.placement.ReplicatedAlong(
        MeshDim::kReplicate, comm_->rank(), comm_->world_size());
  }
  return pieces;
}

int64_t DdpStrategy::ModelStateBytes() const {
  return local_.ModelStateBytes();
}

std::vector<std::vector<int64_t>> DdpStrategy::BucketParameterIndices() const {
  return buckets_->BucketParameterIndices();
}

DdpStrategy::OverlapTrace DdpStrategy::last_overlap_trace() const {
  return buckets_->last_overlap_trace();
}

}  // namespace shardtrain
