#include "worker/progress_reporter.h"

#include <grpcpp/create_channel.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

constexpr absl::Duration kRpcDeadline = absl::Seconds(10);
constexpr int kMaxStepsPerReport = 512;

std::optional<std::string> Env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

}  // namespace

absl::StatusOr<ReporterOptions> ProgressReporter::OptionsFromEnvironment() {
  ReporterOptions options;
  const char* required[] = {"SHARDTRAIN_COORDINATOR", "SHARDTRAIN_JOB_ID",
                            "SHARDTRAIN_JOB_SECRET"};
  for (const char* name : required) {
    if (!Env(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name,
          " is not set: shardtrain-worker is started by shardtraind "
          "(use shardtrain-train to train by hand)"));
    }
  }
  options.address = *Env("SHARDTRAIN_COORDINATOR");
  options.job_id = *Env("SHARDTRAIN_JOB_ID");
  options.secret = *Env("SHARDTRAIN_JOB_SECRET");
  if (auto rank = Env("RANK");
      rank && !absl::SimpleAtoi(*rank, &options.rank)) {
    return absl::InvalidArgumentError(absl::StrCat("RANK: got '", *rank, "'"));
  }
  if (auto seconds = Env("SHARDTRAIN_HEARTBEAT_SECONDS")) {
    double s = 0;
    if (!absl::SimpleAtod(*seconds, &s) || s <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SHARDTRAIN_HEARTBEAT_SECONDS: got '", *seconds, "'; must be > 0"));
    }
    options.heartbeat_interval = absl::Seconds(s);
  }
  options.pid = static_cast<int>(getpid());
  return options;
}

ProgressReporter::ProgressReporter(ReporterOptions options)
    : options_(std::move(options)),
      channel_(grpc::CreateChannel(options_.address,
                                   grpc::InsecureChannelCredentials())),
      stub_(v1::WorkerService::NewStub(channel_)) {}

ProgressReporter::~ProgressReporter() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  if (sender_.joinable()) sender_.join();
  if (heartbeat_.joinable()) heartbeat_.join();
}

v1::WorkerIdentity ProgressReporter::Identity() const {
  v1::WorkerIdentity identity;
  identity.set_job_id(options_.job_id);
  identity.set_secret(options_.secret);
  identity.set_rank(options_.rank);
  identity.set_pid(options_.pid);
  return identity;
}

void ProgressReporter::set_on_cancel(std::function<void()> on_cancel) {
  absl::MutexLock lock(&mutex_);
  on_cancel_ = std::move(on_cancel);
}

void ProgressReporter::NoteCancel(bool cancel) {
  if (!cancel || cancelled_.exchange(true)) return;
  std::function<void()> on_cancel;
  {
    absl::MutexLock lock(&mutex_);
    on_cancel = on_cancel_;
  }
  if (on_cancel) on_cancel();
}

absl::Status ProgressReporter::Register(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::RegisterRequest request;
  *request.mutable_worker() = Identity();
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(kRpcDeadline));
    context.set_wait_for_ready(true);
    v1::RegisterResponse response;
    const grpc::Status status = stub_->Register(&context, request, &response);
    if (status.ok()) break;
    const bool retry =
        status.error_code() == grpc::StatusCode::UNAVAILABLE ||
        status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!retry || absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "rank ", options_.rank, ": cannot register with the coordinator at ",
          options_.address, ": ", status.error_message()));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  sender_ = std::thread([this] { SenderLoop(); });
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  return absl::OkStatus();
}

void ProgressReporter::Report(v1::StepMetrics step) {
  absl::MutexLock lock(&mutex_);
  pending_.push_back(std::move(step));
  ++queued_;
}

void ProgressReporter::SenderLoop() {
  while (true) {
    std::vector<v1::StepMetrics> batch;
    {
      absl::MutexLock lock(&mutex_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
        return !pending_.empty() || stopping_;
      };
      mutex_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(200));
      if (pending_.empty()) {
        if (stopping_) return;
        continue;
      }
      const size_t n = std::min<size_t>(pending_.size(), kMaxStepsPerReport);
      batch.assign(pending_.begin(), pending_.begin() + n);
      pending_.erase(pending_.begin(), pending_.begin() + n);
    }
    v1::ReportProgressRequest request;
    *request.mutable_worker() = Identity();
    for (v1::StepMetrics& step : batch) *request.add_steps() = std::move(step);
    // Retried until stored: a step report is only dropped when the worker
    // itself is going away.
    while (true) {
      grpc::ClientContext context;
      context.set_deadline(DeadlineIn(kRpcDeadline));
      v1::ReportProgressResponse response;
      const grpc::Status status =
          stub_->ReportProgress(&context, request, &response);
      absl::MutexLock lock(&mutex_);
      if (status.ok()) {
        stored_ += request.steps_size();
        last_error_ = absl::OkStatus();
        mutex_.Unlock();
        NoteCancel(response.cancel());
        mutex_.Lock();
        break;
      }
      last_error_ = absl::UnavailableError(
          absl::StrCat("reporting progress to ", options_.address, ": ",
                       status.error_message()));
      if (stopping_ ||
          status.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
        break;
      }
      mutex_.Unlock();
      absl::SleepFor(absl::Milliseconds(200));
      mutex_.Lock();
    }
  }
}

void ProgressReporter::HeartbeatLoop() {
  v1::HeartbeatRequest request;
  *request.mutable_worker() = Identity();
  while (true) {
    {
      absl::MutexLock lock(&mutex_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
        return stopping_;
      };
      if (mutex_.AwaitWithTimeout(absl::Condition(&stopping),
                                  options_.heartbeat_interval)) {
        return;
      }
    }
    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(kRpcDeadline));
    v1::HeartbeatResponse response;
    if (stub_->Heartbeat(&context, request, &response).ok()) {
      NoteCancel(response.cancel());
    }
  }
}

absl::Status ProgressReporter::Flush(absl::Duration timeout) {
  absl::MutexLock lock(&mutex_);
  const int64_t target = queued_;
  auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    return stored_ >= target;
  };
  if (mutex_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rank ", options_.rank, ": ", target - stored_,
      " step reports not stored after ", absl::FormatDuration(timeout),
      last_error_.ok() ? "" : absl::StrCat(" (", last_error_.message(), ")")));
}

}  // namespace shardtrain
