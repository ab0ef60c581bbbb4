// DaemonHarness: a real shardtraind started as a child process on loopback
// (port 0, its own state dir), with gRPC stubs to it and helpers to wait for
// job states and to find a job's worker processes.
#ifndef SHARDTRAIN_TESTS_INTEGRATION_DAEMON_HARNESS_H_
#define SHARDTRAIN_TESTS_INTEGRATION_DAEMON_HARNESS_H_

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "shardtrain/v1/cluster_service.grpc.pb.h"
#include "shardtrain/v1/job_service.grpc.pb.h"
#include "tests/test_util.h"

// ASSERT that a grpc::Status is OK, printing its message when not.
#define ASSERT_GRPC_OK(expr)                              \
  do {                                                    \
    const ::grpc::Status grpc_status_ = (expr);           \
    ASSERT_TRUE(grpc_status_.ok())                        \
        << #expr << ": " << grpc_status_.error_message(); \
  } while (false)

// EXPECT that a grpc::Status is OK (where a fatal ASSERT cannot return).
#define EXPECT_GRPC_OK(expr)                              \
  do {                                                    \
    const ::grpc::Status grpc_status_ = (expr);           \
    EXPECT_TRUE(grpc_status_.ok())                        \
        << #expr << ": " << grpc_status_.error_message(); \
  } while (false)

namespace shardtrain::test {

inline std::string BinDir() {
  return std::string(SHARDTRAIN_BINARY_DIR) + "/bin";
}
inline std::string FakeWorker() {
  return std::string(SHARDTRAIN_BINARY_DIR) + "/tests/fake_worker";
}

// The body of GET http://<address>/metrics ("" when unreachable).
// The socket address of an IPv4 "host:port".
inline sockaddr_in Ipv4SocketAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port =
      htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  return addr;
}

// A TCP connection to an IPv4 "host:port"; -1 when it cannot be made.
inline int ConnectTcp(const std::string& address) {
  sockaddr_in addr = Ipv4SocketAddress(address);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

inline std::string HttpGet(const std::string& address,
                           const std::string& path) {
  const int fd = ConnectTcp(address);
  if (fd < 0) return "";
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: x\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string response;
  char buffer[65536];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

struct DaemonOptions {
  std::string listen = "127.0.0.1:0";
  int cpu_slots = 2;
  double grace_period = 3;
  double heartbeat_interval = 0.5;
  double heartbeat_timeout = 5;
  double rendezvous_timeout = 60;
  std::string worker_binary;  // empty: the real shardtrain-worker
  std::vector<std::string> extra_flags;
  std::vector<std::pair<std::string, std::string>> env;
  // The daemon's descriptor limit (soft and hard); 0: inherited.
  int max_open_files = 0;
};

class Daemon {
 public:
  Daemon(std::string state_dir, DaemonOptions options)
      : state_dir_(std::move(state_dir)), options_(std::move(options)) {}
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      if (WaitExit(absl::Seconds(30)) == -2) {
        kill(pid_, SIGKILL);
        WaitExit(absl::Seconds(5));
      }
    }
  }

  // Starts the daemon and waits for it to serve. Returns false (with the
  // daemon's log in `error`) when it does not come up.
  bool Start(std::string* error, bool insecure_channel = true) {
    std::filesystem::create_directories(state_dir_);
    std::filesystem::remove(state_dir_ + "/endpoint");
    const std::string log = state_dir_ + "/daemon.log";
    std::vector<std::string> args = {BinDir() + "/shardtraind",
                                     "--listen",
                                     options_.listen,
                                     "--metrics-listen",
                                     "127.0.0.1:0",
                                     "--state-dir",
                                     state_dir_,
                                     "--device-kind",
                                     "cpu",
                                     "--cpu-slots",
                                     std::to_string(options_.cpu_slots),
                                     "--grace-period",
                                     absl::StrCat(options_.grace_period),
                                     "--heartbeat-interval",
                                     absl::StrCat(options_.heartbeat_interval),
                                     "--heartbeat-timeout",
                                     absl::StrCat(options_.heartbeat_timeout),
                                     "--rendezvous-timeout",
                                     absl::StrCat(options_.rendezvous_timeout)};
    if (!options_.worker_binary.empty()) {
      args.push_back("--worker-binary");
      args.push_back(options_.worker_binary);
    }
    for (const std::string& flag : options_.extra_flags) args.push_back(flag);
    pid_ = fork();
    if (pid_ == 0) {
      if (options_.max_open_files > 0) {
        const rlimit limit{static_cast<rlim_t>(options_.max_open_files),
                           static_cast<rlim_t>(options_.max_open_files)};
        setrlimit(RLIMIT_NOFILE, &limit);
      }
      for (const auto& [key, value] : options_.env) {
        setenv(key.c_str(), value.c_str(), 1);
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      freopen(log.c_str(), "a", stderr);
      freopen(log.c_str(), "a", stdout);
      execv(argv[0], argv.data());
      _exit(127);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      std::string endpoint = ReadFile(state_dir_ + "/endpoint");
      if (!endpoint.empty() && endpoint.back() == '\n') {
        address_ = std::string(absl::StripSuffix(endpoint, "\n"));
        if (insecure_channel) Connect(grpc::InsecureChannelCredentials());
        return true;
      }
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        *error = "shardtraind exited: " + ReadFile(log);
        return false;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    *error = "shardtraind did not start: " + ReadFile(log);
    return false;
  }

  void Connect(std::shared_ptr<grpc::ChannelCredentials> credentials,
               const grpc::ChannelArguments& args = {}) {
    channel_ = grpc::CreateCustomChannel(address_, credentials, args);
    jobs_ = v1::JobService::NewStub(channel_);
    cluster_ = v1::ClusterService::NewStub(channel_);
  }

  void Signal(int signal) { kill(pid_, signal); }
  // Still running (not exited, not a zombie awaiting waitpid).
  bool Running() {
    int status;
    if (pid_ <= 0) return false;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return true;
    pid_ = -1;
    return false;
  }
  // The exit status (as waitpid reports it), -2 on timeout.
  int WaitExit(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return status;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return -2;
  }

  v1::JobService::Stub& jobs() { return *jobs_; }
  v1::ClusterService::Stub& cluster() { return *cluster_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  const std::string& address() const { return address_; }
  const std::string& state_dir() const { return state_dir_; }
  std::string log() const { return ReadFile(state_dir_ + "/daemon.log"); }
  std::string metrics_address() const {
    std::string a = ReadFile(state_dir_ + "/metrics_endpoint");
    if (!a.empty() && a.back() == '\n') a.pop_back();
    return a;
  }
  std::string ScrapeMetrics() const {
    return HttpGet(metrics_address(), "/metrics");
  }
  int pid() const { return pid_; }

  // The bearer token this harness's own calls (Submit, Get, Cancel,
  // Metrics, WaitFor) carry; empty: none.
  void set_token(std::string token) { token_ = std::move(token); }

  grpc::Status Submit(const v1::JobSpec& spec, v1::Job* job) {
    grpc::ClientContext context;
    Authorize(&context);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    return jobs_->SubmitJob(&context, request, job);
  }

  grpc::Status Cancel(const std::string& id, v1::Job* job) {
    grpc::ClientContext context;
    Authorize(&context);
    v1::CancelJobRequest request;
    request.set_job_id(id);
    return jobs_->CancelJob(&context, request, job);
  }

  v1::Job Get(const std::string& id) {
    grpc::ClientContext context;
    Authorize(&context);
    v1::GetJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    jobs_->GetJob(&context, request, &job);
    return job;
  }

  // Polls GetJob until `done` holds or `timeout` passes; returns the last
  // answer (the caller asserts on it).
  v1::Job WaitFor(const std::string& id,
                  const std::function<bool(const v1::Job&)>& done,
                  absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    v1::Job job = Get(id);
    while (!done(job) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(50));
      job = Get(id);
    }
    return job;
  }

  // Live worker processes of this daemon's job `id` (WorkerPids below).
  std::vector<int> WorkerPids(const std::string& id) const;

  std::vector<v1::StepMetrics> Metrics(const std::string& id) {
    grpc::ClientContext context;
    Authorize(&context);
    v1::GetJobMetricsRequest request;
    request.set_job_id(id);
    v1::GetJobMetricsResponse response;
    jobs_->GetJobMetrics(&context, request, &response);
    return {response.steps().begin(), response.steps().end()};
  }

 private:
  void Authorize(grpc::ClientContext* context) const {
    if (!token_.empty()) {
      context->AddMetadata("authorization", "Bearer " + token_);
    }
  }

  std::string state_dir_;
  DaemonOptions options_;
  std::string token_;
  pid_t pid_ = -1;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
};

// A valid spec for fake workers (tests/tools/fake_worker): the job's name
// selects the fake's behaviour ("quick", "hold", "slow:N", "exit:N", ...).
inline v1::JobSpec FakeSpec(const std::string& mode,
                            const std::string& data_dir, int world_size = 1,
                            int max_restarts = 0) {
  v1::JobSpec spec;
  spec.set_name(mode);
  spec.set_model("gpt2-tiny");
  spec.set_data(data_dir);
  spec.mutable_strategy()->set_name(world_size == 1 ? "single" : "ddp");
  spec.set_world_size(world_size);
  spec.set_max_restarts(max_restarts);
  spec.mutable_trainer()->set_max_steps(1);
  return spec;
}

// A test with a stand-in dataset (data_: a directory holding a train.bin that
// fake workers never read) and daemons in dir_/state whose workers are
// fake_worker unless the options name another binary.
class FakeWorkerDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_ / "data");
    WriteFile(dir_ / "data/train.bin", "x");
    data_ = dir_ / "data";
  }

  // Started and serving (the test fails otherwise); `state_dir` empty:
  // dir_/state.
  std::unique_ptr<Daemon> StartDaemon(DaemonOptions options,
                                      const std::string& state_dir = "") {
    if (options.worker_binary.empty()) options.worker_binary = FakeWorker();
    auto daemon = std::make_unique<Daemon>(
        state_dir.empty() ? dir_ / "state" : state_dir, std::move(options));
    std::string error;
    EXPECT_TRUE(daemon->Start(&error)) << error;
    return daemon;
  }

  TempDir dir_;
  std::string data_;
};

inline bool IsTerminal(const v1::Job& job) {
  return job.state() == v1::SUCCEEDED || job.state() == v1::FAILED ||
         job.state() == v1::CANCELLED;
}

// Live (non-zombie) processes whose command line has `--job-id <id>` and,
// when `within` is given, mentions it (a daemon's state directory: job ids
// repeat across the daemons of tests running side by side).
inline std::vector<int> WorkerPids(const std::string& job_id,
                                   const std::string& within = "") {
  std::vector<int> pids;
  const std::string marker = std::string("--job-id") + '\0' + job_id + '\0';
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmdline = ReadFile(entry.path().string() + "/cmdline");
    if (cmdline.find(marker) == std::string::npos) continue;
    if (!within.empty() && cmdline.find(within) == std::string::npos) continue;
    const std::string stat = ReadFile(entry.path().string() + "/stat");
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() &&
        stat[paren + 2] == 'Z') {
      continue;
    }
    pids.push_back(std::stoi(name));
  }
  return pids;
}

inline std::vector<int> Daemon::WorkerPids(const std::string& id) const {
  return test::WorkerPids(id, state_dir_);
}

inline bool WaitUntil(const std::function<bool()>& done,
                      absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

}  // namespace shardtrain::test

#endif  // SHARDTRAIN_TESTS_INTEGRATION_DAEMON_HARNESS_H_
