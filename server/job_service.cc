#include "server/job_service.h"

#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"
#include "server/log_files.h"

namespace shardtrain {
namespace {

constexpr absl::Duration kStreamPoll = absl::Milliseconds(100);
constexpr int kMaxTail = 100000;

}  // namespace

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* context,
                                       const v1::SubmitJobRequest* request,
                                       v1::Job* response) {
  return authorizer_->ServeAs(*context, response, [&](const Caller& caller) {
    return manager_->Submit(request->spec(), caller);
  });
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context,
                                    const v1::GetJobRequest* request,
                                    v1::Job* response) {
  return authorizer_->Serve(*context, response,
                            [&] { return manager_->Get(request->job_id()); });
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context,
                                      const v1::ListJobsRequest* request,
                                      v1::ListJobsResponse* response) {
  return authorizer_->Serve(
      *context, response, [&]() -> absl::StatusOr<v1::ListJobsResponse> {
        ListJobsQuery query;
        for (int state : request->states()) {
          query.states.push_back(static_cast<v1::JobState>(state));
        }
        query.labels.insert(request->labels().begin(), request->labels().end());
        query.page_size = request->page_size();
        query.page_token = request->page_token();
        absl::StatusOr<ListJobsPage> page = manager_->List(query);
        if (!page.ok()) return page.status();
        v1::ListJobsResponse listed;
        for (v1::Job& job : page->jobs) *listed.add_jobs() = std::move(job);
        listed.set_next_page_token(page->next_page_token);
        return listed;
      });
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context,
                                       const v1::CancelJobRequest* request,
                                       v1::Job* response) {
  return authorizer_->ServeAs(*context, response, [&](const Caller& caller) {
    return manager_->Cancel(request->job_id(), caller);
  });
}

grpc::Status JobServiceImpl::WatchJob(
    grpc::ServerContext* context, const v1::WatchJobRequest* request,
    grpc::ServerWriter<v1::WatchJobEvent>* writer) {
  if (grpc::Status s = authorizer_->Check(*context); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<StreamLimiter::Slot>> slot =
      streams_->Acquire(context->peer());
  if (!slot.ok()) return ToGrpcStatus(slot.status());
  // Registered first, history read second: a step is stored before it is
  // pushed to watchers, so every step is in the history or arrives live
  // (or both, around this moment: those live duplicates are skipped once).
  absl::StatusOr<std::shared_ptr<JobWatch>> watch =
      manager_->Watch(request->job_id());
  if (!watch.ok()) return ToGrpcStatus(watch.status());
  absl::StatusOr<std::vector<v1::StepMetrics>> history =
      manager_->Metrics(request->job_id(), std::nullopt, 0);
  if (!history.ok()) return ToGrpcStatus(history.status());
  // Replayed steps by (rank, step) with their bytes: a live copy of one is
  // skipped, while a step re-run after a restart (other values) is not.
  std::map<std::pair<int, int64_t>, std::string> replayed;
  bool first = true;
  while (!context->IsCancelled()) {
    std::optional<v1::WatchJobEvent> event = (*watch)->Next(kStreamPoll);
    if (!event.has_value()) {
      if ((*watch)->closed_and_drained()) return grpc::Status::OK;
      continue;
    }
    if (event->has_step() && !replayed.empty()) {
      auto it = replayed.find({event->step().rank(), event->step().step()});
      if (it != replayed.end()) {
        const bool duplicate = it->second == event->step().SerializeAsString();
        replayed.erase(it);
        if (duplicate) continue;
      }
    }
    if (!writer->Write(*event)) return grpc::Status::CANCELLED;
    if (first) {  // the job as it is now, then everything it reported so far
      first = false;
      for (v1::StepMetrics& step : *history) {
        replayed[{step.rank(), step.step()}] = step.SerializeAsString();
        v1::WatchJobEvent past;
        *past.mutable_step() = std::move(step);
        if (!writer->Write(past)) return grpc::Status::CANCELLED;
      }
      history->clear();
      history->shrink_to_fit();
    }
  }
  return grpc::Status::CANCELLED;
}

grpc::Status JobServiceImpl::GetJobMetrics(
    grpc::ServerContext* context, const v1::GetJobMetricsRequest* request,
    v1::GetJobMetricsResponse* response) {
  return authorizer_->Serve(
      *context, response, [&]() -> absl::StatusOr<v1::GetJobMetricsResponse> {
        std::optional<int> rank;
        if (request->has_rank()) rank = request->rank();
        absl::StatusOr<std::vector<v1::StepMetrics>> steps =
            manager_->Metrics(request->job_id(), rank, request->from_step());
        if (!steps.ok()) return steps.status();
        v1::GetJobMetricsResponse metrics;
        for (v1::StepMetrics& step : *steps) {
          *metrics.add_steps() = std::move(step);
        }
        return metrics;
      });
}

grpc::Status JobServiceImpl::StreamLogs(
    grpc::ServerContext* context, const v1::StreamLogsRequest* request,
    grpc::ServerWriter<v1::LogLine>* writer) {
  if (grpc::Status s = authorizer_->Check(*context); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<StreamLimiter::Slot>> slot =
      streams_->Acquire(context->peer());
  if (!slot.ok()) return ToGrpcStatus(slot.status());
  absl::StatusOr<std::vector<std::string>> paths =
      manager_->LogPaths(request->job_id());
  if (!paths.ok()) return ToGrpcStatus(paths.status());
  const int world = static_cast<int>(paths->size());
  if (request->has_rank() &&
      (request->rank() < 0 || request->rank() >= world)) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("rank: got ", request->rank(), "; ", request->job_id(),
                     " has ranks 0..", world - 1));
  }
  if (request->tail() < 0 || request->tail() > kMaxTail) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("tail: got ", request->tail(),
                                     "; must be in [0, ", kMaxTail, "]"));
  }
  std::vector<std::pair<int, std::unique_ptr<LogFollower>>> followers;
  for (int r = 0; r < world; ++r) {
    if (request->has_rank() && request->rank() != r) continue;
    followers.emplace_back(
        r, std::make_unique<LogFollower>((*paths)[r], request->tail()));
  }
  auto send = [&](int rank, std::string line) {
    v1::LogLine out;
    out.set_rank(rank);
    out.set_line(std::move(line));
    return writer->Write(out);
  };
  auto drain = [&]() {
    bool any = false;
    for (auto& [rank, follower] : followers) {
      for (std::string& line : follower->Poll()) {
        any = true;
        if (!send(rank, std::move(line))) return std::optional<bool>();
      }
    }
    return std::optional<bool>(any);
  };
  auto flush_partials = [&]() {
    for (auto& [rank, follower] : followers) {
      std::string partial = follower->TakePartial();
      if (!partial.empty() && !send(rank, std::move(partial))) return false;
    }
    return true;
  };
  if (!request->follow()) {
    if (!drain().has_value() || !flush_partials())
      return grpc::Status::CANCELLED;
    return grpc::Status::OK;
  }
  while (!context->IsCancelled()) {
    // Read the state before draining: lines written before the job ended are
    // then surely on disk when the last drain runs.
    absl::StatusOr<v1::Job> job = manager_->Get(request->job_id());
    const bool ended = job.ok() && IsTerminalJobState(job->state());
    std::optional<bool> sent = drain();
    if (!sent.has_value()) return grpc::Status::CANCELLED;
    if (ended && !*sent) {
      return flush_partials() ? grpc::Status::OK : grpc::Status::CANCELLED;
    }
    if (!*sent) absl::SleepFor(kStreamPoll);
  }
  return grpc::Status::CANCELLED;
}

}  // namespace shardtrain
