#include "server/job_manager.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/dist_env.h"
#include "common/exit_codes.h"
#include "common/input_file.h"
#include "core/data/token_file.h"
#include "google/protobuf/util/json_util.h"
#include "proto/job_config.h"
#include "server/log_files.h"
#include "server/rank_specs.h"
#include "server/scheduler.h"

namespace shardtrain {
namespace {

constexpr int kDefaultPageSize = 100;
constexpr size_t kMaxSpecBytes = 64 * 1024;
// Starts of one attempt on a fresh rendezvous port when the picked one was
// taken (another process bound it between the pick and rank 0's bind).
constexpr int kMaxPortRetries = 4;
constexpr int kMaxPageSize = 1000;

// The most directory entries of an init_from directory checked at submit
// (a checkpoint of a thousand ranks has about two thousand files).
constexpr int kMaxCheckedEntries = 4096;

// data and init_from inside `roots`.
absl::Status CheckSpecPaths(const PathRoots& roots, const v1::JobSpec& spec) {
  if (roots.roots().empty()) return absl::OkStatus();
  if (spec.data() != kBuiltinDataset) {
    if (absl::Status s = roots.Check("data", spec.data()); !s.ok()) return s;
    // Each file the ranks read, resolved on its own: a train.bin that is a
    // symlink out of the directory must not pass because its folder does.
    for (const char* file : {"train.bin", "val.bin"}) {
      const std::string path = absl::StrCat(spec.data(), "/", file);
      std::error_code ec;
      if (!std::filesystem::exists(std::filesystem::symlink_status(path, ec))) {
        continue;
      }
      if (absl::Status s = roots.Check(absl::StrCat("data (", file, ")"), path);
          !s.ok()) {
        return s;
      }
    }
  }
  if (!spec.trainer().init_from().empty()) {
    const std::string& init_from = spec.trainer().init_from();
    if (absl::Status s = roots.Check("trainer.init_from", init_from); !s.ok()) {
      return s;
    }
    // What a directory holds (config.json, model.safetensors, a
    // checkpoint's files, checkpoints/latest) is resolved entry by entry, as
    // the ranks will: a directory inside the root may link out of it. The
    // ranks check again on the files they open.
    std::error_code ec;
    int entries = 0;
    for (auto it = std::filesystem::recursive_directory_iterator(init_from, ec);
         !ec && it != std::filesystem::recursive_directory_iterator() &&
         entries < kMaxCheckedEntries;
         it.increment(ec), ++entries) {
      if (it.depth() >= 2) it.disable_recursion_pending();
      const std::string name =
          it->path().lexically_relative(init_from).string();
      if (absl::Status s =
              roots.Check(absl::StrCat("trainer.init_from (", name, ")"),
                          it->path().string());
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

// NotFound for an id no job has. The id is echoed only when it could be one
// (short, printable): a 100 KB id once came back in the error until the
// response metadata overflowed.
absl::Status NoSuchJob(const std::string& job_id) {
  const bool printable =
      std::all_of(job_id.begin(), job_id.end(),
                  [](unsigned char c) { return c >= 0x20 && c < 0x7f; });
  if (job_id.size() > 64 || !printable) {
    return absl::NotFoundError(
        absl::StrCat("job_id: no job has this id (", job_id.size(),
                     " bytes; ids look like job-000001)"));
  }
  return absl::NotFoundError(absl::StrCat("job_id: no job '", job_id, "'"));
}

int64_t UnixMillis(absl::Time t) { return absl::ToUnixMillis(t); }

void LogInfo(const std::string& message) {
  std::cerr << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                absl::UTCTimeZone())
            << " shardtraind: " << message << "\n";
}

std::string NewSecret() {
  absl::BitGen gen;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen),
                         absl::Uniform<uint64_t>(gen));
}

// Compares without an early exit, so timing reveals nothing of the secret.
bool SecretsEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

template <typename Entry>
bool AnyRankRunning(const Entry& entry) {
  return std::any_of(entry.ranks.begin(), entry.ranks.end(),
                     [](const auto& rank) { return !rank.exited; });
}

// Out-of-memory errors as LibTorch, CUDA and the C++ runtime word them.
bool LooksLikeOom(const std::vector<std::string>& lines) {
  for (const std::string& line : lines) {
    const std::string lower = absl::AsciiStrToLower(line);
    if (lower.find("out of memory") != std::string::npos ||
        lower.find("outofmemoryerror") != std::string::npos ||
        lower.find("std::bad_alloc") != std::string::npos ||
        lower.find("can't allocate memory") != std::string::npos) {
      return true;
    }
  }
  return false;
}

// Turns `failure` into OOM when its log tail shows an out-of-memory error;
// whether it did.
bool MarkOomFromLogTail(v1::Failure& failure) {
  const std::vector<std::string> tail(failure.log_tail().begin(),
                                      failure.log_tail().end());
  if (failure.reason() == v1::OOM || !LooksLikeOom(tail)) return false;
  failure.set_reason(v1::OOM);
  failure.set_message(failure.message() + " (out of memory)");
  return true;
}

const char* StateName(v1::JobState state) {
  return v1::JobState_Name(state).c_str();
}

bool IsActive(v1::JobState state) {
  return state == v1::STARTING || state == v1::RUNNING ||
         state == v1::RESTARTING;
}

}  // namespace

bool JobManager::IsTerminal(v1::JobState state) {
  return state == v1::SUCCEEDED || state == v1::FAILED ||
         state == v1::CANCELLED;
}

absl::StatusOr<std::unique_ptr<JobManager>> JobManager::Create(
    JobManagerOptions options, JobStore* store, Launcher* launcher,
    Clock* clock, JobObserver* observer) {
  if (options.devices.empty()) {
    return absl::InvalidArgumentError("job manager: no devices to schedule");
  }
  if (!options.resolve_data) {
    return absl::InvalidArgumentError("job manager: no data resolver");
  }
  std::unique_ptr<JobManager> manager(
      new JobManager(std::move(options), store, launcher, clock, observer));
  if (absl::Status s = manager->Load(); !s.ok()) return s;
  return manager;
}

JobManager::JobManager(JobManagerOptions options, JobStore* store,
                       Launcher* launcher, Clock* clock, JobObserver* observer)
    : options_(std::move(options)),
      store_(store),
      launcher_(launcher),
      clock_(clock),
      observer_(observer) {
  device_holder_.resize(options_.devices.size());
  worker_address_ = options_.worker_address;
}

void JobManager::set_worker_address(std::string address) {
  absl::MutexLock lock(&mutex_);
  worker_address_ = std::move(address);
}

JobManager::~JobManager() { Shutdown(); }

std::string JobManager::JobDir(const std::string& job_id) const {
  return absl::StrCat(options_.state_dir, "/jobs/", job_id);
}

std::string JobManager::LogPath(const std::string& job_id, int rank) const {
  return absl::StrCat(JobDir(job_id), "/rank-", rank, ".log");
}

absl::Status JobManager::Load() {
  absl::StatusOr<std::vector<StoredJob>> stored = store_->LoadJobs();
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
             absl::StrCat(options_.state_dir, "/jobs"), ec)) {
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
        "the job database holds no jobs, but ", options_.state_dir,
        "/jobs has ", unknown_dirs,
        " job directories: the database was lost or truncated. Restore it "
        "from a backup (docs/operations.md), or move the jobs directory away "
        "to start afresh"));
  }
  absl::MutexLock lock(&mutex_);
  next_seq_ = std::max(next_seq_, highest_dir + 1);
  for (StoredJob& s : *stored) {
    auto entry = std::make_unique<Entry>();
    entry->stored = std::move(s);
    // Jobs stored before the field existed.
    entry->stored.job.set_output_dir(JobDir(entry->stored.job.id()));
    next_seq_ = std::max(next_seq_, entry->stored.seq + 1);
    order_.push_back(entry->stored.job.id());
    jobs_[entry->stored.job.id()] = std::move(entry);
  }
  return absl::OkStatus();
}

void JobManager::ResumeInterruptedJobs() {
  // Nothing of the previous coordinator's attempts may run when a job starts
  // again: ended first, without the lock (scancel, or a wait for a killed
  // process, must not hold up RPCs).
  struct Leftover {
    std::string id;
    std::vector<int> pids;
  };
  std::vector<Leftover> leftovers;
  {
    absl::MutexLock lock(&mutex_);
    for (const std::string& id : order_) {
      const Entry& entry = *jobs_[id];
      if (IsActive(entry.stored.job.state()) && entry.ranks.empty() &&
          !entry.relaunch_pending) {
        leftovers.push_back({id, entry.stored.worker_pids});
      }
    }
  }
  for (const Leftover& leftover : leftovers) {
    launcher_->EndLeftovers(leftover.id, JobDir(leftover.id), leftover.pids);
  }
  absl::MutexLock lock(&mutex_);
  int interrupted = 0;
  for (const std::string& id : order_) {
    Entry& entry = *jobs_[id];
    v1::Job& job = entry.stored.job;
    if (!IsActive(job.state()) || entry.ranks.size() > 0 ||
        entry.relaunch_pending) {
      continue;
    }
    ++interrupted;
    entry.stored.worker_pids.clear();
    entry.stored.worker_pgid = 0;
    const int max_restarts = job.spec().max_restarts();
    if (job.cancel_requested()) {
      SetState(entry, v1::CANCELLED,
               "cancelled (the coordinator restarted while the ranks stopped)");
    } else if (job.restarts() < max_restarts) {
      job.set_restarts(job.restarts() + 1);
      entry.relaunch_pending = true;
      SetState(
          entry, v1::RESTARTING,
          absl::StrCat("coordinator restarted while the job was ",
                       StateName(job.state()), "; restart ", job.restarts(),
                       " of ", max_restarts, " from the last checkpoint"));
    } else {
      v1::Failure* failure = job.mutable_failure();
      failure->set_reason(v1::COORDINATOR_RESTART);
      failure->set_rank(-1);
      failure->set_message(absl::StrCat(
          "the coordinator restarted while the job was ",
          StateName(job.state()), " and no restarts were left (max_restarts ",
          max_restarts, ")"));
      SetState(entry, v1::FAILED, failure->message());
    }
  }
  LogInfo(absl::StrCat("loaded ", order_.size(), " jobs from the store; ",
                       interrupted, " were interrupted"));
}

void JobManager::Start() {
  supervisor_ = std::thread([this] { SupervisorLoop(); });
}

void JobManager::SupervisorLoop() {
  while (!stop_supervisor_.WaitForNotificationWithTimeout(options_.tick)) {
    Tick();
  }
}

void JobManager::Shutdown() {
  {
    absl::MutexLock lock(&mutex_);
    if (!shutting_down_) {
      shutting_down_ = true;
      for (auto& [id, entry] : jobs_) {
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
  // Real time, not clock_: this waits on processes, not on job timeouts.
  const absl::Time deadline =
      absl::Now() + options_.grace_period + absl::Seconds(5);
  while (true) {
    {
      absl::MutexLock lock(&mutex_);
      bool any = false;
      for (auto& [id, entry] : jobs_) {
        any = any || !entry->ranks.empty() || entry->launching;
      }
      if (!any) break;
    }
    if (absl::Now() > deadline) break;
    if (absl::Now() > deadline - absl::Seconds(5)) {
      // The grace period has passed in real time: kill what is left, whatever
      // the job clock says.
      absl::MutexLock lock(&mutex_);
      for (auto& [id, entry] : jobs_) {
        if (!entry->ranks.empty() && !entry->killed) {
          entry->stop_deadline = clock_->Now();
        }
      }
    }
    if (!supervisor_.joinable()) Tick();
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (!stop_supervisor_.HasBeenNotified()) stop_supervisor_.Notify();
  if (supervisor_.joinable()) supervisor_.join();
}

// ---------------------------------------------------------------------------
// JobService

absl::StatusOr<v1::JobSpec> ValidateSubmission(const JobManagerOptions& options,
                                               const v1::JobSpec& spec) {
  const v1::DeviceKind cluster_kind = options.devices.front().kind;
  v1::JobSpec effective = spec;
  // Fields this version does not know are dropped, never stored: they would
  // slip past every limit below (a 4 MiB unknown field per submission grew
  // the database by half a gigabyte in 130 submissions).
  effective.DiscardUnknownFields();
  if (effective.device_kind() == v1::DEVICE_KIND_UNSPECIFIED) {
    effective.set_device_kind(cluster_kind);
  }
  if (effective.device_kind() != cluster_kind) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_kind: got ", v1::DeviceKind_Name(effective.device_kind()),
        "; this coordinator schedules ", v1::DeviceKind_Name(cluster_kind),
        " devices only"));
  }
  // The job's directory is not known yet; any path checks the same rules.
  absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(
      effective, absl::StrCat(options.state_dir, "/jobs/new"));
  if (!config.ok()) return config.status();
  const int devices = static_cast<int>(options.devices.size());
  if (effective.world_size() > devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world_size: got ", effective.world_size(), "; this coordinator has ",
        devices, cluster_kind == v1::GPU ? " GPU" : " CPU slot",
        devices == 1 ? "" : "s"));
  }
  if (absl::Status s = CheckSpecPaths(options.path_roots, spec); !s.ok()) {
    return s;
  }
  if (absl::StatusOr<std::string> data = options.resolve_data(spec.data());
      !data.ok()) {
    return data.status();
  }
  // A file (llm.c) or a directory (Hugging Face, a checkpoint); the worker
  // reads and checks what is in it. Nothing else: opening a FIFO would block.
  if (!config->init_from.empty()) {
    struct stat st;
    if (::stat(config->init_from.c_str(), &st) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "trainer.init_from: got '", config->init_from,
          "'; no such file or directory on the coordinator's host"));
    }
    if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("trainer.init_from: '", config->init_from, "' is ",
                       FileKindName(st.st_mode),
                       "; expected an llm.c model file or a directory"));
    }
  }
  return effective;
}

absl::StatusOr<v1::Job> JobManager::Submit(const v1::JobSpec& spec) {
  absl::StatusOr<v1::JobSpec> validated = ValidateSubmission(options_, spec);
  if (!validated.ok()) return validated.status();
  // Every field is bounded by validation; this bounds their sum, so a
  // stored job (and a List page of them) stays small.
  if (const size_t bytes = validated->ByteSizeLong(); bytes > kMaxSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec: ", bytes, " bytes once encoded; at most ", kMaxSpecBytes));
  }
  if (struct statvfs fs; statvfs(options_.state_dir.c_str(), &fs) == 0) {
    const int64_t free_bytes =
        static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    if (free_bytes < options_.min_free_bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the state directory %s has %.1f MiB free, less than the %.1f MiB a "
          "job needs (shardtraind --min-free-mb); free space, then resubmit",
          options_.state_dir, free_bytes / 1048576.0,
          options_.min_free_bytes / 1048576.0));
    }
  }
  const v1::JobSpec& effective = *validated;

  absl::MutexLock lock(&mutex_);
  if (shutting_down_) {
    return absl::UnavailableError("shardtraind is shutting down");
  }
  auto entry = std::make_unique<Entry>();
  entry->stored.seq = next_seq_;
  entry->stored.secret = NewSecret();
  v1::Job& job = entry->stored.job;
  job.set_id(absl::StrFormat("job-%06d", next_seq_));
  job.set_output_dir(JobDir(job.id()));
  *job.mutable_spec() = effective;
  job.set_state(v1::QUEUED);
  job.set_state_reason("waiting for the scheduler");
  job.set_submit_time_unix_ms(UnixMillis(clock_->Now()));
  v1::JobEvent event;
  event.set_time_unix_ms(job.submit_time_unix_ms());
  event.set_state(v1::QUEUED);
  event.set_message("submitted");
  if (absl::Status s = store_->InsertJob(entry->stored, event); !s.ok()) {
    // Nothing was stored; jobs already stored are untouched (the insert is
    // one transaction). A full disk is the operator's to fix: say so.
    if (absl::IsResourceExhausted(s)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the state directory ", options_.state_dir,
          " is full; no new job is accepted until space is freed (",
          s.message(), ")"));
    }
    return absl::InternalError(
        absl::StrCat("could not store the job: ", s.message()));
  }
  ++next_seq_;
  const std::string id = job.id();
  order_.push_back(id);
  v1::Job result = job;
  jobs_[id] = std::move(entry);
  if (observer_ != nullptr) observer_->OnJobChanged(result);
  return result;
}

JobManager::Entry* JobManager::Find(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

absl::StatusOr<v1::Job> JobManager::Get(const std::string& job_id) const {
  absl::MutexLock lock(&mutex_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return NoSuchJob(job_id);
  }
  return it->second->stored.job;
}

absl::StatusOr<ListJobsPage> JobManager::List(
    const ListJobsQuery& query) const {
  if (query.page_size < 0 || query.page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: got ", query.page_size, "; must be in [0, ",
                     kMaxPageSize, "]"));
  }
  int64_t after_seq = 0;
  if (!query.page_token.empty() &&
      (!absl::SimpleAtoi(query.page_token, &after_seq) || after_seq < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token: got '", query.page_token,
                     "'; pass the next_page_token of the previous page"));
  }
  const int page_size =
      query.page_size == 0 ? kDefaultPageSize : query.page_size;
  absl::MutexLock lock(&mutex_);
  ListJobsPage page;
  for (const std::string& id : order_) {
    const Entry& entry = *jobs_.at(id);
    if (entry.stored.seq <= after_seq) continue;
    const v1::Job& job = entry.stored.job;
    if (!query.states.empty() &&
        std::find(query.states.begin(), query.states.end(), job.state()) ==
            query.states.end()) {
      continue;
    }
    bool labels_match = true;
    for (const auto& [key, value] : query.labels) {
      auto it = job.spec().labels().find(key);
      labels_match = labels_match && it != job.spec().labels().end() &&
                     it->second == value;
    }
    if (!labels_match) continue;
    if (static_cast<int>(page.jobs.size()) == page_size) {
      page.next_page_token =
          absl::StrCat(jobs_.at(page.jobs.back().id())->stored.seq);
      break;
    }
    page.jobs.push_back(job);
  }
  return page;
}

absl::StatusOr<v1::Job> JobManager::Cancel(const std::string& job_id) {
  absl::MutexLock lock(&mutex_);
  Entry* entry = Find(job_id);
  if (entry == nullptr) {
    return NoSuchJob(job_id);
  }
  const v1::JobState state = entry->stored.job.state();
  if (IsTerminal(state)) {
    return absl::FailedPreconditionError(
        absl::StrCat(job_id, " already ended (", StateName(state), ")"));
  }
  // Each branch stores the cancel before it acts on it or answers: a cancel
  // the client was told of survives a coordinator restart.
  auto not_stored = [&](const absl::Status& s) {
    return absl::UnavailableError(
        absl::StrCat("the cancel of ", job_id, " could not be stored (",
                     s.message(), "); the job was left as it is: try again"));
  };
  if (state == v1::QUEUED ||
      (entry->ranks.empty() && !entry->relaunch_pending && !entry->launching &&
       entry->stop == StopIntent::kNone)) {
    const bool restarting = state == v1::RESTARTING;
    if (absl::Status s =
            CommitState(*entry, v1::CANCELLED,
                        restarting ? "cancelled while waiting to restart"
                                   : "cancelled before it started");
        !s.ok()) {
      return not_stored(s);
    }
    entry->relaunch_pending = false;
    entry->elastic_restart = false;
    entry->failure.reset();
    ReleaseDevices(*entry);
  } else if (entry->relaunch_pending) {
    if (absl::Status s = CommitState(*entry, v1::CANCELLED,
                                     "cancelled while waiting to restart");
        !s.ok()) {
      return not_stored(s);
    }
    entry->relaunch_pending = false;
    ReleaseDevices(*entry);
  } else if (entry->stop != StopIntent::kCancel) {
    StoredJob requested = entry->stored;
    requested.job.set_cancel_requested(true);
    if (absl::Status s =
            Store(*entry, requested,
                  Event(state, absl::StrCat("cancel requested; stopping ",
                                            entry->ranks.size(), " ranks")));
        !s.ok()) {
      return not_stored(s);
    }
    entry->stored.job.set_cancel_requested(true);
    BeginStop(*entry, StopIntent::kCancel);
  }
  return entry->stored.job;
}

absl::StatusOr<std::vector<v1::StepMetrics>> JobManager::Metrics(
    const std::string& job_id, std::optional<int> rank,
    int64_t from_step) const {
  absl::StatusOr<v1::Job> job = Get(job_id);
  if (!job.ok()) return job.status();
  const int world = job->spec().world_size();
  if (rank.has_value() && (*rank < 0 || *rank >= world)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: got ", *rank, "; ", job_id, " has ranks 0 to ",
                     world - 1, " (world size ", world, ")"));
  }
  return store_->GetMetrics(job_id, rank, from_step);
}

absl::StatusOr<std::shared_ptr<JobWatch>> JobManager::Watch(
    const std::string& job_id) {
  absl::MutexLock lock(&mutex_);
  Entry* entry = Find(job_id);
  if (entry == nullptr) {
    return NoSuchJob(job_id);
  }
  auto watch = std::make_shared<JobWatch>();
  v1::WatchJobEvent first;
  *first.mutable_job() = entry->stored.job;
  watch->Push(std::move(first));
  if (IsTerminal(entry->stored.job.state()) || shutting_down_) {
    watch->Close();
  } else {
    auto& watchers = entry->watchers;
    watchers.erase(std::remove_if(watchers.begin(), watchers.end(),
                                  [](const std::weak_ptr<JobWatch>& w) {
                                    return w.expired();
                                  }),
                   watchers.end());
    watchers.push_back(watch);
  }
  return watch;
}

absl::StatusOr<std::vector<std::string>> JobManager::LogPaths(
    const std::string& job_id) const {
  absl::MutexLock lock(&mutex_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return NoSuchJob(job_id);
  }
  std::vector<std::string> paths;
  for (int r = 0; r < it->second->stored.job.spec().world_size(); ++r) {
    paths.push_back(LogPath(job_id, r));
  }
  return paths;
}

ClusterView JobManager::Cluster() const {
  absl::MutexLock lock(&mutex_);
  ClusterView view;
  view.devices = options_.devices;
  view.holders.resize(options_.devices.size());
  for (size_t d = 0; d < device_holder_.size(); ++d) {
    const std::string& id = device_holder_[d];
    if (id.empty()) continue;
    view.holders[d].job_id = id;
    const std::vector<int>& devices = jobs_.at(id)->devices;
    view.holders[d].rank = static_cast<int>(
        std::find(devices.begin(), devices.end(), static_cast<int>(d)) -
        devices.begin());
  }
  std::vector<QueuedJobRef> queue = QueuedRefs();
  // Reasons as of now, not as of the last scheduling round.
  const ScheduleDecision decision = Schedule(queue, FreeDevices());
  SortQueue(&queue);
  for (const QueuedJobRef& ref : queue) {
    v1::Job job = jobs_.at(ref.job_id)->stored.job;
    auto waiting = decision.waiting.find(ref.job_id);
    job.set_state_reason(waiting != decision.waiting.end()
                             ? waiting->second
                             : "fits now; starts on the next scheduling round");
    view.queue.push_back(std::move(job));
  }
  return view;
}

// ---------------------------------------------------------------------------
// WorkerService

absl::StatusOr<JobManager::Entry*> JobManager::Authenticate(
    const v1::WorkerIdentity& worker) {
  Entry* entry = Find(worker.job_id());
  // One message for every refusal: a caller learns nothing about which part
  // was wrong.
  const absl::Status denied = absl::PermissionDeniedError(
      absl::StrCat("worker: not a live rank of job '", worker.job_id(),
                   "' with that secret"));
  if (entry == nullptr || !IsActive(entry->stored.job.state()) ||
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

absl::Status JobManager::RegisterWorker(const v1::WorkerIdentity& worker) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<Entry*> found = Authenticate(worker);
  if (!found.ok()) return found.status();
  Entry& entry = **found;
  RankProcess& rank = entry.ranks[worker.rank()];
  // A rank on another host: its pid is known from now on.
  if (rank.pid == 0) rank.pid = worker.pid();
  rank.registered = true;
  rank.last_heartbeat = clock_->Now();
  if (observer_ != nullptr) {
    observer_->OnHeartbeat(worker.job_id(), worker.rank(), rank.last_heartbeat);
  }
  const bool all =
      std::all_of(entry.ranks.begin(), entry.ranks.end(),
                  [](const RankProcess& r) { return r.registered; });
  if (all && entry.stop == StopIntent::kNone &&
      entry.stored.job.state() != v1::RUNNING) {
    const v1::Job& job = entry.stored.job;
    SetState(
        entry, v1::RUNNING,
        job.restarts() == 0
            ? absl::StrCat("all ", entry.ranks.size(), " ranks joined")
            : absl::StrCat("all ", entry.ranks.size(),
                           " ranks joined after restart ", job.restarts()));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> JobManager::ReportProgress(
    const v1::WorkerIdentity& worker,
    const std::vector<v1::StepMetrics>& steps) {
  bool stop = false;
  {
    absl::MutexLock lock(&mutex_);
    absl::StatusOr<Entry*> found = Authenticate(worker);
    if (!found.ok()) return found.status();
    Entry& entry = **found;
    entry.ranks[worker.rank()].last_heartbeat = clock_->Now();
    stop = entry.stop != StopIntent::kNone;
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
  if (absl::Status s = store_->AppendMetrics(worker.job_id(), steps); !s.ok()) {
    // Unavailable: the worker keeps the steps and sends them again.
    return absl::UnavailableError(
        absl::StrCat("could not store step metrics: ", s.message()));
  }
  absl::MutexLock lock(&mutex_);
  Entry* entry = Find(worker.job_id());
  if (entry == nullptr) return stop;
  v1::Job& job = entry->stored.job;
  for (const v1::StepMetrics& step : steps) {
    if (step.rank() == 0 && step.step() >= job.last_step().step()) {
      *job.mutable_last_step() = step;
    }
    v1::WatchJobEvent event;
    *event.mutable_step() = step;
    for (auto& weak : entry->watchers) {
      if (auto watch = weak.lock()) watch->Push(event);
    }
  }
  if (observer_ != nullptr && !steps.empty()) observer_->OnSteps(job, steps);
  return stop;
}

absl::StatusOr<bool> JobManager::Heartbeat(const v1::WorkerIdentity& worker) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<Entry*> found = Authenticate(worker);
  if (!found.ok()) return found.status();
  Entry& entry = **found;
  entry.ranks[worker.rank()].last_heartbeat = clock_->Now();
  if (observer_ != nullptr) {
    observer_->OnHeartbeat(worker.job_id(), worker.rank(),
                           entry.ranks[worker.rank()].last_heartbeat);
  }
  return entry.stop != StopIntent::kNone;
}

// ---------------------------------------------------------------------------
// Supervision

// A tick asks the launcher outside the lock, twice: first for the signals
// queued since the last tick and the news of running attempts, then (after
// supervising on that news) for the signals and launches it decided.
void JobManager::Tick() {
  std::vector<PendingSignal> signals;
  std::vector<Poll> polls;
  {
    absl::MutexLock lock(&mutex_);
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
    absl::MutexLock lock(&mutex_);
    for (const Poll& poll : polls) ApplyPoll(poll);
    Supervise();
    for (const auto& [id, entry] : jobs_) {
      elastic = elastic || (entry->elastic_restart && !shutting_down_);
    }
    if (!elastic) {
      requests.swap(launch_requests_);
      signals = TakeSignals();
    }
  }
  if (elastic) {
    // What the backend can run now (Slurm: sinfo), asked without the lock.
    const absl::StatusOr<Capacity> capacity = launcher_->Available();
    absl::MutexLock lock(&mutex_);
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
  absl::MutexLock lock(&mutex_);
  for (size_t i = 0; i < requests.size(); ++i) {
    CompleteLaunch(*jobs_.at(requests[i].launch.job_id), requests[i],
                   prepared[i]);
  }
}

void JobManager::SignalRanks(Entry& entry, int signal) {
  signals_.push_back({entry.stored.job.id(), signal});
}

std::vector<JobManager::PendingSignal> JobManager::TakeSignals() {
  std::vector<PendingSignal> pending;
  for (const auto& [id, signal] : signals_) {
    Entry* entry = Find(id);
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

void JobManager::SendSignals(const std::vector<PendingSignal>& signals) {
  for (const PendingSignal& send : signals) {
    launcher_->Signal(send.attempt, send.ranks, send.signal);
  }
}

std::vector<JobManager::Poll> JobManager::DuePolls() {
  std::vector<Poll> polls;
  const absl::Time now = clock_->Now();
  for (const std::string& id : order_) {
    Entry& entry = *jobs_.at(id);
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

void JobManager::ApplyPoll(const Poll& poll) {
  Entry* entry = Find(poll.job_id);
  if (entry == nullptr || entry->ranks.empty() ||
      entry->attempt.number != poll.attempt.number ||
      entry->attempt.handle != poll.attempt.handle) {
    return;  // the attempt ended meanwhile
  }
  v1::Job& job = entry->stored.job;
  if (!poll.report.ok()) {
    // The backend did not answer this time; ask again at the next poll.
    LogInfo(absl::StrCat(job.id(), ": ", poll.report.status().message()));
    return;
  }
  const AttemptReport& report = *poll.report;
  if (!report.waiting.empty()) {
    // The rendezvous clock starts when the backend starts the ranks.
    entry->launch_time = clock_->Now();
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
    LogInfo(absl::StrCat(job.id(), " rank ", exit.rank, " (pid ", rank.pid,
                         ") ended: ", exit.status.ToString()));
  }
  if (entry->stop != StopIntent::kNone) return;  // ending as intended
  if (report.failure.has_value()) {
    const AttemptFailure& failed = *report.failure;
    v1::Failure failure;
    if (failed.rank >= 0 &&
        failed.rank < static_cast<int>(entry->ranks.size())) {
      failure =
          RankFailure(job.id(), failed.rank, failed.reason, failed.message);
      MarkOomFromLogTail(failure);
    } else {
      failure.set_reason(failed.reason);
      failure.set_rank(-1);
      failure.set_message(failed.message);
      const size_t lines = failed.log_lines.size();
      const size_t keep = static_cast<size_t>(options_.log_tail_lines);
      for (size_t i = lines > keep ? lines - keep : 0; i < lines; ++i) {
        failure.add_log_tail(failed.log_lines[i]);
      }
    }
    FailAttempt(*entry, std::move(failure));
    return;
  }
  for (const RankEnd& exit : report.exits) {
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

v1::Failure JobManager::RankExitFailure(const Entry& entry, int r,
                                        const ExitStatus& exit) {
  const std::string& id = entry.stored.job.id();
  v1::Failure failure =
      RankFailure(id, r, exit.signal > 0 ? v1::SIGNAL : v1::EXIT_CODE,
                  absl::StrCat("rank ", r, " ended with ", exit.ToString()));
  if (!MarkOomFromLogTail(failure) && exit.exit_code == kExitDiverged) {
    // Deterministic: a restart from the last checkpoint would diverge at
    // the same step again.
    failure.set_reason(v1::DIVERGED);
    failure.set_message(absl::StrCat(
        "rank ", r,
        ": training diverged (a non-finite loss or gradient "
        "norm; its last step is in the metrics, the reason in its log)"));
  } else if (exit.exit_code == kExitInputRefused) {
    failure.set_reason(v1::INVALID_SPEC);
    failure.set_message(absl::StrCat(
        "rank ", r,
        ": refused a file the job names (outside shardtraind --path-root, or "
        "not readable by the daemon's user); its log says which"));
  }
  return failure;
}

void JobManager::Supervise() {
  StoreUnsaved();
  for (const std::string& id : order_) {
    Entry& entry = *jobs_.at(id);
    if (!entry.ranks.empty() && !entry.launching) Detect(entry);
  }
  if (shutting_down_) return;
  // Jobs recovered after a coordinator restart go before the queue: they held
  // their devices before.
  for (const std::string& id : order_) {
    Entry& entry = *jobs_.at(id);
    if (!entry.relaunch_pending) continue;
    entry.relaunch_pending = false;
    if (entry.stored.job.spec().elastic().min_world_size() > 0) {
      // Its size is chosen as after any loss (the restart is counted).
      entry.elastic_restart = true;
      entry.elastic_restart_counted = true;
      continue;
    }
    const std::vector<int> free = FreeDevices();
    // An elastic job that continued smaller goes on at that size.
    const int world = entry.stored.job.world_size() > 0
                          ? entry.stored.job.world_size()
                          : entry.stored.job.spec().world_size();
    if (static_cast<int>(free.size()) < world) {
      v1::Failure* failure = entry.stored.job.mutable_failure();
      failure->set_reason(v1::COORDINATOR_RESTART);
      failure->set_rank(-1);
      failure->set_message(
          absl::StrCat("after the coordinator restarted the job needs ", world,
                       " devices and only ", free.size(), " are free"));
      SetState(entry, v1::FAILED, failure->message());
      continue;
    }
    RequestLaunch(entry, std::vector<int>(free.begin(), free.begin() + world));
  }
  ScheduleQueued();
}

void JobManager::Detect(Entry& entry) {
  const absl::Time now = clock_->Now();
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
          now - rank.last_heartbeat > options_.heartbeat_timeout) {
        FailAttempt(
            entry,
            RankFailure(
                id, static_cast<int>(r), v1::HANG,
                absl::StrCat(
                    "rank ", r, " sent no heartbeat for ",
                    absl::FormatDuration(absl::Trunc(now - rank.last_heartbeat,
                                                     absl::Milliseconds(100))),
                    " (timeout ",
                    absl::FormatDuration(options_.heartbeat_timeout), ")")));
        break;
      }
    }
    if (entry.stop == StopIntent::kNone && !unregistered.empty() &&
        now - entry.launch_time > options_.rendezvous_timeout) {
      FailAttempt(
          entry,
          RankFailure(
              id, unregistered.front(), v1::RENDEZVOUS_TIMEOUT,
              absl::StrCat("rank", unregistered.size() == 1 ? " " : "s ",
                           absl::StrJoin(unregistered, ", "),
                           " did not join within ",
                           absl::FormatDuration(options_.rendezvous_timeout))));
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

void JobManager::FailAttempt(Entry& entry, v1::Failure failure) {
  if (entry.failure.has_value()) return;
  LogInfo(absl::StrCat(entry.stored.job.id(), ": ", failure.message()));
  const v1::JobEvent event =
      Event(entry.stored.job.state(),
            absl::StrCat(failure.message(), "; stopping the other ranks"));
  entry.failure = std::move(failure);
  BeginStop(entry, StopIntent::kFail);
  Persist(entry, event);
}

void JobManager::BeginStop(Entry& entry, StopIntent intent) {
  entry.stop = intent;
  entry.stop_deadline = clock_->Now() + options_.grace_period;
  SignalRanks(entry, SIGTERM);
}

void JobManager::FinishAttempt(Entry& entry) {
  const StopIntent stop = entry.stop;
  const bool no_restart = entry.no_restart;
  entry.no_restart = false;
  std::optional<v1::Failure> failure = std::move(entry.failure);
  entry.ranks.clear();
  entry.attempt = Attempt{};
  entry.stop = StopIntent::kNone;
  entry.failure.reset();
  entry.killed = false;
  entry.stored.worker_pids.clear();
  entry.stored.worker_pgid = 0;
  v1::Job& job = entry.stored.job;
  switch (stop) {
    case StopIntent::kShutdown:
      Persist(entry, std::nullopt);
      return;
    case StopIntent::kCancel:
      ReleaseDevices(entry);
      SetState(entry, v1::CANCELLED, "cancelled; all ranks stopped");
      return;
    case StopIntent::kFail:
      if (entry.port_taken && !shutting_down_) {
        entry.port_taken = false;
        ++entry.port_retries;
        Persist(entry,
                Event(job.state(),
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
          shutting_down_) {
        // No relaunch now: the job stays active in the store and the next
        // coordinator restarts it (counting this restart then).
        Persist(entry, std::nullopt);
        return;
      }
      if (job.restarts() < job.spec().max_restarts() && !no_restart) {
        const bool elastic = job.spec().elastic().min_world_size() > 0;
        // An elastic restart is counted when it launches (RestartElastic):
        // a coordinator that dies before then counts it once, on resume.
        if (!elastic) job.set_restarts(job.restarts() + 1);
        SetState(entry, v1::RESTARTING,
                 absl::StrCat(failure->message(), "; restart ",
                              job.restarts() + (elastic ? 1 : 0), " of ",
                              job.spec().max_restarts(),
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
      ReleaseDevices(entry);
      *job.mutable_failure() = *failure;
      SetState(entry, v1::FAILED, failure->message());
      return;
    case StopIntent::kNone:
      ReleaseDevices(entry);
      SetState(entry, v1::SUCCEEDED, "all ranks finished");
      return;
  }
}

void JobManager::RestartElastic(const absl::StatusOr<Capacity>& asked) {
  Capacity capacity;  // unknown: no limit beyond the devices
  if (asked.ok()) {
    capacity = *asked;
  } else {
    LogInfo(absl::StrCat("elastic restart: cannot ask the ", launcher_->name(),
                         " launcher what it can run (",
                         asked.status().message(), "); assuming all of it"));
  }
  if (shutting_down_) return;  // the next coordinator restarts them
  const std::set<int> lost(capacity.lost_devices.begin(),
                           capacity.lost_devices.end());
  // Lost devices are given to no job until the launcher reports them back.
  lost_devices_ = lost;
  for (const std::string& id : order_) {
    Entry& entry = *jobs_.at(id);
    if (!entry.elastic_restart) continue;
    entry.elastic_restart = false;
    v1::Job& job = entry.stored.job;
    std::optional<v1::Failure> failure = std::move(entry.failure);
    entry.failure.reset();
    if (job.state() != v1::RESTARTING) continue;  // cancelled meanwhile
    const int requested = job.spec().world_size();
    const int min_world = job.spec().elastic().min_world_size();
    // Its own devices first, then free ones; none the backend lost.
    std::vector<int> candidates;
    for (int d : entry.devices) {
      if (!lost.count(d)) candidates.push_back(d);
    }
    for (int d : FreeDevices()) {
      if (!lost.count(d)) candidates.push_back(d);
    }
    int available = static_cast<int>(candidates.size());
    if (capacity.slots >= 0) {
      // The backend's slots, less those other jobs hold.
      int held_by_others = 0;
      for (const std::string& holder : device_holder_) {
        held_by_others += !holder.empty() && holder != id;
      }
      available = std::min(available, capacity.slots - held_by_others);
    }
    absl::StatusOr<TrainConfig> config =
        TrainConfigFromJobSpec(job.spec(), JobDir(id));
    const int64_t global =
        config.ok() ? requested * config->batch_size * config->grad_accum : 0;
    int world = std::min(requested, available);
    while (world >= min_world && world > 0 && global % world != 0) --world;
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
      ReleaseDevices(entry);
      v1::Failure* failed = job.mutable_failure();
      if (failure.has_value()) {
        *failed = *failure;
      } else {
        failed->set_reason(v1::COORDINATOR_RESTART);
        failed->set_rank(-1);
        failed->set_message("the coordinator restarted while the job ran");
      }
      failed->set_message(absl::StrCat(
          failed->message(), "; cannot continue: ", available, " of ",
          requested, " ranks can run", lost_text,
          ", and elastic.min_world_size is ", min_world,
          available >= min_world
              ? absl::StrCat(" (no size from ", min_world, " to ", available,
                             " shares the ", global, " sequences per step)")
              : ""));
      SetState(entry, v1::FAILED, failed->message());
      continue;
    }
    std::vector<int> chosen(candidates.begin(), candidates.begin() + world);
    for (int d : entry.devices) {
      if (std::find(chosen.begin(), chosen.end(), d) == chosen.end() &&
          device_holder_[d] == id) {
        device_holder_[d].clear();
      }
    }
    if (!entry.elastic_restart_counted) job.set_restarts(job.restarts() + 1);
    if (world < requested) {
      job.set_resize_reason(absl::StrCat("continued at ", world, " of ",
                                         requested, " ranks", lost_text));
      job.set_state_reason(job.resize_reason());
      Persist(entry, Event(v1::RESTARTING,
                           absl::StrCat(job.resize_reason(),
                                        " (elastic.min_world_size ", min_world,
                                        "; the same ", global,
                                        " sequences per step)")));
    } else {
      job.clear_resize_reason();
    }
    RequestLaunch(entry, chosen);
  }
}

std::vector<QueuedJobRef> JobManager::QueuedRefs() const {
  std::vector<QueuedJobRef> queue;
  for (const std::string& id : order_) {
    const Entry& entry = *jobs_.at(id);
    if (entry.stored.job.state() != v1::QUEUED) continue;
    queue.push_back({id, entry.stored.job.spec().priority(), entry.stored.seq,
                     entry.stored.job.spec().world_size()});
  }
  return queue;
}

v1::JobEvent JobManager::Event(v1::JobState state, std::string message) const {
  v1::JobEvent event;
  event.set_time_unix_ms(UnixMillis(clock_->Now()));
  event.set_state(state);
  event.set_message(std::move(message));
  return event;
}

v1::Failure JobManager::RankFailure(const std::string& job_id, int rank,
                                    v1::FailureReason reason,
                                    std::string message) const {
  v1::Failure failure;
  failure.set_reason(reason);
  failure.set_rank(rank);
  failure.set_message(std::move(message));
  for (std::string& line :
       ReadLastLines(LogPath(job_id, rank), options_.log_tail_lines)) {
    failure.add_log_tail(std::move(line));
  }
  return failure;
}

void JobManager::ScheduleQueued() {
  std::vector<QueuedJobRef> queue = QueuedRefs();
  if (queue.empty()) return;
  const ScheduleDecision decision = Schedule(std::move(queue), FreeDevices());
  for (const auto& [id, reason] : decision.waiting) {
    jobs_.at(id)->stored.job.set_state_reason(reason);
  }
  for (const Placement& placement : decision.start) {
    RequestLaunch(*jobs_.at(placement.job_id), placement.devices);
  }
}

std::vector<int> JobManager::FreeDevices() const {
  std::vector<int> free;
  for (size_t d = 0; d < device_holder_.size(); ++d) {
    if (device_holder_[d].empty() &&
        !lost_devices_.count(static_cast<int>(d))) {
      free.push_back(static_cast<int>(d));
    }
  }
  return free;
}

void JobManager::ReleaseDevices(Entry& entry) {
  for (int d : entry.devices) {
    if (device_holder_[d] == entry.stored.job.id()) device_holder_[d].clear();
  }
  entry.devices.clear();
}

// A launch in three parts, so that no file is touched and no launcher asked
// under the mutex that heartbeats and RPCs need: RequestLaunch (locked) takes
// the devices, the state and the attempt's secret and lays out its ranks;
// PrepareLaunch (unlocked) creates the job's directory, resolves its data,
// writes spec.json and the logs' headers, and has the launcher start the
// ranks; CompleteLaunch (locked) records the attempt, or why it did not
// start. Tick runs all three.
void JobManager::RequestLaunch(Entry& entry, const std::vector<int>& devices) {
  v1::Job& job = entry.stored.job;
  const std::string& id = job.id();
  entry.devices = devices;
  for (int d : devices) device_holder_[d] = id;
  const int world = static_cast<int>(devices.size());
  const bool first_attempt = job.state() == v1::QUEUED;
  job.set_world_size(world);

  entry.stored.secret = NewSecret();
  // Known before the launcher starts them: a rank may register as soon as
  // it runs, before CompleteLaunch.
  entry.ranks.assign(world, RankProcess{});
  entry.attempt = Attempt{};
  entry.stop = StopIntent::kNone;
  entry.failure.reset();
  entry.killed = false;
  entry.launching = true;
  entry.launch_time = clock_->Now();
  entry.stored.worker_pids.clear();
  entry.stored.worker_pgid = 0;
  const bool cpu = job.spec().device_kind() == v1::CPU;
  if (first_attempt) {
    // From here on the job owns its devices and is no longer a queue entry,
    // even if a rank fails to start.
    std::vector<std::string> gpu_list;
    for (int d : devices) gpu_list.push_back(std::to_string(d));
    job.set_start_time_unix_ms(UnixMillis(clock_->Now()));
    SetState(entry, v1::STARTING,
             absl::StrCat("starting ", world, " ranks on ",
                          cpu ? "CPU slots " : "GPUs ",
                          absl::StrJoin(gpu_list, ",")));
  }

  LaunchRequest request;
  request.spec = job.spec();
  request.attempt = job.restarts() + 1;
  request.first_attempt = first_attempt;
  request.started = clock_->Now();
  RankLaunch& launch = request.launch;
  launch.worker_binary = options_.worker_binary;
  launch.job_id = id;
  launch.job_dir = JobDir(id);
  launch.spec_path = launch.job_dir + "/spec.json";
  launch.world_size = world;
  launch.cpu = cpu;
  launch.devices = devices;
  launch.threads_per_rank = std::max(1, options_.cpu_cores / world);
  launch.resume = job.restarts() > 0;
  launch.coordinator_address = worker_address_;
  launch.secret = entry.stored.secret;
  launch.heartbeat_seconds = absl::ToDoubleSeconds(options_.heartbeat_interval);
  launch.read_roots = absl::StrJoin(options_.path_roots.roots(), ":");
  if (job.spec().data() == kBuiltinDataset) {
    launch.prepare_data = kBuiltinDataset;
  }
  for (int r = 0; r < world; ++r) launch.log_paths.push_back(LogPath(id, r));
  launch_requests_.push_back(std::move(request));
}

JobManager::PreparedLaunch JobManager::PrepareLaunch(
    const LaunchRequest& request) {
  PreparedLaunch prepared;
  const RankLaunch& launch = request.launch;
  std::error_code ec;
  std::filesystem::create_directories(launch.job_dir, ec);
  if (ec) {
    prepared.error =
        absl::StrCat("cannot create ", launch.job_dir, ": ", ec.message());
    return prepared;
  }
  // Checked again: a symlink may have been turned since the submit.
  if (absl::Status s = CheckSpecPaths(options_.path_roots, request.spec);
      !s.ok()) {
    prepared.error = std::string(s.message());
    return prepared;
  }
  absl::StatusOr<std::string> data = options_.resolve_data(request.spec.data());
  if (!data.ok()) {
    prepared.error = std::string(data.status().message());
    return prepared;
  }
  v1::JobSpec resolved = request.spec;
  resolved.set_data(*data);
  if (launch.world_size != request.spec.world_size()) {
    // An elastic job continuing smaller: the same global batch, shared by
    // fewer ranks (each rank's checkpoint resume then finds it unchanged).
    absl::StatusOr<TrainConfig> config =
        TrainConfigFromJobSpec(request.spec, launch.job_dir);
    if (!config.ok()) {
      prepared.error = std::string(config.status().message());
      return prepared;
    }
    const int64_t global = static_cast<int64_t>(request.spec.world_size()) *
                           config->batch_size * config->grad_accum;
    absl::StatusOr<BatchSplit> split =
        SplitGlobalBatch(global, launch.world_size, config->batch_size);
    if (!split.ok()) {
      prepared.error = std::string(split.status().message());
      return prepared;
    }
    resolved.mutable_trainer()->set_batch_size(split->batch);
    resolved.mutable_trainer()->set_grad_accum(split->accum);
  }
  // The header only: the ranks read (and validate) the tokens themselves.
  if (absl::StatusOr<int64_t> tokens =
          ReadTokenFileHeader(*data + "/train.bin");
      tokens.ok()) {
    prepared.train_tokens = *tokens;
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  print.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(resolved, &json, print);
  if (absl::Status s = WriteFileAtomically(launch.spec_path, json); !s.ok()) {
    prepared.error = std::string(s.message());
    return prepared;
  }
  for (int r = 0; r < launch.world_size; ++r) {
    std::ofstream log(launch.log_paths[r], std::ios::app);
    log << "=== shardtraind: " << launch.job_id << " rank " << r << " of "
        << launch.world_size << ", attempt " << request.attempt << ", "
        << absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", request.started,
                            absl::UTCTimeZone())
        << " ===\n";
  }
  {
    // Cancelled (or the coordinator began to shut down) meanwhile: nothing
    // is started. A stop from here on finds the ranks in CompleteLaunch.
    absl::MutexLock lock(&mutex_);
    const Entry* entry = Find(launch.job_id);
    if (shutting_down_ || entry == nullptr ||
        entry->stop != StopIntent::kNone) {
      prepared.skipped = true;
      return prepared;
    }
  }
  if (absl::Status s =
          launcher_->Start(launch, request.attempt, &prepared.attempt);
      !s.ok()) {
    prepared.error = std::string(s.message());
  }
  return prepared;
}

void JobManager::CompleteLaunch(Entry& entry, const LaunchRequest& request,
                                const PreparedLaunch& prepared) {
  v1::Job& job = entry.stored.job;
  const std::string& id = job.id();
  const int world = request.launch.world_size;
  entry.launching = false;
  entry.attempt = prepared.attempt;
  if (prepared.train_tokens.has_value()) {
    job.set_train_tokens(*prepared.train_tokens);
  }
  // Which ranks run: all of a started attempt; of one that failed to
  // start, those the launcher gave a pid (Launcher::Start).
  const bool started = prepared.error.empty() && !prepared.skipped;
  int running = 0;
  for (int r = 0; r < world; ++r) {
    const int pid = r < static_cast<int>(prepared.attempt.pids.size())
                        ? prepared.attempt.pids[r]
                        : 0;
    RankProcess& rank = entry.ranks[r];
    if (!started && pid == 0) {
      rank.exited = true;  // never started
      continue;
    }
    ++running;
    if (pid != 0 && rank.pid != 0 && rank.pid != pid) {
      // Registered before the launch was recorded, as another process.
      LogInfo(absl::StrCat(id, " rank ", r, " registered as pid ", rank.pid,
                           " but was started as pid ", pid));
      rank.registered = false;
    }
    if (pid != 0) rank.pid = pid;
  }
  entry.stored.worker_pids.clear();
  for (int pid : prepared.attempt.pids) {
    if (pid != 0) entry.stored.worker_pids.push_back(pid);
  }
  entry.stored.worker_pgid = prepared.attempt.pgid;
  entry.next_poll = clock_->Now();

  if (running > 0 && (entry.stop != StopIntent::kNone || shutting_down_)) {
    // Started, then cancelled (or the coordinator began to shut down):
    // end the attempt; its ranks' end, seen by a poll, finishes it.
    if (entry.stop == StopIntent::kNone) entry.stop = StopIntent::kShutdown;
    entry.stop_deadline = clock_->Now();
    entry.killed = true;
    SignalRanks(entry, SIGKILL);
    return;
  }
  if (running == 0 &&
      (entry.stop != StopIntent::kNone || shutting_down_ || prepared.skipped)) {
    // Cancelled, or the coordinator began to shut down, while the launch was
    // being prepared: nothing was started, so nothing needs stopping.
    const StopIntent stop = entry.stop;
    entry.stop = StopIntent::kNone;
    entry.ranks.clear();
    if (stop == StopIntent::kCancel) {
      ReleaseDevices(entry);
      SetState(entry, v1::CANCELLED, "cancelled before its ranks started");
    } else {
      Persist(entry, std::nullopt);  // the next coordinator resumes it
    }
    return;
  }

  if (!prepared.error.empty()) {
    v1::Failure failure;
    failure.set_reason(v1::EXIT_CODE);
    failure.set_rank(running);  // the first rank that did not start
    failure.set_message(prepared.error);
    if (running == 0) {
      // Nothing to stop: no restart either, the same launch would fail
      // again.
      entry.ranks.clear();
      ReleaseDevices(entry);
      *job.mutable_failure() = failure;
      SetState(entry, v1::FAILED, prepared.error);
      return;
    }
    entry.no_restart = true;
    FailAttempt(entry, std::move(failure));
    return;
  }

  const Attempt& attempt = entry.attempt;
  LogInfo(absl::StrCat(
      id, ": started ", world, " ranks",
      attempt.summary.empty() ? "" : absl::StrCat(" as ", attempt.summary),
      entry.stored.worker_pids.empty()
          ? ""
          : absl::StrCat(" (pids ",
                         absl::StrJoin(entry.stored.worker_pids, ", "), ")")));
  // The workers' pids, and on a restart or a backend's own job an event
  // saying so.
  std::optional<v1::JobEvent> event;
  if (!attempt.summary.empty()) {
    event = Event(
        job.state(),
        absl::StrCat(request.first_attempt ? "submitted " : "resubmitted ",
                     world, " ranks as ", attempt.summary, " (attempt ",
                     request.attempt, ")"));
  } else if (!request.first_attempt) {
    event = Event(job.state(),
                  absl::StrCat("relaunched ", world, " ranks (attempt ",
                               request.attempt, ")"));
  }
  Persist(entry, event);
}

void JobManager::SetState(Entry& entry, v1::JobState state,
                          const std::string& message) {
  // What happened still happened: recorded in memory even when the store
  // fails, and stored later (KeepUnsaved logs it).
  (void)CommitState(entry, state, message, /*even_if_not_stored=*/true);
}

absl::Status JobManager::CommitState(Entry& entry, v1::JobState state,
                                     const std::string& message,
                                     bool even_if_not_stored) {
  // Stored from a copy; entry.stored itself is changed in place afterwards,
  // so references into it that callers hold stay valid.
  const int64_t end_ms = IsTerminal(state)
                             ? UnixMillis(clock_->Now())
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

void JobManager::Announce(Entry& entry, const v1::JobEvent& event) {
  const v1::Job& job = entry.stored.job;
  const v1::JobState state = job.state();
  const std::string& message = job.state_reason();
  LogInfo(absl::StrCat(job.id(), " -> ", StateName(state), ": ", message));
  v1::WatchJobEvent change;
  *change.mutable_state_change() = event;
  for (auto& weak : entry.watchers) {
    if (auto watch = weak.lock()) {
      watch->Push(change);
      if (IsTerminal(state)) watch->Close();
    }
  }
  if (IsTerminal(state)) entry.watchers.clear();
  if (observer_ != nullptr) observer_->OnJobChanged(job);
}

void JobManager::Persist(Entry& entry,
                         const std::optional<v1::JobEvent>& event) {
  if (absl::Status s = Store(entry, entry.stored, event); !s.ok()) {
    KeepUnsaved(entry, event, s);
  }
}

absl::Status JobManager::Store(Entry& entry, const StoredJob& record,
                               const std::optional<v1::JobEvent>& event) {
  // The backlog first, event by event with the newest record: a failure
  // part way keeps the rest, still in order.
  size_t done = 0;
  absl::Status status;
  for (; done < entry.unsaved_events.size(); ++done) {
    status = store_->UpdateJob(entry.stored, entry.unsaved_events[done]);
    if (!status.ok()) break;
  }
  entry.unsaved_events.erase(entry.unsaved_events.begin(),
                             entry.unsaved_events.begin() + done);
  if (status.ok()) status = store_->UpdateJob(record, event);
  if (status.ok() && entry.unsaved) {
    entry.unsaved = false;
    LogInfo(absl::StrCat(entry.stored.job.id(),
                         ": changes kept while the store failed are stored"));
  }
  return status;
}

void JobManager::KeepUnsaved(Entry& entry,
                             const std::optional<v1::JobEvent>& event,
                             const absl::Status& why) {
  if (!entry.unsaved) {
    LogInfo(absl::StrCat("could not store ", entry.stored.job.id(), ": ",
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

void JobManager::StoreUnsaved() {
  if (!any_unsaved_) return;
  for (const std::string& id : order_) {
    Entry& entry = *jobs_.at(id);
    if (!entry.unsaved) continue;
    // One failing write is enough to know the store still refuses.
    if (!Store(entry, entry.stored, std::nullopt).ok()) return;
  }
  any_unsaved_ = false;
}

}  // namespace shardtrain
