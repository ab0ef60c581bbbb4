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

}  // namespace

absl::StatusOr<DistEnv> DistEnvFromLookup(const EnvLookup& lookup) {
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

absl::StatusOr<DistEnv> DistEnvFromEnvironment() {
  return DistEnvFromLookup(
      [](const std::string& name) -> std::optional<std::string> {
        const char* value = std::getenv(name.c_str());
        if (value == nullptr) return std::nullopt;
        return std::string(value);
      });
}

}  // namespace shardtrain
