#include "client/job_commands.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/exit_code.h"
#include "client/output_format.h"
#include "client/step_metrics_csv.h"
#include "common/flag_file.h"
#include "common/nearest_name.h"
#include "core/run/step_metrics.h"
#include "core/run/train_config.h"
#include "core/run/train_flags.h"
#include "proto/job_config.h"
#include "yaml-cpp/yaml.h"

namespace shardtrain::cli {
namespace {

std::string StateName(v1::JobState state) { return v1::JobState_Name(state); }

bool IsTerminal(v1::JobState state) {
  return state == v1::SUCCEEDED || state == v1::FAILED ||
         state == v1::CANCELLED;
}

// Job-level keys of a job YAML; everything else is a trainer key.
absl::Status LoadJobFile(const std::string& path, JobFlags* flags) {
  absl::StatusOr<std::string> text = ReadFlagFile("-f", path);
  if (!text.ok()) return text.status();
  YAML::Node root;
  try {
    root = YAML::Load(*text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("-f ", path, ": ", e.what()));
  }
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "-f ", path, ": expected a mapping of flag names to values"));
  }
  // Keys of the job itself, and shardtrain-train's that the daemon sets for
  // every job (refused rather than ignored).
  const std::vector<std::string> job_keys = {
      "labels",   "max_restarts",   "min_world_size", "name",
      "priority", "priority_class", "world_size"};
  const std::vector<std::string> daemon_sets = {"eval_only", "log_every", "out",
                                                "resume", "threads"};
  std::vector<std::string> known = job_keys;
  for (const std::string& key : YamlTrainConfigKeys()) {
    if (std::find(daemon_sets.begin(), daemon_sets.end(), key) ==
        daemon_sets.end()) {
      known.push_back(key);
    }
  }
  std::sort(known.begin(), known.end());
  YAML::Node trainer(YAML::NodeType::Map);
  try {
    for (auto it = root.begin(); it != root.end(); ++it) {
      std::string key = it->first.as<std::string>();
      const std::string snake = absl::StrReplaceAll(key, {{"-", "_"}});
      if (std::find(daemon_sets.begin(), daemon_sets.end(), snake) !=
          daemon_sets.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "-f ", path, ": '", key,
            "' is set by the daemon for every job (its output directory, "
            "threads, resumption and logging); remove it"));
      }
      if (std::find(known.begin(), known.end(), snake) == known.end()) {
        const std::string near = NearestName(snake, known);
        return absl::InvalidArgumentError(absl::StrCat(
            "-f ", path, ": unknown key '", absl::CHexEscape(key), "'",
            near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)"),
            "; known keys: ", absl::StrJoin(known, ", ")));
      }
      std::replace(key.begin(), key.end(), '_', '-');
      if (key == "name") {
        flags->name = it->second.as<std::string>();
      } else if (key == "world-size") {
        flags->world_size = it->second.as<int>();
      } else if (key == "priority") {
        flags->priority = it->second.as<int>();
      } else if (key == "priority-class") {
        flags->priority_class = it->second.as<std::string>();
      } else if (key == "max-restarts") {
        flags->max_restarts = it->second.as<int>();
      } else if (key == "min-world-size") {
        flags->min_world_size = it->second.as<int>();
      } else if (key == "labels") {
        for (auto l = it->second.begin(); l != it->second.end(); ++l) {
          flags->labels.push_back(absl::StrCat(l->first.as<std::string>(), "=",
                                               l->second.as<std::string>()));
        }
      } else {
        if (key == "device") flags->device_given = true;
        trainer[it->first.as<std::string>()] = it->second;
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("-f ", path, ": ", e.what()));
  }
  YAML::Emitter out;
  out << trainer;
  absl::Status s = ApplyYamlTrainConfig(out.c_str(), &flags->config);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("-f ", path, ": ", s.message()));
  }
  return absl::OkStatus();
}

// What a job's output directory holds: the files there when this host sees
// the directory (the local daemon's), none for a job that never started.
std::string Outputs(const v1::Job& job) {
  if (job.start_time_unix_ms() == 0) return "none (the job never started)";
  const std::filesystem::path dir(job.output_dir());
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::StrCat(job.output_dir(), " (on the daemon's host)");
  }
  std::vector<std::string> present;
  for (const char* file : {"model.bin", "metrics.jsonl"}) {
    if (std::filesystem::exists(dir / file, ec)) present.push_back(file);
  }
  if (!std::filesystem::is_empty(dir / "checkpoints", ec) && !ec) {
    present.push_back("checkpoints/");
  }
  int logs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, "rank-") && absl::EndsWith(name, ".log")) {
      ++logs;
    }
  }
  if (logs > 0) present.push_back(logs == 1 ? "rank-0.log" : "rank-N.log");
  return absl::StrCat(
      job.output_dir(),
      present.empty() ? " (empty)"
                      : absl::StrCat(" (", absl::StrJoin(present, ", "), ")"));
}

// The job's mesh as the daemon names it (JobMeshName at its running
// attempt's world size).
std::string Mesh(const v1::Job& job) {
  return job.mesh().empty() ? JobMeshName(job.spec(), job.world_size())
                            : job.mesh();
}

// "4 ranks": the running attempt's, else the spec's.
std::string Ranks(const v1::Job& job) {
  const int64_t n =
      job.world_size() > 0 ? job.world_size() : job.spec().world_size();
  return absl::StrCat(n, n == 1 ? " rank" : " ranks");
}

void PrintJobDetail(const v1::Job& job, std::ostream& out) {
  std::vector<std::vector<std::string>> rows = {
      {"id", job.id()},
      {"name", job.spec().name().empty() ? "-" : job.spec().name()},
      {"state", StateName(job.state())},
      {"reason", job.state_reason()},
      {"model", job.spec().model()},
      {"data", job.spec().data()},
      {"mesh", absl::StrCat(Mesh(job), " (", Ranks(job), ")")},
      {"device", v1::DeviceKind_Name(job.spec().device_kind())},
      {"owner", job.owner().empty() ? "-" : job.owner()},
      {"priority",
       absl::StrCat(
           job.priority(),
           job.spec().priority_class().empty()
               ? ""
               : absl::StrCat(" (class ", job.spec().priority_class(), ")"),
           job.preemptible() ? "" : ", not preemptible")},
      {"restarts",
       absl::StrCat(job.restarts(), " of ", job.spec().max_restarts())},
      {"preemptions", std::to_string(job.preemptions())},
      {"re-meshes",
       job.remeshes() > 0
           ? absl::StrCat(job.remeshes(), " (",
                          FormatDuration(job.remesh_seconds_lost()),
                          " without a step)")
           : "0"},
      {"eta", job.eta_seconds() > 0 ? FormatDuration(job.eta_seconds()) : "-"},
      {"ranks",
       job.world_size() > 0 && job.world_size() != job.spec().world_size()
           ? absl::StrCat(job.world_size(), " of ", job.spec().world_size(),
                          " (", job.resize_reason(), ")")
           : absl::StrCat(
                 job.spec().world_size(),
                 job.spec().elastic().min_world_size() > 0
                     ? absl::StrCat(" (elastic down to ",
                                    job.spec().elastic().min_world_size(), ")")
                     : "")},
      {"submitted", job.submit_time_unix_ms() > 0
                        ? FormatAge(job.submit_time_unix_ms()) + " ago"
                        : "-"},
  };
  if (job.start_time_unix_ms() > 0) {
    const int64_t end = job.end_time_unix_ms() > 0
                            ? job.end_time_unix_ms()
                            : absl::ToUnixMillis(absl::Now());
    rows.push_back({"running for",
                    FormatDuration((end - job.start_time_unix_ms()) / 1000.0)});
  }
  if (job.has_last_step()) {
    const StepMetrics m = StepMetricsFromProto(job.last_step());
    rows.push_back({"last step", m.FormatLine()});
  }
  if (!job.output_dir().empty()) rows.push_back({"outputs", Outputs(job)});
  std::vector<std::string> labels;
  for (const auto& [k, v] : job.spec().labels()) labels.push_back(k + "=" + v);
  std::sort(labels.begin(), labels.end());
  if (!labels.empty()) rows.push_back({"labels", absl::StrJoin(labels, ",")});
  for (const auto& row : rows)
    out << absl::StrFormat("%-12s %s\n", row[0], TerminalSafe(row[1]));
  if (job.state() == v1::FAILED) {
    out << absl::StrFormat("%-12s %s (rank %d): %s\n", "failure",
                           v1::FailureReason_Name(job.failure().reason()),
                           job.failure().rank(),
                           TerminalSafe(job.failure().message()));
    if (job.failure().log_tail_size() > 0) {
      out << "last lines of the failing rank's log:\n";
      for (const std::string& line : job.failure().log_tail())
        out << "  " << TerminalSafe(line) << "\n";
    }
  }
}

std::string ProgressLine(const v1::StepMetrics& m, double seconds_per_step) {
  const int width = 24;
  const double fraction =
      m.total_steps() > 0
          ? std::min(1.0, static_cast<double>(m.step()) / m.total_steps())
          : 0;
  const int filled = static_cast<int>(fraction * width);
  const double eta = (m.total_steps() - m.step()) * seconds_per_step;
  return absl::StrFormat(
      "[%s%s] %d/%d | loss %.4f | norm %.2f | %s tok/s | ETA %s",
      std::string(filled, '#'), std::string(width - filled, '.'), m.step(),
      m.total_steps(), m.loss(), m.grad_norm(),
      FormatThousands(static_cast<int64_t>(m.tokens_per_second())),
      FormatDuration(std::max(0.0, eta)));
}

}  // namespace

absl::StatusOr<v1::JobSpec> JobFlags::ToSpec() const {
  if (!file_status.ok()) return file_status;
  TrainConfig c = config;
  if (!c.data.empty() && c.data != "brown") {
    c.data = std::filesystem::absolute(c.data).lexically_normal().string();
  }
  if (!c.init_from.empty()) {
    c.init_from =
        std::filesystem::absolute(c.init_from).lexically_normal().string();
  }
  v1::JobSpec spec = JobSpecFromTrainConfig(c, world_size);
  if (!device_given) spec.set_device_kind(v1::DEVICE_KIND_UNSPECIFIED);
  spec.set_name(name);
  spec.set_priority(priority);
  spec.set_priority_class(priority_class);
  spec.set_max_restarts(max_restarts);
  spec.mutable_elastic()->set_min_world_size(min_world_size);
  for (const std::string& label : labels) {
    const size_t eq = label.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--label: got '", label, "'; expected key=value"));
    }
    (*spec.mutable_labels())[label.substr(0, eq)] = label.substr(eq + 1);
  }
  return spec;
}

void AddJobFlags(CLI::App* command, JobFlags* flags, int argc, char** argv) {
  // The file first, so that flags parsed afterwards win.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "-f" || arg == "--file") && i + 1 < argc)
      flags->file = argv[i + 1];
    if (arg.rfind("--file=", 0) == 0) flags->file = arg.substr(7);
  }
  if (!flags->file.empty())
    flags->file_status = LoadJobFile(flags->file, flags);
  AddTrainFlags(*command, flags->config);
  // What the coordinator decides for a job (its directory, threads,
  // restarts) or a JobSpec cannot express is not a submit flag.
  for (const char* name :
       {"--out", "--resume", "--eval-only", "--threads", "--log-every"}) {
    command->remove_option(command->get_option(name));
  }
  command->add_option("-f,--file", flags->file,
                      "job YAML: the flags' names as keys, plus name, labels, "
                      "priority, priority-class, world-size, max-restarts, "
                      "min-world-size");
  command->add_option("--world-size", flags->world_size,
                      "ranks (devices) for ddp/fsdp");
  command->add_option("--name", flags->name, "a name for people");
  command->add_option("--label", flags->labels, "key=value (repeatable)");
  command->add_option("--priority", flags->priority, "higher runs first");
  command->add_option("--priority-class", flags->priority_class,
                      "one of the daemon's --priority-class names (sets the "
                      "priority, and whether the job may be preempted)");
  command->add_option("--max-restarts", flags->max_restarts,
                      "restarts from the last checkpoint after a failure");
  command->add_option(
      "--min-world-size", flags->min_world_size,
      "elastic: shrunk to as few as this many ranks for a higher-priority "
      "job instead of preempted, and, when a rank or node is lost for good, "
      "continued from the last checkpoint on as few (same global batch; "
      "needs --checkpoint-every; continuing after a loss is a restart, so "
      "that also needs --max-restarts)");
  command->get_option("--device")->each([flags](const std::string&) {
    flags->device_given = true;
  });
}

namespace {

// The end of a successful run in a few lines: where it ended and where its
// outputs are.
std::string RunSummary(const v1::Job& job, double val_loss) {
  std::string summary;
  if (job.has_last_step()) {
    const v1::StepMetrics& m = job.last_step();
    summary +=
        absl::StrFormat("  %d steps, final loss %.4f", m.step(), m.loss());
    if (val_loss >= 0) summary += absl::StrFormat(", val loss %.4f", val_loss);
    if (m.tokens_per_second() > 0) {
      summary += absl::StrFormat(
          ", %s tokens/s at the end",
          FormatThousands(static_cast<int64_t>(m.tokens_per_second())));
    }
    summary += "\n";
  }
  if (!job.output_dir().empty()) {
    summary += absl::StrFormat("  outputs: %s\n", Outputs(job));
  }
  return summary;
}

}  // namespace

int FollowJob(DaemonClient& client, const std::string& job_id, bool terminal,
              std::ostream& out) {
  auto context = client.Context();
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  auto reader = client.jobs().WatchJob(context.get(), request);
  v1::WatchJobEvent event;
  double seconds_per_step = 0;
  double final_val_loss = -1;
  bool bar_shown = false;
  auto clear_bar = [&] {
    if (bar_shown) out << "\r\033[K";
    bar_shown = false;
  };
  while (reader->Read(&event)) {
    if (event.has_job()) {
      const v1::Job& job = event.job();
      out << job.id() << " (" << Mesh(job) << ", "
          << TerminalSafe(job.spec().model()) << "): " << StateName(job.state())
          << (job.state_reason().empty()
                  ? ""
                  : " - " + TerminalSafe(job.state_reason()))
          << "\n";
    } else if (event.has_state_change()) {
      clear_bar();
      out << StateName(event.state_change().state()) << ": "
          << TerminalSafe(event.state_change().message()) << "\n";
    } else if (event.has_step() && event.step().rank() == 0) {
      const v1::StepMetrics& m = event.step();
      if (m.has_val_loss()) final_val_loss = m.val_loss();
      seconds_per_step = seconds_per_step == 0
                             ? m.step_seconds()
                             : 0.9 * seconds_per_step + 0.1 * m.step_seconds();
      if (terminal) {
        out << "\r\033[K" << ProgressLine(m, seconds_per_step);
        bar_shown = true;
        if (m.has_val_loss()) {
          clear_bar();
          out << absl::StrFormat("step %d: val_loss %.4f\n", m.step(),
                                 m.val_loss());
        }
      } else {
        out << StepMetricsFromProto(m).FormatLine() << "\n";
        if (m.has_val_loss())
          out << absl::StrFormat("val_loss %.6f\n", m.val_loss());
      }
    }
    out.flush();
  }
  clear_bar();
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return client.Report(status);
  v1::GetJobRequest get;
  get.set_job_id(job_id);
  v1::Job job;
  if (int code = client.Call([&](grpc::ClientContext* c) {
        return client.jobs().GetJob(c, get, &job);
      });
      code != kExitOk) {
    return code;
  }
  if (job.state() == v1::SUCCEEDED) {
    out << job.id() << " SUCCEEDED in "
        << FormatDuration((job.end_time_unix_ms() - job.start_time_unix_ms()) /
                          1000.0)
        << "\n"
        << RunSummary(job, final_val_loss);
    return kExitOk;
  }
  if (!IsTerminal(job.state())) {
    out << job.id() << " is " << StateName(job.state())
        << " (the daemon stopped streaming)\n";
    return kExitFailure;
  }
  PrintJobDetail(job, out);
  return kExitFailure;
}

namespace {

// What every job command shares: the daemon connection flags, where the exit
// code goes, whether stdout is a terminal.
struct CommandContext {
  std::shared_ptr<ConnectionOptions> connection;
  int* exit_code;
  bool terminal;
  int argc;
  char** argv;

  // A client for the daemon, or nullptr with the exit code set.
  std::unique_ptr<DaemonClient> Connect() const {
    absl::StatusOr<std::unique_ptr<DaemonClient>> client =
        DaemonClient::Connect(*connection);
    if (!client.ok()) {
      *exit_code = ReportFailure(client.status());
      return nullptr;
    }
    return std::move(*client);
  }

  // Connects and makes one unary call, rpc(client, context); the client for
  // what follows, or nullptr with the exit code set when either failed.
  template <typename Rpc>
  std::unique_ptr<DaemonClient> ConnectAndCall(Rpc&& rpc) const {
    std::unique_ptr<DaemonClient> client = Connect();
    if (client == nullptr) return nullptr;
    *exit_code = client->Call(
        [&](grpc::ClientContext* context) { return rpc(*client, context); });
    return *exit_code == kExitOk ? std::move(client) : nullptr;
  }
};

// `submit`
void AddSubmitCommand(CLI::App* app, const CommandContext& ctx) {
  auto flags = std::make_shared<JobFlags>();
  auto watch = std::make_shared<bool>(false);
  auto format = std::make_shared<std::string>("table");
  CLI::App* cmd = app->add_subcommand(
      "submit",
      "Submit a training job (shardtrain-train's flags, or -f job.yaml)");
  AddJobFlags(cmd, flags.get(), ctx.argc, ctx.argv);
  cmd->add_flag("--watch,-w", *watch, "follow the job until it ends");
  AddOutputFlag(cmd, format.get());
  AddConnectionFlags(cmd, ctx.connection.get());
  cmd->callback([=, exit_code = ctx.exit_code, terminal = ctx.terminal] {
    absl::StatusOr<v1::JobSpec> spec = flags->ToSpec();
    if (!spec.ok()) {
      ReportFailure(spec.status());
      *exit_code = kExitUsage;
      return;
    }
    v1::SubmitJobRequest request;
    *request.mutable_spec() = *spec;
    v1::Job job;
    auto client =
        ctx.ConnectAndCall([&](DaemonClient& daemon, grpc::ClientContext* c) {
          return daemon.jobs().SubmitJob(c, request, &job);
        });
    if (!client) return;
    if (*format != "table") {
      PrintMessage(job, *format);
    } else {
      std::cout << job.id() << "\n";
    }
    *exit_code =
        *watch ? FollowJob(*client, job.id(), terminal, std::cerr) : kExitOk;
  });
}

// `list`
void AddListCommand(CLI::App* app, const CommandContext& ctx) {
  auto states = std::make_shared<std::vector<std::string>>();
  auto labels = std::make_shared<std::vector<std::string>>();
  auto format = std::make_shared<std::string>("table");
  auto limit = std::make_shared<int>(0);
  CLI::App* cmd = app->add_subcommand("list", "List jobs (oldest first)");
  std::vector<std::string> state_names;
  for (int s = v1::JobState_MIN; s <= v1::JobState_MAX; ++s) {
    if (s == v1::JOB_STATE_UNSPECIFIED || !v1::JobState_IsValid(s)) continue;
    state_names.push_back(v1::JobState_Name(static_cast<v1::JobState>(s)));
  }
  cmd->add_option("--state", *states, "only these states (repeatable)")
      ->transform(CLI::IsMember(state_names, CLI::ignore_case));
  cmd->add_option("--label", *labels, "key=value; all must match (repeatable)");
  cmd->add_option("--limit", *limit, "at most N jobs (0: all)")
      ->check(CLI::NonNegativeNumber);
  AddOutputFlag(cmd, format.get());
  AddConnectionFlags(cmd, ctx.connection.get());
  cmd->callback([=, exit_code = ctx.exit_code] {
    auto client = ctx.Connect();
    if (!client) return;
    v1::ListJobsRequest request;
    for (const std::string& s : *states) {
      v1::JobState state{};
      if (v1::JobState_Parse(s, &state)) request.add_states(state);
    }
    for (const std::string& label : *labels) {
      const size_t eq = label.find('=');
      if (eq == std::string::npos) {
        ReportFailure(
            absl::StrCat("--label: got '", label, "'; expected key=value"));
        *exit_code = kExitUsage;
        return;
      }
      (*request.mutable_labels())[label.substr(0, eq)] = label.substr(eq + 1);
    }
    v1::ListJobsResponse all;
    do {
      v1::ListJobsResponse page;
      if ((*exit_code = client->Call([&](grpc::ClientContext* c) {
            return client->jobs().ListJobs(c, request, &page);
          })) != kExitOk) {
        return;
      }
      for (const v1::Job& job : page.jobs()) {
        if (*limit > 0 && all.jobs_size() >= *limit) break;
        *all.add_jobs() = job;
      }
      request.set_page_token(page.next_page_token());
    } while (!request.page_token().empty() &&
             (*limit == 0 || all.jobs_size() < *limit));
    if (*format != "table") {
      PrintMessage(all, *format);
      return;
    }
    std::vector<std::vector<std::string>> rows;
    for (const v1::Job& job : all.jobs()) {
      rows.push_back(
          {job.id(), job.spec().name().empty() ? "-" : job.spec().name(),
           job.owner().empty() ? "-" : job.owner(), StateName(job.state()),
           Mesh(job), job.spec().model(),
           job.has_last_step() ? absl::StrCat(job.last_step().step(), "/",
                                              job.last_step().total_steps())
                               : "-",
           job.has_last_step() ? absl::StrFormat("%.4f", job.last_step().loss())
                               : "-",
           FormatAge(job.submit_time_unix_ms())});
    }
    std::cout << FormatTable({"ID", "NAME", "OWNER", "STATE", "MESH", "MODEL",
                              "STEP", "LOSS", "AGE"},
                             rows);
  });
}

// `get` and `status` (the same command)
void AddGetCommands(CLI::App* app, const CommandContext& ctx) {
  for (const char* name : {"get", "status"}) {
    auto id = std::make_shared<std::string>();
    auto format = std::make_shared<std::string>("table");
    CLI::App* cmd = app->add_subcommand(name, "Show one job");
    cmd->add_option("job", *id, "job id")->required();
    AddOutputFlag(cmd, format.get());
    AddConnectionFlags(cmd, ctx.connection.get());
    cmd->callback([=, exit_code = ctx.exit_code] {
      v1::GetJobRequest request;
      request.set_job_id(*id);
      v1::Job job;
      auto client =
          ctx.ConnectAndCall([&](DaemonClient& daemon, grpc::ClientContext* c) {
            return daemon.jobs().GetJob(c, request, &job);
          });
      if (!client) return;
      if (*format != "table") {
        PrintMessage(job, *format);
      } else {
        PrintJobDetail(job, std::cout);
      }
    });
  }
}

// `watch`
void AddWatchCommand(CLI::App* app, const CommandContext& ctx) {
  auto id = std::make_shared<std::string>();
  CLI::App* cmd = app->add_subcommand(
      "watch", "Follow a job live until it ends (exit 1 if it fails)");
  cmd->add_option("job", *id, "job id")->required();
  AddConnectionFlags(cmd, ctx.connection.get());
  cmd->callback([=, exit_code = ctx.exit_code, terminal = ctx.terminal] {
    auto client = ctx.Connect();
    if (!client) return;
    *exit_code = FollowJob(*client, *id, terminal, std::cout);
  });
}

// `logs`
void AddLogsCommand(CLI::App* app, const CommandContext& ctx) {
  auto id = std::make_shared<std::string>();
  auto rank = std::make_shared<int>(-1);
  auto tail = std::make_shared<int>(0);
  auto follow = std::make_shared<bool>(false);
  CLI::App* cmd = app->add_subcommand("logs", "Print a job's worker logs");
  cmd->add_option("job", *id, "job id")->required();
  cmd->add_option("--rank", *rank, "one rank (default: all, prefixed)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--tail", *tail, "last N lines of each rank first")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("-f,--follow", *follow, "keep printing until the job ends");
  AddConnectionFlags(cmd, ctx.connection.get());
  cmd->callback([=, exit_code = ctx.exit_code] {
    auto client = ctx.Connect();
    if (!client) return;
    auto context = client->Context();
    v1::StreamLogsRequest request;
    request.set_job_id(*id);
    if (*rank >= 0) request.set_rank(*rank);
    request.set_tail(*tail);
    request.set_follow(*follow);
    auto reader = client->jobs().StreamLogs(context.get(), request);
    v1::LogLine line;
    // A line at a time, also into a pipe: `logs -f | grep` shows each as it
    // comes, and Ctrl-C loses none.
    while (reader->Read(&line)) {
      if (*rank < 0) std::cout << "[rank " << line.rank() << "] ";
      std::cout << TerminalSafe(line.line()) << std::endl;
    }
    if (grpc::Status s = reader->Finish(); !s.ok())
      *exit_code = client->Report(s);
  });
}

// `cancel`
void AddCancelCommand(CLI::App* app, const CommandContext& ctx) {
  auto id = std::make_shared<std::string>();
  CLI::App* cmd =
      app->add_subcommand("cancel", "Cancel a queued or running job");
  cmd->add_option("job", *id, "job id")->required();
  AddConnectionFlags(cmd, ctx.connection.get());
  cmd->callback([=, exit_code = ctx.exit_code, terminal = ctx.terminal] {
    v1::CancelJobRequest request;
    request.set_job_id(*id);
    v1::Job job;
    auto client =
        ctx.ConnectAndCall([&](DaemonClient& daemon, grpc::ClientContext* c) {
          return daemon.jobs().CancelJob(c, request, &job);
        });
    if (!client) return;
    std::cout << job.id() << ": "
              << (job.state() == v1::CANCELLED
                      ? "CANCELLED"
                      : "cancel requested; stopping its ranks")
              << "\n";
  });
}

// `metrics`
void AddMetricsCommand(CLI::App* app, const CommandContext& ctx) {
  auto id = std::make_shared<std::string>();
  auto rank = std::make_shared<int>(-1);
  auto csv = std::make_shared<bool>(false);
  auto format = std::make_shared<std::string>("table");
  CLI::App* cmd = app->add_subcommand("metrics", "A job's stored step metrics");
  cmd->add_option("job", *id, "job id")->required();
  cmd->add_option("--rank", *rank,
                  "one rank (table default: 0; csv/json: all)");
  cmd->add_flag("--csv", *csv, "every field of every step as CSV");
  AddOutputFlag(cmd, format.get());
  AddConnectionFlags(cmd, ctx.connection.get());
  cmd->callback([=, exit_code = ctx.exit_code, terminal = ctx.terminal] {
    v1::GetJobMetricsRequest request;
    request.set_job_id(*id);
    const bool table = !*csv && *format == "table";
    if (*rank >= 0) {
      request.set_rank(*rank);
    } else if (table) {
      request.set_rank(0);
    }
    v1::GetJobMetricsResponse response;
    auto client =
        ctx.ConnectAndCall([&](DaemonClient& daemon, grpc::ClientContext* c) {
          return daemon.jobs().GetJobMetrics(c, request, &response);
        });
    if (!client) return;
    if (*csv) {
      std::cout << StepMetricsCsv(
          {response.steps().begin(), response.steps().end()});
      return;
    }
    if (!table) {
      PrintMessage(response, *format);
      return;
    }
    std::vector<std::vector<std::string>> rows;
    for (const v1::StepMetrics& m : response.steps()) {
      rows.push_back(
          {std::to_string(m.step()), absl::StrFormat("%.4f", m.loss()),
           m.has_val_loss() ? absl::StrFormat("%.4f", m.val_loss()) : "",
           absl::StrFormat("%.3f", m.grad_norm()),
           absl::StrFormat("%.2e", m.lr()),
           absl::StrFormat("%.0f", m.step_seconds() * 1000),
           FormatThousands(static_cast<int64_t>(m.tokens_per_second())),
           absl::StrFormat("%.1f%%", m.mfu() * 100),
           FormatBytes(m.memory_peak_bytes())});
    }
    std::cout << FormatTable(
        {"STEP", "LOSS", "VAL", "NORM", "LR", "MS", "TOK/S", "MFU", "PEAK MEM"},
        rows);
  });
}

// `cluster`
// The backend's part of `shardtrain cluster`: its name, note, node groups
// and nodes (none for the local backend).
void PrintBackendView(const v1::Cluster& cluster) {
  if (cluster.backend_note().empty() && cluster.backend_error().empty() &&
      cluster.nodes().empty() && cluster.node_groups().empty()) {
    return;
  }
  std::cout << "\nlauncher: " << TerminalSafe(cluster.launcher());
  if (!cluster.backend_note().empty()) {
    std::cout << " (" << TerminalSafe(cluster.backend_note()) << ")";
  }
  std::cout << "\n";
  if (!cluster.backend_error().empty()) {
    std::cout << TerminalSafe(cluster.backend_error()) << "\n";
    return;
  }
  const std::string group_kind = absl::AsciiStrToUpper(
      cluster.node_group_kind().empty() ? "group" : cluster.node_group_kind());
  if (!cluster.node_groups().empty()) {
    std::vector<std::vector<std::string>> groups;
    for (const v1::NodeGroup& g : cluster.node_groups()) {
      groups.push_back(
          {TerminalSafe(g.name()) + (g.is_default() ? "*" : ""),
           TerminalSafe(g.state()), std::to_string(g.total_nodes()),
           std::to_string(g.total_cpus()), TerminalSafe(g.nodes())});
    }
    std::cout << "\n"
              << FormatTable({group_kind, "STATE", "NODES", "CPUS", "NODELIST"},
                             groups);
  }
  if (!cluster.nodes().empty()) {
    std::vector<std::vector<std::string>> nodes;
    for (const v1::ClusterNode& n : cluster.nodes()) {
      nodes.push_back({TerminalSafe(n.name()), TerminalSafe(n.address()),
                       TerminalSafe(n.state()),
                       absl::StrCat(n.cpus_allocated(), "/", n.cpus()),
                       std::to_string(n.gpus()),
                       TerminalSafe(absl::StrJoin(n.groups(), ","))});
    }
    std::cout << "\n"
              << FormatTable({"NODE", "ADDRESS", "STATE", "CPUS USED", "GPUS",
                              group_kind + "S"},
                             nodes);
  }
}

void AddClusterCommand(CLI::App* app, const CommandContext& ctx) {
  auto format = std::make_shared<std::string>("table");
  CLI::App* cmd =
      app->add_subcommand("cluster", "Devices, who holds them, and the queue");
  AddOutputFlag(cmd, format.get());
  AddConnectionFlags(cmd, ctx.connection.get());
  cmd->callback([=, exit_code = ctx.exit_code, terminal = ctx.terminal] {
    v1::Cluster cluster;
    auto client =
        ctx.ConnectAndCall([&](DaemonClient& daemon, grpc::ClientContext* c) {
          return daemon.cluster().GetCluster(c, {}, &cluster);
        });
    if (!client) return;
    if (*format != "table") {
      PrintMessage(cluster, *format);
      return;
    }
    std::cout << "shardtraind " << cluster.version() << " at "
              << client->address() << "\n\n";
    std::vector<std::vector<std::string>> devices;
    for (const v1::Device& d : cluster.devices()) {
      devices.push_back(
          {std::to_string(d.index()), v1::DeviceKind_Name(d.kind()), d.name(),
           FormatBytes(d.memory_bytes()),
           d.job_id().empty() ? "-"
                              : absl::StrCat(d.job_id(), " rank ", d.rank())});
    }
    std::cout << FormatTable({"DEVICE", "KIND", "NAME", "MEMORY", "HELD BY"},
                             devices);
    std::vector<std::vector<std::string>> queue;
    for (const v1::QueuedJob& q : cluster.queue()) {
      queue.push_back(
          {q.job_id(), q.owner().empty() ? "-" : q.owner(),
           std::to_string(q.priority()), std::to_string(q.world_size()),
           q.predicted_start_unix_ms() > 0
               ? absl::FormatTime(
                     "%Y-%m-%d %H:%M:%S",
                     absl::FromUnixMillis(q.predicted_start_unix_ms()),
                     absl::LocalTimeZone())
               : "-",
           q.reason()});
    }
    std::cout << "\n"
              << (queue.empty()
                      ? "queue empty\n"
                      : FormatTable({"QUEUED", "OWNER", "PRIORITY", "DEVICES",
                                     "PREDICTED START", "WAITING BECAUSE"},
                                    queue));
    PrintBackendView(cluster);
  });
}

}  // namespace

void AddJobCommands(CLI::App* app, int* exit_code, int argc, char** argv) {
  const CommandContext ctx{std::make_shared<ConnectionOptions>(), exit_code,
                           isatty(STDOUT_FILENO) != 0, argc, argv};
  AddSubmitCommand(app, ctx);
  AddListCommand(app, ctx);
  AddGetCommands(app, ctx);
  AddWatchCommand(app, ctx);
  AddLogsCommand(app, ctx);
  AddCancelCommand(app, ctx);
  AddMetricsCommand(app, ctx);
  AddClusterCommand(app, ctx);
}

}  // namespace shardtrain::cli
