#include "common/dist_env.h"

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

// Parses variable `name` as an integer in [min, max]; `fallback` when unset.
absl::StatusOr<int64_t> ReadInt(const EnvLookup& lookup,
                                const std::string& name, int64_t fallback,
                                int64_t min, int64_t max,
                                const std::string& meaning) {
  const std::optional<std::string> value = lookup(name);
  if (!value.has_value()) return fallback;
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(*value, &parsed) || parsed < min || parsed > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "='", *value, "' is not valid: expected ", meaning,
                     " (an integer in [", min, ", ", max, "])"));
  }
  return parsed;
}

// torchrun's variables from Slurm's, for a process srun started (see the
// header); the other variables pass through.
absl::StatusOr<EnvLookup> SlurmAsTorchrun(const EnvLookup& lookup) {
  std::optional<std::string> node_list;
  for (const char* name :
       {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (!node_list) node_list = lookup(name);
  }
  std::string master_addr;
  if (!lookup("MASTER_ADDR").has_value()) {
    if (!node_list.has_value()) {
      return absl::InvalidArgumentError(
          "srun set SLURM_PROCID but no SLURM_STEP_NODELIST or "
          "SLURM_JOB_NODELIST: set MASTER_ADDR to rank 0's host");
    }
    absl::StatusOr<std::string> first = FirstHostOfNodeList(*node_list);
    if (!first.ok()) return first.status();
    master_addr = *first;
  }
  std::string master_port;
  if (!lookup("MASTER_PORT").has_value()) {
    int64_t job_id = 0;
    const std::optional<std::string> id = lookup("SLURM_JOB_ID");
    if (!id.has_value() || !absl::SimpleAtoi(*id, &job_id) || job_id < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SLURM_JOB_ID='", id.value_or(""),
          "' is not a job id: set MASTER_PORT for the rendezvous"));
    }
    master_port = absl::StrCat(SlurmDefaultPort(job_id));
  }
  return EnvLookup([lookup, master_addr, master_port](
                       const std::string& name) -> std::optional<std::string> {
    if (name == "RANK") return lookup("SLURM_PROCID");
    if (name == "WORLD_SIZE") return lookup("SLURM_NTASKS");
    if (name == "LOCAL_RANK") {
      std::optional<std::string> local = lookup("LOCAL_RANK");
      return local ? local : lookup("SLURM_LOCALID");
    }
    if (name == "LOCAL_WORLD_SIZE") {
      if (auto v = lookup("LOCAL_WORLD_SIZE")) return v;
      if (auto v = lookup("SLURM_NTASKS_PER_NODE")) return v;
      if (auto v = lookup("SLURM_TASKS_PER_NODE")) {
        // "2(x3),1": the first node's count.
        const std::string count =
            v->substr(0, v->find_first_not_of("0123456789"));
        if (!count.empty()) return count;
      }
      return std::nullopt;
    }
    if (name == "MASTER_ADDR" && !master_addr.empty()) return master_addr;
    if (name == "MASTER_PORT" && !master_port.empty()) return master_port;
    return lookup(name);
  });
}

absl::StatusOr<DistEnv> ReadTorchrun(const EnvLookup& lookup);

}  // namespace

absl::StatusOr<std::string> FirstHostOfNodeList(const std::string& list) {
  // Up to the first comma outside brackets.
  std::string host;
  int depth = 0;
  for (char ch : list) {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (ch == ',' && depth == 0) break;
    host.push_back(ch);
  }
  // Each bracket group becomes its first element: "01-03,07" -> "01".
  std::string first;
  for (size_t i = 0; i < host.size(); ++i) {
    if (host[i] != '[') {
      first.push_back(host[i]);
      continue;
    }
    const size_t close = host.find(']', i);
    if (close == std::string::npos) break;
    const std::string group = host.substr(i + 1, close - i - 1);
    const size_t end = group.find_first_of("-,");
    first += group.substr(0, end);
    i = close;
  }
  if (depth != 0 || first.empty() ||
      first.find_first_of("[], ") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Slurm node list '", list, "' is not a host list like node[01-04]"));
  }
  return first;
}

int SlurmDefaultPort(int64_t job_id) {
  return 20000 + static_cast<int>(job_id % 20000);
}

absl::StatusOr<DistEnv> DistEnvFromLookup(const EnvLookup& lookup) {
  const bool torchrun =
      lookup("RANK").has_value() || lookup("WORLD_SIZE").has_value();
  const bool srun = lookup("SLURM_STEP_ID").has_value() &&
                    lookup("SLURM_PROCID").has_value() &&
                    lookup("SLURM_NTASKS").has_value();
  if (!torchrun && srun) {
    absl::StatusOr<EnvLookup> slurm = SlurmAsTorchrun(lookup);
    if (!slurm.ok()) return slurm.status();
    absl::StatusOr<DistEnv> env = ReadTorchrun(*slurm);
    if (env.ok()) env->source = "slurm";
    return env;
  }
  absl::StatusOr<DistEnv> env = ReadTorchrun(lookup);
  if (env.ok() && torchrun) env->source = "torchrun";
  return env;
}

namespace {

absl::StatusOr<DistEnv> ReadTorchrun(const EnvLookup& lookup) {
  const bool has_rank = lookup("RANK").has_value();
  const bool has_world = lookup("WORLD_SIZE").has_value();
  if (has_rank != has_world) {
    return absl::InvalidArgumentError(absl::StrCat(
        has_rank ? "WORLD_SIZE" : "RANK", " is not set but ",
        has_rank ? "RANK" : "WORLD_SIZE",
        " is: a distributed run needs both (as torchrun sets them)"));
  }
  DistEnv env;
  constexpr int64_t kMaxWorld = 1 << 20;
  absl::StatusOr<int64_t> world_size =
      ReadInt(lookup, "WORLD_SIZE", 1, 1, kMaxWorld, "the number of processes");
  if (!world_size.ok()) return world_size.status();
  env.world_size = *world_size;
  absl::StatusOr<int64_t> rank =
      ReadInt(lookup, "RANK", 0, 0, kMaxWorld, "this process's rank");
  if (!rank.ok()) return rank.status();
  if (*rank >= env.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RANK=", *rank, " is not below WORLD_SIZE=", env.world_size,
        ": ranks are 0 .. WORLD_SIZE-1"));
  }
  env.rank = *rank;
  absl::StatusOr<int64_t> local_rank =
      ReadInt(lookup, "LOCAL_RANK", env.rank, 0, env.world_size - 1,
              "the rank on this host, below WORLD_SIZE");
  if (!local_rank.ok()) return local_rank.status();
  env.local_rank = *local_rank;
  absl::StatusOr<int64_t> local_world =
      ReadInt(lookup, "LOCAL_WORLD_SIZE", 0, 0, env.world_size,
              "the processes on this host, at most WORLD_SIZE");
  if (!local_world.ok()) return local_world.status();
  env.local_world_size = *local_world;
  if (std::optional<std::string> addr = lookup("MASTER_ADDR");
      addr.has_value()) {
    if (addr->empty()) {
      return absl::InvalidArgumentError(
          "MASTER_ADDR is empty: expected rank 0's host name or address");
    }
    env.master_addr = *addr;
  }
  absl::StatusOr<int64_t> port = ReadInt(lookup, "MASTER_PORT", env.master_port,
                                         1, 65535, "rank 0's store port");
  if (!port.ok()) return port.status();
  env.master_port = static_cast<int>(*port);
  return env;
}

}  // namespace

absl::StatusOr<DistEnv> DistEnvFromEnvironment() {
  return DistEnvFromLookup(
      [](const std::string& name) -> std::optional<std::string> {
        const char* value = std::getenv(name.c_str());
        if (value == nullptr) return std::nullopt;
        return std::string(value);
      });
}

std::vector<std::pair<std::string, std::string>> TorchrunEnvironment(
    const DistEnv& env, int64_t group_rank) {
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", absl::StrCat(env.rank)},
      {"LOCAL_RANK", absl::StrCat(env.local_rank)},
      {"WORLD_SIZE", absl::StrCat(env.world_size)},
      {"GROUP_RANK", absl::StrCat(group_rank)},
  };
  if (env.local_world_size > 0) {
    vars.emplace_back("LOCAL_WORLD_SIZE", absl::StrCat(env.local_world_size));
  }
  vars.emplace_back("MASTER_ADDR", env.master_addr);
  vars.emplace_back("MASTER_PORT", absl::StrCat(env.master_port));
  return vars;
}

}  // namespace shardtrain
