#include "server/process_spawner.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/subprocess.h"

namespace shardtrain {

std::string ExitStatus::ToString() const {
  return DescribeExit(exit_code, signal);
}

absl::StatusOr<int> PosixProcessSpawner::Spawn(const ProcessSpec& spec) {
  SubprocessOptions options;
  options.argv = spec.argv;
  options.env = spec.env;
  options.process_group = spec.process_group;
  options.output = SubprocessOptions::Output::kLogFile;
  options.log_path = spec.log_path;
  // A rank takes SIGUSR1 (checkpoint and stop) once its handler is in
  // place: one sent right after the launch waits for it. SIGTERM is not
  // held: it stops a rank at once, whatever --worker-binary runs.
  options.held_signals = {SIGUSR1};
  absl::StatusOr<Subprocess> child = SpawnSubprocess(options);
  if (!child.ok()) return child.status();
  return child->pid;
}

std::optional<ExitStatus> PosixProcessSpawner::TryWait(int pid) {
  int status = 0;
  const pid_t r = waitpid(pid, &status, WNOHANG);
  if (r == 0) return std::nullopt;
  ExitStatus exit;
  if (r < 0) {
    // Not our child any more (already reaped elsewhere): treat as gone.
    exit.exit_code = -1;
    exit.signal = 0;
    return exit;
  }
  if (WIFEXITED(status)) exit.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) exit.signal = WTERMSIG(status);
  return exit;
}

void PosixProcessSpawner::Signal(int pid, int pgid, int signal) {
  if (pgid > 0) kill(-pgid, signal);
  if (pid > 0) kill(pid, signal);
}

void PosixProcessSpawner::KillOrphan(int pid, const std::string& marker,
                                     absl::Duration timeout) {
  if (pid <= 0) return;
  const std::string proc = absl::StrCat("/proc/", pid);
  std::ifstream in(proc + "/cmdline", std::ios::binary);
  const std::string cmdline((std::istreambuf_iterator<char>(in)),
                            std::istreambuf_iterator<char>());
  if (cmdline.empty() || cmdline.find(marker) == std::string::npos) return;
  kill(pid, SIGKILL);
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream stat(proc + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return;  // gone
    // State is the field after the ")" that ends the command name.
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() &&
        line[paren + 2] == 'Z') {
      return;  // a zombie waiting for its new parent: it holds nothing
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace shardtrain
