#include "server/slurm.h"

#include <signal.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/exit_codes.h"
#include "common/read_roots.h"
#include "common/subprocess.h"

namespace shardtrain {
namespace {

// "Key=Value Key2=Value2 ..." as scontrol's one-line (-o) format prints it.
// Values hold no spaces, except the last key of a node's line (Reason=...):
// a token without '=' continues the previous value.
std::map<std::string, std::string> KeyValues(absl::string_view line) {
  std::map<std::string, std::string> values;
  std::string last;
  for (absl::string_view token :
       absl::StrSplit(line, absl::ByAnyChar(" \t\n"), absl::SkipEmpty())) {
    const size_t eq = token.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      if (!last.empty()) absl::StrAppend(&values[last], " ", token);
      continue;
    }
    last = std::string(token.substr(0, eq));
    values[last] = std::string(token.substr(eq + 1));
  }
  return values;
}

// The value of `key`, "" when absent.
std::string Field(const std::map<std::string, std::string>& values,
                  const char* key) {
  auto it = values.find(key);
  return it == values.end() ? std::string() : it->second;
}

int ToInt(const std::string& text) {
  int value = 0;
  return absl::SimpleAtoi(text, &value) ? value : 0;
}

// "143:0" -> exit 143, signal 0.
void ParseExitCode(absl::string_view text, SlurmJobInfo* info) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  if (!parts.empty()) (void)absl::SimpleAtoi(parts[0], &info->exit_code);
  if (parts.size() > 1) (void)absl::SimpleAtoi(parts[1], &info->signal);
}

// "gpu:4", "gpu:h200:8(S:0-1)", "gpu:2,shard:8" -> the GPU count.
int GpusOf(const std::string& gres) {
  int total = 0;
  for (absl::string_view entry : absl::StrSplit(gres, ',')) {
    if (!absl::StartsWith(entry, "gpu")) continue;
    entry = entry.substr(0, entry.find('('));
    const size_t colon = entry.rfind(':');
    int count = 0;
    if (colon != absl::string_view::npos &&
        absl::SimpleAtoi(entry.substr(colon + 1), &count)) {
      total += count;
    }
  }
  return total;
}

std::string SignalName(int signal) {
  switch (signal) {
    case SIGTERM:
      return "TERM";
    case SIGKILL:
      return "KILL";
    case SIGINT:
      return "INT";
    case SIGUSR1:
      return "USR1";
    default:
      return std::to_string(signal);
  }
}

// The first "task N: <what>" srun reported, skipping the tasks srun itself
// terminated after the first failure (--kill-on-bad-exit).
bool FirstTaskFailure(const std::vector<std::string>& log, int* task,
                      std::string* what) {
  for (const std::string& line : log) {
    const size_t at = line.find(": task ");
    if (at == std::string::npos || !absl::StrContains(line, "srun")) continue;
    absl::string_view rest = absl::string_view(line).substr(at + 7);
    const size_t colon = rest.find(':');
    if (colon == absl::string_view::npos) continue;
    int rank = -1;
    if (!absl::SimpleAtoi(rest.substr(0, colon), &rank)) continue;
    const std::string description(
        absl::StripAsciiWhitespace(rest.substr(colon + 1)));
    if (description == "Terminated") continue;
    *task = rank;
    *what = description;
    return true;
  }
  return false;
}

}  // namespace

bool SlurmJobInfo::Ended() const {
  static const char* const kEnded[] = {
      "COMPLETED",     "FAILED",       "CANCELLED", "NODE_FAIL",
      "OUT_OF_MEMORY", "TIMEOUT",      "BOOT_FAIL", "DEADLINE",
      "PREEMPTED",     "SPECIAL_EXIT", "REVOKED",   "RESV_DEL_HOLD"};
  // sacct prints "CANCELLED by 0".
  const std::string first = state.substr(0, state.find(' '));
  return std::find(std::begin(kEnded), std::end(kEnded), first) !=
         std::end(kEnded);
}

bool SlurmJobInfo::Waiting() const {
  return state == "PENDING" || state == "CONFIGURING" || state == "REQUEUED" ||
         state == "REQUEUE_HOLD" || state == "REQUEUE_FED" ||
         state == "RESIZING" || state == "SUSPENDED";
}

std::string ShellQuote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

SlurmLaunchPlan PlanSlurmLaunch(const RankLaunch& launch,
                                const SlurmOptions& options,
                                const std::string& batch_log) {
  SlurmLaunchPlan plan;
  const int world = launch.world_size;
  const bool gpu = options.gpus_per_node > 0;
  const int per_node = std::max(
      1, std::min(world, gpu ? options.gpus_per_node : options.tasks_per_node));
  const int nodes = (world + per_node - 1) / per_node;
  std::vector<std::string>& args = plan.sbatch_args;
  args = {"--parsable",
          "--no-requeue",
          absl::StrCat("--job-name=shardtrain-", launch.job_id),
          absl::StrCat("--nodes=", nodes),
          absl::StrCat("--ntasks=", world),
          absl::StrCat("--ntasks-per-node=", per_node),
          absl::StrCat("--cpus-per-task=", std::max(1, options.cpus_per_task)),
          absl::StrCat("--output=", batch_log),
          "--open-mode=append",
          absl::StrCat("--chdir=", launch.job_dir)};
  if (gpu) args.push_back(absl::StrCat("--gpus-per-node=", per_node));
  if (!options.partition.empty()) {
    args.push_back(absl::StrCat("--partition=", options.partition));
  }
  for (const std::string& extra : options.extra_sbatch_args) {
    args.push_back(extra);
  }

  // Rank r's log is job_dir/rank-<r>.log, as on one host: srun's %t is the
  // task id, which is the rank.
  const std::string log_pattern = launch.job_dir + "/rank-%t.log";
  std::vector<std::string> worker = {
      launch.worker_binary, "--spec",   launch.spec_path, "--out",
      launch.job_dir,       "--job-id", launch.job_id};
  if (!gpu) {
    worker.push_back("--threads");
    worker.push_back(std::to_string(std::max(1, options.cpus_per_task)));
  }
  if (launch.resume) worker.push_back("--resume");
  if (!launch.prepare_data.empty()) {
    worker.push_back("--prepare-data");
    worker.push_back(launch.prepare_data);
  }
  std::vector<std::string> quoted;
  for (const std::string& arg : worker) quoted.push_back(ShellQuote(arg));

  plan.script = absl::StrCat(
      "#!/bin/bash\n"
      "# Written by shardtraind for job ",
      launch.job_id,
      ". Runs on the allocation's first node, where task 0 (rank 0)\n"
      "# and its rendezvous store run: the other nodes reach it at this "
      "node's\n"
      "# address as slurm.conf gives it (NodeAddr), the port follows from\n"
      "# SLURM_JOB_ID. Ranks read SLURM_PROCID, SLURM_NTASKS and "
      "SLURM_LOCALID.\n"
      "addr=$(scontrol show node \"$SLURMD_NODENAME\" 2>/dev/null |\n"
      "  sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)\n"
      "export MASTER_ADDR=\"${addr:-$SLURMD_NODENAME}\"\n"
      "exec srun --kill-on-bad-exit=1 --open-mode=append \\\n"
      "  --output=",
      ShellQuote(log_pattern), " \\\n  ", absl::StrJoin(quoted, " "), "\n");

  plan.env = {
      {"SHARDTRAIN_JOB_ID", launch.job_id},
      {"SHARDTRAIN_COORDINATOR", launch.coordinator_address},
      {"SHARDTRAIN_JOB_SECRET", launch.secret},
      {"SHARDTRAIN_HEARTBEAT_SECONDS", absl::StrCat(launch.heartbeat_seconds)},
      // Slurm preempts a job with SIGTERM (then SIGKILL after GraceTime):
      // the ranks take it as the request to save a checkpoint at the next
      // step boundary, as they take shardtraind's SIGUSR1.
      {"SHARDTRAIN_CHECKPOINT_ON_SIGTERM", "1"},
  };
  if (!launch.read_roots.empty()) {
    plan.env.push_back({kReadRootsEnv, launch.read_roots});
  }
  if (!gpu) {
    plan.env.push_back({"OMP_NUM_THREADS",
                        std::to_string(std::max(1, options.cpus_per_task))});
    plan.env.push_back({"CUDA_VISIBLE_DEVICES", ""});
  }
  return plan;
}

absl::StatusOr<std::string> ParseSbatchJobId(const std::string& text) {
  const std::string line(
      absl::StripAsciiWhitespace(absl::string_view(text).substr(
          0, std::min(text.find('\n'), text.size()))));
  const std::string id = line.substr(0, line.find(';'));
  int64_t number = 0;
  if (id.empty() || !absl::SimpleAtoi(id, &number) || number <= 0) {
    return absl::InternalError(absl::StrCat(
        "sbatch printed no job id (expected '<id>[;cluster]'), got '", line,
        "'"));
  }
  return id;
}

absl::StatusOr<SlurmJobInfo> ParseScontrolJob(const std::string& text) {
  const std::map<std::string, std::string> values = KeyValues(text);
  SlurmJobInfo info;
  info.job_id = Field(values, "JobId");
  info.state = Field(values, "JobState");
  if (info.job_id.empty() || info.state.empty()) {
    return absl::InternalError(absl::StrCat(
        "scontrol printed no JobId/JobState: '", text.substr(0, 200), "'"));
  }
  info.reason = Field(values, "Reason");
  ParseExitCode(Field(values, "ExitCode"), &info);
  info.nodes = Field(values, "NodeList");
  if (info.nodes == "(null)") info.nodes.clear();
  info.batch_host = Field(values, "BatchHost");
  return info;
}

absl::StatusOr<SlurmJobInfo> ParseSacctJob(const std::string& text) {
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<std::string> fields = absl::StrSplit(line, '|');
    if (fields.size() < 4) continue;
    // The allocation's own line ("123"), not its steps ("123.batch").
    if (fields[0].find('.') != std::string::npos) continue;
    SlurmJobInfo info;
    info.job_id = fields[0];
    info.state = fields[1];
    ParseExitCode(fields[2], &info);
    info.nodes = fields[3];
    if (info.nodes == "None assigned") info.nodes.clear();
    return info;
  }
  return absl::NotFoundError("sacct has no record of the job");
}

std::vector<SlurmNode> ParseScontrolNodes(const std::string& text) {
  std::vector<SlurmNode> nodes;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const std::map<std::string, std::string> values = KeyValues(line);
    SlurmNode node;
    node.name = Field(values, "NodeName");
    if (node.name.empty()) continue;
    node.address = Field(values, "NodeAddr");
    node.state = Field(values, "State");
    node.cpus = ToInt(Field(values, "CPUTot"));
    node.cpus_allocated = ToInt(Field(values, "CPUAlloc"));
    node.gpus = GpusOf(Field(values, "Gres"));
    const std::string partitions = Field(values, "Partitions");
    if (!partitions.empty() && partitions != "(null)") {
      node.partitions = absl::StrSplit(partitions, ',');
    }
    nodes.push_back(std::move(node));
  }
  return nodes;
}

std::vector<SlurmPartition> ParseScontrolPartitions(const std::string& text) {
  std::vector<SlurmPartition> partitions;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const std::map<std::string, std::string> values = KeyValues(line);
    SlurmPartition partition;
    partition.name = Field(values, "PartitionName");
    if (partition.name.empty()) continue;
    partition.state = Field(values, "State");
    partition.nodes = Field(values, "Nodes");
    partition.total_nodes = ToInt(Field(values, "TotalNodes"));
    partition.total_cpus = ToInt(Field(values, "TotalCPUs"));
    partition.is_default = Field(values, "Default") == "YES";
    partitions.push_back(std::move(partition));
  }
  return partitions;
}

SlurmOutcome ClassifySlurmEnd(const SlurmJobInfo& info,
                              const std::vector<std::string>& batch_log) {
  SlurmOutcome outcome;
  const std::string state = info.state.substr(0, info.state.find(' '));
  const std::string job = absl::StrCat("Slurm job ", info.job_id);
  const std::string on =
      info.nodes.empty() ? "" : absl::StrCat(" (nodes ", info.nodes, ")");
  if (state == "COMPLETED") {
    outcome.success = true;
    outcome.exit_code = 0;
    outcome.message = absl::StrCat(job, " completed");
    return outcome;
  }
  int task = -1;
  std::string what;
  const bool found_task = FirstTaskFailure(batch_log, &task, &what);
  if (state == "PREEMPTED" ||
      (found_task &&
       what == absl::StrCat("Exited with exit code ", kExitPreempted))) {
    outcome.preempted = true;
    outcome.exit_code = kExitPreempted;
    outcome.message = absl::StrCat(
        job, state == "PREEMPTED" ? " was preempted by Slurm" : " stopped", on,
        " after its ranks were asked to save a checkpoint");
    return outcome;
  }
  if (state == "NODE_FAIL") {
    outcome.reason = v1::NODE_FAILURE;
    outcome.message =
        absl::StrCat(job, " lost a node", on, ": Slurm says ",
                     info.reason.empty() ? "NODE_FAIL" : info.reason);
    return outcome;
  }
  if (state == "OUT_OF_MEMORY" ||
      std::any_of(batch_log.begin(), batch_log.end(),
                  [](const std::string& line) {
                    return absl::StrContains(line, "oom-kill") ||
                           absl::StrContains(line, "OUT_OF_MEMORY");
                  })) {
    outcome.reason = v1::OOM;
    outcome.rank = found_task ? task : -1;
    outcome.message =
        absl::StrCat(job, " ran out of memory", on,
                     found_task ? absl::StrCat(" (rank ", task, ")") : "");
    return outcome;
  }
  if (found_task) {
    outcome.rank = task;
    const std::string exited = "Exited with exit code ";
    if (absl::StartsWith(what, exited) &&
        absl::SimpleAtoi(what.substr(exited.size()), &outcome.exit_code)) {
      outcome.reason = v1::EXIT_CODE;
      outcome.message = absl::StrCat("rank ", task, " ended with exit code ",
                                     outcome.exit_code, " (", job, ")");
    } else {
      outcome.reason = v1::SIGNAL;
      outcome.signal = what == "Killed" ? SIGKILL : 0;
      outcome.message = absl::StrCat(
          "rank ", task, " ended: ", what == "Killed" ? "signal KILL" : what,
          " (", job, ")");
    }
    return outcome;
  }
  if (state == "TIMEOUT" || state == "DEADLINE") {
    outcome.reason = v1::SIGNAL;
    outcome.message = absl::StrCat(job, " reached Slurm's time limit", on);
  } else if (state == "CANCELLED") {
    outcome.reason = v1::SIGNAL;
    outcome.message =
        absl::StrCat(job, " was cancelled outside shardtraind", on);
  } else if (state == "FAILED" && info.signal > 0) {
    outcome.reason = v1::SIGNAL;
    outcome.signal = info.signal;
    outcome.message =
        absl::StrCat(job, " ended with signal ", SignalName(info.signal), on);
  } else if (state == "FAILED") {
    outcome.reason = v1::EXIT_CODE;
    outcome.exit_code = info.exit_code;
    outcome.message = absl::StrCat(job, " failed with exit code ",
                                   info.exit_code, on, ": ", info.reason);
  } else {
    outcome.reason = v1::EXIT_CODE;
    outcome.message =
        absl::StrCat(job, " ended ", info.state, on,
                     info.reason.empty() ? "" : ": ", info.reason);
  }
  return outcome;
}

bool SlurmNodeUsable(const std::string& state) {
  // A base state and flags joined by '+' (MIXED+DRAIN, IDLE+CLOUD+
  // POWERED_DOWN); a trailing '*' means not responding.
  if (state.empty() || absl::EndsWith(state, "*")) return false;
  static const std::set<std::string>* const kUnusable =
      new std::set<std::string>{"DOWN",           "FAIL",
                                "FAILING",        "FUTURE",
                                "UNKNOWN",        "DRAIN",
                                "DRAINED",        "DRAINING",
                                "NOT_RESPONDING", "REBOOT_REQUESTED",
                                "REBOOT_ISSUED",  "MAINT",
                                "RESERVED",       "INVAL",
                                "INVALID_REG"};
  for (absl::string_view word : absl::StrSplit(state, '+')) {
    if (kUnusable->count(absl::AsciiStrToUpper(word))) return false;
  }
  return true;
}

absl::StatusOr<SlurmCapacity> SlurmPartitionCapacity(
    const std::vector<SlurmNode>& nodes,
    const std::vector<SlurmPartition>& partitions,
    const SlurmOptions& options) {
  std::string name = options.partition;
  if (name.empty()) {
    for (const SlurmPartition& partition : partitions) {
      if (partition.is_default) name = partition.name;
    }
    if (name.empty()) {
      return absl::FailedPreconditionError(
          "Slurm has no default partition: give --slurm-partition");
    }
  }
  // A partition that is not UP schedules nothing.
  bool partition_up = true;
  for (const SlurmPartition& partition : partitions) {
    if (partition.name == name && !partition.state.empty()) {
      partition_up = absl::AsciiStrToUpper(partition.state) == "UP";
    }
  }
  const int per_node =
      std::max(1, options.gpus_per_node > 0 ? options.gpus_per_node
                                            : options.tasks_per_node);
  SlurmCapacity capacity;
  for (const SlurmNode& node : nodes) {
    if (std::find(node.partitions.begin(), node.partitions.end(), name) ==
        node.partitions.end()) {
      continue;
    }
    capacity.slots += per_node;
    const bool unusable = !SlurmNodeUsable(node.state);
    if (unusable || !partition_up) {
      capacity.unusable_nodes.push_back(
          absl::StrCat(node.name, " (", node.state, ")"));
    } else {
      capacity.usable_slots += per_node;
    }
  }
  if (capacity.slots == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Slurm partition '", name, "' has no nodes (or does not exist)"));
  }
  return capacity;
}

absl::StatusOr<int> SlurmSlotCount(
    const std::vector<SlurmNode>& nodes,
    const std::vector<SlurmPartition>& partitions,
    const SlurmOptions& options) {
  absl::StatusOr<SlurmCapacity> capacity =
      SlurmPartitionCapacity(nodes, partitions, options);
  if (!capacity.ok()) return capacity.status();
  return capacity->slots;
}

// ---------------------------------------------------------------------------
// CommandSlurmClient

CommandSlurmClient::CommandSlurmClient(SlurmOptions options)
    : options_(std::move(options)) {}

namespace {

// Runs a Slurm command; its stderr names the problem when it fails.
absl::StatusOr<std::string> Slurm(
    const std::vector<std::string>& argv, double timeout,
    const std::vector<std::pair<std::string, std::string>>& env = {}) {
  absl::StatusOr<CommandResult> result = RunCommand(argv, env, timeout);
  if (!result.ok()) {
    return absl::UnavailableError(
        absl::StrCat("Slurm: ", result.status().message()));
  }
  if (!result->ok()) {
    return absl::UnavailableError(
        absl::StrCat("`", absl::StrJoin(argv, " "), "` failed (",
                     DescribeExit(result->exit_code, result->signal),
                     "): ", absl::StripAsciiWhitespace(result->err)));
  }
  return result->out;
}

}  // namespace

absl::StatusOr<std::string> CommandSlurmClient::Submit(
    const SlurmLaunchPlan& plan, const std::string& script_path) {
  std::vector<std::string> argv = {"sbatch"};
  argv.insert(argv.end(), plan.sbatch_args.begin(), plan.sbatch_args.end());
  argv.push_back(script_path);
  absl::StatusOr<std::string> out =
      Slurm(argv, options_.command_timeout_seconds, plan.env);
  if (!out.ok()) return out.status();
  return ParseSbatchJobId(*out);
}

absl::StatusOr<SlurmJobInfo> CommandSlurmClient::Query(
    const std::string& job_id) {
  absl::StatusOr<CommandResult> result =
      RunCommand({"scontrol", "show", "job", "-o", job_id}, {},
                 options_.command_timeout_seconds);
  if (!result.ok()) return result.status();
  if (result->ok()) return ParseScontrolJob(result->out);
  if (!absl::StrContains(result->err, "Invalid job id")) {
    return absl::UnavailableError(
        absl::StrCat("scontrol show job ", job_id, ": ",
                     absl::StripAsciiWhitespace(result->err)));
  }
  // Purged from the controller's memory (MinJobAge): ask the accounting.
  absl::StatusOr<std::string> sacct =
      Slurm({"sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode,NodeList",
             "-j", job_id},
            options_.command_timeout_seconds);
  if (!sacct.ok()) {
    return absl::NotFoundError(absl::StrCat("Slurm has no record of job ",
                                            job_id, " (",
                                            sacct.status().message(), ")"));
  }
  absl::StatusOr<SlurmJobInfo> info = ParseSacctJob(*sacct);
  if (!info.ok()) {
    return absl::NotFoundError(
        absl::StrCat("Slurm has no record of job ", job_id));
  }
  return info;
}

absl::Status CommandSlurmClient::Signal(const std::string& job_id, int signal) {
  absl::StatusOr<std::string> out =
      Slurm({"scancel", absl::StrCat("--signal=", SignalName(signal)), job_id},
            options_.command_timeout_seconds);
  // A job whose tasks have not started cannot take a signal: end it.
  if (!out.ok()) return Cancel(job_id);
  return absl::OkStatus();
}

absl::Status CommandSlurmClient::Cancel(const std::string& job_id) {
  return Slurm({"scancel", job_id}, options_.command_timeout_seconds).status();
}

absl::StatusOr<std::vector<SlurmNode>> CommandSlurmClient::Nodes() {
  absl::StatusOr<std::string> out = Slurm({"scontrol", "show", "node", "-o"},
                                          options_.command_timeout_seconds);
  if (!out.ok()) return out.status();
  return ParseScontrolNodes(*out);
}

absl::StatusOr<std::vector<SlurmPartition>> CommandSlurmClient::Partitions() {
  absl::StatusOr<std::string> out =
      Slurm({"scontrol", "show", "partition", "-o"},
            options_.command_timeout_seconds);
  if (!out.ok()) return out.status();
  return ParseScontrolPartitions(*out);
}

}  // namespace shardtrain
