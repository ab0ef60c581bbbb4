#include "server/process_launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace shardtrain {

std::string ExitStatus::ToString() const {
  if (signal > 0) {
    const char* abbrev = sigabbrev_np(signal);
    return absl::StrCat("signal ", abbrev != nullptr ? abbrev : "",
                        abbrev != nullptr ? "" : std::to_string(signal));
  }
  return absl::StrCat("exit code ", exit_code);
}

namespace {

// Everything the child needs, built before fork(): after fork() in a
// multi-threaded process only async-signal-safe calls are allowed.
struct ExecImage {
  std::vector<std::string> argv_storage;
  std::vector<std::string> env_storage;
  std::vector<char*> argv;
  std::vector<char*> envp;
};

ExecImage BuildImage(const ProcessSpec& spec) {
  ExecImage image;
  image.argv_storage = spec.argv;
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) continue;
    env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [key, value] : spec.env) env[key] = value;
  for (const auto& [key, value] : env) {
    image.env_storage.push_back(key + "=" + value);
  }
  for (std::string& s : image.argv_storage) image.argv.push_back(s.data());
  image.argv.push_back(nullptr);
  for (std::string& s : image.env_storage) image.envp.push_back(s.data());
  image.envp.push_back(nullptr);
  return image;
}

// Runs in the child between fork() and exec(): async-signal-safe calls only.
// On failure writes errno to `error_fd` and exits 127.
[[noreturn]] void ExecChild(const ExecImage& image, const char* log_path,
                            int process_group, pid_t parent, int error_fd) {
  auto fail = [error_fd]() {
    const int err = errno;
    (void)!write(error_fd, &err, sizeof(err));
    _exit(127);
  };
  if (setpgid(0, process_group) != 0 && setpgid(0, 0) != 0) fail();
  // The worker must not outlive the coordinator (or rather, the thread that
  // spawned it), and must notice if the coordinator died before this line.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail();
  if (getppid() != parent) _exit(1);
  sigset_t all;
  sigemptyset(&all);
  sigprocmask(SIG_SETMASK, &all, nullptr);
  const int log =
      open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) fail();
  const int null = open("/dev/null", O_RDONLY);
  if (null < 0 || dup2(null, 0) < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0) {
    fail();
  }
  // Everything else the coordinator holds open (sockets, the database) stays
  // out of the worker; error_fd is close-on-exec.
  // close_range (Linux 5.9+) covers every descriptor; the loop is the
  // fallback for older kernels.
  if (syscall(SYS_close_range, 3u, static_cast<unsigned>(error_fd) - 1, 0u) !=
          0 ||
      syscall(SYS_close_range, static_cast<unsigned>(error_fd) + 1, ~0u, 0u) !=
          0) {
    for (int fd = 3; fd < 4096; ++fd) {
      if (fd != error_fd) close(fd);
    }
  }
  execve(image.argv[0], image.argv.data(), image.envp.data());
  fail();
  _exit(127);  // not reached: fail() exits
}

}  // namespace

absl::StatusOr<int> PosixProcessLauncher::Spawn(const ProcessSpec& spec) {
  if (spec.argv.empty()) {
    return absl::InvalidArgumentError("spawn: empty argv");
  }
  const ExecImage image = BuildImage(spec);
  int error_pipe[2];
  if (pipe2(error_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(error_pipe[0]);
    close(error_pipe[1]);
    return absl::ResourceExhaustedError(absl::StrCat("fork: ", strerror(err)));
  }
  if (pid == 0) {
    close(error_pipe[0]);
    ExecChild(image, spec.log_path.c_str(), spec.process_group, parent,
              error_pipe[1]);
  }
  close(error_pipe[1]);
  // Also from this side, so the group exists before Spawn returns.
  setpgid(pid, spec.process_group == 0 ? pid : spec.process_group);
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(error_pipe[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(error_pipe[0]);
  if (n == sizeof(child_errno)) {
    int status;
    waitpid(pid, &status, 0);
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot start ", spec.argv[0], ": ", strerror(child_errno)));
  }
  return pid;
}

std::optional<ExitStatus> PosixProcessLauncher::TryWait(int pid) {
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

void PosixProcessLauncher::Signal(int pid, int pgid, int signal) {
  if (pgid > 0) kill(-pgid, signal);
  if (pid > 0) kill(pid, signal);
}

void PosixProcessLauncher::KillOrphan(int pid, const std::string& marker,
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
