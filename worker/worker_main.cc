// shardtrain-worker: one rank of a shardtraind job. The coordinator starts it
// with torchrun's variables plus SHARDTRAIN_JOB_ID, SHARDTRAIN_COORDINATOR and
// SHARDTRAIN_JOB_SECRET, and the job's spec (JSON) in the job directory. It
// trains exactly as shardtrain-train does (RunTrainingRank), registers once
// the process group has formed, and reports every step.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/dist_env.h"
#include "common/exit_codes.h"
#include "common/startup_signals.h"
#include "core/data/builtin_dataset.h"
#include "google/protobuf/util/json_util.h"
#include "proto/job_config.h"
#include "worker/engine/support/cpu_threads.h"
#include "worker/progress_reporter.h"
#include "worker/training_run.h"

namespace shardtrain {
namespace {

constexpr absl::Duration kRegisterTimeout = absl::Seconds(60);
constexpr absl::Duration kFlushTimeout = absl::Seconds(60);

absl::StatusOr<v1::JobSpec> ReadSpec(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat("--spec: cannot read ", path));
  const std::string json((std::istreambuf_iterator<char>(in)),
                         std::istreambuf_iterator<char>());
  v1::JobSpec spec;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &spec);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--spec: ", path, ": ", status.ToString()));
  }
  return spec;
}

// SIGUSR1: save a checkpoint at the next step boundary and stop (a
// preemption by shardtraind, or a cluster scheduler's signal before it
// preempts the job).
volatile sig_atomic_t stop_requested = 0;

void OnStopSignal(int) { stop_requested = 1; }

// SIGUSR1 always; SIGTERM too when SHARDTRAIN_CHECKPOINT_ON_SIGTERM=1 (the
// Slurm backend: Slurm preempts with SIGTERM), once: a second SIGTERM ends
// the rank at once.
void CatchStopSignals() {
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &action, nullptr);
  const char* on_term = std::getenv("SHARDTRAIN_CHECKPOINT_ON_SIGTERM");
  if (on_term != nullptr && std::string(on_term) == "1") {
    action.sa_flags = SA_RESTART | SA_RESETHAND;
    sigaction(SIGTERM, &action, nullptr);
  }
}

int Fail(const absl::Status& status, int code) {
  std::cerr << "shardtrain-worker: " << status.message() << std::endl;
  return code;
}

int Main(int argc, char** argv) {
  CatchStopSignals();
  // Held since exec (SHARDTRAIN_HOLD_SIGNALS_FROM_START): a SIGUSR1 that
  // came before the handler is taken now, a SIGTERM ends the rank now.
  ReleaseStartupSignals();
  std::string spec_path, out_dir, job_id;
  int64_t threads = 0;
  bool resume = false;
  CLI::App app{"shardtrain-worker: one rank of a shardtraind job"};
  app.add_option("--spec", spec_path, "the job's spec (JSON)")->required();
  app.add_option("--out", out_dir, "the job's directory")->required();
  app.add_option("--job-id", job_id, "the job's id (for ps and logs)");
  app.add_option("--threads", threads, "CPU threads for this rank");
  app.add_flag("--resume", resume, "continue from the latest checkpoint");
  std::string prepare_data;
  app.add_option("--prepare-data", prepare_data,
                 "a built-in dataset (brown) to prepare into the spec's data "
                 "directory first, unless it is there already");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  absl::StatusOr<v1::JobSpec> spec = ReadSpec(spec_path);
  if (!spec.ok()) return Fail(spec.status(), 2);
  absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(*spec, out_dir);
  if (!config.ok()) return Fail(config.status(), 2);
  config->threads = threads;
  config->resume = resume;
  absl::StatusOr<DistEnv> env = DistEnvFromEnvironment();
  if (!env.ok()) return Fail(env.status(), 2);
  if (!prepare_data.empty()) {
    // Every rank asks; the first prepares while the others wait on its lock.
    if (absl::Status s = PrepareBuiltinDataset(prepare_data, config->data);
        !s.ok()) {
      return Fail(s, ExitCodeFor(s));
    }
  }
  absl::StatusOr<ReporterOptions> options =
      ProgressReporter::OptionsFromEnvironment();
  if (!options.ok()) return Fail(options.status(), 2);
  // The rank as the launcher gave it: RANK (shardtraind's local launcher)
  // or SLURM_PROCID (srun).
  options->rank = static_cast<int>(env->rank);

  ProgressReporter reporter(*options);
  reporter.set_on_cancel([rank = env->rank] {
    std::cerr << "shardtrain-worker: rank " << rank
              << ": the coordinator asked this job to stop" << std::endl;
    std::_Exit(143);
  });
  TrainingHooks hooks;
  hooks.on_ready = [&reporter] { return reporter.Register(kRegisterTimeout); };
  hooks.on_step = [&reporter](const StepMetrics& m) {
    reporter.Report(StepMetricsToProto(m));
  };
  hooks.stop_requested = [] { return stop_requested != 0; };
  absl::Status run = RunTrainingRank(*config, *env, &std::cout, hooks);
  std::cout.flush();
  // A diverged run's steps (the last one says why) and a stopped run's are
  // stored before the rank exits; other failures exit at once.
  if (!run.ok() && !IsDiverged(run) && !IsPreempted(run)) {
    return Fail(run, ExitCodeFor(run));
  }
  // The job succeeds only when every step it reported is stored.
  if (absl::Status s = reporter.Flush(kFlushTimeout); !s.ok())
    return Fail(s, 1);
  if (!run.ok()) return Fail(run, ExitCodeFor(run));
  return 0;
}

}  // namespace
}  // namespace shardtrain

SHARDTRAIN_HOLD_SIGNALS_FROM_START();

int main(int argc, char** argv) {
  shardtrain::ReexecForFasterBlasKernels(argv);
  return shardtrain::Main(argc, argv);
}
