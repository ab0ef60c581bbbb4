#include "client/study_commands.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/compare_report.h"
#include "client/daemon_client.h"
#include "client/exit_code.h"
#include "client/job_commands.h"
#include "proto/job_config.h"
#include "worker/engine/train/memory_plan.h"
#include "worker/engine/train/step_metrics.h"
#include "worker/engine/train/strategy_kinds.h"

namespace shardtrain::cli {
namespace {

struct CompareFlags {
  JobFlags job;
  // Empty: every strategy that means something at the world size (HSDP
  // needs four ranks for two groups of two).
  std::vector<std::string> strategies;
  std::string out;
  std::string scaling = "strong";
  std::string memory_budget;  // --memory-budget: per-rank cap, e.g. 512MiB
};

std::vector<std::string> DefaultStudy(int world) {
  std::vector<std::string> names;
  for (const std::string& name : StrategyNames()) {
    if (name == "hsdp" && world < 4) continue;
    names.push_back(name);
  }
  return names;
}

int RunCompare(CompareFlags flags, const ConnectionOptions& connection) {
  absl::StatusOr<v1::JobSpec> base = flags.job.ToSpec();
  if (!base.ok()) {
    ReportFailure(base.status());
    return kExitUsage;
  }
  const int world = flags.job.world_size;
  if (flags.strategies.empty()) flags.strategies = DefaultStudy(world);
  int64_t budget = 0;
  if (!flags.memory_budget.empty()) {
    absl::StatusOr<int64_t> bytes = ParseBytes(flags.memory_budget);
    if (!bytes.ok()) {
      ReportFailure(
          absl::StrCat("--memory-budget: ", bytes.status().message()));
      return kExitUsage;
    }
    budget = *bytes;
    flags.scaling = "budget";
  }
  for (const std::string& s : flags.strategies) {
    const StrategyKind* kind = FindStrategyKind(s);
    if (kind == nullptr) {
      ReportFailure(absl::StrCat("--strategies: unknown strategy '", s,
                                 "'; expected one of ", StrategyNameList()));
      return kExitUsage;
    }
    if (kind->distributed && world < 2) {
      ReportFailure(absl::StrCat("--world-size: got ", world, "; ", s,
                                 " needs at least 2 ranks to compare"));
      return kExitUsage;
    }
  }
  absl::StatusOr<std::unique_ptr<DaemonClient>> client =
      DaemonClient::Connect(connection);
  if (!client.ok()) return ReportFailure(client.status());
  const bool terminal = isatty(STDERR_FILENO) != 0;
  const std::string study =
      absl::StrCat("compare-", absl::ToUnixSeconds(absl::Now()));

  std::vector<StrategyRun> runs;
  for (size_t i = 0; i < flags.strategies.size(); ++i) {
    const std::string& strategy = flags.strategies[i];
    v1::JobSpec spec = *base;
    spec.mutable_strategy()->set_name(strategy);
    const bool distributed = FindStrategyKind(strategy)->distributed;
    const int ranks = distributed ? world : 1;
    spec.set_world_size(ranks);
    // Strong scaling: every strategy trains on the same global batch, so the
    // losses match step for step; single-device takes the whole of it.
    // Weak scaling: the same batch per device.
    if (!distributed && flags.scaling == "strong") {
      spec.mutable_trainer()->set_batch_size(spec.trainer().batch_size() *
                                             world);
    }
    if (budget > 0) {
      // Each strategy at the largest batch its plan fits in the budget, run
      // under that cap: what the memory buys.
      absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(spec, "-");
      if (!config.ok()) return ReportFailure(config.status());
      absl::StatusOr<int64_t> batch =
          LargestFittingBatch(*config, ranks, PlannableBytes(budget));
      if (!batch.ok()) return ReportFailure(batch.status());
      if (*batch == 0) {
        std::cerr << "\n== " << i + 1 << "/" << flags.strategies.size() << ": "
                  << strategy << " does not fit one sequence per rank"
                  << " in " << FormatBytes(budget) << "; skipped ==\n";
        continue;
      }
      spec.mutable_trainer()->set_batch_size(*batch);
      spec.mutable_trainer()->set_memory_cap_bytes(budget);
    }
    spec.set_name(absl::StrCat(flags.job.name.empty() ? study : flags.job.name,
                               "-", strategy));
    (*spec.mutable_labels())["study"] =
        flags.job.name.empty() ? study : flags.job.name;
    (*spec.mutable_labels())["strategy"] = strategy;

    std::cerr << "\n== " << i + 1 << "/" << flags.strategies.size() << ": "
              << strategy << " on " << ranks
              << (ranks == 1 ? " device" : " devices") << ", batch "
              << spec.trainer().batch_size() << " per rank ==\n";
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::Job job;
    if (int code = (*client)->Call([&](grpc::ClientContext* c) {
          return (*client)->jobs().SubmitJob(c, request, &job);
        });
        code != kExitOk) {
      return code;
    }
    if (int code = FollowJob(**client, job.id(), terminal, std::cerr);
        code != kExitOk) {
      std::cerr << "shardtrain: error: " << strategy << " run " << job.id()
                << " did not succeed; the study stops here\n";
      return code;
    }
    v1::GetJobRequest get;
    get.set_job_id(job.id());
    v1::GetJobMetricsRequest metrics;
    metrics.set_job_id(job.id());
    v1::GetJobMetricsResponse steps;
    if (int code = (*client)->Call([&](grpc::ClientContext* c) {
          return (*client)->jobs().GetJob(c, get, &job);
        });
        code != kExitOk) {
      return code;
    }
    if (int code = (*client)->Call([&](grpc::ClientContext* c) {
          return (*client)->jobs().GetJobMetrics(c, metrics, &steps);
        });
        code != kExitOk) {
      return code;
    }
    StrategyRun run;
    run.strategy = strategy;
    run.job_id = job.id();
    run.world_size = ranks;
    run.batch_size = spec.trainer().batch_size();
    run.grad_accum = spec.trainer().grad_accum();
    run.seq_len = spec.trainer().seq_len();
    run.steps.assign(steps.steps().begin(), steps.steps().end());
    run.wall_seconds =
        (job.end_time_unix_ms() - job.start_time_unix_ms()) / 1000.0;
    run.train_tokens = job.train_tokens();  // read by the daemon at launch
    // The stored spec: the daemon filled in its device kind.
    if (absl::StatusOr<TrainConfig> config =
            TrainConfigFromJobSpec(job.has_spec() ? job.spec() : spec, "-");
        config.ok()) {
      if (absl::StatusOr<MemoryPlan> plan = PlanMemory(*config, ranks);
          plan.ok()) {
        run.predicted_peak_bytes_per_rank = plan->total();
      }
    }
    runs.push_back(std::move(run));
  }

  CompareOptions options;
  options.scaling = flags.scaling;
  options.title = absl::StrCat(
      base->model(), " on ",
      base->data() == "brown" ? "the Brown Corpus" : base->data(), ", ",
      absl::StrJoin(flags.strategies, " vs "), ", world size ", world, ", ",
      budget > 0 ? absl::StrCat("each at its largest batch within ",
                                FormatBytes(budget), " per rank")
                 : absl::StrCat(flags.scaling, " scaling"));
  if (runs.empty()) {
    return ReportFailure(absl::StrCat(
        "no strategy fits one sequence per rank in ", FormatBytes(budget)));
  }
  if (absl::Status s = WriteCompareReport(runs, options, flags.out); !s.ok()) {
    return ReportFailure(s);
  }
  std::vector<StrategySummary> rows;
  for (const StrategyRun& run : runs) rows.push_back(Summarise(run));
  std::cout << "\n" << FormatSummaryTable(rows) << "\n";
  for (const std::string& finding : Findings(rows))
    std::cout << finding << "\n";
  std::cout << "\nreport: " << std::filesystem::absolute(flags.out).string()
            << "/report.html (and report.md, one CSV per strategy)\n";
  return kExitOk;
}

std::string SelfDir() {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/self/exe", ec)
      .parent_path()
      .string();
}

struct DaemonFlags {
  std::string state_dir;
  std::string listen = "127.0.0.1:50551";
  std::string metrics_listen = "127.0.0.1:9464";
  int cpu_slots = 0;
  std::string device_kind = "auto";
  bool foreground = false;
};

int RunDaemon(const DaemonFlags& flags) {
  const std::string state_dir =
      flags.state_dir.empty() ? DefaultStateDir() : flags.state_dir;
  ConnectionOptions connection;
  connection.address = flags.listen;
  absl::StatusOr<std::unique_ptr<DaemonClient>> client =
      DaemonClient::Connect(connection);
  if (client.ok()) {
    auto context = (*client)->Context();
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(2));
    v1::Cluster cluster;
    const grpc::Status s =
        (*client)->cluster().GetCluster(context.get(), {}, &cluster);
    if (s.ok() || s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      std::cout << "shardtraind already running at " << flags.listen << "\n";
      return kExitOk;
    }
  }
  std::vector<std::string> args = {SelfDir() + "/shardtraind",
                                   "--state-dir",
                                   state_dir,
                                   "--listen",
                                   flags.listen,
                                   "--metrics-listen",
                                   flags.metrics_listen};
  args.push_back("--device-kind");
  args.push_back(flags.device_kind);
  if (flags.cpu_slots > 0) {
    args.push_back("--cpu-slots");
    args.push_back(std::to_string(flags.cpu_slots));
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (flags.foreground) {
    execv(argv[0], argv.data());
    return ReportFailure(absl::StrCat("cannot run ", args[0]));
  }
  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  std::filesystem::remove(state_dir + "/endpoint", ec);
  const std::string log = state_dir + "/shardtraind.log";
  const pid_t pid = fork();
  if (pid == 0) {
    setsid();  // outlives this shell command
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    const int null = open("/dev/null", O_RDONLY);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    if (null >= 0) dup2(null, 0);
    execv(argv[0], argv.data());
    _exit(127);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    std::ifstream endpoint(state_dir + "/endpoint");
    std::string address;
    if (std::getline(endpoint, address) && !address.empty()) {
      std::cout << "shardtraind started at " << address << " (pid " << pid
                << "; state in " << state_dir << ", log " << log << ")\n";
      return kExitOk;
    }
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      std::ifstream in(log);
      std::string line, last;
      while (std::getline(in, line)) last = line;
      return ReportFailure(absl::StrCat("shardtraind exited: ", last));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return ReportFailure(
      absl::StrCat("shardtraind did not start within 60 s; see ", log));
}

}  // namespace

void AddCompareCommand(CLI::App* app, int* exit_code, int argc, char** argv) {
  auto flags = std::make_shared<CompareFlags>();
  auto connection = std::make_shared<ConnectionOptions>();
  CLI::App* cmd = app->add_subcommand(
      "compare",
      "Run the same job under each strategy, one after another, and write a "
      "report (table, CSVs, charts)");
  AddJobFlags(cmd, &flags->job, argc, argv);
  cmd->add_option("--strategies", flags->strategies,
                  "comma-separated (default: single, ddp, fsdp, and hsdp "
                  "from world size 4)")
      ->delimiter(',');
  cmd->add_option("--memory-budget", flags->memory_budget,
                  "per-rank memory, e.g. 512MiB: each strategy runs at the "
                  "largest batch it fits (by `shardtrain plan`), capped there "
                  "(past it a run fails out of memory)");
  cmd->add_option("--out", flags->out, "report directory")->required();
  cmd->add_option("--scaling", flags->scaling,
                  "strong: same global batch for every strategy; weak: same "
                  "batch per device")
      ->check(CLI::IsMember({"strong", "weak"}))
      ->capture_default_str();
  AddConnectionFlags(cmd, connection.get());
  cmd->callback([flags, connection, exit_code] {
    *exit_code = RunCompare(*flags, *connection);
  });
}

void AddDaemonCommand(CLI::App* app, int* exit_code) {
  auto flags = std::make_shared<DaemonFlags>();
  CLI::App* cmd = app->add_subcommand(
      "daemon",
      "Start a local shardtraind (in the background) unless one answers");
  cmd->add_option(
      "--state-dir", flags->state_dir,
      "default: $XDG_CACHE_HOME/shardtrain/state or ~/.cache/shardtrain/state");
  cmd->add_option("--listen", flags->listen, "address:port")
      ->capture_default_str();
  cmd->add_option("--metrics-listen", flags->metrics_listen,
                  "Prometheus endpoint")
      ->capture_default_str();
  cmd->add_option("--cpu-slots", flags->cpu_slots,
                  "CPU devices (0: one per core)");
  cmd->add_option("--device-kind", flags->device_kind, "auto | gpu | cpu")
      ->check(CLI::IsMember({"auto", "gpu", "cpu"}))
      ->capture_default_str();
  cmd->add_flag("--foreground", flags->foreground, "run in this terminal");
  cmd->callback([flags, exit_code] { *exit_code = RunDaemon(*flags); });
}

}  // namespace shardtrain::cli
