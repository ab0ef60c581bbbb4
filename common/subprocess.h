// SpawnSubprocess: the one way shardtrain starts a child process — the
// coordinator's workers (server/process_spawner) and `shardtrain-train
// --nproc`'s ranks (worker/local_ranks) alike. Torch-free, gRPC-free.
#ifndef SHARDTRAIN_COMMON_SUBPROCESS_H_
#define SHARDTRAIN_COMMON_SUBPROCESS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardtrain {

struct SubprocessOptions {
  std::vector<std::string> argv;  // argv[0] is the executable's path
  // Executed instead of argv[0] when set (argv[0] stays what the child sees).
  std::string program;
  // Added to (or replacing entries of) this process's environment.
  std::vector<std::pair<std::string, std::string>> env;
  int process_group = 0;  // 0: lead a new process group; else join this one
  // A new session and no death signal: the child outlives this process (a
  // daemon started by `shardtrain daemon`). process_group is ignored.
  bool detached = false;
  enum class Output {
    kInherit,  // this process's stdout and stderr
    kLogFile,  // both appended to log_path
    kPipes,    // pipes whose read ends come back in Subprocess
  };
  Output output = Output::kInherit;
  std::string log_path;
  // Signals the child starts with blocked instead of an empty mask (the
  // mask survives exec): for programs of ours that take them once their
  // handlers are in place (common/startup_signals.h). Only signals the
  // child would act on: a program that never unblocks them never sees them
  // (a wrapper script would ignore a SIGTERM held here).
  std::vector<int> held_signals;
};

struct Subprocess {
  int pid = -1;
  int stdout_fd = -1;  // Output::kPipes only; close-on-exec, blocking
  int stderr_fd = -1;
};

// Forks and execs. The child gets its own process group (or joins
// `process_group`), SIGKILL when the thread that spawned it dies
// (PR_SET_PDEATHSIG; it exits at once if that happened before), an empty
// signal mask (but held_signals), stdin on
// /dev/null and no other descriptor of this process (close_range). Everything
// is prepared before fork(), so this is safe in a multi-threaded process. A
// program that cannot be executed is an error here (FailedPrecondition naming
// it and the errno text), not a child that exits 127.
absl::StatusOr<Subprocess> SpawnSubprocess(const SubprocessOptions& options);

// A command run to its end: what it printed and how it ended.
struct CommandResult {
  int exit_code = -1;  // >= 0 when it exited
  int signal = 0;      // > 0 when a signal ended it
  std::string out;     // stdout
  std::string err;     // stderr
  bool ok() const { return exit_code == 0; }
};

// Runs `argv` (searched on PATH when it has no '/') with `env` added to this
// process's environment, collects its output and waits for it, at most
// `timeout_seconds`: past that it is killed (SIGKILL to its process group)
// and the result is DeadlineExceeded naming the command. A command that
// cannot be started is FailedPrecondition. Output beyond 16 MiB per stream
// is dropped.
absl::StatusOr<CommandResult> RunCommand(
    const std::vector<std::string>& argv,
    const std::vector<std::pair<std::string, std::string>>& env,
    double timeout_seconds);

// `name` in the directory of this process's executable: the path of a
// sibling program (shardtraind beside shardtrain, shardtrain-worker beside
// shardtraind).
std::string SiblingProgram(const std::string& name);

// How a process ended, as people read it: "exit code 3" or "signal KILL".
std::string DescribeExit(int exit_code, int signal);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_SUBPROCESS_H_
