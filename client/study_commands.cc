#include "client/study_commands.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/compare_report.h"
#include "client/daemon_client.h"
#include "client/exit_code.h"
#include "client/host_load.h"
#include "client/job_commands.h"
#include "common/net_route.h"
#include "core/data/dataset_preparer.h"
#include "core/model/model_config.h"
#include "core/plan/memory_plan.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"
#include "proto/job_config.h"

namespace shardtrain::cli {
namespace {

struct CompareFlags {
  JobFlags job;
  // Empty: every strategy whose study minimum the world size meets
  // (StrategyKind::min_study_world: HSDP needs four ranks for two groups).
  std::vector<std::string> strategies;
  std::string out;
  std::string scaling = "strong";
  std::string memory_budget;  // --memory-budget: per-rank cap, e.g. 512MiB
  int repeat = 1;             // runs of each strategy, interleaved
};

// One run of one strategy's job, followed to its end.
struct FinishedRun {
  v1::Job job;
  std::vector<v1::StepMetrics> steps;
  HostLoad host_load;
};

// Submits `spec`, follows it to its end (sampling the host's load when the
// coordinator is local) and fetches its steps. Returns the exit code; `out`
// is filled when it is kExitOk.
int RunOnce(DaemonClient& client, const v1::JobSpec& spec, bool sample_load,
            const std::string& strategy, FinishedRun* out) {
  const bool terminal = isatty(STDERR_FILENO) != 0;
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::Job job;
  if (int code = client.Call([&](grpc::ClientContext* c) {
        return client.jobs().SubmitJob(c, request, &job);
      });
      code != kExitOk) {
    return code;
  }
  std::optional<HostLoadSampler> sampler;
  if (sample_load) {
    // The ranks' pids from the coordinator itself: a process that only
    // names the job in its arguments is not the job's.
    sampler.emplace(
        [&client, id = job.id()] {
          v1::GetJobRequest get;
          get.set_job_id(id);
          v1::Job now;
          std::unique_ptr<grpc::ClientContext> context = client.Context();
          context->set_deadline(std::chrono::system_clock::now() +
                                std::chrono::seconds(2));
          if (!client.jobs().GetJob(context.get(), get, &now).ok())
            return std::vector<int>{};
          return std::vector<int>(now.worker_pids().begin(),
                                  now.worker_pids().end());
        },
        absl::Seconds(1));
  }
  if (int code = FollowJob(client, job.id(), terminal, std::cerr);
      code != kExitOk) {
    std::cerr << "shardtrain: error: " << strategy << " run " << job.id()
              << " did not succeed; the study stops here\n";
    return code;
  }
  if (sampler) out->host_load = sampler->Stop();
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  if (int code = client.Call([&](grpc::ClientContext* c) {
        return client.jobs().GetJob(c, get, &out->job);
      });
      code != kExitOk) {
    return code;
  }
  v1::GetJobMetricsRequest metrics;
  metrics.set_job_id(job.id());
  v1::GetJobMetricsResponse steps;
  if (int code = client.Call([&](grpc::ClientContext* c) {
        return client.jobs().GetJobMetrics(c, metrics, &steps);
      });
      code != kExitOk) {
    return code;
  }
  out->steps.assign(steps.steps().begin(), steps.steps().end());
  return kExitOk;
}

struct Planned {
  StudyEntry entry;
  int64_t stages = 1;
  int64_t tensor = 1;
  int64_t replicas = 1;
  int64_t batch = 0;
};

struct Prepared {
  std::string strategy;
  v1::JobSpec spec;
  int ranks = 1;
  int64_t replicas = 1;  // data-parallel: the global batch's sharers
};

// Each entry as it runs: its mesh, ranks and batch per replica. Strong
// scaling keeps the global batch of --batch-size x the study's replicas.
// InvalidArgument (a usage error) names every entry the world cannot run,
// all at once.
absl::StatusOr<std::vector<Planned>> PlanEntries(const CompareFlags& flags,
                                                 const v1::JobSpec& base,
                                                 int world, int stages) {
  const int64_t base_tensor =
      std::max<int64_t>(1, base.strategy().tensor_parallel());
  const int64_t global_batch =
      base.trainer().batch_size() *
      std::max<int64_t>(1, world / (stages * base_tensor));
  std::vector<Planned> plan;
  std::vector<std::string> problems;
  for (const std::string& s : flags.strategies) {
    absl::StatusOr<StudyEntry> entry = ParseStudyEntry(s);
    if (!entry.ok()) {
      problems.push_back(std::string(entry.status().message()));
      continue;
    }
    Planned p;
    p.entry = *entry;
    p.stages = entry->pipeline_stages > 1 ? entry->pipeline_stages : stages;
    p.tensor =
        entry->tensor_parallel > 1 ? entry->tensor_parallel : base_tensor;
    // The ranks of one replica: its stages x its tensor-parallel ranks.
    const int64_t model_parallel = p.stages * p.tensor;
    const StrategyKind* kind = FindStrategyKind(entry->strategy);
    if (entry->strategy == kAutoStrategy) {
      // The whole world, the mesh picked when the job starts: the global
      // batch handed over as a DDP run of the world would have it.
      p.stages = 1;
      p.tensor = 1;
      p.replicas = world;
    } else if (kind->distributed) {
      p.replicas =
          entry->replicas > 0 ? entry->replicas : world / model_parallel;
      if (p.replicas < 2 ||
          (entry->replicas == 0 && world % model_parallel != 0)) {
        std::vector<std::string> parts;
        if (p.stages > 1) parts.push_back(absl::StrCat(p.stages, " stages"));
        if (p.tensor > 1) {
          parts.push_back(absl::StrCat(p.tensor, " tensor-parallel ranks"));
        }
        problems.push_back(absl::StrCat(
            s, " needs at least ", 2 * model_parallel, " ranks to compare",
            model_parallel > 1 ? absl::StrCat(" (2 data-parallel replicas of ",
                                              absl::StrJoin(parts, " x "), ")")
                               : ""));
        continue;
      }
    }
    const int64_t ranks = p.stages * p.tensor * p.replicas;
    if (ranks > world) {
      problems.push_back(absl::StrCat(
          s, " runs on ", ranks, " ranks, more than --world-size ", world));
      continue;
    }
    p.batch = base.trainer().batch_size();
    if (flags.scaling == "strong") {
      if (global_batch % p.replicas != 0) {
        problems.push_back(
            absl::StrCat(s, " runs ", p.replicas,
                         " replicas, which cannot share the global batch of ",
                         global_batch, " sequences equally"));
        continue;
      }
      p.batch = global_batch / p.replicas;
    }
    plan.push_back(std::move(p));
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--strategies at --world-size ", world, ": ",
        absl::StrJoin(problems, "; "), ". Nothing was submitted."));
  }
  return plan;
}

// Every prepared job checked as the daemon would check it, before any runs:
// its configuration and mesh, and the daemon's devices. InvalidArgument
// naming every entry at fault, all at once.
absl::Status CheckPreparedJobs(const std::vector<Prepared>& jobs,
                               int64_t daemon_devices) {
  std::vector<std::string> problems;
  for (const Prepared& job : jobs) {
    if (job.spec.strategy().name() != kAutoStrategy) {
      absl::StatusOr<TrainConfig> config =
          TrainConfigFromJobSpec(job.spec, "-");
      absl::Status s = config.status();
      if (s.ok()) s = config->CheckMeshWorld(job.ranks);
      if (!s.ok()) {
        problems.push_back(absl::StrCat(job.strategy, ": ", s.message()));
        continue;
      }
    }
    if (daemon_devices > 0 && job.ranks > daemon_devices) {
      problems.push_back(absl::StrCat(job.strategy, " needs ", job.ranks,
                                      " devices; the daemon has ",
                                      daemon_devices));
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--strategies: ", absl::StrJoin(problems, "; "),
                   ". Nothing was submitted."));
}

// Every entry's job spec, at `threads_as_ranks` and labelled with `study`;
// "llama-tiny (Llama) on the Brown Corpus (GPT-2 tokens)": the model, its
// family and the data with the tokenizer it was prepared with (from
// DATA/meta.json when the folder is readable here).
std::string ModelAndTokens(const std::string& model, const std::string& data) {
  std::string out = model;
  if (absl::StatusOr<ModelConfig> config = ParseModelSpec(model); config.ok()) {
    absl::StrAppend(&out, " (", config->is_llama() ? "Llama" : "GPT-2", ")");
  }
  std::string tokens;
  if (data == "brown") {
    tokens = "GPT-2";
  } else if (absl::StatusOr<std::string> name = DatasetTokenizer(data);
             name.ok()) {
    tokens = *name == "gpt2" ? "GPT-2" : *name;
  }
  absl::StrAppend(&out, " on ", data == "brown" ? "the Brown Corpus" : data,
                  tokens.empty() ? "" : absl::StrCat(" (", tokens, " tokens)"));
  return out;
}

// under a memory budget each at the largest batch its plan fits (an entry
// that fits none is left out, and said so).
absl::StatusOr<std::vector<Prepared>> PrepareJobs(
    const std::vector<Planned>& plan, const v1::JobSpec& base, int64_t budget,
    int64_t largest, const std::string& study) {
  std::vector<Prepared> jobs;
  for (const Planned& p : plan) {
    const std::string& strategy = p.entry.name;
    v1::JobSpec spec = base;
    spec.mutable_strategy()->set_name(p.entry.strategy);
    spec.mutable_strategy()->set_pipeline_stages(p.stages);
    spec.mutable_strategy()->set_tensor_parallel(p.tensor);
    if (p.stages == 1) {
      spec.mutable_strategy()->clear_micro_batches();
      spec.mutable_strategy()->clear_pipeline_split();
    }
    const int ranks = static_cast<int>(p.stages * p.tensor * p.replicas);
    spec.set_world_size(ranks);
    spec.mutable_trainer()->set_batch_size(p.batch);
    spec.mutable_trainer()->set_threads_as_ranks(static_cast<int>(largest));
    if (budget > 0 && p.entry.strategy == kAutoStrategy) {
      // Auto picks the fastest mesh that fits the cap itself.
      spec.mutable_trainer()->set_memory_cap_bytes(budget);
    } else if (budget > 0) {
      // Each strategy at the largest batch its plan fits in the budget, run
      // under that cap: what the memory buys.
      absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(spec, "-");
      if (!config.ok()) return config.status();
      absl::StatusOr<int64_t> batch =
          LargestFittingBatch(*config, ranks, PlannableBytes(budget));
      if (!batch.ok()) return batch.status();
      if (*batch == 0) {
        std::cerr << "\n== " << strategy << " does not fit one sequence per "
                  << "rank in " << FormatBytes(budget) << "; skipped ==\n";
        continue;
      }
      spec.mutable_trainer()->set_batch_size(*batch);
      spec.mutable_trainer()->set_memory_cap_bytes(budget);
    }
    (*spec.mutable_labels())["study"] = study;
    (*spec.mutable_labels())["strategy"] = strategy;
    jobs.push_back({strategy, std::move(spec), ranks, p.replicas});
  }

  return jobs;
}

// A strategy's first run as the report takes it: its job, steps and host
// load, and `shardtrain plan`'s peak at the threads the daemon gave it.
StrategyRun FirstRun(const Prepared& prepared, const v1::JobSpec& spec,
                     FinishedRun finished, int64_t largest) {
  const v1::Job& job = finished.job;
  const double wall =
      (job.end_time_unix_ms() - job.start_time_unix_ms()) / 1000.0;
  StrategyRun run;
  run.strategy = prepared.strategy;
  run.job_id = job.id();
  run.world_size = prepared.ranks;
  run.replicas = prepared.replicas;
  run.batch_size = spec.trainer().batch_size();
  // Auto: the mesh the coordinator chose, at the batch per replica it gave
  // it (the global batch stays the one handed over).
  const auto chosen = job.spec().labels().find("auto_mesh");
  if (prepared.spec.strategy().name() == kAutoStrategy &&
      chosen != job.spec().labels().end()) {
    if (absl::StatusOr<StudyEntry> mesh = ParseStudyEntry(chosen->second);
        mesh.ok()) {
      const int64_t model_parallel =
          mesh->pipeline_stages * mesh->tensor_parallel;
      const int64_t replicas =
          mesh->replicas > 0
              ? mesh->replicas
              : std::max<int64_t>(1, run.world_size / model_parallel);
      const int64_t global = run.batch_size * prepared.replicas;
      if (global % replicas == 0) {
        run.batch_size = global / replicas;
        run.replicas = replicas;
      }
      run.strategy = absl::StrCat(kAutoStrategy, ": ", chosen->second);
    }
  }
  run.grad_accum = spec.trainer().grad_accum();
  run.seq_len = spec.trainer().seq_len();
  run.steps = std::move(finished.steps);
  run.wall_seconds = wall;
  run.host_load = finished.host_load;
  run.train_tokens = job.train_tokens();  // read by the daemon at launch
  // The stored spec: the daemon filled in its device kind.
  if (absl::StatusOr<TrainConfig> config =
          TrainConfigFromJobSpec(job.has_spec() ? job.spec() : spec, "-");
      config.ok()) {
    // At the threads the daemon gave it (its host taken to be this one).
    config->threads = std::max<int64_t>(
        1, static_cast<int64_t>(std::thread::hardware_concurrency()) / largest);
    if (absl::StatusOr<MemoryPlan> plan = PlanMemory(*config, prepared.ranks);
        plan.ok()) {
      run.predicted_peak_bytes_per_rank = plan->total();
    }
  }
  return run;
}

int RunCompare(CompareFlags flags, const ConnectionOptions& connection) {
  absl::StatusOr<v1::JobSpec> base = flags.job.ToSpec();
  if (!base.ok()) {
    ReportFailure(base.status());
    return kExitUsage;
  }
  const int world = flags.job.world_size;
  // With pipeline stages every run has them; the strategies compared are the
  // data-parallel part, over world / stages replicas of the stages.
  const int stages = static_cast<int>(
      std::max<int64_t>(1, base->strategy().pipeline_stages()));
  if (stages > 1 && (world < stages || world % stages != 0)) {
    ReportFailure(absl::StrCat("--world-size: got ", world,
                               "; must be a multiple of --pipeline-stages (",
                               stages, ")"));
    return kExitUsage;
  }
  if (flags.strategies.empty()) {
    flags.strategies = StudyStrategyNames(world / stages);
  }
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
  absl::StatusOr<std::vector<Planned>> plan =
      PlanEntries(flags, *base, world, stages);
  if (!plan.ok()) {
    ReportFailure(plan.status());
    return kExitUsage;
  }
  absl::StatusOr<std::unique_ptr<DaemonClient>> client =
      DaemonClient::Connect(connection);
  if (!client.ok()) return ReportFailure(client.status());
  const std::string study =
      absl::StrCat("compare-", absl::ToUnixSeconds(absl::Now()));

  // Every run at the threads per rank of the study's largest job, so that
  // per-rank speed and memory compare at equal threads (single-device would
  // otherwise get all the cores: the LM head's chunk, and its peak memory,
  // grows with the threads).
  int64_t largest = 1;
  for (const Planned& p : *plan) {
    largest = std::max<int64_t>(largest, p.stages * p.tensor * p.replicas);
  }
  // Every job's spec first (a budget may leave a strategy out), then the
  // runs: round after round, each strategy once per round, so that what
  // changes on the host over time falls on every strategy alike.
  const std::string study_name =
      flags.job.name.empty() ? study : flags.job.name;
  absl::StatusOr<std::vector<Prepared>> jobs =
      PrepareJobs(*plan, *base, budget, largest, study_name);
  if (!jobs.ok()) return ReportFailure(jobs.status());
  // Every entry against the daemon's devices before the first run.
  int64_t devices = 0;
  {
    auto context = (*client)->Context();
    v1::Cluster cluster;
    if ((*client)->cluster().GetCluster(context.get(), {}, &cluster).ok()) {
      devices = cluster.devices_size();
    }
  }
  if (absl::Status s = CheckPreparedJobs(*jobs, devices); !s.ok()) {
    ReportFailure(s);
    return kExitUsage;
  }
  const bool sample_load = IsThisHost((*client)->address());
  std::vector<StrategyRun> runs(jobs->size());
  const size_t total = jobs->size() * static_cast<size_t>(flags.repeat);
  for (int round = 0; round < flags.repeat; ++round) {
    for (size_t i = 0; i < jobs->size(); ++i) {
      const Prepared& prepared = (*jobs)[i];
      v1::JobSpec spec = prepared.spec;
      spec.set_name(absl::StrCat(
          study_name, "-", prepared.strategy,
          flags.repeat > 1 ? absl::StrCat("-run", round + 1) : ""));
      std::cerr << "\n== " << round * jobs->size() + i + 1 << "/" << total
                << ": " << prepared.strategy
                << (flags.repeat > 1 ? absl::StrCat(" (run ", round + 1, " of ",
                                                    flags.repeat, ")")
                                     : "")
                << " on " << prepared.ranks
                << (prepared.ranks == 1 ? " device" : " devices") << ", batch "
                << spec.trainer().batch_size() << " per replica ==\n";
      FinishedRun finished;
      if (int code = RunOnce(**client, spec, sample_load, prepared.strategy,
                             &finished);
          code != kExitOk) {
        return code;
      }
      const v1::Job& job = finished.job;
      if (const auto chosen = job.spec().labels().find("auto_mesh");
          chosen != job.spec().labels().end()) {
        std::cerr << prepared.strategy << " trained " << chosen->second
                  << " (the mesh predicted fastest; its log says why)\n";
      }
      const double wall =
          (job.end_time_unix_ms() - job.start_time_unix_ms()) / 1000.0;
      StrategyRun& run = runs[i];
      if (round > 0) {
        run.repeats.push_back(
            {job.id(), std::move(finished.steps), wall, finished.host_load});
        continue;
      }
      run = FirstRun(prepared, spec, std::move(finished), largest);
    }
  }

  CompareOptions options;
  options.scaling = flags.scaling;
  options.conditions = absl::StrCat(
      "Equal threads: on CPU slots every rank, single-device included, "
      "computes with the threads of a ",
      largest, "-rank job (the daemon host's cores / ", largest,
      "), so per-rank speed and memory compare at the same threads.");
  options.title = absl::StrCat(
      ModelAndTokens(base->model(), base->data()), ", ",
      absl::StrJoin(flags.strategies, " vs "), ", world size ", world, ", ",
      budget > 0 ? absl::StrCat("each at its largest batch within ",
                                FormatBytes(budget), " per rank")
                 : absl::StrCat(flags.scaling, " scaling"));
  options.subject = absl::StrCat(
      base->model(), " at ", world, world == 1 ? " rank" : " ranks",
      budget > 0 ? absl::StrCat(" within ", FormatBytes(budget), " a rank")
                 : "");
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
    std::cout << "- " << finding << "\n";
  if (const std::string r = Recommendation(rows, options.subject); !r.empty())
    std::cout << "\n" << r << "\n";
  std::cout << "\nreport: " << std::filesystem::absolute(flags.out).string()
            << "/report.html (and report.md, one CSV per strategy)\n";
  return kExitOk;
}

}  // namespace

void AddCompareCommand(CLI::App* app, int* exit_code, int argc, char** argv) {
  auto flags = std::make_shared<CompareFlags>();
  auto connection = std::make_shared<ConnectionOptions>();
  CLI::App* cmd = app->add_subcommand(
      "compare",
      "Run the same job under each strategy, one after another, and write a "
      "report (table, CSVs, charts)");
  // Two ranks unless the file or --world-size says otherwise: the study's
  // point is the distributed strategies beside one device.
  flags->job.world_size = 2;
  AddJobFlags(cmd, &flags->job, argc, argv);
  // --strategies says which; one --strategy would be ignored.
  cmd->remove_option(cmd->get_option("--strategy"));
  cmd->get_option("--world-size")
      ->description("ranks of the distributed strategies")
      ->capture_default_str();
  cmd->add_option("--strategies", flags->strategies,
                  absl::StrCat("comma-separated (default: every strategy "
                               "the world size allows: ",
                               absl::StrJoin(StudyStrategyNames(4), ", "),
                               " at 4 ranks)"))
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
  cmd->add_option("--repeat", flags->repeat,
                  "runs of each strategy, interleaved (round after round), "
                  "for a run-to-run throughput interval")
      ->check(CLI::Range(1, 20))
      ->capture_default_str();
  AddConnectionFlags(cmd, connection.get());
  cmd->callback([flags, connection, exit_code] {
    *exit_code = RunCompare(*flags, *connection);
  });
}

}  // namespace shardtrain::cli
