// The launch of an attempt, in three parts, so that no file is touched and
// no launcher asked under the mutex that heartbeats and RPCs need:
// RequestLaunch (locked) takes the devices, the state and the attempt's
// secret and lays out its ranks; PrepareLaunch (unlocked) creates the job's
// directory, resolves its data, writes spec.json and the logs' headers, and
// has the launcher start the ranks; CompleteLaunch (locked) records the
// attempt, or why it did not start. AttemptSupervisor::Tick runs all three.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "core/data/builtin_dataset.h"
#include "core/data/token_file.h"
#include "core/plan/auto_mesh.h"
#include "core/run/strategy_kinds.h"
#include "google/protobuf/util/json_util.h"
#include "proto/job_config.h"
#include "server/attempt_supervisor.h"
#include "server/job_requests.h"

namespace shardtrain {

void AttemptSupervisor::RequestLaunch(JobEntry& entry,
                                      const std::vector<int>& devices) {
  v1::Job& job = entry.stored.job;
  const std::string& id = job.id();
  table_->CountHeldDevices(entry, true);
  entry.devices = devices;
  for (int d : devices) table_->device_holder[d] = id;
  const int world = static_cast<int>(devices.size());
  const bool first_attempt = job.state() == v1::QUEUED;
  job.set_world_size(world);

  entry.stored.secret = JobTable::NewSecret();
  // Known before the launcher starts them: a rank may register as soon as
  // it runs, before CompleteLaunch.
  ClearAttempt(entry);
  entry.ranks.assign(world, RankProcess{});
  entry.launching = true;
  entry.launch_time = table_->clock->Now();
  const bool cpu = job.spec().device_kind() == v1::CPU;
  if (first_attempt) {
    // From here on the job owns its devices and is no longer a queue entry,
    // even if a rank fails to start.
    std::vector<std::string> gpu_list;
    for (int d : devices) gpu_list.push_back(std::to_string(d));
    if (job.start_time_unix_ms() ==
        0) {  // not when it resumes after a preemption
      job.set_start_time_unix_ms(absl::ToUnixMillis(table_->clock->Now()));
    }
    table_->SetState(entry, v1::STARTING,
                     absl::StrCat("starting ", world, " ranks on ",
                                  cpu ? "CPU slots " : "GPUs ",
                                  absl::StrJoin(gpu_list, ",")));
  }

  LaunchRequest request;
  request.spec = job.spec();
  request.attempt = job.restarts() + job.preemptions() + job.remeshes() + 1;
  request.first_attempt = first_attempt;
  request.remesh = entry.remesh_started != absl::InfinitePast();
  request.started = table_->clock->Now();
  RankLaunch& launch = request.launch;
  launch.worker_binary = table_->options.worker_binary;
  launch.job_id = id;
  launch.job_dir = table_->JobDir(id);
  launch.spec_path = launch.job_dir + "/spec.json";
  launch.world_size = world;
  launch.cpu = cpu;
  launch.devices = devices;
  // The host's cores shared by every rank on it: this job's and its
  // neighbours' (a job that starts beside others, or is shrunk or grown
  // among them, gets its share of the cores, not all of them). A study's
  // jobs may ask for the threads of a larger job, so that every strategy
  // runs at the same threads per rank.
  const int ranks_on_host = static_cast<int>(
      std::count_if(table_->device_holder.begin(), table_->device_holder.end(),
                    [](const std::string& holder) { return !holder.empty(); }));
  launch.threads_per_rank =
      std::max(1, table_->options.cpu_cores /
                      std::max({world, ranks_on_host,
                                job.spec().trainer().threads_as_ranks()}));
  launch.resume =
      job.restarts() > 0 || job.preemptions() > 0 || job.remeshes() > 0;
  launch.coordinator_address = worker_address_;
  launch.secret = entry.stored.secret;
  launch.heartbeat_seconds =
      absl::ToDoubleSeconds(table_->options.heartbeat_interval);
  if (job.spec().data() == kBuiltinDataset) {
    launch.prepare_data = kBuiltinDataset;
  }
  for (int r = 0; r < world; ++r)
    launch.log_paths.push_back(table_->LogPath(id, r));
  launch_requests_.push_back(std::move(request));
}

namespace {

// The directories a job's ranks may read under --path-root: the roots, the
// job's own directory (its checkpoints, read back on a resume and by the
// rank that wrote them) and the built-in dataset the ranks prepare. The
// rest of the state directory (other jobs, the database) stays out. Empty
// without --path-root: reading is not restricted.
std::string RankReadRoots(const PathRoots& roots, const std::string& job_dir,
                          const std::string& builtin_data_dir) {
  if (roots.roots().empty()) return "";
  std::vector<std::string> result = roots.roots();
  for (const std::string& own : {job_dir, builtin_data_dir}) {
    if (own.empty()) continue;
    std::error_code ec;
    const std::filesystem::path canonical =
        std::filesystem::weakly_canonical(std::filesystem::absolute(own), ec);
    if (!ec) result.push_back(canonical.string());
  }
  return absl::StrJoin(result, ":");
}

// `resolved`'s mesh fields, batch and accumulation as `config` has them.
void SetMeshFields(const TrainConfig& config, v1::JobSpec* resolved) {
  v1::StrategyOptions* mesh = resolved->mutable_strategy();
  mesh->set_name(config.strategy);
  mesh->set_pipeline_stages(config.pipeline_stages);
  mesh->set_micro_batches(config.micro_batches);
  mesh->set_tensor_parallel(config.tensor_parallel);
  mesh->set_activation_checkpointing(config.activation_checkpointing);
  mesh->set_shard_group_size(config.shard_group_size);
  resolved->mutable_trainer()->set_batch_size(config.batch_size);
  resolved->mutable_trainer()->set_grad_accum(config.grad_accum);
}

// Strategy auto: the mesh predicted fastest for the ranks this attempt has,
// from this host's measured rates (measured now, once, by the
// shardtrain-train beside the worker when there are none). `resolved` gets
// the mesh; the ranks' logs get `log`, which says why.
absl::Status ResolveAutoMesh(const v1::JobSpec& spec, const RankLaunch& launch,
                             v1::JobSpec* resolved, std::string* mesh_name,
                             std::string* log_text) {
  absl::StatusOr<TrainConfig> config =
      TrainConfigFromJobSpec(spec, launch.job_dir);
  if (!config.ok()) return config.status();
  const std::string calibrator =
      (std::filesystem::path(launch.worker_binary).parent_path() /
       "shardtrain-train")
          .string();
  std::ostringstream log;
  AutoChoice choice;
  if (absl::Status s =
          ResolveAutoStrategy(&*config, launch.world_size, launch.world_size,
                              calibrator, log, &choice);
      !s.ok()) {
    return s;
  }
  SetMeshFields(*config, resolved);
  *mesh_name = choice.ranked.front().name;
  *log_text = log.str();
  return absl::OkStatus();
}

// An elastic job continuing at another world size (smaller after a loss or
// for another job, or grown back part of the way): the mesh the planner
// chooses there for its global batch (ChooseElasticMesh), by this host's
// rates (measured now, once, when there are none and there is a choice to
// make; without them its own stages and tensor ranks where they divide).
// Each rank's checkpoint resume finds the global batch unchanged.
absl::Status ResolveElasticMesh(const v1::JobSpec& spec,
                                const RankLaunch& launch, int64_t device_memory,
                                v1::JobSpec* resolved,
                                ElasticMeshChoice* choice,
                                std::string* log_text) {
  absl::StatusOr<TrainConfig> config =
      TrainConfigFromJobSpec(spec, launch.job_dir);
  if (!config.ok()) return config.status();
  std::ostringstream log;
  absl::StatusOr<ElasticMeshChoice> chosen = ChooseElasticMesh(
      *config, spec.world_size(), launch.world_size, nullptr, device_memory);
  if (chosen.ok()) {
    // Measured now only when there is a choice to make; else the cached
    // rates predict what the mesh does, if there are some.
    const std::string calibrator =
        chosen->candidates > 1
            ? (std::filesystem::path(launch.worker_binary).parent_path() /
               "shardtrain-train")
                  .string()
            : "";
    absl::StatusOr<HostRates> rates =
        LoadOrMeasureHostRates(*config, calibrator, log);
    if (rates.ok()) {
      chosen = ChooseElasticMesh(*config, spec.world_size(), launch.world_size,
                                 &*rates, device_memory);
    } else if (!calibrator.empty()) {
      log << "elastic: no rates for the step-time model ("
          << rates.status().message() << ")\n";
    }
  }
  if (!chosen.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("elastic: at ", launch.world_size, " ranks, ",
                     chosen.status().message()));
  }
  SetMeshFields(chosen->config, resolved);
  // The world this attempt's mesh is checked against (the ranks the
  // launcher starts).
  resolved->set_world_size(launch.world_size);
  log << "elastic: " << launch.world_size << " of " << spec.world_size()
      << " ranks train " << chosen->name << " (batch "
      << chosen->config.batch_size << " x accum " << chosen->config.grad_accum
      << "), " << chosen->why << "\n";
  *log_text = log.str();
  *choice = *std::move(chosen);
  return absl::OkStatus();
}

// The step-time model's seconds for all of the attempt's steps, over this
// host's cached rates (never measured here: a launch does not wait for a
// calibration to predict); 0 when there are none or the model cannot price
// the mesh. The steps: max_steps, else its epochs of `train_tokens` at the
// global batch (the trainer's count).
double PredictedRunSeconds(const v1::JobSpec& resolved,
                           const RankLaunch& launch,
                           std::optional<int64_t> train_tokens) {
  absl::StatusOr<TrainConfig> config =
      TrainConfigFromJobSpec(resolved, launch.job_dir);
  if (!config.ok() || config->strategy == kAutoStrategy) return 0;
  std::ostringstream ignored;
  absl::StatusOr<HostRates> rates =
      LoadOrMeasureHostRates(*config, /*calibrator=*/"", ignored);
  if (!rates.ok()) return 0;
  absl::StatusOr<StepTimePlan> step =
      PlanStepTime(*config, launch.world_size, launch.world_size, *rates);
  if (!step.ok() || step->step_seconds <= 0) return 0;
  int64_t steps = config->max_steps;
  if (steps <= 0 && train_tokens.has_value()) {
    const int64_t sequences = config->batch_size *
                              std::max<int64_t>(1, config->grad_accum) *
                              config->DataParallelSize(launch.world_size);
    // BatchSampler's count: windows of seq_len + 1 tokens at multiples of
    // seq_len, whole steps of them per epoch.
    const int64_t windows =
        (*train_tokens - 1) / std::max<int64_t>(1, config->seq_len);
    steps = config->epochs * (windows / std::max<int64_t>(1, sequences));
  }
  return steps > 0 ? step->step_seconds * static_cast<double>(steps) : 0;
}

// The attempt's spec.json (what its ranks train) and a header line in each
// rank's log, followed by `log_text`.
absl::Status WriteAttemptFiles(const RankLaunch& launch, int attempt,
                               absl::Time started, const v1::JobSpec& resolved,
                               const std::string& log_text) {
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  print.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(resolved, &json, print);
  if (absl::Status s = WriteFileAtomically(launch.spec_path, json); !s.ok()) {
    return s;
  }
  for (int r = 0; r < launch.world_size; ++r) {
    std::ofstream log(launch.log_paths[r], std::ios::app);
    log << "=== shardtraind: " << launch.job_id << " rank " << r << " of "
        << launch.world_size << ", attempt " << attempt << ", "
        << absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", started,
                            absl::UTCTimeZone())
        << " ===\n"
        << log_text;
  }
  return absl::OkStatus();
}

}  // namespace

AttemptSupervisor::PreparedLaunch AttemptSupervisor::PrepareLaunch(
    const LaunchRequest& request) {
  PreparedLaunch prepared;
  RankLaunch launch = request.launch;
  std::error_code ec;
  std::filesystem::create_directories(launch.job_dir, ec);
  if (ec) {
    prepared.error =
        absl::StrCat("cannot create ", launch.job_dir, ": ", ec.message());
    return prepared;
  }
  // Checked again: a symlink may have been turned since the submit.
  if (absl::Status s = CheckSpecPaths(table_->options.path_roots, request.spec);
      !s.ok()) {
    prepared.error = std::string(s.message());
    return prepared;
  }
  absl::StatusOr<std::string> data =
      table_->options.resolve_data(request.spec.data());
  if (!data.ok()) {
    prepared.error = std::string(data.status().message());
    return prepared;
  }
  v1::JobSpec resolved = request.spec;
  resolved.set_data(*data);
  launch.read_roots = RankReadRoots(
      table_->options.path_roots, launch.job_dir,
      request.spec.data() == kBuiltinDataset ? *data : std::string());
  std::string auto_log;
  absl::Status status = absl::OkStatus();
  const bool is_auto = request.spec.strategy().name() == kAutoStrategy;
  // An elastic job at another world size, or changing its mesh: the
  // planner's choice for its global batch (auto's too, at any size).
  const bool elastic_mesh =
      request.spec.elastic().min_world_size() > 0 &&
      (launch.world_size != request.spec.world_size() || request.remesh);
  if (is_auto && !elastic_mesh) {
    status = ResolveAutoMesh(request.spec, launch, &resolved,
                             &prepared.auto_mesh, &auto_log);
  }
  if (status.ok() && elastic_mesh) {
    ElasticMeshChoice choice;
    status = ResolveElasticMesh(request.spec, launch,
                                DeviceMemoryFor(table_->options, request.spec),
                                &resolved, &choice, &auto_log);
    if (status.ok()) {
      prepared.elastic_mesh =
          is_auto ? absl::StrCat(kAutoStrategy, ": ", choice.name)
                  : choice.name;
      if (is_auto) prepared.auto_mesh = choice.name;
      prepared.elastic_predicted = choice.predicted_tokens_per_second;
      prepared.elastic_why = choice.why;
    }
  }
  if (status.ok()) {
    // The header only: the ranks read (and validate) the tokens themselves.
    if (absl::StatusOr<int64_t> tokens =
            ReadTokenFileHeader(*data + "/train.bin");
        tokens.ok()) {
      prepared.train_tokens = *tokens;
    }
    prepared.predicted_seconds =
        PredictedRunSeconds(resolved, launch, prepared.train_tokens);
    status = WriteAttemptFiles(launch, request.attempt, request.started,
                               resolved, auto_log);
  }
  if (!status.ok()) {
    prepared.error = std::string(status.message());
    return prepared;
  }
  {
    // Cancelled (or the coordinator began to shut down) meanwhile: nothing
    // is started. A stop from here on finds the ranks in CompleteLaunch.
    absl::MutexLock lock(&table_->mutex);
    const JobEntry* entry = table_->Find(launch.job_id);
    if (table_->shutting_down || entry == nullptr ||
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

int AttemptSupervisor::RecordStartedRanks(JobEntry& entry,
                                          const LaunchRequest& request,
                                          const PreparedLaunch& prepared) {
  v1::Job& job = entry.stored.job;
  const std::string& id = job.id();
  const int world = request.launch.world_size;
  entry.launching = false;
  entry.attempt = prepared.attempt;
  if (prepared.train_tokens.has_value()) {
    job.set_train_tokens(*prepared.train_tokens);
  }
  entry.predicted_seconds = prepared.predicted_seconds;
  if (!prepared.auto_mesh.empty()) {
    (*job.mutable_spec()->mutable_labels())["auto_mesh"] = prepared.auto_mesh;
  }
  job.set_mesh(prepared.elastic_mesh.empty() ? JobMeshName(job.spec(), world)
                                             : prepared.elastic_mesh);
  // Which ranks run: all of a started attempt; of one that failed to
  // start, those the launcher gave a pid (AttemptLauncher::Start).
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
      JobTable::Log(absl::StrCat(id, " rank ", r, " registered as pid ",
                                 rank.pid, " but was started as pid ", pid));
      rank.registered = false;
    }
    if (pid != 0) rank.pid = pid;
  }
  entry.stored.worker_pids.clear();
  for (int pid : prepared.attempt.pids) {
    if (pid != 0) entry.stored.worker_pids.push_back(pid);
  }
  entry.stored.worker_pgid = prepared.attempt.pgid;
  entry.next_poll = table_->clock->Now();
  return running;
}

void AttemptSupervisor::CompleteLaunch(JobEntry& entry,
                                       const LaunchRequest& request,
                                       const PreparedLaunch& prepared) {
  v1::Job& job = entry.stored.job;
  const std::string& id = job.id();
  const int world = request.launch.world_size;
  const int running = RecordStartedRanks(entry, request, prepared);
  if (running > 0 &&
      (entry.stop != StopIntent::kNone || table_->shutting_down)) {
    // Started, then cancelled (or the coordinator began to shut down):
    // end the attempt; its ranks' end, seen by a poll, finishes it.
    if (entry.stop == StopIntent::kNone) entry.stop = StopIntent::kShutdown;
    entry.stop_deadline = table_->clock->Now();
    entry.killed = true;
    SignalRanks(entry, SIGKILL);
    return;
  }
  if (running == 0 && (entry.stop != StopIntent::kNone ||
                       table_->shutting_down || prepared.skipped)) {
    // Cancelled, or the coordinator began to shut down, while the launch was
    // being prepared: nothing was started, so nothing needs stopping.
    const StopIntent stop = entry.stop;
    entry.stop = StopIntent::kNone;
    entry.ranks.clear();
    if (stop == StopIntent::kCancel) {
      table_->ReleaseDevices(entry);
      table_->SetState(entry, v1::CANCELLED,
                       "cancelled before its ranks started");
    } else {
      table_->Persist(entry, std::nullopt);  // the next coordinator resumes it
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
      table_->ReleaseDevices(entry);
      *job.mutable_failure() = failure;
      table_->SetState(entry, v1::FAILED, prepared.error);
      return;
    }
    entry.no_restart = true;
    FailAttempt(entry, std::move(failure));
    return;
  }

  const Attempt& attempt = entry.attempt;
  entry.remesh_predicted = prepared.elastic_predicted;
  JobTable::Log(absl::StrCat(
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
    event = table_->Event(
        job.state(),
        absl::StrCat(request.first_attempt ? "submitted " : "resubmitted ",
                     world, " ranks as ", attempt.summary, " (attempt ",
                     request.attempt, ")"));
  } else if (!request.first_attempt) {
    event = table_->Event(job.state(),
                          absl::StrCat("relaunched ", world, " ranks (attempt ",
                                       request.attempt, ")"));
  }
  if (!prepared.elastic_mesh.empty()) {
    // At another world size than its own: the mesh the planner chose.
    const std::string said =
        absl::StrCat("trains ", prepared.elastic_mesh, " at ", world, " of ",
                     job.spec().world_size(), " ranks",
                     prepared.elastic_predicted > 0
                         ? absl::StrFormat(", %.0f tokens/s predicted",
                                           prepared.elastic_predicted)
                         : "",
                     ": ", prepared.elastic_why);
    if (!event.has_value()) event = table_->Event(job.state(), "");
    event->set_message(event->message().empty()
                           ? said
                           : absl::StrCat(event->message(), "; ", said));
  }
  table_->Persist(entry, event);
}

}  // namespace shardtrain
