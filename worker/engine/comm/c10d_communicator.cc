#include "worker/engine/comm/c10d_communicator.h"

#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>
#ifdef SHARDTRAIN_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/exit_codes.h"
#include "common/net_route.h"
#include "worker/engine/torch_compat.h"

namespace shardtrain {
namespace {

using SteadyClock = std::chrono::steady_clock;
using WorkPtr = c10::intrusive_ptr<::c10d::Work>;

double Seconds(SteadyClock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// The message of an exception from c10d or Gloo, without c10's backtrace.
std::string ErrorText(std::exception_ptr error) {
  std::string text = "unknown error";
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    text = e.what_without_backtrace();
  } catch (const std::exception& e) {
    text = e.what();
  } catch (...) {
  }
  return std::string(absl::StripAsciiWhitespace(text));
}

// LibTorch 1.13 says "timed out"; 2.x's NCCL watchdog "collective operation
// timeout ... before timing out", its TCPStore "wait timeout after N ms".
// Not any "timeout": 2.x describes every NCCL work with "Timeout(ms)=...".
bool IsTimeout(const std::string& error) {
  const std::string lower = absl::AsciiStrToLower(error);
  return absl::StrContains(lower, "timed out") ||
         absl::StrContains(lower, "timing out") ||
         absl::StrContains(lower, "operation timeout") ||
         absl::StrContains(lower, "wait timeout");
}

#ifdef SHARDTRAIN_WITH_CUDA
// PyTorch 2.x's NCCL watchdog tears the whole process down (SIGABRT, or a
// fatal log from its heartbeat monitor minutes later) when a collective times
// out, before the caller sees an error. We want the error instead: the
// communicator names the lost rank and the trainer exits with it. So, unless
// the user chose otherwise: on a timeout the watchdog only aborts the NCCL
// communicators (CleanUpOnly), which makes the pending and next waits throw;
// no debug dump and no monitor thread that would kill us. Read by
// ProcessGroupNCCL's constructor; LibTorch 1.13 knows only the first one
// under its older name.
void SetNcclErrorHandlingDefaults() {
  if (std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr &&
      std::getenv("NCCL_ASYNC_ERROR_HANDLING") == nullptr) {
    setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
    setenv("NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
  }
  setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", /*overwrite=*/0);
  setenv("TORCH_NCCL_ENABLE_MONITORING", "0", /*overwrite=*/0);
}
#endif

bool IsLoopback(const std::string& host) {
  return host == "localhost" || absl::StartsWith(host, "127.") || host == "::1";
}

// Gloo binds one address for its connections: GLOO_SOCKET_IFNAME when set
// (as in PyTorch), loopback when the store is on this host's loopback, else
// the address of the interface that routes to MASTER_ADDR (several nodes,
// network namespaces: the host name may resolve to an address the others
// cannot reach). NCCL gets the same interface through NCCL_SOCKET_IFNAME
// unless that is set.
std::shared_ptr<::gloo::transport::Device> GlooDevice(
    const std::string& master_addr) {
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname != '\0') {
    return ::c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (IsLoopback(master_addr)) {
    return ::c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  absl::StatusOr<LocalRoute> route = LocalRouteTo(master_addr);
  if (!route.ok()) return ::c10d::ProcessGroupGloo::createDefaultDevice();
  if (!route->interface.empty()) {
    setenv("NCCL_SOCKET_IFNAME", route->interface.c_str(), /*overwrite=*/0);
  }
  return ::c10d::ProcessGroupGloo::createDeviceForHostname(route->address);
}

c10d::TCPStoreOptions StoreOptions(int port, bool is_server,
                                   std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = is_server;
  // TCPStore's own wait for workers gives up silently on timeout; Rendezvous()
  // below does the waiting instead.
  options.waitWorkers = false;
  options.timeout = timeout;
  return options;
}

// A TCPStore on PyTorch's default backend for this LibTorch. 2.4 and later
// default to the libuv one, which a LibTorch built without libuv (Debian
// 13's) refuses: then, or when USE_LIBUV=0 as in PyTorch, the classic one.
c10::intrusive_ptr<c10d::TCPStore> MakeTcpStore(const std::string& host,
                                                c10d::TCPStoreOptions options) {
#ifdef SHARDTRAIN_TORCH_TCPSTORE_HAS_LIBUV
  const char* use_libuv = std::getenv("USE_LIBUV");
  options.useLibUV = use_libuv == nullptr || std::string(use_libuv) != "0";
  if (options.useLibUV) {
    try {
      return c10::make_intrusive<c10d::TCPStore>(host, options);
    } catch (const c10::Error& e) {
      if (!absl::StrContains(e.what_without_backtrace(), "without libuv")) {
        throw;
      }
    }
    options.useLibUV = false;
  }
#endif
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

// Waits until the store on host:port accepts connections, or `deadline`
// passes. A client TCPStore of LibTorch 2.x that finds no server sleeps a
// jittered backoff (seen: 2.4 s) before it looks at its own deadline again,
// overrunning a short rendezvous timeout by seconds; once the server
// listens, it connects at its first try.
absl::Status WaitForStore(const std::string& host, int port,
                          SteadyClock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) !=
          0 ||
      found == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve the store host ", host));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(found,
                                                               freeaddrinfo);
  while (true) {
    for (addrinfo* a = addresses.get(); a != nullptr; a = a->ai_next) {
      const int fd =
          socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                 a->ai_protocol);
      if (fd < 0) continue;
      bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      if (!connected && errno == EINPROGRESS) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - SteadyClock::now());
        pollfd p{fd, POLLOUT, 0};
        int error = 0;
        socklen_t length = sizeof(error);
        connected =
            poll(&p, 1,
                 static_cast<int>(std::clamp<int64_t>(left.count(), 0, 200))) ==
                1 &&
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 &&
            error == 0;
      }
      close(fd);
      if (connected) return absl::OkStatus();
    }
    if (SteadyClock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out: no store is listening at ", host, ":", port,
                       " (rank 0 serves it)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Waits until all ranks have reached the store or `deadline` passes. The
// last rank to arrive marks the rendezvous complete for the others.
absl::Status Rendezvous(c10d::Store& store, int64_t world_size,
                        SteadyClock::time_point deadline) {
  const std::string arrived_key = "shardtrain/rendezvous/arrived";
  const std::string complete_key = "shardtrain/rendezvous/complete";
  try {
    if (store.add(arrived_key, 1) == world_size) {
      store.set(complete_key, std::vector<uint8_t>{1});
      return absl::OkStatus();
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - SteadyClock::now());
    store.wait({complete_key}, std::max(left, std::chrono::milliseconds(1)));
  } catch (...) {
    std::string error = ErrorText(std::current_exception());
    try {
      error = absl::StrCat(store.add(arrived_key, 0), " of ", world_size,
                           " ranks arrived (", error, ")");
    } catch (...) {
    }
    return absl::DeadlineExceededError(error);
  }
  return absl::OkStatus();
}

// The heartbeat's own connection to the rendezvous store.
class TcpHeartbeatStore final : public HeartbeatStore {
 public:
  explicit TcpHeartbeatStore(c10::intrusive_ptr<c10d::TCPStore> store)
      : store_(std::move(store)) {}

  absl::Status Set(const std::string& key, int64_t value) override {
    const std::string text = absl::StrCat(value);
    try {
      store_->set(key, std::vector<uint8_t>(text.begin(), text.end()));
    } catch (...) {
      return absl::UnavailableError(ErrorText(std::current_exception()));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Get(const std::string& key) override {
    // add(key, 0) reads a decimal value without waiting for the key to exist.
    try {
      return store_->add(key, 0);
    } catch (...) {
      return absl::UnavailableError(ErrorText(std::current_exception()));
    }
  }

 private:
  c10::intrusive_ptr<c10d::TCPStore> store_;
};

// Where a collective that completes asynchronously reports its outcome.
struct Completion {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::string error;  // empty: success

  void Finish(std::string e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
};

}  // namespace

namespace c10d_internal {

// State shared by the communicator and the works it hands out.
struct Shared {
  Shared(int64_t rank, std::chrono::milliseconds timeout)
      : rank(rank), timeout(timeout) {}

  void Count(const torch::Tensor& tensor) {
    absl::MutexLock lock(&mutex);
    stats.bytes += tensor.nbytes();
  }
  void Blocked(SteadyClock::duration d) {
    absl::MutexLock lock(&mutex);
    stats.seconds += Seconds(d);
  }

  // Turns the error of collective `op` into a Status that names the lost
  // ranks. The first diagnosis that finds someone lost is kept: the group is
  // broken from then on and later failures have the same cause.
  absl::Status Failure(const std::string& op, const std::string& error) {
    std::string cause = "no heartbeat information";
    mutex.Lock();
    failed = true;
    if (lost.has_value()) {
      cause = lost->ToString();
    } else if (monitor != nullptr) {
      std::shared_ptr<HeartbeatMonitor> m = monitor;
      mutex.Unlock();  // a diagnosis takes seconds
      HeartbeatDiagnosis diagnosis = m->Diagnose();
      mutex.Lock();
      if (diagnosis.any_lost() && !lost.has_value()) lost = diagnosis;
      cause = diagnosis.ToString();
    }
    mutex.Unlock();
    if (IsTimeout(error)) {
      return absl::DeadlineExceededError(
          absl::StrFormat("%s timed out after %.1f s on rank %d: %s: %s", op,
                          timeout.count() / 1000.0, rank, cause, error));
    }
    return absl::UnavailableError(absl::StrFormat(
        "%s failed on rank %d: %s: %s", op, rank, cause, error));
  }

  const int64_t rank;
  const std::chrono::milliseconds timeout;
  absl::Mutex mutex;
  CommStats stats ABSL_GUARDED_BY(mutex);
  std::shared_ptr<HeartbeatMonitor> monitor ABSL_GUARDED_BY(mutex);
  std::optional<HeartbeatDiagnosis> lost ABSL_GUARDED_BY(mutex);
  // A collective has failed: the groups are broken and must be aborted, not
  // shut down (which would wait for the lost peers).
  bool failed ABSL_GUARDED_BY(mutex) = false;
};

// ---------------------------------------------------------------------------
// Process groups

class Groups {
 public:
  c10::intrusive_ptr<c10d::TCPStore> store;
  // The transport the Gloo groups use; sub-groups reuse it.
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#ifdef SHARDTRAIN_WITH_CUDA
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
};

// One thread that runs jobs in the order they were queued, so the Gloo
// reduce_scatter rings of all ranks line up.
class SideThread {
 public:
  SideThread() : thread_([this] { Run(); }) {}
  // Runs the jobs still queued, then joins.
  ~SideThread() {
    {
      absl::MutexLock lock(&mutex_);
      stop_ = true;
    }
    thread_.join();
  }

  void Post(std::function<void()> job) {
    absl::MutexLock lock(&mutex_);
    jobs_.push_back(std::move(job));
  }

 private:
  void Run() {
    absl::MutexLock lock(&mutex_);
    while (true) {
      mutex_.Await(absl::Condition(
          +[](SideThread* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mutex_) {
            return self->stop_ || !self->jobs_.empty();
          },
          this));
      if (jobs_.empty()) return;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      mutex_.Unlock();
      job();
      mutex_.Lock();
    }
  }

  absl::Mutex mutex_;
  bool stop_ ABSL_GUARDED_BY(mutex_) = false;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mutex_);
  std::thread thread_;
};

}  // namespace c10d_internal

using c10d_internal::Groups;
using c10d_internal::Shared;
using c10d_internal::SideThread;

namespace {

// ---------------------------------------------------------------------------
// Works

// A c10d work. On the host (Gloo) Wait() blocks until the collective is done
// or the communicator's timeout passes. On a GPU (NCCL) it only orders the
// current CUDA stream after the collective and returns at once, so the host
// keeps queueing kernels (an FSDP prefetch stays overlapped); there the
// process group's own timeout (the same value) aborts a collective that
// hangs, and the error surfaces at this or the next Wait(). In 2.x a
// wait(timeout) would block the host until NCCL finished.
class C10dWork final : public CommWork {
 public:
  C10dWork(std::shared_ptr<Shared> shared, std::string op, WorkPtr work,
           bool on_device)
      : shared_(std::move(shared)),
        op_(std::move(op)),
        work_(std::move(work)),
        on_device_(on_device) {}

  absl::Status Wait() override {
    if (waited_) return status_;
    waited_ = true;
    const SteadyClock::time_point start = SteadyClock::now();
    try {
      if (on_device_) {
        work_->wait();
        // A collective the watchdog already aborted reports it here; one
        // aborted later surfaces at the next Wait() or launch.
        if (work_->isCompleted() && work_->exception()) {
          std::rethrow_exception(work_->exception());
        }
      } else {
        work_->wait(shared_->timeout);
        AwaitRelease();
      }
    } catch (...) {
      status_ = shared_->Failure(op_, ErrorText(std::current_exception()));
    }
    shared_->Blocked(SteadyClock::now() - start);
    return status_;
  }
  bool IsCompleted() override { return work_->isCompleted(); }

 private:
  // Gloo's worker thread marks a work complete and only then drops its
  // reference to it, and with it the work's tensors (and the flat buffer an
  // all-gather copies through). Waiting for that here frees a tensor the
  // caller lets go of next at once, not at a moment that depends on thread
  // scheduling: the step's peak memory would (one tensor more, at random).
  // Bounded: a reference kept elsewhere only costs the wait.
  void AwaitRelease() {
    const SteadyClock::time_point limit =
        SteadyClock::now() + std::chrono::milliseconds(50);
    while (work_.use_count() > 1 && SteadyClock::now() < limit) {
      std::this_thread::yield();
    }
  }

  std::shared_ptr<Shared> shared_;
  const std::string op_;
  WorkPtr work_;
  const bool on_device_;
  bool waited_ = false;
  absl::Status status_;
};

// A collective run by the side thread.
class SideWork final : public CommWork {
 public:
  SideWork(std::shared_ptr<Shared> shared, std::string op,
           std::shared_ptr<Completion> completion)
      : shared_(std::move(shared)),
        op_(std::move(op)),
        completion_(std::move(completion)) {}

  absl::Status Wait() override {
    if (waited_) return status_;
    waited_ = true;
    const SteadyClock::time_point start = SteadyClock::now();
    std::string error;
    {
      std::unique_lock<std::mutex> lock(completion_->mutex);
      if (!completion_->cv.wait_for(lock, shared_->timeout,
                                    [&] { return completion_->done; })) {
        error = absl::StrFormat("timed out waiting %d ms",
                                shared_->timeout.count());
      } else {
        error = completion_->error;
      }
    }
    if (!error.empty()) status_ = shared_->Failure(op_, error);
    shared_->Blocked(SteadyClock::now() - start);
    return status_;
  }
  bool IsCompleted() override {
    std::lock_guard<std::mutex> lock(completion_->mutex);
    return completion_->done;
  }

 private:
  std::shared_ptr<Shared> shared_;
  const std::string op_;
  std::shared_ptr<Completion> completion_;
  bool waited_ = false;
  absl::Status status_;
};

std::unique_ptr<CommWork> Done(absl::Status status) {
  return CompletedWork(std::move(status));
}

// Ring reduce-scatter over Gloo sends and receives. With chunks indexed by
// rank, at step s every rank passes its running sum of chunk (rank - 1 - s)
// to the right and adds its own contribution to chunk (rank - 2 - s) arriving
// from the left; after world - 1 steps it holds the full sum of chunk rank.
// Each rank sends (world - 1) / world of the input, half of what an
// all-reduce would. Returns the error text, empty on success.
std::string RingReduceScatter(c10d::ProcessGroupGloo& gloo,
                              torch::Tensor output, torch::Tensor input,
                              int64_t rank, int64_t world, int64_t ring,
                              std::chrono::milliseconds timeout) {
  try {
    const int64_t n = output.numel();
    const torch::Tensor flat_in = input.view({-1});
    auto chunk = [&](int64_t i) {
      return flat_in.narrow(0, ((i % world) + world) % world * n, n);
    };
    const int right = static_cast<int>((rank + 1) % world);
    const int left = static_cast<int>((rank + world - 1) % world);
    torch::Tensor buffers[2] = {torch::empty_like(flat_in.narrow(0, 0, n)),
                                world > 2
                                    ? torch::empty_like(flat_in.narrow(0, 0, n))
                                    : torch::Tensor()};
    torch::Tensor outgoing = chunk(rank - 1);
    for (int64_t step = 0; step + 1 < world; ++step) {
      torch::Tensor incoming = buffers[step % 2];
      const int tag = static_cast<int>((ring * world + step) & 0x7fffffff);
      std::vector<torch::Tensor> send_tensors{outgoing};
      std::vector<torch::Tensor> recv_tensors{incoming};
      WorkPtr send = gloo.send(send_tensors, right, tag);
      WorkPtr recv = gloo.recv(recv_tensors, left, tag);
      recv->wait(timeout);
      send->wait(timeout);
      if (step + 2 < world) {
        incoming.add_(chunk(rank - 2 - step));
        outgoing = incoming;
      } else {
        // The last chunk arriving is this rank's; writing the sum straight
        // into `output` is safe even when it is that chunk of `input`.
        torch::Tensor flat_out = output.view({-1});
        torch::add_out(flat_out, incoming, chunk(rank));
      }
    }
  } catch (...) {
    return ErrorText(std::current_exception());
  }
  return "";
}

absl::Status CheckDense(const char* op, const char* name,
                        const torch::Tensor& t) {
  if (!t.defined() || !t.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " must be a defined, contiguous tensor"));
  }
  return absl::OkStatus();
}

// The flat collectives: `large` has world times the elements of `small`.
absl::Status CheckFlatPair(const char* op, const char* small_name,
                           const torch::Tensor& small, const char* large_name,
                           const torch::Tensor& large, int64_t world) {
  if (absl::Status s = CheckDense(op, small_name, small); !s.ok()) return s;
  if (absl::Status s = CheckDense(op, large_name, large); !s.ok()) return s;
  if (large.numel() != small.numel() * world ||
      large.dtype() != small.dtype() || large.device() != small.device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", large_name, " must have world_size (", world, ") times the ",
        small_name, "'s ", small.numel(), " elements (has ", large.numel(),
        "), with the same dtype and device"));
  }
  return absl::OkStatus();
}

template <typename Launch>
std::unique_ptr<CommWork> Issue(const std::shared_ptr<Shared>& shared,
                                const char* op, const torch::Tensor& tensor,
                                Launch launch) {
  try {
    return std::make_unique<C10dWork>(shared, op, launch(),
                                      tensor.defined() && tensor.is_cuda());
  } catch (...) {
    // The arguments were checked before: a launch that throws is a broken
    // group (2.x: a communicator the watchdog aborted), diagnosed as such.
    return Done(shared->Failure(absl::StrCat(op, " (at launch)"),
                                ErrorText(std::current_exception())));
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// C10dCommunicator

C10dCommunicator::C10dCommunicator(int64_t rank, int64_t world_size,
                                   std::chrono::milliseconds timeout,
                                   HeartbeatOptions heartbeat,
                                   int64_t root_rank, bool sub_group)
    : rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      heartbeat_(heartbeat),
      sub_group_(sub_group),
      shared_(std::make_shared<Shared>(root_rank, timeout)),
      groups_(std::make_unique<Groups>()) {}

absl::StatusOr<std::unique_ptr<C10dCommunicator>> C10dCommunicator::Create(
    const DistEnv& env, std::chrono::milliseconds timeout, torch::Device device,
    C10dOptions options) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", env.rank, " is not in a world of size ", env.world_size));
  }
  if (timeout <= std::chrono::milliseconds(0)) {
    return absl::InvalidArgumentError(
        "the communication timeout must be positive");
  }
#ifndef SHARDTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    return absl::FailedPreconditionError(
        "this build has no CUDA: NCCL is unavailable; use a cpu device");
  }
#endif
  std::unique_ptr<C10dCommunicator> comm(
      new C10dCommunicator(env.rank, env.world_size, timeout, options.heartbeat,
                           env.rank, /*sub_group=*/false));
  const std::string where = absl::StrCat(env.master_addr, ":", env.master_port);
  Groups& groups = *comm->groups_;
  // Gloo writes with writev(), which raises SIGPIPE when a peer is gone.
  struct sigaction pipe_action {};
  if (sigaction(SIGPIPE, nullptr, &pipe_action) == 0 &&
      pipe_action.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
  const std::chrono::milliseconds rendezvous_timeout =
      options.rendezvous_timeout > std::chrono::milliseconds(0)
          ? options.rendezvous_timeout
          : timeout;
  const SteadyClock::time_point started = SteadyClock::now();
  const SteadyClock::time_point deadline = started + rendezvous_timeout;
  absl::Status joined;
  if (env.rank != 0) {
    joined = WaitForStore(env.master_addr, env.master_port, deadline);
  }
  // A world of one has no peer to find the store: it listens on a port the
  // kernel picks, so concurrent single-rank runs never contend for
  // MASTER_PORT's default.
  int store_port = env.world_size == 1 ? 0 : env.master_port;
  if (joined.ok()) {
    try {
      groups.store = MakeTcpStore(
          env.master_addr,
          StoreOptions(store_port, env.rank == 0, rendezvous_timeout));
      store_port = groups.store->getPort();
      joined = Rendezvous(*groups.store, env.world_size, deadline);
    } catch (...) {
      const std::string error = ErrorText(std::current_exception());
      joined = IsTimeout(error) ? absl::DeadlineExceededError(error)
                                : absl::UnavailableError(error);
    }
  }
  if (!joined.ok()) {
    // How long it tried, not the timeout: a port taken fails at once.
    const double tried =
        std::chrono::duration<double>(SteadyClock::now() - started).count();
    const std::string message = absl::StrFormat(
        "rendezvous of rank %d of %d at %s (MASTER_ADDR:"
        "MASTER_PORT) failed after %.1f s (timeout %.1f s): %s",
        env.rank, env.world_size, where, tried,
        rendezvous_timeout.count() / 1000.0, joined.message());
    // Rank 0 serves the store: a port taken by another process is worth
    // another try on a different one (the launcher's call).
    const std::string lower = absl::AsciiStrToLower(joined.message());
    if (env.rank == 0 && (absl::StrContains(lower, "address already in use") ||
                          absl::StrContains(lower, "eaddrinuse"))) {
      return RendezvousPortTakenError(message);
    }
    return absl::Status(joined.code(), message);
  }
  try {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
    groups.gloo_device = GlooDevice(env.master_addr);
    gloo_options->devices.push_back(groups.gloo_device);
    groups.gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", groups.store),
        static_cast<int>(env.rank), static_cast<int>(env.world_size),
        gloo_options);
#ifdef SHARDTRAIN_WITH_CUDA
    if (device.is_cuda()) {
      SetNcclErrorHandlingDefaults();
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      groups.nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl", groups.store),
          static_cast<int>(env.rank), static_cast<int>(env.world_size),
          nccl_options);
    }
#endif
    auto heartbeat_store =
        MakeTcpStore(env.master_addr,
                     StoreOptions(store_port, /*is_server=*/false, timeout));
    absl::MutexLock lock(&comm->shared_->mutex);
    comm->shared_->monitor = std::make_shared<HeartbeatMonitor>(
        std::make_unique<TcpHeartbeatStore>(std::move(heartbeat_store)),
        env.rank, env.world_size, options.heartbeat);
  } catch (...) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", env.rank, " could not set up its process groups via ", where,
        ": ", ErrorText(std::current_exception())));
  }
  comm->side_thread_ = std::make_unique<SideThread>();
  return comm;
}

C10dCommunicator::~C10dCommunicator() {
  side_thread_.reset();
  // Leave the process groups first, so that peers still in a collective
  // with us fail at once instead of timing out.
  groups_->gloo.reset();
#ifdef SHARDTRAIN_WITH_CUDA
  if (groups_->nccl) {
#ifdef SHARDTRAIN_TORCH_NCCL_HAS_SHUTDOWN
    // 2.x warns when a group is destroyed without either. shutdown() flushes
    // pending work (and would wait for a lost peer), abort() does not.
    bool failed = false;
    {
      absl::MutexLock lock(&shared_->mutex);
      failed = shared_->failed;
    }
    try {
      if (failed) {
        groups_->nccl->abort();
      } else {
        groups_->nccl->shutdown();
      }
    } catch (...) {
      // Leaving anyway.
    }
#endif
    groups_->nccl.reset();
  }
#endif
  std::shared_ptr<HeartbeatMonitor> monitor;
  {
    absl::MutexLock lock(&shared_->mutex);
    monitor = std::move(shared_->monitor);
  }
  const bool joined = monitor != nullptr;  // Create() got to the end
  monitor.reset();
  if (sub_group_) {
    // The store and the heartbeat belong to the group this one was made
    // from.
    groups_.reset();
    return;
  }
  // LibTorch 1.13's store client misbehaves when its server goes away under
  // it (a background thread spins on the closed socket, or aborts the
  // process on a reset one), so rank 0 keeps the store up until the others
  // have closed their connections.
  if (!joined) {
    // Nobody counts on us yet.
  } else if (rank_ == 0) {
    AwaitDepartures();
  } else {
    try {
      groups_->store->set(DepartureKey(rank_), std::vector<uint8_t>{1});
    } catch (...) {
      // The store is gone already; nobody is waiting.
    }
  }
  groups_.reset();
}

std::string C10dCommunicator::DepartureKey(int64_t rank) {
  return absl::StrCat("shardtrain/left/", rank);
}

void C10dCommunicator::AwaitDepartures() {
  {
    absl::MutexLock lock(&shared_->mutex);
    if (shared_->lost.has_value()) return;  // the group broke; don't linger
  }
  const SteadyClock::time_point deadline = SteadyClock::now() + timeout_;
  // A rank that has not left but whose heartbeat is this old is dead.
  const int64_t stale_ms = heartbeat_.stale_after.count() + 1000;
  try {
    std::vector<int64_t> pending;
    for (int64_t r = 1; r < world_size_; ++r) pending.push_back(r);
    while (!pending.empty() && SteadyClock::now() < deadline) {
      const int64_t unix_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(
              std::chrono::system_clock::now().time_since_epoch())
              .count();
      std::vector<int64_t> still;
      for (int64_t r : pending) {
        if (groups_->store->check({DepartureKey(r)})) continue;
        const int64_t beat = groups_->store->add(HeartbeatMonitor::Key(r), 0);
        if (unix_ms - beat > stale_ms) continue;
        still.push_back(r);
      }
      pending = std::move(still);
      if (!pending.empty()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  } catch (...) {
    // Our own store failing is no reason to keep the process.
  }
}

std::unique_ptr<CommWork> C10dCommunicator::AllReduce(torch::Tensor& tensor) {
  if (absl::Status s = CheckDense("all_reduce", "tensor", tensor); !s.ok()) {
    return Done(s);
  }
  shared_->Count(tensor);
  std::vector<torch::Tensor> tensors{tensor};
  return Issue(shared_, "all_reduce", tensor, [&]() -> WorkPtr {
#ifdef SHARDTRAIN_WITH_CUDA
    if (tensor.is_cuda()) return groups_->nccl->allreduce(tensors);
#endif
    return groups_->gloo->allreduce(tensors);
  });
}

std::unique_ptr<CommWork> C10dCommunicator::ReduceScatter(
    torch::Tensor& output, const torch::Tensor& input) {
  if (absl::Status s = CheckFlatPair("reduce_scatter", "output", output,
                                     "input", input, world_size_);
      !s.ok()) {
    return Done(s);
  }
  shared_->Count(input);
#ifdef SHARDTRAIN_WITH_CUDA
  if (input.is_cuda()) {
    return Issue(shared_, "reduce_scatter", input, [&]() -> WorkPtr {
      torch::Tensor in = input;
      return groups_->nccl->_reduce_scatter_base(output, in);
    });
  }
#endif
  if (world_size_ == 1) {
    if (!output.is_same(input)) output.copy_(input.view_as(output));
    return Done(absl::OkStatus());
  }
  auto completion = std::make_shared<Completion>();
  side_thread_->Post([gloo = groups_->gloo, out = output, in = input,
                      rank = rank_, world = world_size_, ring = ring_count_++,
                      timeout = timeout_, completion]() mutable {
    const std::string error =
        RingReduceScatter(*gloo, out, in, rank, world, ring, timeout);
    // Let go of the tensors before the waiter wakes (see AwaitRelease).
    out = torch::Tensor();
    in = torch::Tensor();
    completion->Finish(error);
  });
  return std::make_unique<SideWork>(shared_, "reduce_scatter", completion);
}

std::unique_ptr<CommWork> C10dCommunicator::AllGather(
    torch::Tensor& output, const torch::Tensor& input) {
  if (absl::Status s = CheckFlatPair("all_gather", "input", input, "output",
                                     output, world_size_);
      !s.ok()) {
    return Done(s);
  }
  shared_->Count(input);
  return Issue(shared_, "all_gather", input, [&]() -> WorkPtr {
    std::vector<torch::Tensor> inputs{input};
#ifdef SHARDTRAIN_WITH_CUDA
    if (input.is_cuda())
      return groups_->nccl->_allgather_base(output, inputs[0]);
#endif
    // Gloo has only the list form: give it views of the flat output.
    const int64_t n = input.numel();
    std::vector<std::vector<torch::Tensor>> outputs(1);
    for (int64_t r = 0; r < world_size_; ++r) {
      outputs[0].push_back(
          output.view({-1}).narrow(0, r * n, n).view(input.sizes()));
    }
    return groups_->gloo->allgather(outputs, inputs);
  });
}

std::unique_ptr<CommWork> C10dCommunicator::Broadcast(torch::Tensor& tensor,
                                                      int64_t root) {
  if (absl::Status s = CheckDense("broadcast", "tensor", tensor); !s.ok()) {
    return Done(s);
  }
  if (root < 0 || root >= world_size_) {
    return Done(absl::InvalidArgumentError(absl::StrCat(
        "broadcast: root ", root, " is not a rank below ", world_size_)));
  }
  shared_->Count(tensor);
  std::vector<torch::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return Issue(shared_, "broadcast", tensor, [&]() -> WorkPtr {
#ifdef SHARDTRAIN_WITH_CUDA
    if (tensor.is_cuda()) return groups_->nccl->broadcast(tensors, options);
#endif
    return groups_->gloo->broadcast(tensors, options);
  });
}

namespace {

// Point-to-point peers and tags, checked alike for both directions.
absl::Status CheckPeer(const char* op, const torch::Tensor& tensor,
                       int64_t peer, int64_t rank, int64_t world, int64_t tag) {
  if (absl::Status s = CheckDense(op, "tensor", tensor); !s.ok()) return s;
  if (peer < 0 || peer >= world || peer == rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": peer ", peer, " is not another rank below ", world));
  }
  if (tag < 0 || tag > 0x7fffffff) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": tag ", tag, " is outside [0, 2^31)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<CommWork> C10dCommunicator::Send(const torch::Tensor& tensor,
                                                 int64_t dst, int64_t tag) {
  if (absl::Status s = CheckPeer("send", tensor, dst, rank_, world_size_, tag);
      !s.ok()) {
    return Done(s);
  }
  shared_->Count(tensor);
  std::vector<torch::Tensor> tensors{tensor};
  return Issue(shared_, "send", tensor, [&]() -> WorkPtr {
#ifdef SHARDTRAIN_WITH_CUDA
    if (tensor.is_cuda()) {
      return groups_->nccl->send(tensors, static_cast<int>(dst),
                                 static_cast<int>(tag));
    }
#endif
    return groups_->gloo->send(tensors, static_cast<int>(dst),
                               static_cast<int>(tag));
  });
}

std::unique_ptr<CommWork> C10dCommunicator::Recv(torch::Tensor& tensor,
                                                 int64_t src, int64_t tag) {
  if (absl::Status s = CheckPeer("recv", tensor, src, rank_, world_size_, tag);
      !s.ok()) {
    return Done(s);
  }
  std::vector<torch::Tensor> tensors{tensor};
  return Issue(shared_, "recv", tensor, [&]() -> WorkPtr {
#ifdef SHARDTRAIN_WITH_CUDA
    if (tensor.is_cuda()) {
      return groups_->nccl->recv(tensors, static_cast<int>(src),
                                 static_cast<int>(tag));
    }
#endif
    return groups_->gloo->recv(tensors, static_cast<int>(src),
                               static_cast<int>(tag));
  });
}

absl::Status C10dCommunicator::Barrier() {
  // Gloo's barrier blocks the host whatever the device, which is what a
  // barrier is for.
  return Issue(shared_, "barrier", torch::Tensor(),
               [&] { return groups_->gloo->barrier(); })
      ->Wait();
}

absl::StatusOr<std::unique_ptr<Communicator>> C10dCommunicator::NewGroup(
    const std::string& tag, const std::vector<int64_t>& members) {
  absl::StatusOr<int64_t> position =
      PositionInGroup(members, rank_, world_size_);
  if (!position.ok()) return position.status();
  int64_t root_rank = 0;
  std::shared_ptr<HeartbeatMonitor> monitor;
  {
    absl::MutexLock lock(&shared_->mutex);
    root_rank = shared_->rank;
    monitor = shared_->monitor;
  }
  std::unique_ptr<C10dCommunicator> sub(new C10dCommunicator(
      *position, static_cast<int64_t>(members.size()), timeout_, heartbeat_,
      root_rank, /*sub_group=*/true));
  Groups& groups = *sub->groups_;
  groups.store = groups_->store;
  groups.gloo_device = groups_->gloo_device;
  // The key prefix keeps the group's rendezvous apart from every other's.
  const std::string prefix =
      absl::StrCat("group/", tag, "/", absl::StrJoin(members, ","), "/");
  try {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout_);
    gloo_options->devices.push_back(groups.gloo_device);
    groups.gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>(prefix + "gloo", groups.store),
        static_cast<int>(*position), static_cast<int>(members.size()),
        gloo_options);
#ifdef SHARDTRAIN_WITH_CUDA
    if (groups_->nccl) {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout_;
      groups.nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>(prefix + "nccl", groups.store),
          static_cast<int>(*position), static_cast<int>(members.size()),
          nccl_options);
    }
#endif
  } catch (...) {
    return shared_->Failure(absl::StrCat("forming group ", tag),
                            ErrorText(std::current_exception()));
  }
  {
    absl::MutexLock lock(&sub->shared_->mutex);
    sub->shared_->monitor = std::move(monitor);
  }
  sub->side_thread_ = std::make_unique<SideThread>();
  return sub;
}

CommStats C10dCommunicator::TakeStats() {
  absl::MutexLock lock(&shared_->mutex);
  CommStats stats = shared_->stats;
  shared_->stats = {};
  return stats;
}

}  // namespace shardtrain
