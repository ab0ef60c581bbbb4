// fake_worker: stands in for shardtrain-worker in coordinator tests and
// benchmarks, so scheduling, failure handling and ingestion are exercised
// with real processes and the real WorkerService but without training.
// Takes the worker's command line; what it does is chosen by the job's name:
//   (anything else)  register, report one step, exit 0
//   hold             register, then run (heartbeating) until killed
//   hold-deaf        as hold, ignoring SIGUSR1 (a rank that never answers a
//                    checkpoint request: it is killed after the grace)
//   hold-checkpoint  as hold; a checkpoint request (SIGUSR1) is answered as
//                    the trainer does: a file under <out>/checkpoints, then
//                    exit 85; a file it cannot write fails the rank (exit 1)
//   hang             register, then stop itself (SIGSTOP): heartbeats cease
//   no-register      never register; sleep until killed
//   oom              print an out-of-memory error, exit 1
//   exit:N           register, exit N
//   sleep:MS         register, sleep MS milliseconds, exit 0 (no steps)
//   flood:N          register, report N steps as fast as possible (batched
//                    by ProgressReporter, as real workers are), exit 0
//   slow:N           register, report N steps 20 ms apart, exit 0
//   stages:N         as flood:N, each rank reporting as pipeline stage `rank`
//                    (5 ms of bubble and 4096 point-to-point bytes a step)
//   trickle:N        register, report N steps one ReportProgress call each,
//                    waiting for every answer (the unbatched worst case)
// With SHARDTRAIN_FAKE_ORDER_FILE set, rank 0 appends the job id to that file
// when it starts (the launch order).
#include <grpcpp/create_channel.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "common/exit_codes.h"
#include "common/startup_signals.h"
#include "google/protobuf/util/json_util.h"
#include "shardtrain/v1/job.pb.h"
#include "worker/progress_reporter.h"

namespace {

volatile sig_atomic_t checkpoint_asked = 0;

// hold-checkpoint: waits for SIGUSR1 (blocked since before registering,
// so that none is lost between the check and the wait), then saves as the
// trainer would.
int HoldUntilCheckpointRequest(const std::string& out_dir, int rank,
                               const sigset_t& unblocked) {
  while (!checkpoint_asked) sigsuspend(&unblocked);
  const std::string dir =
      out_dir + "/checkpoints/fake-rank-" + std::to_string(rank);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  std::ofstream file(dir + "/state");
  file << "state\n";
  file.close();
  if (ec || !file) {
    std::cerr << "fake_worker: cannot write the checkpoint " << dir << ": "
              << (ec ? ec.message() : std::string("write failed")) << std::endl;
    return 1;
  }
  std::cout << "fake_worker: checkpoint saved in " << dir << std::endl;
  return shardtrain::kExitPreempted;
}

int Main(int argc, char** argv) {
  // Launched with the startup signals held, as the real worker is; it
  // takes them at once (hold-checkpoint blocks SIGUSR1 again below).
  shardtrain::ReleaseStartupSignals();
  std::string spec_path, out_dir, job_id;
  int64_t threads = 0;
  bool resume = false;
  CLI::App app{"fake_worker"};
  app.add_option("--spec", spec_path)->required();
  app.add_option("--out", out_dir);
  app.add_option("--job-id", job_id);
  app.add_option("--threads", threads);
  app.add_flag("--resume", resume);
  CLI11_PARSE(app, argc, argv);

  std::ifstream in(spec_path);
  const std::string json((std::istreambuf_iterator<char>(in)),
                         std::istreambuf_iterator<char>());
  shardtrain::v1::JobSpec spec;
  if (!google::protobuf::util::JsonStringToMessage(json, &spec).ok()) {
    std::cerr << "fake_worker: cannot parse " << spec_path << "\n";
    return 2;
  }
  auto options = shardtrain::ProgressReporter::OptionsFromEnvironment();
  if (!options.ok()) {
    std::cerr << "fake_worker: " << options.status() << "\n";
    return 2;
  }
  const std::string mode = spec.name();
  if (const char* order = std::getenv("SHARDTRAIN_FAKE_ORDER_FILE");
      order != nullptr && options->rank == 0) {
    std::ofstream(order, std::ios::app) << job_id << "\n";
  }
  std::cout << "fake_worker " << job_id << " rank " << options->rank
            << " mode '" << mode << "'" << std::endl;
  if (mode == "no-register") {
    while (true) pause();
  }
  // Before registering: a request may come as soon as the coordinator
  // knows the rank. Blocked until sigsuspend waits for it.
  sigset_t unblocked;
  sigemptyset(&unblocked);
  if (mode == "hold-checkpoint") {
    signal(SIGUSR1, [](int) { checkpoint_asked = 1; });
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    sigprocmask(SIG_BLOCK, &usr1, &unblocked);
    sigdelset(&unblocked, SIGUSR1);
  }
  if (mode == "enospc") {  // a write that found the disk full
    std::cerr << "shardtrain-worker: cannot write " << out_dir
              << "/checkpoints/step-1/rank-0.bin: No space left on device"
              << std::endl;
    return 1;
  }
  if (mode == "oom") {
    std::cerr << "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
              << std::endl;
    return 1;
  }
  shardtrain::ProgressReporter reporter(*options);
  if (auto s = reporter.Register(absl::Seconds(30)); !s.ok()) {
    std::cerr << "fake_worker: " << s << "\n";
    return 1;
  }
  if (mode == "hold") {
    while (true) pause();
  }
  if (mode == "hold-checkpoint") {
    return HoldUntilCheckpointRequest(out_dir, options->rank, unblocked);
  }
  if (mode == "hold-deaf") {
    signal(SIGUSR1, SIG_IGN);
    while (true) pause();
  }
  if (mode == "hang") {
    absl::SleepFor(absl::Milliseconds(300));
    raise(SIGSTOP);
    while (true) pause();
  }
  int n = 1;
  if (absl::StartsWith(mode, "exit:")) {
    int code = 0;
    (void)absl::SimpleAtoi(mode.substr(5), &code);
    return code;
  }
  if (absl::StartsWith(mode, "sleep:")) {
    int ms = 0;
    (void)absl::SimpleAtoi(mode.substr(6), &ms);
    absl::SleepFor(absl::Milliseconds(ms));
    return 0;
  }
  if (absl::StartsWith(mode, "trickle:")) {
    (void)absl::SimpleAtoi(mode.substr(8), &n);
    auto stub = shardtrain::v1::WorkerService::NewStub(grpc::CreateChannel(
        options->address, grpc::InsecureChannelCredentials()));
    for (int step = 1; step <= n; ++step) {
      shardtrain::v1::ReportProgressRequest request;
      request.mutable_worker()->set_job_id(options->job_id);
      request.mutable_worker()->set_secret(options->secret);
      request.mutable_worker()->set_rank(options->rank);
      request.mutable_worker()->set_pid(options->pid);
      shardtrain::v1::StepMetrics* m = request.add_steps();
      m->set_step(step);
      m->set_total_steps(n);
      m->set_rank(options->rank);
      m->set_loss(10.0 / step);
      grpc::ClientContext context;
      shardtrain::v1::ReportProgressResponse response;
      const grpc::Status status =
          stub->ReportProgress(&context, request, &response);
      if (!status.ok()) {
        std::cerr << "fake_worker: " << status.error_message() << "\n";
        return 1;
      }
    }
    return 0;
  }
  if (absl::StartsWith(mode, "flood:"))
    (void)absl::SimpleAtoi(mode.substr(6), &n);
  const bool slow = absl::StartsWith(mode, "slow:");
  if (slow) (void)absl::SimpleAtoi(mode.substr(5), &n);
  const bool stages = absl::StartsWith(mode, "stages:");
  if (stages) (void)absl::SimpleAtoi(mode.substr(7), &n);
  for (int step = 1; step <= n; ++step) {
    shardtrain::v1::StepMetrics m;
    m.set_step(step);
    m.set_total_steps(n);
    m.set_rank(options->rank);
    m.set_loss(10.0 / step);
    m.set_tokens(1024);
    m.set_step_seconds(0.02);
    m.set_tokens_per_second(51200);
    if (stages) {
      m.set_pipeline_stage(options->rank);
      m.set_pipeline_bubble_seconds(0.005);
      m.set_p2p_bytes(4096);
    }
    reporter.Report(m);
    if (slow) absl::SleepFor(absl::Milliseconds(20));
  }
  if (auto s = reporter.Flush(absl::Seconds(120)); !s.ok()) {
    std::cerr << "fake_worker: " << s << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
