#include "server/worker_reports.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/secrets.h"
#include "proto/job_config.h"
#include "server/job_watch.h"

namespace shardtrain {
namespace {

// The ranks are told to exit at once when their attempt is being stopped,
// but for a preemption: then they save a checkpoint first (asked by
// SIGUSR1) and exit on their own.
bool StopsNow(const JobEntry& entry) {
  return entry.stop != StopIntent::kNone && entry.stop != StopIntent::kPreempt;
}

}  // namespace

WorkerReports::WorkerReports(JobTable* table) : table_(table) {}

absl::StatusOr<JobEntry*> WorkerReports::Authenticate(
    const v1::WorkerIdentity& worker) {
  JobEntry* entry = table_->Find(worker.job_id());
  // One message for every refusal: a caller learns nothing about which part
  // was wrong.
  const absl::Status denied = absl::PermissionDeniedError(
      absl::StrCat("worker: not a live rank of job '", worker.job_id(),
                   "' with that secret"));
  if (entry == nullptr || !JobTable::IsActive(entry->stored.job.state()) ||
      entry->ranks.empty()) {
    return denied;
  }
  if (!SecretsEqual(worker.secret(), entry->stored.secret) ||
      worker.rank() < 0 ||
      worker.rank() >= static_cast<int>(entry->ranks.size()) ||
      (entry->ranks[worker.rank()].pid != worker.pid() &&
       entry->ranks[worker.rank()].pid != 0) ||
      entry->ranks[worker.rank()].exited) {
    return denied;
  }
  return entry;
}

absl::Status WorkerReports::RegisterWorker(const v1::WorkerIdentity& worker) {
  absl::MutexLock lock(&table_->mutex);
  absl::StatusOr<JobEntry*> found = Authenticate(worker);
  if (!found.ok()) return found.status();
  JobEntry& entry = **found;
  RankProcess& rank = entry.ranks[worker.rank()];
  // A rank on another host: its pid is known from now on.
  if (rank.pid == 0) rank.pid = worker.pid();
  rank.registered = true;
  rank.last_heartbeat = table_->clock->Now();
  if (table_->observer != nullptr) {
    table_->observer->OnHeartbeat(worker.job_id(), worker.rank(),
                                  rank.last_heartbeat);
  }
  const bool all =
      std::all_of(entry.ranks.begin(), entry.ranks.end(),
                  [](const RankProcess& r) { return r.registered; });
  if (all && entry.stop == StopIntent::kNone &&
      entry.stored.job.state() != v1::RUNNING) {
    const v1::Job& job = entry.stored.job;
    table_->SetState(
        entry, v1::RUNNING,
        job.restarts() == 0
            ? absl::StrCat("all ", entry.ranks.size(), " ranks joined")
            : absl::StrCat("all ", entry.ranks.size(),
                           " ranks joined after restart ", job.restarts()));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> WorkerReports::ReportProgress(
    const v1::WorkerIdentity& worker,
    const std::vector<v1::StepMetrics>& steps) {
  bool stop = false;
  {
    absl::MutexLock lock(&table_->mutex);
    absl::StatusOr<JobEntry*> found = Authenticate(worker);
    if (!found.ok()) return found.status();
    JobEntry& entry = **found;
    entry.ranks[worker.rank()].last_heartbeat = table_->clock->Now();
    stop = StopsNow(entry);
  }
  for (const v1::StepMetrics& step : steps) {
    if (step.rank() != worker.rank()) {
      return absl::InvalidArgumentError(
          absl::StrCat("steps: rank ", worker.rank(),
                       " reported a step of rank ", step.rank()));
    }
  }
  // Stored outside the lock: the store batches concurrent reports into one
  // transaction, and the other ranks keep reporting meanwhile.
  if (absl::Status s = table_->store->AppendMetrics(worker.job_id(), steps);
      !s.ok()) {
    // Unavailable: the worker keeps the steps and sends them again.
    return absl::UnavailableError(
        absl::StrCat("could not store step metrics: ", s.message()));
  }
  absl::MutexLock lock(&table_->mutex);
  JobEntry* entry = table_->Find(worker.job_id());
  if (entry == nullptr) return stop;
  v1::Job& job = entry->stored.job;
  for (const v1::StepMetrics& step : steps) {
    if (step.rank() == 0 && step.step() >= job.last_step().step()) {
      *job.mutable_last_step() = step;
    }
    if (step.rank() == 0) {
      table_->CountKeptStep(*entry, step);
      table_->CountHeldDevices(*entry, !entry->devices.empty());
    }
    if (step.rank() == 0 && entry->remesh_started != absl::InfinitePast()) {
      // The first step of a re-meshed attempt: what the change cost and
      // what the new mesh does.
      const absl::Duration lost = table_->clock->Now() - entry->remesh_started;
      entry->remesh_started = absl::InfinitePast();
      job.set_remesh_seconds_lost(job.remesh_seconds_lost() +
                                  absl::ToDoubleSeconds(lost));
      table_->Persist(
          *entry,
          table_->Event(
              job.state(),
              absl::StrCat(absl::StrFormat("re-meshed %s -> %s: %.0f tokens/s",
                                           entry->remesh_from, JobMesh(job),
                                           step.tokens_per_second()),
                           entry->remesh_predicted > 0
                               ? absl::StrFormat(" (%.0f predicted)",
                                                 entry->remesh_predicted)
                               : "",
                           absl::StrFormat(", was %.0f; %.1f s without a step",
                                           entry->remesh_tokens_per_second,
                                           absl::ToDoubleSeconds(lost)))));
    }
    v1::WatchJobEvent event;
    *event.mutable_step() = step;
    for (auto& weak : entry->watchers) {
      if (auto watch = weak.lock()) watch->Push(event);
    }
  }
  if (table_->observer != nullptr && !steps.empty())
    table_->observer->OnSteps(job, steps);
  return stop;
}

absl::StatusOr<bool> WorkerReports::Heartbeat(
    const v1::WorkerIdentity& worker) {
  absl::MutexLock lock(&table_->mutex);
  absl::StatusOr<JobEntry*> found = Authenticate(worker);
  if (!found.ok()) return found.status();
  JobEntry& entry = **found;
  entry.ranks[worker.rank()].last_heartbeat = table_->clock->Now();
  if (table_->observer != nullptr) {
    table_->observer->OnHeartbeat(worker.job_id(), worker.rank(),
                                  entry.ranks[worker.rank()].last_heartbeat);
  }
  return StopsNow(entry);
}

}  // namespace shardtrain
