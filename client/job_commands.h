// The job commands of the CLI: submit, list, get/status, watch, logs, cancel,
// metrics, cluster. Each talks to shardtraind through DaemonClient.
#ifndef SHARDTRAIN_CLIENT_JOB_COMMANDS_H_
#define SHARDTRAIN_CLIENT_JOB_COMMANDS_H_

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "client/daemon_client.h"
#include "core/run/train_config.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain::cli {

// What `submit` and `compare` accept: shardtrain-train's flags plus the
// job's own (world size, name, labels, priority, restarts) or a YAML file
// (-f) with the same keys; flags given on the command line win.
struct JobFlags {
  TrainConfig config;
  int world_size = 1;
  std::string name;
  std::vector<std::string> labels;  // key=value
  int priority = 0;
  std::string priority_class;  // one of shardtraind's --priority-class
  int max_restarts = 0;
  int min_world_size = 0;  // elastic when > 0
  std::string file;
  bool device_given = false;
  absl::Status file_status;  // an error reading -f, reported when run

  // The spec to submit (relative data/init_from paths made absolute, device
  // kind left to the daemon unless --device was given).
  absl::StatusOr<v1::JobSpec> ToSpec() const;
};

// Registers the flags on `command`. `argv` is scanned for -f/--file now, so
// the file sets the base values before the flags are parsed.
void AddJobFlags(CLI::App* command, JobFlags* flags, int argc, char** argv);

// Follows a job until it ends: a progress bar on a terminal, one line per
// step otherwise; then a summary. Returns 0 when it succeeded, 1 when it
// failed or was cancelled, 3 when the daemon is unreachable.
int FollowJob(DaemonClient& client, const std::string& job_id, bool terminal,
              std::ostream& out);

void AddJobCommands(CLI::App* app, int* exit_code, int argc, char** argv);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_JOB_COMMANDS_H_
