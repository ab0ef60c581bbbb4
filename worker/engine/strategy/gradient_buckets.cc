#include "worker/engine/strategy/gradient_buckets.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace shardtrain {

GradientBuckets::GradientBuckets(std::vector<torch::Tensor> params,
                                 Communicator* replicas, int64_t bucket_bytes,
                                 std::string strategy)
    : params_(std::move(params)),
      replicas_(replicas),
      strategy_(std::move(strategy)) {
  BuildBuckets(bucket_bytes);
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.Add(params_[i], [this, i] { OnGradReady(static_cast<int64_t>(i)); });
  }
}

void GradientBuckets::BuildBuckets(int64_t bucket_bytes) {
  bucket_of_param_.assign(params_.size(), -1);
  int64_t bytes = 0;
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    const torch::Tensor& p = params_[i];
    const bool fits =
        !buckets_.empty() &&
        params_[buckets_.back().params.front()].dtype() == p.dtype() &&
        bytes + static_cast<int64_t>(p.nbytes()) <= bucket_bytes;
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

absl::Status GradientBuckets::BroadcastFromRankZero() {
  // The bucket buffers are free until the first backward: stage the
  // parameters in them so a few large broadcasts replace many small ones.
  torch::NoGradGuard no_grad;
  std::vector<std::unique_ptr<CommWork>> works;
  for (Bucket& bucket : buckets_) {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const torch::Tensor& p = params_[bucket.params[k]];
      bucket.flat.narrow(0, bucket.offsets[k], p.numel()).copy_(p.reshape(-1));
    }
    works.push_back(replicas_->Broadcast(bucket.flat, 0));
  }
  absl::Status status;
  for (std::unique_ptr<CommWork>& work : works) status.Update(work->Wait());
  if (!status.ok()) {
    return absl::Status(
        status.code(),
        absl::StrCat(strategy_,
                     ": initial broadcast of the parameters from rank 0 "
                     "failed: ",
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

void GradientBuckets::AttachGradViews() {
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

void GradientBuckets::Arm(bool armed) {
  absl::MutexLock lock(&mutex_);
  Reset(armed);
  param_armed_.assign(params_.size(), armed);
}

void GradientBuckets::ArmParameters(const std::vector<int64_t>& indices) {
  absl::MutexLock lock(&mutex_);
  if (!armed_) {
    Reset(true);
    param_armed_.assign(params_.size(), false);
  }
  for (int64_t i : indices) param_armed_[i] = true;
}

void GradientBuckets::Reset(bool armed) {
  armed_ = armed;
  param_ready_.assign(params_.size(), false);
  for (Bucket& bucket : buckets_) {
    bucket.pending = static_cast<int64_t>(bucket.params.size());
    bucket.work.reset();
  }
  next_launch_ = 0;
  if (armed) trace_.bucket_launch.assign(buckets_.size(), {});
}

void GradientBuckets::OnGradReady(int64_t index) {
  absl::MutexLock lock(&mutex_);
  if (!armed_ || !param_armed_[index] || param_ready_[index]) return;
  param_ready_[index] = true;
  --buckets_[bucket_of_param_[index]].pending;
  LaunchReadyBuckets(/*force=*/false);
}

void GradientBuckets::MarkReady(const std::vector<int64_t>& indices) {
  for (int64_t i : indices) OnGradReady(i);
}

void GradientBuckets::LaunchReadyBuckets(bool force) {
  while (next_launch_ < buckets_.size() &&
         (force || buckets_[next_launch_].pending == 0)) {
    Bucket& bucket = buckets_[next_launch_];
    trace_.bucket_launch[next_launch_] = Clock::now();
    bucket.work = replicas_->AllReduce(bucket.flat);
    ++next_launch_;
  }
}

void GradientBuckets::Finish() {
  {
    absl::MutexLock lock(&mutex_);
    if (!armed_) {
      // A reduction without an armed backward: everything launches now.
      trace_.bucket_launch.assign(buckets_.size(), {});
      next_launch_ = 0;
    }
    trace_.backward_end = Clock::now();
    LaunchReadyBuckets(/*force=*/true);
    armed_ = false;
  }
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / static_cast<double>(replicas_->world_size());
  for (Bucket& bucket : buckets_) {
    ThrowIfFailed(bucket.work->Wait(), strategy_, "gradient all-reduce");
    bucket.work.reset();
    bucket.flat.mul_(inv);
  }
}

std::vector<std::vector<int64_t>> GradientBuckets::BucketParameterIndices()
    const {
  std::vector<std::vector<int64_t>> indices;
  for (const Bucket& bucket : buckets_) indices.push_back(bucket.params);
  return indices;
}

GradientBuckets::OverlapTrace GradientBuckets::last_overlap_trace() const {
  absl::MutexLock lock(&mutex_);
  return trace_;
}

}  // namespace shardtrain
