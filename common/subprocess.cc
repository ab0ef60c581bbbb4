#include "common/subprocess.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace shardtrain {
namespace {

// Everything the child needs, built before fork(): after fork() in a
// multi-threaded process only async-signal-safe calls are allowed.
struct ExecImage {
  std::string program;
  std::vector<std::string> argv_storage;
  std::vector<std::string> env_storage;
  std::vector<char*> argv;
  std::vector<char*> envp;
};

ExecImage BuildImage(const SubprocessOptions& options) {
  ExecImage image;
  image.program = options.program.empty() ? options.argv[0] : options.program;
  image.argv_storage = options.argv;
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) continue;
    env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [key, value] : options.env) env[key] = value;
  for (const auto& [key, value] : env) {
    image.env_storage.push_back(key + "=" + value);
  }
  for (std::string& s : image.argv_storage) image.argv.push_back(s.data());
  image.argv.push_back(nullptr);
  for (std::string& s : image.env_storage) image.envp.push_back(s.data());
  image.envp.push_back(nullptr);
  return image;
}

// Descriptors the child keeps: 0-2 and the exec-error pipe.
void CloseAllBut(int keep) {
  // close_range (Linux 5.9+) covers every descriptor; the loop is the
  // fallback for older kernels.
  if (syscall(SYS_close_range, 3u, static_cast<unsigned>(keep) - 1, 0u) != 0 ||
      syscall(SYS_close_range, static_cast<unsigned>(keep) + 1, ~0u, 0u) != 0) {
    for (int fd = 3; fd < 4096; ++fd) {
      if (fd != keep) close(fd);
    }
  }
}

// Runs in the child between fork() and exec(): async-signal-safe calls only.
// On failure writes errno to `error_fd` and exits 127.
[[noreturn]] void ExecChild(const ExecImage& image,
                            const SubprocessOptions& options, pid_t parent,
                            int out_fd, int err_fd, int error_fd) {
  const auto fail = [error_fd]() {
    const int err = errno;
    (void)!write(error_fd, &err, sizeof(err));
    _exit(127);
  };
  if (options.detached) {
    if (setsid() < 0) fail();
  } else {
    if (setpgid(0, options.process_group) != 0 && setpgid(0, 0) != 0) fail();
    // The child must not outlive the thread that spawned it, and must notice
    // if that thread died before this line.
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail();
    if (getppid() != parent) _exit(1);
  }
  sigset_t mask;
  sigemptyset(&mask);
  for (int held : options.held_signals) sigaddset(&mask, held);
  sigprocmask(SIG_SETMASK, &mask, nullptr);
  const int null = open("/dev/null", O_RDONLY);
  if (null < 0 || dup2(null, 0) < 0) fail();
  if (options.output == SubprocessOptions::Output::kLogFile) {
    const int log = open(options.log_path.c_str(),
                         O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0) fail();
  } else if (options.output == SubprocessOptions::Output::kPipes) {
    if (dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0) fail();
  }
  // error_fd is close-on-exec; everything else this process holds open
  // (sockets, databases, other children's pipes) stays out of the child.
  CloseAllBut(error_fd);
  execve(image.program.c_str(), image.argv.data(), image.envp.data());
  fail();
  _exit(127);  // not reached: fail() exits
}

void CloseAll(std::initializer_list<int> fds) {
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace

std::string SiblingProgram(const std::string& name) {
  std::error_code ec;
  const std::filesystem::path self =
      std::filesystem::read_symlink("/proc/self/exe", ec);
  return (self.parent_path() / name).string();
}

std::string DescribeExit(int exit_code, int signal) {
  if (signal > 0) {
    const char* abbrev = sigabbrev_np(signal);
    return abbrev != nullptr ? absl::StrCat("signal ", abbrev)
                             : absl::StrCat("signal ", signal);
  }
  return absl::StrCat("exit code ", exit_code);
}

absl::StatusOr<Subprocess> SpawnSubprocess(const SubprocessOptions& options) {
  if (options.argv.empty()) {
    return absl::InvalidArgumentError("spawn: empty argv");
  }
  if (options.output == SubprocessOptions::Output::kLogFile &&
      options.log_path.empty()) {
    return absl::InvalidArgumentError("spawn: no log path");
  }
  const ExecImage image = BuildImage(options);
  int error_pipe[2] = {-1, -1};
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  const bool pipes = options.output == SubprocessOptions::Output::kPipes;
  if (pipe2(error_pipe, O_CLOEXEC) != 0 ||
      (pipes &&
       (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0))) {
    const int err = errno;
    CloseAll({error_pipe[0], error_pipe[1], out_pipe[0], out_pipe[1],
              err_pipe[0], err_pipe[1]});
    return absl::InternalError(absl::StrCat("pipe: ", strerror(err)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    CloseAll({error_pipe[0], error_pipe[1], out_pipe[0], out_pipe[1],
              err_pipe[0], err_pipe[1]});
    return absl::ResourceExhaustedError(absl::StrCat("fork: ", strerror(err)));
  }
  if (pid == 0) {
    ExecChild(image, options, parent, out_pipe[1], err_pipe[1], error_pipe[1]);
  }
  CloseAll({error_pipe[1], out_pipe[1], err_pipe[1]});
  // Also from this side, so the group exists before this returns (a
  // detached child makes its own session, which needs it not to lead a
  // group yet).
  if (!options.detached) {
    setpgid(pid, options.process_group == 0 ? pid : options.process_group);
  }
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(error_pipe[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(error_pipe[0]);
  if (n == sizeof(child_errno)) {
    int status;
    waitpid(pid, &status, 0);
    CloseAll({out_pipe[0], err_pipe[0]});
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot run ", image.program, ": ", strerror(child_errno)));
  }
  return Subprocess{pid, out_pipe[0], err_pipe[0]};
}

namespace {

// The first executable `name` on PATH; `name` itself when it has a '/' or
// nothing matches (the spawn then names it in its error).
std::string FindOnPath(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = dirs.substr(start, end - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return name;
}

}  // namespace

absl::StatusOr<CommandResult> RunCommand(
    const std::vector<std::string>& argv,
    const std::vector<std::pair<std::string, std::string>>& env,
    double timeout_seconds) {
  if (argv.empty()) return absl::InvalidArgumentError("run: empty argv");
  SubprocessOptions options;
  options.argv = argv;
  options.program = FindOnPath(argv[0]);
  options.env = env;
  options.output = SubprocessOptions::Output::kPipes;
  absl::StatusOr<Subprocess> child = SpawnSubprocess(options);
  if (!child.ok()) return child.status();

  constexpr size_t kMaxOutput = size_t{16} << 20;
  CommandResult result;
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  struct pollfd fds[2] = {{child->stdout_fd, POLLIN, 0},
                          {child->stderr_fd, POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_streams = 2;
  bool timed_out = false;
  char buffer[65536];
  while (open_streams > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    const int ready = poll(fds, 2, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_streams;
        continue;
      }
      if (sinks[i]->size() < kMaxOutput) {
        sinks[i]->append(buffer, std::min(static_cast<size_t>(n),
                                          kMaxOutput - sinks[i]->size()));
      }
    }
  }
  for (struct pollfd& fd : fds) {
    if (fd.fd >= 0) close(fd.fd);
  }
  if (timed_out) kill(-child->pid, SIGKILL);
  int status = 0;
  while (waitpid(child->pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    return absl::DeadlineExceededError(
        absl::StrCat("`", absl::StrJoin(argv, " "), "` did not finish within ",
                     timeout_seconds, " s"));
  }
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  return result;
}

}  // namespace shardtrain
