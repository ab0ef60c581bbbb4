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

absl::Status DdpStrategy::Setup(Gpt2 model) {
  if (absl::Status s = local_.Setup(model); !s.ok()) return s;
  params_ = model->parameters();
  try {
    BuildBuckets();
    if (absl::Status s = BroadcastFromRankZero(); !s.ok()) return s;
    torch::NoGradGuard no_grad;
    for (torch::Tensor& buffer : model->buffers()) {
      CheckCollective(comm_->Broadcast(buffer, 0)->Wait(), "broadcast");
    }
    AttachGradViews();
    RegisterHooks();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("ddp setup: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

void DdpStrategy::BuildBuckets() {
  buckets_.clear();
  bucket_of_param_.assign(params_.size(), -1);
  int64_t bytes = 0;
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    const torch::Tensor& p = params_[i];
    const bool fits =
        !buckets_.empty() &&
        params_[buckets_.back().params.front()].dtype() == p.dtype() &&
        bytes + static_cast<int64_t>(p.nbytes()) <= bucket_bytes_;
    if (!fits) {
      buckets_.emplace_back();
      bytes = 0;
    }
    Bucket& bucket = buckets_.back();
    bucket.offsets.push_back(bucket.params.empty()
                                 ? 0
                                 : bucket.offsets.back() +
                                       params_[bucket.params.back()].numel());
    bucket.params.push_back(i);
    bucket_of_param_[i] = static_cast<int64_t>(buckets_.size()) - 1;
    bytes += static_cast<int64_t>(p.nbytes());
  }
  for (Bucket& bucket : buckets_) {
    const torch::Tensor& last = params_[bucket.params.back()];
    bucket.flat = torch::zeros({bucket.offsets.back() + last.numel()},
                               last.options().requires_grad(false));
  }
}

absl::Status DdpStrategy::BroadcastFromRankZero() {
  // The bucket buffers are free until the first backward: stage the
  // parameters in them so a few large broadcasts replace many small ones.
  torch::NoGradGuard no_grad;
  std::vector<std::unique_ptr<CommWork>> works;
  for (Bucket& bucket : buckets_) {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const torch::Tensor& p = params_[bucket.params[k]];
      bucket.flat.narrow(0, bucket.offsets[k], p.numel()).copy_(p.reshape(-1));
    }
    works.push_back(comm_->Broadcast(bucket.flat, 0));
  }
  absl::Status status;
  for (std::unique_ptr<CommWork>& work : works) status.Update(work->Wait());
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("ddp: initial broadcast of the parameters "
                                     "from rank 0 failed: ",
                                     status.message()));
  }
  for (Bucket& bucket : buckets_) {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      torch::Tensor& p = params_[bucket.params[k]];
      p.copy_(bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view_as(p));
    }
    bucket.flat.zero_();
  }
  return absl::OkStatus();
}

void DdpStrategy::AttachGradViews() {
  torch::NoGradGuard no_grad;
  for (const Bucket& bucket : buckets_) {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      torch::Tensor& p = params_[bucket.params[k]];
      torch::Tensor view =
          bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes());
      torch::Tensor& grad = p.mutable_grad();
      if (grad.defined() && grad.data_ptr() == view.data_ptr()) continue;
      if (grad.defined()) {
        view.copy_(grad);
      } else {
        view.zero_();
      }
      grad = view;
    }
  }
}

void DdpStrategy::RegisterHooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.Add(params_[i], [this, i] { OnGradReady(static_cast<int64_t>(i)); });
  }
}

void DdpStrategy::OnGradReady(int64_t index) {
  absl::MutexLock lock(&mutex_);
  if (!reducing_ || param_ready_[index]) return;
  param_ready_[index] = true;
  --buckets_[bucket_of_param_[index]].pending;
  LaunchReadyBuckets(/*force=*/false);
}

void DdpStrategy::LaunchReadyBuckets(bool force) {
  while (next_launch_ < buckets_.size() &&
         (force || buckets_[next_launch_].pending == 0)) {
    Bucket& bucket = buckets_[next_launch_];
    trace_.bucket_launch[next_launch_] = Clock::now();
    bucket.work = comm_->AllReduce(bucket.flat);
    ++next_launch_;
  }
}

torch::Tensor DdpStrategy::ForwardBackward(const torch::Tensor& inputs,
                                           const torch::Tensor& targets,
                                           double loss_scale, bool sync) {
  AttachGradViews();
  {
    absl::MutexLock lock(&mutex_);
    reducing_ = sync;
    param_ready_.assign(params_.size(), false);
    for (Bucket& bucket : buckets_) {
      bucket.pending = static_cast<int64_t>(bucket.params.size());
      bucket.work.reset();
    }
    next_launch_ = 0;
    if (sync) trace_.bucket_launch.assign(buckets_.size(), {});
  }
  torch::Tensor loss =
      local_.ForwardBackward(inputs, targets, loss_scale, sync);
  if (!sync) return loss;

  {
    absl::MutexLock lock(&mutex_);
    trace_.backward_end = Clock::now();
    // Parameters that took no part in this graph never fire their hook; their
    // (locally accumulated, possibly zero) gradients are reduced all the same.
    LaunchReadyBuckets(/*force=*/true);
    reducing_ = false;
  }
  torch::NoGradGuard no_grad;
  const double inv_world = 1.0 / static_cast<double>(comm_->world_size());
  for (Bucket& bucket : buckets_) {
    CheckCollective(bucket.work->Wait(), "gradient all-reduce");
    bucket.work.reset();
    bucket.flat.mul_(inv_world);
  }
  return loss;
}

double DdpStrategy::ClipGradNorm(double max_norm) {
  return local_.ClipGradNorm(max_norm);
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

std::vector<StateSlice> DdpStrategy::GradientSlices() {
  return local_.GradientSlices();
}

std::vector<StateSlice> DdpStrategy::StateSlices(bool to_save) {
  std::vector<StateSlice> slices = local_.StateSlices(to_save);
  if (!to_save) return slices;
  // Replicas are identical: rank r writes elements [n r / W, n (r+1) / W) of
  // every tensor, so all ranks write at once and no byte is written twice.
  const int64_t r = comm_->rank();
  const int64_t w = comm_->world_size();
  std::vector<StateSlice> mine;
  for (StateSlice& slice : slices) {
    const int64_t n = slice.data.numel();
    const int64_t begin = n * r / w;
    const int64_t end = n * (r + 1) / w;
    if (begin == end) continue;  // a tensor smaller than the world
    slice.offset = begin;
    slice.data = slice.data.narrow(0, begin, end - begin);
    mine.push_back(std::move(slice));
  }
  return mine;
}

absl::Status DdpStrategy::ExportModel(const std::string& path) {
  if (comm_->rank() != 0) return absl::OkStatus();
  return local_.ExportModel(path);
}

int64_t DdpStrategy::ModelStateBytes() const {
  return local_.ModelStateBytes();
}

std::vector<std::vector<int64_t>> DdpStrategy::BucketParameterIndices() const {
  std::vector<std::vector<int64_t>> indices;
  for (const Bucket& bucket : buckets_) indices.push_back(bucket.params);
  return indices;
}

DdpStrategy::OverlapTrace DdpStrategy::last_overlap_trace() const {
  absl::MutexLock lock(&mutex_);
  return trace_;
}

}  // namespace shardtrain
