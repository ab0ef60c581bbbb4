#include "server/job_table.h"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <set>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/log_files.h"

namespace shardtrain {

JobTable::JobTable(JobManagerOptions options, JobStore* store, Clock* clock,
                   JobObserver* observer)
    : options(std::move(options)),
      store(store),
      clock(clock),
      observer(observer) {
  device_holder.resize(this->options.devices.size());
}

bool IsRemeshReason(const std::string& resize_reason) {
  return absl::StartsWith(resize_reason, kShrunkReason) ||
         absl::StartsWith(resize_reason, kGrownReason);
}

bool JobTable::IsActive(v1::JobState state) {
  return state == v1::STARTING || state == v1::RUNNING ||
         state == v1::RESTARTING || state == v1::PREEMPTED;
}

const char* JobTable::StateName(v1::JobState state) {
  return v1::JobState_Name(state).c_str();
}

std::string JobTable::NewSecret() {
  absl::BitGen gen;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen),
                         absl::Uniform<uint64_t>(gen));
}

void JobTable::Log(const std::string& message) {
  std::cerr << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                absl::UTCTimeZone())
            << " shardtraind: " << message << "\n";
}

std::string JobTable::JobDir(const std::string& job_id) const {
  return absl::StrCat(options.state_dir, "/jobs/", job_id);
}

std::string JobTable::LogPath(const std::string& job_id, int rank) const {
  return absl::StrCat(JobDir(job_id), "/rank-", rank, ".log");
}

absl::Status JobTable::Load() {
  absl::StatusOr<std::vector<StoredJob>> stored = store->LoadJobs();
  if (!stored.ok()) return stored.status();
  // Job directories the store does not know of: a database lost or emptied
  // (a zero-byte file opens as a new one) would otherwise hand their ids,
  // and so their directories, to new jobs.
  int64_t highest_dir = 0;
  int unknown_dirs = 0;
  {
    std::set<std::string> known;
    for (const StoredJob& s : *stored) known.insert(s.job.id());
    std::error_code ec;
    for (const auto& dir : std::filesystem::directory_iterator(
             absl::StrCat(options.state_dir, "/jobs"), ec)) {
      const std::string name = dir.path().filename().string();
      int64_t seq = 0;
      if (!absl::StartsWith(name, "job-") ||
          !absl::SimpleAtoi(name.substr(4), &seq)) {
        continue;
      }
      highest_dir = std::max(highest_dir, seq);
      unknown_dirs += known.count(name) == 0;
    }
  }
  if (stored->empty() && unknown_dirs > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job database holds no jobs, but ", options.state_dir, "/jobs has ",
        unknown_dirs,
        " job directories: the database was lost or truncated. Restore it "
        "from a backup (docs/operations.md), or move the jobs directory away "
        "to start afresh"));
  }
  absl::MutexLock lock(&mutex);
  next_seq = std::max(next_seq, highest_dir + 1);
  for (StoredJob& s : *stored) {
    auto entry = std::make_unique<JobEntry>();
    entry->stored = std::move(s);
    // Jobs stored before the field existed.
    v1::Job& job = entry->stored.job;
    job.set_output_dir(JobDir(job.id()));
    if (job.priority() == 0 && !job.preemptible() &&
        job.spec().priority_class().empty()) {
      job.set_priority(job.spec().priority());
      job.set_preemptible(true);
    }
    entry->elastic_worlds =
        ElasticWorlds(job.spec(), DeviceMemoryFor(options, job.spec()));
    Add(std::move(entry));
  }
  return absl::OkStatus();
}

void JobTable::Add(std::unique_ptr<JobEntry> entry) {
  const std::string id = entry->stored.job.id();
  next_seq = std::max(next_seq, entry->stored.seq + 1);
  order.push_back(id);
  jobs[id] = std::move(entry);
}

JobEntry* JobTable::Find(const std::string& job_id) {
  auto it = jobs.find(job_id);
  return it == jobs.end() ? nullptr : it->second.get();
}

void JobTable::SetState(JobEntry& entry, v1::JobState state,
                        const std::string& message) {
  // What happened still happened: recorded in memory even when the store
  // fails, and stored later (KeepUnsaved logs it).
  (void)CommitState(entry, state, message, /*even_if_not_stored=*/true);
}

absl::Status JobTable::CommitState(JobEntry& entry, v1::JobState state,
                                   const std::string& message,
                                   bool even_if_not_stored) {
  // Stored from a copy; entry.stored itself is changed in place afterwards,
  // so references into it that callers hold stay valid.
  const int64_t end_ms = IsTerminalJobState(state)
                             ? absl::ToUnixMillis(clock->Now())
                             : entry.stored.job.end_time_unix_ms();
  auto apply = [&](v1::Job& job) {
    job.set_state(state);
    job.set_state_reason(message);
    job.set_end_time_unix_ms(end_ms);
  };
  StoredJob next = entry.stored;
  apply(next.job);
  const v1::JobEvent event = Event(state, message);
  const absl::Status stored = Store(entry, next, event);
  if (!stored.ok() && !even_if_not_stored) return stored;
  apply(entry.stored.job);
  if (!stored.ok()) KeepUnsaved(entry, event, stored);
  Announce(entry, event);
  return stored;
}

void JobTable::Announce(JobEntry& entry, const v1::JobEvent& event) {
  const v1::Job& job = entry.stored.job;
  const v1::JobState state = job.state();
  const bool terminal = IsTerminalJobState(state);
  Log(absl::StrCat(job.id(), " -> ", StateName(state), ": ",
                   job.state_reason()));
  v1::WatchJobEvent change;
  *change.mutable_state_change() = event;
  for (auto& weak : entry.watchers) {
    if (auto watch = weak.lock()) {
      watch->Push(change);
      if (terminal) watch->Close();
    }
  }
  if (terminal) entry.watchers.clear();
  if (observer != nullptr) observer->OnJobChanged(job);
}

void JobTable::Persist(JobEntry& entry,
                       const std::optional<v1::JobEvent>& event) {
  if (absl::Status s = Store(entry, entry.stored, event); !s.ok()) {
    KeepUnsaved(entry, event, s);
  }
}

absl::Status JobTable::Store(JobEntry& entry, const StoredJob& record,
                             const std::optional<v1::JobEvent>& event) {
  // The backlog first, event by event with the newest record: a failure
  // part way keeps the rest, still in order.
  size_t done = 0;
  absl::Status status;
  for (; done < entry.unsaved_events.size(); ++done) {
    status = store->UpdateJob(entry.stored, entry.unsaved_events[done]);
    if (!status.ok()) break;
  }
  entry.unsaved_events.erase(entry.unsaved_events.begin(),
                             entry.unsaved_events.begin() + done);
  if (status.ok()) status = store->UpdateJob(record, event);
  if (status.ok() && entry.unsaved) {
    entry.unsaved = false;
    Log(absl::StrCat(entry.stored.job.id(),
                     ": changes kept while the store failed are stored"));
  }
  return status;
}

void JobTable::KeepUnsaved(JobEntry& entry,
                           const std::optional<v1::JobEvent>& event,
                           const absl::Status& why) {
  if (!entry.unsaved) {
    Log(absl::StrCat("could not store ", entry.stored.job.id(), ": ",
                     why.message(), "; kept, and retried until stored"));
  }
  entry.unsaved = true;
  any_unsaved_ = true;
  if (!event.has_value()) return;
  // Bounded: a job whose store fails for hours keeps its first and latest
  // events (its state itself is always the newest record).
  constexpr size_t kMaxUnsavedEvents = 256;
  if (entry.unsaved_events.size() >= kMaxUnsavedEvents) {
    entry.unsaved_events.erase(entry.unsaved_events.begin() + 1);
  }
  entry.unsaved_events.push_back(*event);
}

void JobTable::StoreUnsaved() {
  if (!any_unsaved_) return;
  for (const std::string& id : order) {
    JobEntry& entry = *jobs.at(id);
    if (!entry.unsaved) continue;
    // One failing write is enough to know the store still refuses.
    if (!Store(entry, entry.stored, std::nullopt).ok()) return;
  }
  any_unsaved_ = false;
}

std::vector<int> JobTable::FreeDevices() const {
  std::vector<int> free;
  for (size_t d = 0; d < device_holder.size(); ++d) {
    if (device_holder[d].empty() && !lost_devices.count(static_cast<int>(d))) {
      free.push_back(static_cast<int>(d));
    }
  }
  return free;
}

void JobTable::CountHeldDevices(JobEntry& entry, bool holding) {
  const absl::Time now = clock->Now();
  if (entry.held_since != absl::InfinitePast() && !entry.devices.empty()) {
    v1::Job& job = entry.stored.job;
    job.set_device_seconds_held(job.device_seconds_held() +
                                absl::ToDoubleSeconds(now - entry.held_since) *
                                    entry.devices.size());
  }
  entry.held_since = holding ? now : absl::InfinitePast();
}

void JobTable::CountKeptStep(JobEntry& entry, const v1::StepMetrics& step) {
  if (step.rank() != 0 || step.step() <= 0 ||
      step.step() > (int64_t{1} << 31)) {
    return;
  }
  v1::Job& job = entry.stored.job;
  const size_t at = static_cast<size_t>(step.step() - 1);
  double kept = job.device_seconds_kept();
  if (at < entry.step_seconds.size()) {
    kept -= static_cast<double>(entry.step_seconds[at]) * entry.step_world[at];
  } else {
    entry.step_seconds.resize(at + 1, 0.0f);
    entry.step_world.resize(at + 1, 0);
  }
  const int world = std::max(1, job.world_size());
  entry.step_seconds[at] = static_cast<float>(step.step_seconds());
  entry.step_world[at] = static_cast<uint16_t>(std::min(world, 65535));
  kept += static_cast<double>(entry.step_seconds[at]) * entry.step_world[at];
  job.set_device_seconds_kept(std::max(0.0, kept));
}

void JobTable::ReleaseDevices(JobEntry& entry) {
  CountHeldDevices(entry, false);
  // Every device held in its name: its own, and any reserved for it to
  // grow onto.
  for (std::string& holder : device_holder) {
    if (holder == entry.stored.job.id()) holder.clear();
  }
  entry.devices.clear();
}

std::vector<QueuedJobRef> JobTable::QueuedRefs() const {
  std::vector<QueuedJobRef> queue;
  for (const std::string& id : order) {
    const JobEntry& entry = *jobs.at(id);
    const v1::Job& job = entry.stored.job;
    if (job.state() != v1::QUEUED) continue;
    queue.push_back({id, job.priority(), entry.stored.seq,
                     job.spec().world_size(), job.owner()});
  }
  return queue;
}

QuotaLedger JobTable::HeldDevices(const std::string& except_job) const {
  QuotaLedger ledger(options.device_quota);
  for (const std::string& holder : device_holder) {
    if (holder.empty() || holder == except_job) continue;
    auto it = jobs.find(holder);
    if (it != jobs.end()) ledger.Hold(it->second->stored.job.owner(), 1);
  }
  return ledger;
}

ScheduleInput JobTable::SchedulerInput() const {
  ScheduleInput input;
  input.queue = QueuedRefs();
  input.free_devices = FreeDevices();
  input.now = clock->Now();
  input.quota = options.device_quota;
  for (const std::string& id : order) {
    const JobEntry& entry = *jobs.at(id);
    if (entry.devices.empty()) continue;
    const v1::Job& job = entry.stored.job;
    RunningJobRef running;
    running.job_id = id;
    running.priority = job.priority();
    running.preemptible = job.preemptible();
    running.owner = job.owner();
    running.devices = static_cast<int>(entry.devices.size());
    running.started = entry.launch_time;
    running.stopping = entry.stop != StopIntent::kNone;
    running.worlds = entry.elastic_worlds;
    if (job.state() != v1::RUNNING || entry.launching) running.worlds.clear();
    // It grows back only onto what a re-mesh took from it: smaller after a
    // lost device or node, the devices the backend can run are its to say
    // (an elastic restart), not the free list's.
    if (!IsRemeshReason(job.resize_reason())) {
      running.worlds.erase(
          std::remove_if(running.worlds.begin(), running.worlds.end(),
                         [&](int w) { return w > running.devices; }),
          running.worlds.end());
    }
    // Its pace so far times the steps left (rank 0's last report); before
    // any, the step-time model's time for its steps from its launch.
    const v1::StepMetrics& last = job.last_step();
    if (job.state() == v1::RUNNING && last.step_seconds() > 0 &&
        last.total_steps() >= last.step()) {
      running.predicted_end =
          input.now +
          absl::Seconds(last.step_seconds() *
                        static_cast<double>(last.total_steps() - last.step()));
    } else if (job.state() == v1::RUNNING && entry.predicted_seconds > 0) {
      running.predicted_end =
          std::max(input.now,
                   entry.launch_time + absl::Seconds(entry.predicted_seconds));
    }
    input.running.push_back(std::move(running));
  }
  return input;
}

v1::JobEvent JobTable::Event(v1::JobState state, std::string message) const {
  v1::JobEvent event;
  event.set_time_unix_ms(absl::ToUnixMillis(clock->Now()));
  event.set_state(state);
  event.set_message(std::move(message));
  return event;
}

v1::Failure JobTable::RankFailure(const std::string& job_id, int rank,
                                  v1::FailureReason reason,
                                  std::string message) const {
  v1::Failure failure;
  failure.set_reason(reason);
  failure.set_rank(rank);
  failure.set_message(std::move(message));
  for (std::string& line :
       ReadLastLines(LogPath(job_id, rank), options.log_tail_lines)) {
    failure.add_log_tail(std::move(line));
  }
  return failure;
}

}  // namespace shardtrain
