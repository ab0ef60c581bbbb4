// ProcessSpawner: how the coordinator starts, signals and reaps worker
// processes. PosixProcessSpawner fork/execs; tests use a fake.
#ifndef SHARDTRAIN_SERVER_PROCESS_SPAWNER_H_
#define SHARDTRAIN_SERVER_PROCESS_SPAWNER_H_

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardtrain {

struct ProcessSpec {
  std::vector<std::string> argv;  // argv[0] is the executable's path
  // Added to (or replacing entries of) the coordinator's environment.
  std::vector<std::pair<std::string, std::string>> env;
  std::string log_path;   // stdout and stderr are appended here
  int process_group = 0;  // 0: lead a new process group; else join this one
};

// How a process ended: exit_code >= 0 when it exited, signal > 0 when a
// signal killed it.
struct ExitStatus {
  int exit_code = -1;
  int signal = 0;

  bool success() const { return exit_code == 0; }
  // "exit code 3" or "signal KILL".
  std::string ToString() const;
};

class ProcessSpawner {
 public:
  virtual ~ProcessSpawner() = default;

  // Starts the process; returns its pid. The child dies with the thread that
  // spawned it (parent-death signal), so call this from a thread that lives
  // as long as the coordinator. Failing to exec is an error here, not a
  // child that exits 127.
  virtual absl::StatusOr<int> Spawn(const ProcessSpec& spec) = 0;

  // Reaps `pid` when it has ended; nullopt while it runs.
  virtual std::optional<ExitStatus> TryWait(int pid) = 0;

  // Sends `signal` to the process group `pgid` (and to `pid` itself, in case
  // it left the group). Signals to processes already gone are ignored.
  virtual void Signal(int pid, int pgid, int signal) = 0;

  // A process left by an earlier coordinator (not our child): SIGKILLs it
  // when its command line contains `marker` (so a reused pid is spared) and
  // waits up to `timeout` for it to disappear.
  virtual void KillOrphan(int pid, const std::string& marker,
                          absl::Duration timeout) = 0;
};

class PosixProcessSpawner : public ProcessSpawner {
 public:
  absl::StatusOr<int> Spawn(const ProcessSpec& spec) override;
  std::optional<ExitStatus> TryWait(int pid) override;
  void Signal(int pid, int pgid, int signal) override;
  void KillOrphan(int pid, const std::string& marker,
                  absl::Duration timeout) override;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_PROCESS_SPAWNER_H_
