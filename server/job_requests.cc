#include "server/job_requests.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/input_file.h"
#include "core/data/builtin_dataset.h"
#include "core/plan/mesh_search.h"
#include "core/run/strategy_kinds.h"
#include "proto/job_config.h"
#include "server/attempt_supervisor.h"
#include "server/scheduler.h"

namespace shardtrain {
namespace {

constexpr int kDefaultPageSize = 100;
constexpr int kMaxPageSize = 1000;

// `job` as the daemon shows it: with its mesh (JobMesh) and, while it
// runs, the time its last step is due.
v1::Job WithMesh(const v1::Job& job) {
  v1::Job view = job;
  view.set_mesh(JobMesh(job));
  const v1::StepMetrics& last = job.last_step();
  if (job.state() == v1::RUNNING && last.step_seconds() > 0 &&
      last.total_steps() > last.step()) {
    view.set_eta_seconds(last.step_seconds() *
                         static_cast<double>(last.total_steps() - last.step()));
  }
  return view;
}
constexpr size_t kMaxSpecBytes = 64 * 1024;

// The most directory entries of an init_from directory checked at submit
// (a checkpoint of a thousand ranks has about two thousand files).
constexpr int kMaxCheckedEntries = 4096;

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

// PermissionDenied naming the owner unless `caller` owns the job or is an
// admin.
absl::Status CheckMayChange(const JobEntry& entry, const Caller& caller,
                            const char* what) {
  const v1::Job& job = entry.stored.job;
  if (caller.admin || (!caller.user.empty() && job.owner() == caller.user)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      job.id(), " belongs to ",
      job.owner().empty() ? "no user (submitted without a token)" : job.owner(),
      "; only ", job.owner().empty() ? "" : absl::StrCat(job.owner(), " or "),
      "an admin may ", what, " it (", caller.Describe(), " is a user)"));
}

}  // namespace

absl::StatusOr<std::map<std::string, PriorityClass>> ParsePriorityClasses(
    const std::vector<std::string>& values) {
  std::map<std::string, PriorityClass> classes;
  for (const std::string& value : values) {
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(
          absl::StrCat("--priority-class '", value, "': ", what,
                       " (NAME=PRIORITY[,preemptible=false][,open=true])"));
    };
    std::vector<std::string> parts = absl::StrSplit(value, ',');
    const std::vector<std::string> head =
        absl::StrSplit(parts[0], absl::MaxSplits('=', 1));
    if (head.size() != 2 || head[0].empty()) return bad("no NAME=PRIORITY");
    PriorityClass priority_class;
    if (!absl::SimpleAtoi(head[1], &priority_class.priority)) {
      return bad(
          absl::StrCat("priority '", head[1], "' is not a whole number"));
    }
    for (size_t i = 1; i < parts.size(); ++i) {
      if (parts[i] == "preemptible=false") {
        priority_class.preemptible = false;
      } else if (parts[i] == "open=true") {
        priority_class.open = true;
      } else if (parts[i] != "preemptible=true" && parts[i] != "open=false") {
        return bad(absl::StrCat("unknown setting '", parts[i], "'"));
      }
    }
    if (!classes.emplace(head[0], priority_class).second) {
      return bad(absl::StrCat("class ", head[0], " is defined twice"));
    }
  }
  return classes;
}

PriorityClass EffectivePriority(const JobManagerOptions& options,
                                const v1::JobSpec& spec) {
  auto it = options.priority_classes.find(spec.priority_class());
  if (!spec.priority_class().empty() && it != options.priority_classes.end()) {
    return it->second;
  }
  return PriorityClass{spec.priority(), true};
}

int UserPriorityCeiling(const JobManagerOptions& options) {
  int ceiling = 0;
  for (const auto& [name, priority_class] : options.priority_classes) {
    if (priority_class.open) {
      ceiling = std::max(ceiling, priority_class.priority);
    }
  }
  return ceiling;
}

absl::Status CheckPriorityAllowed(const JobManagerOptions& options,
                                  const v1::JobSpec& spec,
                                  const Caller& caller) {
  if (caller.admin) return absl::OkStatus();
  if (!spec.priority_class().empty()) {
    auto it = options.priority_classes.find(spec.priority_class());
    if (it == options.priority_classes.end() || it->second.open) {
      return absl::OkStatus();  // an unknown class is ValidateSubmission's
    }
    std::vector<std::string> open;
    for (const auto& [name, priority_class] : options.priority_classes) {
      if (priority_class.open) open.push_back(name);
    }
    return absl::PermissionDeniedError(
        absl::StrCat("priority_class: '", spec.priority_class(),
                     "' is for admins; ", caller.Describe(),
                     " is a user, who may name only the classes an admin "
                     "opened (",
                     open.empty() ? "none are" : absl::StrJoin(open, ", "),
                     "; shardtraind --priority-class NAME=P,open=true)"));
  }
  if (const int ceiling = UserPriorityCeiling(options);
      spec.priority() > ceiling) {
    return absl::PermissionDeniedError(absl::StrCat(
        "priority: got ", spec.priority(), "; ", caller.Describe(),
        " is a user, who may set a priority of at most ", ceiling,
        " (the highest class open to users, else 0); higher is for admins"));
  }
  return absl::OkStatus();
}

int64_t DeviceMemoryFor(const JobManagerOptions& options,
                        const v1::JobSpec& spec) {
  int64_t least = 0;
  for (const DeviceInfo& d : options.devices) {
    if (d.kind != spec.device_kind() || d.memory_bytes <= 0) continue;
    least = least == 0 ? d.memory_bytes : std::min(least, d.memory_bytes);
  }
  return least;
}

std::vector<int> ElasticWorlds(const v1::JobSpec& spec, int64_t device_memory) {
  const int min_world = spec.elastic().min_world_size();
  if (min_world <= 0) return {};
  absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(spec, "/");
  if (!config.ok()) return {};
  std::vector<int> worlds;
  for (int64_t w : ElasticWorldSizes(*config, spec.world_size(), min_world,
                                     device_memory)) {
    worlds.push_back(static_cast<int>(w));
  }
  return worlds;
}

int DeviceQuota(const JobManagerOptions& options, const std::string& user) {
  return options.device_quota ? options.device_quota(user) : 0;
}

JobRequests::JobRequests(JobTable* table, AttemptSupervisor* supervisor)
    : table_(table), supervisor_(supervisor) {}

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
  if (!effective.priority_class().empty() &&
      !options.priority_classes.count(effective.priority_class())) {
    std::vector<std::string> names;
    for (const auto& [name, unused] : options.priority_classes) {
      names.push_back(name);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "priority_class: '", effective.priority_class().substr(0, 64), "' ",
        names.empty()
            ? "given, but this coordinator defines no classes"
            : absl::StrCat("is not one of ", absl::StrJoin(names, ", ")),
        " (shardtraind --priority-class)"));
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

absl::StatusOr<v1::Job> JobRequests::Submit(const v1::JobSpec& spec,
                                            const Caller& caller) {
  absl::StatusOr<v1::JobSpec> validated =
      ValidateSubmission(table_->options, spec);
  if (!validated.ok()) return validated.status();
  if (absl::Status s =
          CheckPriorityAllowed(table_->options, *validated, caller);
      !s.ok()) {
    return s;
  }
  if (const int quota = DeviceQuota(table_->options, caller.user);
      quota > 0 && validated->world_size() > quota) {
    return absl::FailedPreconditionError(absl::StrCat(
        "world_size: got ", validated->world_size(), "; ", caller.Describe(),
        "'s quota is ", quota, quota == 1 ? " device" : " devices",
        " held at once (the token file's max_devices or shardtraind "
        "--default-quota)"));
  }
  // Every field is bounded by validation; this bounds their sum, so a
  // stored job (and a List page of them) stays small.
  if (const size_t bytes = validated->ByteSizeLong(); bytes > kMaxSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec: ", bytes, " bytes once encoded; at most ", kMaxSpecBytes));
  }
  if (struct statvfs fs; statvfs(table_->options.state_dir.c_str(), &fs) == 0) {
    const int64_t free_bytes =
        static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    if (free_bytes < table_->options.min_free_bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the state directory %s has %.1f MiB free, less than the %.1f MiB a "
          "job needs (shardtraind --min-free-mb); free space, then resubmit",
          table_->options.state_dir, free_bytes / 1048576.0,
          table_->options.min_free_bytes / 1048576.0));
    }
  }
  const v1::JobSpec& effective = *validated;

  // The planner's work, before the lock (options are fixed).
  std::vector<int> elastic_worlds =
      ElasticWorlds(effective, DeviceMemoryFor(table_->options, effective));
  absl::MutexLock lock(&table_->mutex);
  if (table_->shutting_down) {
    return absl::UnavailableError("shardtraind is shutting down");
  }
  auto entry = std::make_unique<JobEntry>();
  entry->stored.seq = table_->next_seq;
  entry->stored.secret = JobTable::NewSecret();
  v1::Job& job = entry->stored.job;
  job.set_id(absl::StrFormat("job-%06d", table_->next_seq));
  job.set_output_dir(table_->JobDir(job.id()));
  *job.mutable_spec() = effective;
  job.set_owner(caller.user);
  entry->elastic_worlds = std::move(elastic_worlds);
  const PriorityClass priority = EffectivePriority(table_->options, effective);
  job.set_priority(priority.priority);
  job.set_preemptible(priority.preemptible);
  job.set_state(v1::QUEUED);
  job.set_state_reason("waiting for the scheduler");
  job.set_submit_time_unix_ms(absl::ToUnixMillis(table_->clock->Now()));
  v1::JobEvent event;
  event.set_time_unix_ms(job.submit_time_unix_ms());
  event.set_state(v1::QUEUED);
  event.set_message(caller.user.empty()
                        ? std::string("submitted")
                        : absl::StrCat("submitted by ", caller.user));
  if (absl::Status s = table_->store->InsertJob(entry->stored, event);
      !s.ok()) {
    // Nothing was stored; jobs already stored are untouched (the insert is
    // one transaction). A full disk is the operator's to fix: say so.
    if (absl::IsResourceExhausted(s)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the state directory ", table_->options.state_dir,
          " is full; no new job is accepted until space is freed (",
          s.message(), ")"));
    }
    return absl::InternalError(
        absl::StrCat("could not store the job: ", s.message()));
  }
  v1::Job result = WithMesh(job);
  table_->Add(std::move(entry));
  if (table_->observer != nullptr) table_->observer->OnJobChanged(result);
  return result;
}

absl::StatusOr<v1::Job> JobRequests::Get(const std::string& job_id) const {
  absl::MutexLock lock(&table_->mutex);
  const JobEntry* entry = table_->Find(job_id);
  if (entry == nullptr) return NoSuchJob(job_id);
  v1::Job view = WithMesh(entry->stored.job);
  if (!IsTerminalJobState(view.state())) {
    for (int pid : entry->stored.worker_pids) view.add_worker_pids(pid);
  }
  return view;
}

absl::StatusOr<ListJobsPage> JobRequests::List(
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
  absl::MutexLock lock(&table_->mutex);
  ListJobsPage page;
  for (const std::string& id : table_->order) {
    const JobEntry& entry = *table_->jobs.at(id);
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
          absl::StrCat(table_->jobs.at(page.jobs.back().id())->stored.seq);
      break;
    }
    page.jobs.push_back(WithMesh(job));
  }
  return page;
}

absl::StatusOr<v1::Job> JobRequests::Cancel(const std::string& job_id,
                                            const Caller& caller) {
  absl::MutexLock lock(&table_->mutex);
  JobEntry* entry = table_->Find(job_id);
  if (entry == nullptr) return NoSuchJob(job_id);
  if (absl::Status s = CheckMayChange(*entry, caller, "cancel"); !s.ok()) {
    return s;
  }
  const v1::JobState state = entry->stored.job.state();
  if (IsTerminalJobState(state)) {
    return absl::FailedPreconditionError(absl::StrCat(
        job_id, " already ended (", JobTable::StateName(state), ")"));
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
    if (absl::Status s = table_->CommitState(
            *entry, v1::CANCELLED,
            restarting ? "cancelled while waiting to restart"
                       : "cancelled before it started");
        !s.ok()) {
      return not_stored(s);
    }
    entry->relaunch_pending = false;
    entry->elastic_restart = false;
    entry->failure.reset();
    table_->ReleaseDevices(*entry);
  } else if (entry->relaunch_pending) {
    if (absl::Status s = table_->CommitState(
            *entry, v1::CANCELLED, "cancelled while waiting to restart");
        !s.ok()) {
      return not_stored(s);
    }
    entry->relaunch_pending = false;
    table_->ReleaseDevices(*entry);
  } else if (entry->stop != StopIntent::kCancel) {
    StoredJob requested = entry->stored;
    requested.job.set_cancel_requested(true);
    if (absl::Status s = table_->Store(
            *entry, requested,
            table_->Event(state, absl::StrCat("cancel requested; stopping ",
                                              entry->ranks.size(), " ranks")));
        !s.ok()) {
      return not_stored(s);
    }
    entry->stored.job.set_cancel_requested(true);
    supervisor_->BeginStop(*entry, StopIntent::kCancel);
  }
  return entry->stored.job;
}

absl::StatusOr<std::vector<v1::StepMetrics>> JobRequests::Metrics(
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
  return table_->store->GetMetrics(job_id, rank, from_step);
}

absl::StatusOr<std::shared_ptr<JobWatch>> JobRequests::Watch(
    const std::string& job_id) {
  absl::MutexLock lock(&table_->mutex);
  JobEntry* entry = table_->Find(job_id);
  if (entry == nullptr) return NoSuchJob(job_id);
  auto watch = std::make_shared<JobWatch>();
  v1::WatchJobEvent first;
  *first.mutable_job() = WithMesh(entry->stored.job);
  watch->Push(std::move(first));
  if (IsTerminalJobState(entry->stored.job.state()) || table_->shutting_down) {
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

absl::StatusOr<std::vector<std::string>> JobRequests::LogPaths(
    const std::string& job_id) const {
  absl::MutexLock lock(&table_->mutex);
  const JobEntry* entry = table_->Find(job_id);
  if (entry == nullptr) return NoSuchJob(job_id);
  std::vector<std::string> paths;
  for (int r = 0; r < entry->stored.job.spec().world_size(); ++r) {
    paths.push_back(table_->LogPath(job_id, r));
  }
  return paths;
}

ClusterView JobRequests::Cluster() const {
  absl::MutexLock lock(&table_->mutex);
  ClusterView view;
  view.devices = table_->options.devices;
  view.holders.resize(table_->options.devices.size());
  for (size_t d = 0; d < table_->device_holder.size(); ++d) {
    const std::string& id = table_->device_holder[d];
    if (id.empty()) continue;
    view.holders[d].job_id = id;
    const std::vector<int>& devices = table_->jobs.at(id)->devices;
    view.holders[d].rank = static_cast<int>(
        std::find(devices.begin(), devices.end(), static_cast<int>(d)) -
        devices.begin());
  }
  ScheduleInput input = table_->SchedulerInput();
  std::vector<QueuedJobRef> queue = input.queue;
  // Reasons as of now, not as of the last scheduling round.
  const ScheduleDecision decision = Schedule(std::move(input));
  view.head = decision.head;
  view.head_predicted_start = decision.head_predicted_start;
  SortQueue(&queue);
  for (const QueuedJobRef& ref : queue) {
    v1::Job job = table_->jobs.at(ref.job_id)->stored.job;
    auto waiting = decision.waiting.find(ref.job_id);
    job.set_state_reason(waiting != decision.waiting.end()
                             ? waiting->second
                             : "fits now; starts on the next scheduling round");
    view.queue.push_back(std::move(job));
  }
  return view;
}

}  // namespace shardtrain
