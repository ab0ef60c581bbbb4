#include "client/daemon_command.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/daemon_client.h"
#include "client/exit_code.h"
#include "common/input_file.h"
#include "common/startup_signals.h"
#include "common/state_dir.h"
#include "common/subprocess.h"

namespace shardtrain::cli {
namespace {

// The first line of a file the daemon wrote into its state directory, read
// as every file of our own (a FIFO or a device there cannot stall the CLI);
// "" when there is none.
std::string OwnFileFirstLine(const std::string& path) {
  absl::StatusOr<std::string> text = ReadOwnFile(path, 1 << 16, path);
  if (!text.ok()) return "";
  return text->substr(0, text->find('\n'));
}

// The last non-empty line of a log the daemon wrote, from its last 64 KiB.
std::string OwnFileLastLine(const std::string& path) {
  absl::StatusOr<InputFile> file = InputFile::OpenOwn(path);
  if (!file.ok()) return "";
  const int64_t bytes = std::min<int64_t>(file->size(), 1 << 16);
  std::string tail(static_cast<size_t>(bytes), '\0');
  if (!file->ReadAt(file->size() - bytes, tail.data(), bytes).ok()) return "";
  while (!tail.empty() && tail.back() == '\n') tail.pop_back();
  return tail.substr(tail.rfind('\n') + 1);
}

struct DaemonFlags {
  std::string state_dir;
  std::string listen = "127.0.0.1:50551";
  std::string metrics_listen = "127.0.0.1:9464";
  int cpu_slots = 0;
  std::string device_kind = "auto";
  bool foreground = false;
};

int RunDaemon(const DaemonFlags& flags) {
  const std::string state_dir =
      flags.state_dir.empty() ? DefaultStateDir() : flags.state_dir;
  ConnectionOptions connection;
  connection.address = flags.listen;
  absl::StatusOr<std::unique_ptr<DaemonClient>> client =
      DaemonClient::Connect(connection);
  if (client.ok()) {
    auto context = (*client)->Context();
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(2));
    v1::Cluster cluster;
    const grpc::Status s =
        (*client)->cluster().GetCluster(context.get(), {}, &cluster);
    if (s.ok() || s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      std::cout << "shardtraind already running at " << flags.listen << "\n";
      return kExitOk;
    }
  }
  std::vector<std::string> args = {SiblingProgram("shardtraind"),
                                   "--state-dir",
                                   state_dir,
                                   "--listen",
                                   flags.listen,
                                   "--metrics-listen",
                                   flags.metrics_listen};
  args.push_back("--device-kind");
  args.push_back(flags.device_kind);
  if (flags.cpu_slots > 0) {
    args.push_back("--cpu-slots");
    args.push_back(std::to_string(flags.cpu_slots));
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (flags.foreground) {
    HoldStartupSignals();  // the mask survives exec (common/startup_signals.h)
    execv(argv[0], argv.data());
    return ReportFailure(absl::StrCat("cannot run ", args[0]));
  }
  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  std::filesystem::remove(state_dir + "/endpoint", ec);
  const std::string log = state_dir + "/shardtraind.log";
  SubprocessOptions daemon;
  daemon.argv = args;
  daemon.detached = true;  // outlives this shell command
  daemon.output = SubprocessOptions::Output::kLogFile;
  daemon.log_path = log;
  // A SIGHUP (token rotation) or SIGTERM sent while it starts waits for it.
  daemon.held_signals = {SIGHUP, SIGINT, SIGTERM, SIGUSR1};
  absl::StatusOr<Subprocess> started = SpawnSubprocess(daemon);
  if (!started.ok()) {
    return ReportFailure(absl::StrCat("cannot start ", args[0], ": ",
                                      started.status().message()));
  }
  const pid_t pid = started->pid;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    const std::string address = OwnFileFirstLine(state_dir + "/endpoint");
    if (!address.empty()) {
      std::cout << "shardtraind started at " << address << " (pid " << pid
                << "; state in " << state_dir << ", log " << log << ")\n";
      return kExitOk;
    }
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return ReportFailure(
          absl::StrCat("shardtraind exited: ", OwnFileLastLine(log)));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return ReportFailure(
      absl::StrCat("shardtraind did not start within 60 s; see ", log));
}

// The first line of a /proc file (whose size reads as 0, so not through
// the bounded reader).
std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Whether `pid` has exited (gone, or a zombie its new parent has yet to
// reap).
bool Exited(pid_t pid) {
  if (kill(pid, 0) != 0) return true;
  const std::string stat = FirstLine(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() &&
         stat[paren + 2] == 'Z';
}

// The shardtraind that holds state_dir/LOCK, by pid; 0 when none does. The
// pid written in the file is believed only while its lock is held (a daemon
// killed with -9 leaves its pid behind, and the number may be reused by
// another process), and only when that process is a shardtraind.
absl::StatusOr<pid_t> LockHolder(const std::string& state_dir) {
  const std::string path = state_dir + "/LOCK";
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return 0;
    return absl::PermissionDeniedError(absl::StrCat("cannot open ", path));
  }
  if (flock(fd, LOCK_SH | LOCK_NB) == 0) {
    close(fd);  // nobody holds it: no daemon, whatever pid the file names
    return 0;
  }
  char text[32] = {};
  (void)!pread(fd, text, sizeof(text) - 1, 0);
  close(fd);
  int pid = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &pid) || pid <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is locked but names no pid"));
  }
  const std::string name = FirstLine(absl::StrCat("/proc/", pid, "/comm"));
  if (name != "shardtraind") {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is locked and names pid ", pid, ", which is ",
                     name.empty() ? "not running" : "'" + name + "'",
                     ", not shardtraind: nothing signalled"));
  }
  return pid;
}

struct LifecycleFlags {
  std::string state_dir;
  int timeout = 60;  // seconds stop waits for the daemon to exit
};

std::string StateDirOf(const LifecycleFlags& flags) {
  return flags.state_dir.empty() ? DefaultStateDir() : flags.state_dir;
}

// Where daemon `pid` logs: the state directory's shardtraind.log when its
// stderr is that file (`shardtrain daemon` starts it so), else the stderr
// it was started with. Without /proc to ask (another user's process), the
// log file when it exists.
std::string DaemonLogPlace(pid_t pid, const std::string& state_dir) {
  namespace fs = std::filesystem;
  const std::string log = state_dir + "/shardtraind.log";
  std::error_code ec;
  const fs::path target =
      fs::read_symlink(absl::StrCat("/proc/", pid, "/fd/2"), ec);
  if (ec) {
    return fs::exists(log, ec) ? absl::StrCat("log ", log)
                               : "log: its own stderr";
  }
  const fs::path canonical_log = fs::weakly_canonical(log, ec);
  if (!ec && target == canonical_log) return absl::StrCat("log ", log);
  return absl::StrCat("log: its own stderr (", target.string(),
                      "; started directly, not by `shardtrain daemon`)");
}

int RunStatus(const LifecycleFlags& flags) {
  const std::string state_dir = StateDirOf(flags);
  absl::StatusOr<pid_t> pid = LockHolder(state_dir);
  if (!pid.ok()) return ReportFailure(pid.status());
  if (*pid == 0) {
    std::cout << "shardtraind is not running (state in " << state_dir << ")\n";
    return kExitUnreachable;
  }
  const std::string address = OwnFileFirstLine(state_dir + "/endpoint");
  const std::string metrics = OwnFileFirstLine(state_dir + "/metrics_endpoint");
  std::cout << "shardtraind is running: pid " << *pid << ", listening on "
            << (address.empty() ? "(starting)" : address);
  if (!metrics.empty()) std::cout << ", metrics on " << metrics;
  std::cout << "\n  state in " << state_dir << ", "
            << DaemonLogPlace(*pid, state_dir) << "\n";
  return kExitOk;
}

int RunStop(const LifecycleFlags& flags) {
  const std::string state_dir = StateDirOf(flags);
  absl::StatusOr<pid_t> pid = LockHolder(state_dir);
  if (!pid.ok()) return ReportFailure(pid.status());
  if (*pid == 0) {
    std::cout << "shardtraind is not running (state in " << state_dir << ")\n";
    return kExitOk;
  }
  // SIGTERM: the daemon stops its workers (their grace period) and keeps
  // every job's state; it is gone when it lets go of the lock.
  if (kill(*pid, SIGTERM) != 0) {
    return ReportFailure(
        absl::StrCat("cannot signal shardtraind (pid ", *pid, ")"));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(flags.timeout);
  while (absl::Now() < deadline) {
    // It lets go of the lock just before it exits.
    absl::StatusOr<pid_t> holder = LockHolder(state_dir);
    if (holder.ok() && *holder == 0 && Exited(*pid)) {
      std::cout << "stopped shardtraind (pid " << *pid << "; state kept in "
                << state_dir << ")\n";
      return kExitOk;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return ReportFailure(absl::StrCat(
      "shardtraind (pid ", *pid, ") is still running after ", flags.timeout,
      " s; see ", state_dir, "/shardtraind.log (kill -9 ", *pid,
      " forces it, without stopping its workers)"));
}

void AddLifecycleFlags(CLI::App* cmd, LifecycleFlags* flags) {
  cmd->add_option(
      "--state-dir", flags->state_dir,
      "default: $XDG_CACHE_HOME/shardtrain/state or ~/.cache/shardtrain/state");
}

}  // namespace

void AddDaemonCommand(CLI::App* app, int* exit_code) {
  auto flags = std::make_shared<DaemonFlags>();
  CLI::App* cmd = app->add_subcommand(
      "daemon",
      "Start a local shardtraind (in the background) unless one answers; "
      "`daemon status`, `daemon stop`");
  cmd->add_option(
      "--state-dir", flags->state_dir,
      "default: $XDG_CACHE_HOME/shardtrain/state or ~/.cache/shardtrain/state");
  cmd->add_option("--listen", flags->listen, "address:port")
      ->capture_default_str();
  cmd->add_option("--metrics-listen", flags->metrics_listen,
                  "Prometheus endpoint")
      ->capture_default_str();
  cmd->add_option("--cpu-slots", flags->cpu_slots,
                  "CPU devices (0: one per core)");
  cmd->add_option("--device-kind", flags->device_kind, "auto | gpu | cpu")
      ->check(CLI::IsMember({"auto", "gpu", "cpu"}))
      ->capture_default_str();
  cmd->add_flag("--foreground", flags->foreground, "run in this terminal");
  auto lifecycle = std::make_shared<LifecycleFlags>();
  CLI::App* status = cmd->add_subcommand(
      "status", "Whether a shardtraind holds the state directory (exit 3: no)");
  AddLifecycleFlags(status, lifecycle.get());
  status->callback(
      [lifecycle, exit_code] { *exit_code = RunStatus(*lifecycle); });
  CLI::App* stop = cmd->add_subcommand(
      "stop",
      "Stop the shardtraind holding the state directory (SIGTERM: workers "
      "stopped, state kept) and wait until it has exited");
  AddLifecycleFlags(stop, lifecycle.get());
  stop->add_option("--timeout", lifecycle->timeout, "seconds to wait");
  stop->callback([lifecycle, exit_code] { *exit_code = RunStop(*lifecycle); });
  // Without status or stop: start one.
  cmd->callback([cmd, flags, exit_code] {
    if (cmd->get_subcommands().empty()) *exit_code = RunDaemon(*flags);
  });
}

}  // namespace shardtrain::cli
