#include "server/attempt_supervisor.h"

#include <signal.h>

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/exit_codes.h"
#include "common/subprocess.h"
#include "proto/job_config.h"
#include "server/failure_reasons.h"
#include "server/scheduler.h"

namespace shardtrain {
namespace {

// Starts of one attempt on a fresh rendezvous port when the picked one was
// taken (another process bound it between the pick and rank 0's bind).
constexpr int kMaxPortRetries = 4;

bool AnyRankRunning(const JobEntry& entry) {
  return std::any_of(entry.ranks.begin(), entry.ranks.end(),
                     [](const RankProcess& rank) { return !rank.exited; });
}

}  // namespace

AttemptSupervisor::AttemptSupervisor(JobTable* table, AttemptLauncher* launcher)
    : table_(table),
      launcher_(launcher),
      worker_address_(table->options.worker_address) {}

AttemptSupervisor::~AttemptSupervisor() { Shutdown(); }

void AttemptSupervisor::set_worker_address(std::string address) {
  absl::MutexLock lock(&table_->mutex);
  worker_address_ = std::move(address);
}

void AttemptSupervisor::ClearAttempt(JobEntry& entry) {
  entry.ranks.clear();
  entry.attempt = Attempt{};
  entry.stop = StopIntent::kNone;
  entry.failure.reset();
  entry.killed = false;
  entry.stored.worker_pids.clear();
  entry.stored.worker_pgid = 0;
}

void AttemptSupervisor::ResumeInterruptedJobs() {
  // Nothing of the previous coordinator's attempts may run when a job starts
  // again: ended first, without the lock (scancel, or a wait for a killed
  // process, must not hold up RPCs).
  struct Leftover {
    std::string id;
    std::vector<int> pids;
  };
  std::vector<Leftover> leftovers;
  {
    absl::MutexLock lock(&table_->mutex);
    for (const std::string& id : table_->order) {
      const JobEntry& entry = *table_->jobs[id];
      if (JobTable::IsActive(entry.stored.job.state()) && entry.ranks.empty() &&
          !entry.relaunch_pending) {
        leftovers.push_back({id, entry.stored.worker_pids});
      }
    }
  }
  for (const Leftover& leftover : leftovers) {
    launcher_->EndLeftovers(leftover.id, table_->JobDir(leftover.id),
                            leftover.pids);
  }
  absl::MutexLock lock(&table_->mutex);
  int interrupted = 0;
  for (const std::string& id : table_->order) {
    JobEntry& entry = *table_->jobs[id];
    v1::Job& job = entry.stored.job;
    if (!JobTable::IsActive(job.state()) || entry.ranks.size() > 0 ||
        entry.relaunch_pending) {
      continue;
    }
    ++interrupted;
    entry.stored.worker_pids.clear();
    entry.stored.worker_pgid = 0;
    const int max_restarts = job.spec().max_restarts();
    if (job.cancel_requested()) {
      table_->SetState(
          entry, v1::CANCELLED,
          "cancelled (the coordinator restarted while the ranks stopped)");
    } else if (job.state() == v1::PREEMPTED) {
      // Its ranks were saving their checkpoint: what they saved (or the one
      // before) is where it resumes; a preemption uses no restart.
      job.set_preemptions(job.preemptions() + 1);
      table_->SetState(entry, v1::QUEUED,
                       "queued again: the coordinator restarted while the "
                       "job was being preempted; resumes from its latest "
                       "checkpoint");
    } else if (job.restarts() < max_restarts) {
      job.set_restarts(job.restarts() + 1);
      entry.relaunch_pending = true;
      table_->SetState(entry, v1::RESTARTING,
                       absl::StrCat("coordinator restarted while the job was ",
                                    JobTable::StateName(job.state()),
                                    "; restart ", job.restarts(), " of ",
                                    max_restarts, " from the last checkpoint"));
    } else {
      v1::Failure* failure = job.mutable_failure();
      SetCoordinatorRestartFailure(
          failure, absl::StrCat("the coordinator restarted while the job was ",
                                JobTable::StateName(job.state()),
                                " and no restarts were left (max_restarts ",
                                max_restarts, ")"));
      table_->SetState(entry, v1::FAILED, failure->message());
    }
  }
  JobTable::Log(absl::StrCat("loaded ", table_->order.size(),
                             " jobs from the store; ", interrupted,
                             " were interrupted"));
}

void AttemptSupervisor::Start() {
  thread_ = std::thread([this] { SupervisorLoop(); });
}

void AttemptSupervisor::SupervisorLoop() {
  while (!stop_thread_.WaitForNotificationWithTimeout(table_->options.tick)) {
    Tick();
  }
}

void AttemptSupervisor::Shutdown() {
  {
    absl::MutexLock lock(&table_->mutex);
    if (!table_->shutting_down) {
      table_->shutting_down = true;
      for (auto& [id, entry] : table_->jobs) {
        // A cancel or failure already under way keeps its intent, so its
        // outcome is stored as CANCELLED / FAILED, not lost to the shutdown.
        if (!entry->ranks.empty() && entry->stop == StopIntent::kNone) {
          BeginStop(*entry, StopIntent::kShutdown);
        }
        for (auto& weak : entry->watchers) {
          if (auto watch = weak.lock()) watch->Close();
        }
        entry->watchers.clear();
      }
    }
  }
  // Workers die with the thread that spawned them, so the supervisor keeps
  // running (and reaping) until they are gone.
  // Real time, not the table's clock: this waits on processes, not on job
  // timeouts.
  const absl::Time deadline =
      absl::Now() + table_->options.grace_period + absl::Seconds(5);
  while (true) {
    {
      absl::MutexLock lock(&table_->mutex);
      bool any = false;
      for (auto& [id, entry] : table_->jobs) {
        any = any || !entry->ranks.empty() || entry->launching;
      }
      if (!any) break;
    }
    if (absl::Now() > deadline) break;
    if (absl::Now() > deadline - absl::Seconds(5)) {
      // The grace period has passed in real time: kill what is left, whatever
      // the job clock says.
      absl::MutexLock lock(&table_->mutex);
      for (auto& [id, entry] : table_->jobs) {
        if (!entry->ranks.empty() && !entry->killed) {
          entry->stop_deadline = table_->clock->Now();
        }
      }
    }
    if (!thread_.joinable()) Tick();
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (!stop_thread_.HasBeenNotified()) stop_thread_.Notify();
  if (thread_.joinable()) thread_.join();
}

// A tick asks the launcher outside the lock, twice: first for the signals
// queued since the last tick and the news of running attempts, then (after
// supervising on that news) for the signals and launches it decided.
void AttemptSupervisor::Tick() {
  std::vector<PendingSignal> signals;
  std::vector<Poll> polls;
  {
    absl::MutexLock lock(&table_->mutex);
    signals = TakeSignals();
    polls = DuePolls();
  }
  SendSignals(signals);
  for (Poll& poll : polls) {
    poll.report = launcher_->Poll(poll.attempt, poll.running);
  }
  std::vector<LaunchRequest> requests;
  bool elastic = false;
  {
    absl::MutexLock lock(&table_->mutex);
    for (const Poll& poll : polls) ApplyPoll(poll);
    Supervise();
    for (const auto& [id, entry] : table_->jobs) {
      elastic = elastic || (entry->elastic_restart && !table_->shutting_down);
    }
    if (!elastic) {
      requests.swap(launch_requests_);
      signals = TakeSignals();
    }
  }
  if (elastic) {
    // What the backend can run now (Slurm: sinfo), asked without the lock.
    const absl::StatusOr<Capacity> capacity = launcher_->Available();
    absl::MutexLock lock(&table_->mutex);
    RestartElastic(capacity);
    requests.swap(launch_requests_);
    signals = TakeSignals();
  }
  SendSignals(signals);
  if (requests.empty()) return;
  std::vector<PreparedLaunch> prepared;
  for (const LaunchRequest& request : requests) {
    prepared.push_back(PrepareLaunch(request));
  }
  absl::MutexLock lock(&table_->mutex);
  for (size_t i = 0; i < requests.size(); ++i) {
    CompleteLaunch(*table_->jobs.at(requests[i].launch.job_id), requests[i],
                   prepared[i]);
  }
}

void AttemptSupervisor::SignalRanks(JobEntry& entry, int signal) {
  signals_.push_back({entry.stored.job.id(), signal});
}

std::vector<AttemptSupervisor::PendingSignal> AttemptSupervisor::TakeSignals() {
  std::vector<PendingSignal> pending;
  for (const auto& [id, signal] : signals_) {
    JobEntry* entry = table_->Find(id);
    // Not started yet (CompleteLaunch deals with a stop then), or gone.
    if (entry == nullptr || entry->launching || entry->ranks.empty()) continue;
    PendingSignal send;
    for (size_t r = 0; r < entry->ranks.size(); ++r) {
      if (!entry->ranks[r].exited) send.ranks.push_back(static_cast<int>(r));
    }
    if (send.ranks.empty()) continue;
    send.attempt = entry->attempt;
    send.signal = signal;
    pending.push_back(std::move(send));
  }
  signals_.clear();
  return pending;
}

void AttemptSupervisor::SendSignals(const std::vector<PendingSignal>& signals) {
  for (const PendingSignal& send : signals) {
    launcher_->Signal(send.attempt, send.ranks, send.signal);
  }
}

std::vector<AttemptSupervisor::Poll> AttemptSupervisor::DuePolls() {
  std::vector<Poll> polls;
  const absl::Time now = table_->clock->Now();
  for (const std::string& id : table_->order) {
    JobEntry& entry = *table_->jobs.at(id);
    if (entry.ranks.empty() || entry.launching || now < entry.next_poll) {
      continue;
    }
    if (!AnyRankRunning(entry)) continue;
    entry.next_poll = now + launcher_->poll_interval();
    Poll poll;
    poll.job_id = id;
    poll.attempt = entry.attempt;
    for (const RankProcess& rank : entry.ranks) {
      poll.running.push_back(!rank.exited);
    }
    polls.push_back(std::move(poll));
  }
  return polls;
}

void AttemptSupervisor::ApplyPoll(const Poll& poll) {
  JobEntry* entry = table_->Find(poll.job_id);
  if (entry == nullptr || entry->ranks.empty() ||
      entry->attempt.number != poll.attempt.number ||
      entry->attempt.handle != poll.attempt.handle) {
    return;  // the attempt ended meanwhile
  }
  v1::Job& job = entry->stored.job;
  if (!poll.report.ok()) {
    // The backend did not answer this time; ask again at the next poll.
    JobTable::Log(absl::StrCat(job.id(), ": ", poll.report.status().message()));
    return;
  }
  const AttemptReport& report = *poll.report;
  if (!report.waiting.empty()) {
    // The rendezvous clock starts when the backend starts the ranks.
    entry->launch_time = table_->clock->Now();
    if (job.state_reason() != report.waiting &&
        (job.state() == v1::STARTING || job.state() == v1::RESTARTING)) {
      job.set_state_reason(report.waiting);
    }
  }
  for (const RankEnd& exit : report.exits) {
    if (exit.rank < 0 || exit.rank >= static_cast<int>(entry->ranks.size())) {
      continue;
    }
    RankProcess& rank = entry->ranks[exit.rank];
    if (rank.exited) continue;
    rank.exited = true;
    rank.exit = exit.status;
    JobTable::Log(absl::StrCat(job.id(), " rank ", exit.rank, " (pid ",
                               rank.pid, ") ended: ", exit.status.ToString()));
  }
  if (entry->stop != StopIntent::kNone) return;  // ending as intended
  if (report.failure.has_value()) {
    const AttemptFailure& failed = *report.failure;
    v1::Failure failure;
    if (failed.rank >= 0 &&
        failed.rank < static_cast<int>(entry->ranks.size())) {
      failure = table_->RankFailure(job.id(), failed.rank, failed.reason,
                                    failed.message);
      MarkOomFromLogTail(failure);
      MarkDiskFull(failure, table_->JobDir(job.id()));
    } else {
      failure.set_reason(failed.reason);
      failure.set_rank(-1);
      failure.set_message(failed.message);
      const size_t lines = failed.log_lines.size();
      const size_t keep = static_cast<size_t>(table_->options.log_tail_lines);
      for (size_t i = lines > keep ? lines - keep : 0; i < lines; ++i) {
        failure.add_log_tail(failed.log_lines[i]);
      }
    }
    FailAttempt(*entry, std::move(failure));
    return;
  }
  for (const RankEnd& exit : report.exits) {
    if (exit.status.exit_code == kExitPreempted &&
        entry->stop == StopIntent::kNone) {
      // Asked to stop by someone else (Slurm's preemption signal): the
      // ranks saved a checkpoint, as for our own preemption.
      entry->stop = StopIntent::kPreempt;
      entry->stop_deadline =
          table_->clock->Now() + table_->options.preempt_grace;
      SignalRanks(*entry, SIGUSR1);
      table_->SetState(
          *entry, v1::PREEMPTED,
          absl::StrCat("rank ", exit.rank,
                       " saved a checkpoint and stopped when "
                       "the ",
                       launcher_->name(), " backend asked it to (SIGUSR1)"));
    }
    if (exit.status.success() || entry->stop != StopIntent::kNone) continue;
    if (exit.rank == 0 && exit.status.exit_code == kExitRendezvousPortTaken &&
        entry->port_retries < kMaxPortRetries) {
      entry->port_taken = true;
    }
    v1::Failure failure = RankExitFailure(*entry, exit.rank, exit.status);
    // Deterministic: the same step would diverge, or outgrow the job's own
    // memory cap, again.
    if (failure.reason() == v1::DIVERGED ||
        failure.reason() == v1::INVALID_SPEC ||
        (failure.reason() == v1::OOM &&
         entry->stored.job.spec().trainer().memory_cap_bytes() > 0)) {
      entry->no_restart = true;
    }
    FailAttempt(*entry, std::move(failure));
  }
}

v1::Failure AttemptSupervisor::RankExitFailure(const JobEntry& entry, int r,
                                               const ExitStatus& exit) {
  const std::string& id = entry.stored.job.id();
  v1::Failure failure = table_->RankFailure(
      id, r, exit.signal > 0 ? v1::SIGNAL : v1::EXIT_CODE,
      absl::StrCat("rank ", r, " ended with ", exit.ToString()));
  ClassifyRankExit(failure, r, exit, table_->JobDir(id));
  return failure;
}

void AttemptSupervisor::Supervise() {
  table_->StoreUnsaved();
  for (const std::string& id : table_->order) {
    JobEntry& entry = *table_->jobs.at(id);
    if (!entry.ranks.empty() && !entry.launching) Detect(entry);
  }
  if (table_->shutting_down) return;
  // Jobs recovered after a coordinator restart go before the queue: they held
  // their devices before.
  for (const std::string& id : table_->order) {
    JobEntry& entry = *table_->jobs.at(id);
    if (!entry.relaunch_pending) continue;
    entry.relaunch_pending = false;
    if (entry.stored.job.spec().elastic().min_world_size() > 0) {
      // Its size is chosen as after any loss (the restart is counted).
      entry.elastic_restart = true;
      entry.elastic_restart_counted = true;
      continue;
    }
    const std::vector<int> free = table_->FreeDevices();
    // An elastic job that continued smaller goes on at that size.
    const int world = entry.stored.job.world_size() > 0
                          ? entry.stored.job.world_size()
                          : entry.stored.job.spec().world_size();
    // Its devices are taken anew: within its owner's quota (which the
    // token file may have lowered meanwhile), else it waits in the queue.
    if (const QuotaLedger quotas = table_->HeldDevices(id);
        !quotas.MayHold(entry.stored.job.owner(), world)) {
      table_->SetState(
          entry, v1::QUEUED,
          absl::StrCat("queued again after the coordinator restarted: ",
                       quotas.Refusal(entry.stored.job.owner(), world)));
      continue;
    }
    if (static_cast<int>(free.size()) < world) {
      v1::Failure* failure = entry.stored.job.mutable_failure();
      SetCoordinatorRestartFailure(
          failure,
          absl::StrCat("after the coordinator restarted the job needs ", world,
                       " devices and only ", free.size(), " are free"));
      table_->SetState(entry, v1::FAILED, failure->message());
      continue;
    }
    RequestLaunch(entry, std::vector<int>(free.begin(), free.begin() + world));
  }
  ScheduleQueued();
}

void AttemptSupervisor::Detect(JobEntry& entry) {
  const absl::Time now = table_->clock->Now();
  const std::string& id = entry.stored.job.id();
  if (entry.stop == StopIntent::kNone) {
    std::vector<int> unregistered;
    for (size_t r = 0; r < entry.ranks.size(); ++r) {
      const RankProcess& rank = entry.ranks[r];
      if (!rank.registered) {
        unregistered.push_back(static_cast<int>(r));
        continue;
      }
      if (!rank.exited &&
          now - rank.last_heartbeat > table_->options.heartbeat_timeout) {
        FailAttempt(
            entry,
            table_->RankFailure(
                id, static_cast<int>(r), v1::HANG,
                absl::StrCat(
                    "rank ", r, " sent no heartbeat for ",
                    absl::FormatDuration(absl::Trunc(now - rank.last_heartbeat,
                                                     absl::Milliseconds(100))),
                    " (timeout ",
                    absl::FormatDuration(table_->options.heartbeat_timeout),
                    ")")));
        break;
      }
    }
    if (entry.stop == StopIntent::kNone && !unregistered.empty() &&
        now - entry.launch_time > table_->options.rendezvous_timeout) {
      FailAttempt(
          entry,
          table_->RankFailure(
              id, unregistered.front(), v1::RENDEZVOUS_TIMEOUT,
              absl::StrCat(
                  "rank", unregistered.size() == 1 ? " " : "s ",
                  absl::StrJoin(unregistered, ", "), " did not join within ",
                  absl::FormatDuration(table_->options.rendezvous_timeout))));
    }
  }

  if (entry.stop != StopIntent::kNone && !entry.killed &&
      now >= entry.stop_deadline) {
    SignalRanks(entry, SIGKILL);
    entry.killed = true;
  }
  const bool all_exited =
      std::all_of(entry.ranks.begin(), entry.ranks.end(),
                  [](const RankProcess& r) { return r.exited; });
  if (all_exited) FinishAttempt(entry);
}

void AttemptSupervisor::FailAttempt(JobEntry& entry, v1::Failure failure) {
  if (entry.failure.has_value()) return;
  JobTable::Log(absl::StrCat(entry.stored.job.id(), ": ", failure.message()));
  const v1::JobEvent event = table_->Event(
      entry.stored.job.state(),
      absl::StrCat(failure.message(), "; stopping the other ranks"));
  entry.failure = std::move(failure);
  BeginStop(entry, StopIntent::kFail);
  table_->Persist(entry, event);
}

void AttemptSupervisor::BeginStop(JobEntry& entry, StopIntent intent) {
  entry.stop = intent;
  entry.stop_deadline = table_->clock->Now() + table_->options.grace_period;
  // A shutdown asks for a checkpoint at the next step boundary, as a
  // preemption does; anything else stops the ranks now.
  SignalRanks(entry, intent == StopIntent::kShutdown ? SIGUSR1 : SIGTERM);
}

void AttemptSupervisor::BeginGrow(JobEntry& entry, const Growth& growth) {
  const std::string& id = entry.stored.job.id();
  for (int d : growth.devices) table_->device_holder[d] = id;
  entry.remesh_to = growth.to_world;
  entry.remesh_devices = entry.devices;
  entry.remesh_devices.insert(entry.remesh_devices.end(),
                              growth.devices.begin(), growth.devices.end());
  entry.remesh_why = absl::StrCat(kGrownReason, entry.devices.size(), " to ",
                                  growth.to_world, " ranks (devices freed up)");
  entry.stop = StopIntent::kPreempt;
  entry.stop_deadline = table_->clock->Now() + table_->options.preempt_grace;
  SignalRanks(entry, SIGUSR1);
  table_->Persist(
      entry, table_->Event(entry.stored.job.state(),
                           absl::StrCat("growing from ", entry.devices.size(),
                                        " to ", growth.to_world,
                                        " ranks: the ranks save a checkpoint "
                                        "at the next step boundary, then it "
                                        "continues on more devices")));
}

void AttemptSupervisor::BeginPreempt(JobEntry& entry,
                                     const std::string& for_job,
                                     int shrink_to) {
  entry.stop = StopIntent::kPreempt;
  entry.stop_deadline = table_->clock->Now() + table_->options.preempt_grace;
  SignalRanks(entry, SIGUSR1);
  const JobEntry* other = table_->Find(for_job);
  if (shrink_to > 0) {
    entry.remesh_to = shrink_to;
    entry.remesh_devices.assign(entry.devices.begin(),
                                entry.devices.begin() + shrink_to);
    entry.remesh_why = absl::StrCat(kShrunkReason, entry.devices.size(), " to ",
                                    shrink_to, " ranks for ", for_job);
    table_->SetState(
        entry, v1::PREEMPTED,
        absl::StrCat("shrinking from ", entry.devices.size(), " to ", shrink_to,
                     " ranks for ", for_job,
                     other == nullptr
                         ? ""
                         : absl::StrCat(" (priority ",
                                        other->stored.job.priority(), ")"),
                     ": the ranks save a checkpoint at the next step "
                     "boundary, then it continues on fewer devices"));
    return;
  }
  table_->SetState(
      entry, v1::PREEMPTED,
      absl::StrCat(
          "preempted for ", for_job,
          other == nullptr
              ? ""
              : absl::StrCat(" (priority ", other->stored.job.priority(), ")"),
          ": the ranks save a checkpoint at the next step boundary and stop "
          "(killed after ",
          absl::FormatDuration(table_->options.preempt_grace), ")"));
}

void AttemptSupervisor::Remesh(JobEntry& entry, int world,
                               const std::vector<int>& devices,
                               const std::string& why) {
  v1::Job& job = entry.stored.job;
  const std::string& id = job.id();
  const int before = static_cast<int>(entry.devices.size());
  table_->CountHeldDevices(entry, false);
  for (std::string& holder : table_->device_holder) {
    if (holder == id) holder.clear();
  }
  entry.remesh_from = JobMesh(job);
  entry.remesh_tokens_per_second = job.last_step().tokens_per_second();
  entry.remesh_started = table_->clock->Now();
  job.set_remeshes(job.remeshes() + 1);
  job.set_resize_reason(why);
  table_->SetState(
      entry, v1::RESTARTING,
      absl::StrCat(why, "; ", entry.remesh_from, " at ", before, " ranks",
                   entry.remesh_tokens_per_second > 0
                       ? absl::StrFormat(" (%.0f tokens/s)",
                                         entry.remesh_tokens_per_second)
                       : "",
                   " -> ", world,
                   " ranks, on the mesh the planner chooses; resumes from its "
                   "checkpoint with the same global batch"));
  RequestLaunch(entry,
                std::vector<int>(devices.begin(), devices.begin() + world));
}

void AttemptSupervisor::FinishAttempt(JobEntry& entry) {
  const StopIntent stop = entry.stop;
  const bool no_restart = entry.no_restart;
  entry.no_restart = false;
  const int remesh_to = entry.remesh_to;
  const std::vector<int> remesh_devices = std::move(entry.remesh_devices);
  const std::string remesh_why = std::move(entry.remesh_why);
  entry.remesh_to = 0;
  entry.remesh_devices.clear();
  entry.remesh_why.clear();
  std::optional<v1::Failure> failure = std::move(entry.failure);
  // A re-mesh that ended before its first step is over (Remesh starts the
  // next one): its seconds without a step are not counted on.
  entry.remesh_started = absl::InfinitePast();
  entry.remesh_predicted = 0;
  // Every rank saved the checkpoint it was asked for and stopped.
  const auto saved = [](const RankProcess& r) {
    return r.exit.exit_code == kExitPreempted && r.exit.signal == 0;
  };
  const bool checkpointed =
      !entry.ranks.empty() &&
      std::all_of(entry.ranks.begin(), entry.ranks.end(), saved);
  // The first rank that did not save it, and how it ended.
  std::string unsaved;
  for (size_t r = 0; r < entry.ranks.size() && !checkpointed; ++r) {
    if (saved(entry.ranks[r])) continue;
    unsaved = absl::StrCat(
        "rank ", r, " ",
        entry.killed && entry.ranks[r].exit.signal == SIGKILL
            ? "was killed after the grace period"
            : absl::StrCat("ended with ",
                           DescribeExit(entry.ranks[r].exit.exit_code,
                                        entry.ranks[r].exit.signal)));
    break;
  }
  ClearAttempt(entry);
  v1::Job& job = entry.stored.job;
  switch (stop) {
    case StopIntent::kShutdown:
      if (checkpointed) {
        // Nothing is lost: queued again, it resumes from that checkpoint
        // when a coordinator runs it, as after a preemption.
        table_->ReleaseDevices(entry);
        job.set_preemptions(job.preemptions() + 1);
        table_->SetState(entry, v1::QUEUED,
                         "queued again at the coordinator's shutdown: its "
                         "ranks saved a checkpoint; resumes from it");
        return;
      }
      table_->Persist(entry, std::nullopt);
      return;
    case StopIntent::kCancel:
      table_->ReleaseDevices(entry);
      table_->SetState(entry, v1::CANCELLED, "cancelled; all ranks stopped");
      return;
    case StopIntent::kPreempt:
      if (remesh_to > 0 && !table_->shutting_down) {
        Remesh(entry, remesh_to, remesh_devices, remesh_why);
        return;
      }
      table_->ReleaseDevices(entry);
      job.set_preemptions(job.preemptions() + 1);
      job.clear_resize_reason();
      table_->SetState(
          entry, v1::QUEUED,
          absl::StrCat(
              "preempted (", job.preemptions(),
              job.preemptions() == 1 ? " time" : " times", "); queued again, ",
              checkpointed
                  ? "resumes from the checkpoint its ranks saved"
                  : absl::StrCat("resumes from its latest checkpoint (the "
                                 "one asked for was not saved: ",
                                 unsaved,
                                 "; the steps since the one before are run "
                                 "again)")));
      return;
    case StopIntent::kFail:
      if (entry.port_taken && !table_->shutting_down) {
        entry.port_taken = false;
        ++entry.port_retries;
        table_->Persist(
            entry, table_->Event(
                       job.state(),
                       absl::StrCat("rendezvous port was taken before rank 0 "
                                    "could bind it; starting the ranks again "
                                    "on another port (try ",
                                    entry.port_retries + 1, " of ",
                                    kMaxPortRetries + 1, ")")));
        RequestLaunch(entry, entry.devices);
        return;
      }
      entry.port_taken = false;
      if (job.restarts() < job.spec().max_restarts() && !no_restart &&
          table_->shutting_down) {
        // No relaunch now: the job stays active in the store and the next
        // coordinator restarts it (counting this restart then).
        table_->Persist(entry, std::nullopt);
        return;
      }
      if (job.restarts() < job.spec().max_restarts() && !no_restart) {
        const bool elastic = job.spec().elastic().min_world_size() > 0;
        // An elastic restart is counted when it launches (RestartElastic):
        // a coordinator that dies before then counts it once, on resume.
        if (!elastic) job.set_restarts(job.restarts() + 1);
        table_->SetState(entry, v1::RESTARTING,
                         absl::StrCat(failure->message(), "; restart ",
                                      job.restarts() + (elastic ? 1 : 0),
                                      " of ", job.spec().max_restarts(),
                                      " from the last checkpoint"));
        if (elastic) {
          // At what size is decided once the launcher says what it can run.
          entry.elastic_restart = true;
          entry.elastic_restart_counted = false;
          entry.failure = std::move(failure);
          return;
        }
        RequestLaunch(entry, entry.devices);
        return;
      }
      table_->ReleaseDevices(entry);
      *job.mutable_failure() = *failure;
      table_->SetState(entry, v1::FAILED, failure->message());
      return;
    case StopIntent::kNone:
      table_->ReleaseDevices(entry);
      table_->SetState(entry, v1::SUCCEEDED, "all ranks finished");
      return;
  }
}

void AttemptSupervisor::RestartElastic(const absl::StatusOr<Capacity>& asked) {
  Capacity capacity;  // unknown: no limit beyond the devices
  if (asked.ok()) {
    capacity = *asked;
  } else {
    JobTable::Log(absl::StrCat("elastic restart: cannot ask the ",
                               launcher_->name(), " launcher what it can run (",
                               asked.status().message(),
                               "); assuming all of it"));
  }
  if (table_->shutting_down) return;  // the next coordinator restarts them
  const std::set<int> lost(capacity.lost_devices.begin(),
                           capacity.lost_devices.end());
  // Lost devices are given to no job until the launcher reports them back.
  table_->lost_devices = lost;
  for (const std::string& id : table_->order) {
    JobEntry& entry = *table_->jobs.at(id);
    if (!entry.elastic_restart) continue;
    entry.elastic_restart = false;
    std::optional<v1::Failure> failure = std::move(entry.failure);
    entry.failure.reset();
    if (entry.stored.job.state() != v1::RESTARTING)
      continue;  // cancelled meanwhile
    RestartElasticJob(entry, capacity, lost, std::move(failure));
  }
}

void AttemptSupervisor::RestartElasticJob(JobEntry& entry,
                                          const Capacity& capacity,
                                          const std::set<int>& lost,
                                          std::optional<v1::Failure> failure) {
  v1::Job& job = entry.stored.job;
  const std::string& id = job.id();
  const int requested = job.spec().world_size();
  const int min_world = job.spec().elastic().min_world_size();
  // Its own devices first, then free ones; none the backend lost.
  std::vector<int> candidates;
  for (int d : entry.devices) {
    if (!lost.count(d)) candidates.push_back(d);
  }
  for (int d : table_->FreeDevices()) {
    if (!lost.count(d)) candidates.push_back(d);
  }
  int available = static_cast<int>(candidates.size());
  if (capacity.slots >= 0) {
    // The backend's slots, less those other jobs hold.
    int held_by_others = 0;
    for (const std::string& holder : table_->device_holder) {
      held_by_others += !holder.empty() && holder != id;
    }
    available = std::min(available, capacity.slots - held_by_others);
  }
  // Free devices beyond its own are a grant: within its owner's quota.
  const int own_kept =
      static_cast<int>(std::count_if(entry.devices.begin(), entry.devices.end(),
                                     [&](int d) { return !lost.count(d); }));
  const int headroom = table_->HeldDevices(id).Headroom(job.owner());
  const int quota_allows = std::max(own_kept, std::min(requested, headroom));
  const bool quota_limits = quota_allows < available;
  available = std::min(available, quota_allows);
  absl::StatusOr<TrainConfig> config =
      TrainConfigFromJobSpec(job.spec(), table_->JobDir(id));
  const int64_t global = config.ok()
                             ? config->DataParallelSize(requested) *
                                   config->batch_size * config->grad_accum
                             : 0;
  // The largest world some mesh of it runs at (ElasticWorlds).
  int world = 0;
  for (int w : entry.elastic_worlds) {
    if (w <= available) world = std::max(world, w);
  }
  // What this job lost: its own devices, or (a backend that places ranks
  // itself) what the backend reports unusable.
  std::vector<std::string> own_lost;
  for (int d : entry.devices) {
    if (lost.count(d)) own_lost.push_back(absl::StrCat("device ", d));
  }
  const std::string what =
      lost.empty() ? capacity.lost : absl::StrJoin(own_lost, ", ");
  const std::string lost_text =
      what.empty() ? "" : absl::StrCat(" after losing ", what);
  if (world < std::max(min_world, 1)) {
    table_->ReleaseDevices(entry);
    v1::Failure* failed = job.mutable_failure();
    if (failure.has_value()) {
      *failed = *failure;
    } else {
      SetCoordinatorRestartFailure(
          failed, "the coordinator restarted while the job ran");
    }
    failed->set_message(absl::StrCat(
        failed->message(), "; cannot continue: ", available, " of ", requested,
        " ranks can run", lost_text,
        quota_limits ? absl::StrCat(" (", job.owner(), "'s quota)") : "",
        ", and elastic.min_world_size is ", min_world,
        available >= min_world
            ? absl::StrCat(" (no mesh from ", min_world, " to ", available,
                           " ranks shares the ", global, " sequences per step)")
            : ""));
    table_->SetState(entry, v1::FAILED, failed->message());
    return;
  }
  std::vector<int> chosen(candidates.begin(), candidates.begin() + world);
  for (int d : entry.devices) {
    if (std::find(chosen.begin(), chosen.end(), d) == chosen.end() &&
        table_->device_holder[d] == id) {
      table_->device_holder[d].clear();
    }
  }
  if (!entry.elastic_restart_counted) job.set_restarts(job.restarts() + 1);
  if (world < requested) {
    job.set_resize_reason(absl::StrCat("continued at ", world, " of ",
                                       requested, " ranks", lost_text));
    job.set_state_reason(job.resize_reason());
    table_->Persist(entry,
                    table_->Event(v1::RESTARTING,
                                  absl::StrCat(job.resize_reason(),
                                               " (elastic.min_world_size ",
                                               min_world, "; the same ", global,
                                               " sequences per step)")));
  } else {
    job.clear_resize_reason();
  }
  RequestLaunch(entry, chosen);
}

void AttemptSupervisor::ScheduleQueued() {
  ScheduleInput input = table_->SchedulerInput();
  if (input.queue.empty() &&
      std::none_of(input.running.begin(), input.running.end(), MayGrow)) {
    return;
  }
  const ScheduleDecision decision = Schedule(std::move(input));
  for (const auto& [id, reason] : decision.waiting) {
    table_->jobs.at(id)->stored.job.set_state_reason(reason);
  }
  for (const Preemption& preempt : decision.preempt) {
    JobEntry& victim = *table_->jobs.at(preempt.job_id);
    // An attempt still launching is asked on a later tick, once its ranks
    // can be signalled.
    if (victim.ranks.empty() || victim.launching ||
        victim.stop != StopIntent::kNone) {
      continue;
    }
    BeginPreempt(victim, preempt.for_job, preempt.shrink_to);
  }
  for (const Growth& growth : decision.grow) {
    JobEntry& job = *table_->jobs.at(growth.job_id);
    if (job.ranks.empty() || job.launching || job.stop != StopIntent::kNone) {
      continue;
    }
    BeginGrow(job, growth);
  }
  for (const Placement& placement : decision.start) {
    JobEntry& entry = *table_->jobs.at(placement.job_id);
    RequestLaunch(entry, placement.devices);
    if (placement.backfilled) {
      const std::string why =
          absl::StrCat("backfilled ahead of ", decision.head,
                       ": its devices are not among those ", decision.head,
                       " needs at its predicted start");
      entry.stored.job.set_state_reason(why);
      table_->Persist(entry, table_->Event(entry.stored.job.state(), why));
    }
  }
}

}  // namespace shardtrain
