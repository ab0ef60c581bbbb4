#include "worker/local_ranks.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dist_env.h"
#include "common/exit_codes.h"
#include "common/free_port.h"
#include "common/subprocess.h"

namespace shardtrain {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr char kReport[] = "[launcher] ";

std::string ErrnoText(const std::string& what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

// ---------------------------------------------------------------------------
// Signals reach the event loop through a self-pipe, so poll() wakes for them.

int g_signal_pipe_write = -1;

void OnSignal(int signo) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  if (write(g_signal_pipe_write, &byte, 1) < 0) {
    // The pipe is full: the loop has wake-ups pending anyway.
  }
  errno = saved;
}

// Routes SIGINT, SIGTERM and SIGCHLD to a pipe while alive; restores the
// previous handlers afterwards.
class SignalPipe {
 public:
  SignalPipe() {
    if (pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
      error_ = ErrnoText("pipe");
      return;
    }
    g_signal_pipe_write = fds_[1];
    struct sigaction action {};
    action.sa_handler = OnSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int i = 0; i < kCount; ++i) sigaction(kSignals[i], &action, &old_[i]);
  }
  ~SignalPipe() {
    if (fds_[0] < 0) return;
    for (int i = 0; i < kCount; ++i) sigaction(kSignals[i], &old_[i], nullptr);
    g_signal_pipe_write = -1;
    close(fds_[0]);
    close(fds_[1]);
  }
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  const std::string& error() const { return error_; }
  int read_fd() const { return fds_[0]; }

  // The signals received since the last call, in order.
  std::vector<int> Drain() {
    std::vector<int> signals;
    unsigned char buffer[64];
    ssize_t n;
    while ((n = read(fds_[0], buffer, sizeof buffer)) > 0) {
      signals.insert(signals.end(), buffer, buffer + n);
    }
    return signals;
  }

 private:
  static constexpr int kCount = 3;
  static constexpr int kSignals[kCount] = {SIGINT, SIGTERM, SIGCHLD};
  int fds_[2] = {-1, -1};
  struct sigaction old_[kCount] {};
  std::string error_;
};

// ---------------------------------------------------------------------------
// A rank's output stream: complete lines are forwarded with the prefix.

class PrefixedStream {
 public:
  PrefixedStream(int fd, std::string prefix, std::ostream* sink)
      : fd_(fd), prefix_(std::move(prefix)), sink_(sink) {}
  PrefixedStream(PrefixedStream&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)),
        prefix_(std::move(other.prefix_)),
        sink_(other.sink_),
        pending_(std::move(other.pending_)) {}
  ~PrefixedStream() { Close(); }

  int fd() const { return fd_; }
  bool open() const { return fd_ >= 0; }
  bool forwarded() const { return forwarded_; }  // any line so far

  // Reads what is available without blocking; at end of file forwards the
  // last partial line and closes.
  void Pump() {
    if (fd_ < 0) return;
    char buffer[65536];
    while (true) {
      const ssize_t n = read(fd_, buffer, sizeof buffer);
      if (n > 0) {
        pending_.append(buffer, n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
        if (!pending_.empty()) pending_ += '\n';
        Forward();
        Close();
      }
      break;
    }
    Forward();
  }

 private:
  void Forward() {
    size_t start = 0;
    size_t end;
    while ((end = pending_.find('\n', start)) != std::string::npos) {
      *sink_ << prefix_;
      sink_->write(pending_.data() + start, end + 1 - start);
      start = end + 1;
      forwarded_ = true;
    }
    if (start > 0) {
      pending_.erase(0, start);
      sink_->flush();
    }
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  int fd_;
  std::string prefix_;
  std::ostream* sink_;
  std::string pending_;
  bool forwarded_ = false;
};

struct Child {
  pid_t pid = -1;
  bool running = false;
  bool signalled_by_us = false;
  RankExit exit;
  std::vector<PrefixedStream> streams;  // stdout, stderr
};

// Starts one rank in its own process group (so stopping it also stops what
// it started) with stdout/stderr on pipes and stdin on /dev/null.
absl::Status Spawn(const LocalRanksOptions& options, int rank, int port,
                   std::ostream& out, std::ostream& err, Child* child) {
  SubprocessOptions spawn;
  spawn.argv = options.argv;
  if (spawn.argv.empty()) spawn.argv.push_back(options.program);
  spawn.program = options.program;
  const int local_rank = rank - options.node_rank * options.nproc;
  DistEnv env;
  env.rank = rank;
  env.local_rank = local_rank;
  env.world_size = options.nnodes * options.nproc;
  env.local_world_size = options.nproc;
  env.master_addr = options.master_addr;
  env.master_port = port;
  spawn.env = TorchrunEnvironment(env, options.node_rank);
  spawn.output = SubprocessOptions::Output::kPipes;
  absl::StatusOr<Subprocess> process = SpawnSubprocess(spawn);
  if (!process.ok()) return process.status();
  child->pid = process->pid;
  child->running = true;
  child->exit.rank = rank;
  const std::string prefix = absl::StrCat("[rank ", rank, "] ");
  for (int fd : {process->stdout_fd, process->stderr_fd}) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  child->streams.emplace_back(process->stdout_fd, prefix, &out);
  child->streams.emplace_back(process->stderr_fd, prefix, &err);
  return absl::OkStatus();
}

void SignalGroup(Child& child, int signo) {
  if (!child.running) return;
  child.signalled_by_us = true;
  kill(-child.pid, signo);
}

}  // namespace

std::string RankExit::Describe() const {
  return DescribeExit(exit_code, signal);
}

LocalRanks::LocalRanks(LocalRanksOptions options, std::ostream& out,
                       std::ostream& err)
    : options_(std::move(options)), out_(out), err_(err) {}

absl::StatusOr<LocalRanksResult> LocalRanks::Run() {
  if (options_.nproc < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nproc must be at least 1, got ", options_.nproc));
  }
  if (options_.nnodes < 1 || options_.node_rank < 0 ||
      options_.node_rank >= options_.nnodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--node-rank must be in [0, --nnodes) and --nnodes at least 1; got ",
        options_.node_rank, " of ", options_.nnodes));
  }
  if (options_.nnodes > 1 &&
      (options_.master_addr.empty() || options_.master_addr == "127.0.0.1")) {
    return absl::InvalidArgumentError(
        "--nnodes > 1 needs --master-addr: the host of node 0, reachable "
        "from every node");
  }
  int port = options_.master_port;
  if (port == 0 && options_.nnodes > 1) port = 29500;  // as torchrun
  const bool picked = port == 0;
  // A port picked free can be taken by another process before rank 0 binds
  // it; rank 0 then exits with kExitRendezvousPortTaken and the ranks start
  // again on another port. A port the user named is never changed.
  constexpr int kPortTries = 5;
  FreshPortPicker ports(kPortTries);  // no try repeats an earlier one's port
  for (int attempt = 1;; ++attempt) {
    if (picked) {
      absl::StatusOr<int> free_port = ports.Pick();
      if (!free_port.ok()) return free_port.status();
      port = *free_port;
    }
    absl::StatusOr<LocalRanksResult> result = RunOnce(port);
    if (!result.ok() || !picked || attempt == kPortTries ||
        result->interrupted_by != 0 || result->first_failure.rank != 0 ||
        result->first_failure.exit_code != kExitRendezvousPortTaken) {
      return result;
    }
    err_ << kReport << "rendezvous port " << port
         << " was taken before rank 0 could bind it; starting the ranks "
            "again on another port (try "
         << attempt + 1 << " of " << kPortTries << ")" << std::endl;
  }
}

namespace {

// One start of every rank of this host: spawn them, forward their output,
// stop the rest when one fails or the launcher is interrupted (SIGTERM, then
// SIGKILL after the grace), and say how each ended.
class OneStart {
 public:
  OneStart(const LocalRanksOptions& options, std::ostream& out,
           std::ostream& err)
      : options_(options),
        out_(out),
        err_(err),
        children_(options.nproc),
        started_(SteadyClock::now()),
        progress_at_(started_ + options.progress_every) {}

  // Spawns every rank with MASTER_PORT `port`; on an error, the ones that
  // started are killed and reaped first.
  absl::Status SpawnAll(int port);
  // Serves the ranks until all have ended.
  LocalRanksResult Serve(SignalPipe& signals);

 private:
  // Reaps ranks that have ended (waiting when `block`); their local indices.
  std::vector<int> Reap(bool block);
  void StopAll(int signo) {
    for (Child& c : children_) SignalGroup(c, signo);
  }
  void BeginStop() {
    if (stopping_) return;
    stopping_ = true;
    kill_at_ = SteadyClock::now() + options_.grace;
    StopAll(SIGTERM);
  }
  void PumpAll() {
    for (Child& c : children_) {
      for (PrefixedStream& stream : c.streams) stream.Pump();
    }
  }
  bool AnyRunning() const {
    for (const Child& c : children_) {
      if (c.running) return true;
    }
    return false;
  }
  // Among ranks reaped in the same round, takes the first failure.
  void NoteFailure(const std::vector<int>& ended);
  // Until a rank prints its first line, says now and then that they run.
  void ReportProgress();
  // Waits for output, a signal or the next deadline, and forwards output.
  void Poll(SignalPipe& signals);
  void HandleSignals(SignalPipe& signals);
  // The exit code and, after a failure, the line naming how each ended.
  void Finish();

  const LocalRanksOptions& options_;
  std::ostream& out_;
  std::ostream& err_;
  std::vector<Child> children_;
  LocalRanksResult result_;
  bool stopping_ = false;
  bool killed_ = false;
  SteadyClock::time_point kill_at_;
  const SteadyClock::time_point started_;
  bool heard_ = false;
  SteadyClock::time_point progress_at_;
};

absl::Status OneStart::SpawnAll(int port) {
  for (int local = 0; local < options_.nproc; ++local) {
    const int rank = options_.node_rank * options_.nproc + local;
    if (absl::Status s =
            Spawn(options_, rank, port, out_, err_, &children_[local]);
        !s.ok()) {
      StopAll(SIGKILL);
      Reap(/*block=*/true);
      PumpAll();
      return absl::Status(s.code(),
                          absl::StrCat("rank ", rank, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

std::vector<int> OneStart::Reap(bool block) {
  std::vector<int> ended;
  for (Child& c : children_) {
    if (!c.running) continue;
    int status = 0;
    const pid_t r = waitpid(c.pid, &status, block ? 0 : WNOHANG);
    if (r != c.pid) continue;
    c.running = false;
    if (WIFSIGNALED(status)) c.exit.signal = WTERMSIG(status);
    if (WIFEXITED(status)) c.exit.exit_code = WEXITSTATUS(status);
    ended.push_back(static_cast<int>(&c - children_.data()));  // local
  }
  return ended;
}

void OneStart::NoteFailure(const std::vector<int>& ended) {
  if (result_.first_failure.rank >= 0 || result_.interrupted_by != 0) return;
  // Ranks often fail together (a peer's death breaks the collective of the
  // rest); among those reaped in the same round, one killed by a signal or
  // else the lowest rank is taken as the first.
  const RankExit* first = nullptr;
  for (int local : ended) {
    const RankExit& e = children_[local].exit;
    if (e.ok()) continue;
    if (first == nullptr || (e.signal != 0 && first->signal == 0)) first = &e;
  }
  if (first == nullptr) return;
  result_.first_failure = *first;
  err_ << kReport << "rank " << first->rank << " failed first ("
       << first->Describe() << "); stopping the other ranks" << std::endl;
  BeginStop();
}

void OneStart::ReportProgress() {
  for (const Child& c : children_) {
    for (const PrefixedStream& stream : c.streams) {
      heard_ |= stream.forwarded();
    }
  }
  if (heard_ || stopping_ || SteadyClock::now() < progress_at_) return;
  int running = 0;
  for (const Child& c : children_) running += c.running ? 1 : 0;
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           SteadyClock::now() - started_)
                           .count();
  err_ << kReport << running << " of " << options_.nproc
       << " ranks running for " << seconds
       << " s, none has printed yet (loading and joining the process "
          "group)"
       << std::endl;
  progress_at_ += options_.progress_every;
}

void OneStart::Poll(SignalPipe& signals) {
  std::vector<pollfd> fds = {{signals.read_fd(), POLLIN, 0}};
  std::vector<PrefixedStream*> polled;
  for (Child& c : children_) {
    for (PrefixedStream& stream : c.streams) {
      if (!stream.open()) continue;
      fds.push_back({stream.fd(), POLLIN, 0});
      polled.push_back(&stream);
    }
  }
  ReportProgress();
  auto ms_until = [](SteadyClock::time_point at) {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(
               at - SteadyClock::now())
                   .count() +
               1));
  };
  int timeout_ms = -1;
  if (stopping_ && !killed_) timeout_ms = ms_until(kill_at_);
  if (!heard_ && !stopping_) {
    const int progress_ms = ms_until(progress_at_);
    timeout_ms =
        timeout_ms < 0 ? progress_ms : std::min(timeout_ms, progress_ms);
  }
  if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
    err_ << kReport << ErrnoText("poll") << std::endl;
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) polled[i - 1]->Pump();
  }
}

void OneStart::HandleSignals(SignalPipe& signals) {
  for (int signo : signals.Drain()) {
    if (signo == SIGCHLD) continue;  // reaped at the top of the loop
    if (result_.interrupted_by == 0) {
      result_.interrupted_by = signo;
      err_ << kReport << "received SIG" << sigabbrev_np(signo)
           << "; stopping all ranks" << std::endl;
      BeginStop();
    } else if (!killed_) {
      StopAll(SIGKILL);  // a second interrupt: no more grace
      killed_ = true;
    }
  }
}

LocalRanksResult OneStart::Serve(SignalPipe& signals) {
  while (true) {
    NoteFailure(Reap(/*block=*/false));
    if (!AnyRunning()) break;
    if (stopping_ && !killed_ && SteadyClock::now() >= kill_at_) {
      StopAll(SIGKILL);
      killed_ = true;
    }
    Poll(signals);
    HandleSignals(signals);
  }
  // Output still buffered in the pipes of ranks that have exited; a
  // descendant holding a pipe open does not keep us waiting.
  PumpAll();
  Finish();
  return result_;
}

void OneStart::Finish() {
  for (const Child& c : children_) result_.ranks.push_back(c.exit);
  if (result_.interrupted_by != 0) {
    result_.exit_code = 128 + result_.interrupted_by;
    return;
  }
  if (result_.first_failure.rank < 0) return;
  const RankExit& first = result_.first_failure;
  result_.exit_code = first.signal != 0 ? 128 + first.signal : first.exit_code;
  std::vector<std::string> others;
  for (const Child& c : children_) {
    if (c.exit.rank == first.rank) continue;
    others.push_back(
        absl::StrCat(c.exit.rank, ": ",
                     c.signalled_by_us && c.exit.signal != 0 ? "stopped, " : "",
                     c.exit.Describe()));
  }
  err_ << kReport << "rank " << first.rank << " failed first ("
       << first.Describe() << ")";
  if (!others.empty()) err_ << "; other ranks: " << absl::StrJoin(others, ", ");
  err_ << std::endl;
}

}  // namespace

absl::StatusOr<LocalRanksResult> LocalRanks::RunOnce(int port) {
  SignalPipe signals;
  if (!signals.error().empty()) return absl::InternalError(signals.error());
  OneStart start(options_, out_, err_);
  if (absl::Status s = start.SpawnAll(port); !s.ok()) return s;
  return start.Serve(signals);
}

int RunLocalRanks(LocalRanksOptions options, int argc, char** argv) {
  options.program = "/proc/self/exe";
  options.argv.assign(argv, argv + argc);
  LocalRanks launcher(std::move(options), std::cout, std::cerr);
  absl::StatusOr<LocalRanksResult> result = launcher.Run();
  if (!result.ok()) {
    std::cerr << kReport << result.status().message() << std::endl;
    return 1;
  }
  return result->exit_code;
}

}  // namespace shardtrain
