// C10dCommunicator on real Gloo groups over loopback. Ranks run as threads of
// this process, each with its own store connection and process group; where
// a rank has to die, it runs as a child process (this binary, re-run with a
// filter that selects the disabled PeerProcess test).
#include "worker/engine/comm/c10d_communicator.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "common/exit_codes.h"
#include "common/free_port.h"
#include "worker/local_ranks.h"

extern char** environ;

namespace shardtrain {
namespace {

using ::testing::HasSubstr;
using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kTimeout{10000};

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// A listening loopback socket on a port the kernel picks (another process's
// MASTER_PORT, as far as a rank can tell): its fd (-1 on failure, errno set),
// the port in *port.
int HoldLoopbackPort(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(fd, 1) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int error = errno;
    close(fd);
    errno = error;
    return -1;
  }
  *port = ntohs(address.sin_port);
  return fd;
}

int FreePort() {
  absl::StatusOr<int> port = PickFreePort();
  EXPECT_TRUE(port.ok()) << port.status();
  return port.value_or(0);
}

DistEnv Env(int64_t rank, int64_t world, int port) {
  DistEnv env;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  return env;
}

// Collectives may time out quickly, but joining is allowed the usual time:
// a loaded machine can take seconds to start a peer process.
C10dOptions Patient() {
  C10dOptions options;
  options.rendezvous_timeout = kTimeout;
  return options;
}

// Runs fn(rank, communicator) for every rank on its own thread and joins.
void RunGroup(int64_t world,
              const std::function<void(int64_t, C10dCommunicator&)>& fn,
              milliseconds timeout = kTimeout) {
  const int port = FreePort();
  std::vector<std::thread> threads;
  for (int64_t rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      auto comm = C10dCommunicator::Create(Env(rank, world, port), timeout,
                                           torch::kCPU, Patient());
      ASSERT_TRUE(comm.ok()) << comm.status();
      fn(rank, **comm);
    });
  }
  for (std::thread& t : threads) t.join();
}

class C10dCommunicatorTest : public testing::TestWithParam<int64_t> {
 protected:
  int64_t world() const { return GetParam(); }
};

TEST_P(C10dCommunicatorTest, AllReduceSumsEveryRanksTensor) {
  const int64_t w = world();
  RunGroup(w, [&](int64_t rank, C10dCommunicator& comm) {
    torch::Tensor floats = torch::full({2, 3}, rank + 1.0, torch::kFloat64);
    torch::Tensor ints = torch::arange(5, torch::kInt64) * (rank + 1);

    ASSERT_TRUE(comm.AllReduce(floats)->Wait().ok());
    ASSERT_TRUE(comm.AllReduce(ints)->Wait().ok());

    const int64_t ranks_sum = w * (w + 1) / 2;
    EXPECT_TRUE(torch::equal(
        floats, torch::full({2, 3}, double(ranks_sum), torch::kFloat64)));
    EXPECT_TRUE(
        torch::equal(ints, torch::arange(5, torch::kInt64) * ranks_sum));
  });
}

// Each rank contributes arange(w * n) + 100 * rank, so chunk r of the sum is
// w * arange(r * n, (r + 1) * n) + 100 * (0 + 1 + ... + w - 1).
torch::Tensor ReduceScatterInput(int64_t rank, int64_t w, int64_t n) {
  return torch::arange(w * n, torch::kFloat32) + 100.0 * rank;
}
torch::Tensor ReduceScatterExpected(int64_t rank, int64_t w, int64_t n) {
  return torch::arange(rank * n, (rank + 1) * n, torch::kFloat32) * w +
         100.0 * (w * (w - 1) / 2);
}

TEST_P(C10dCommunicatorTest, ReduceScatterGivesEachRankTheSumOfItsChunk) {
  const int64_t w = world();
  RunGroup(w, [&](int64_t rank, C10dCommunicator& comm) {
    for (int64_t n : {1, 7, 100000}) {
      torch::Tensor input = ReduceScatterInput(rank, w, n);
      torch::Tensor output = torch::empty({n});

      ASSERT_TRUE(comm.ReduceScatter(output, input)->Wait().ok());

      EXPECT_TRUE(torch::equal(output, ReduceScatterExpected(rank, w, n)))
          << "n=" << n << " rank " << rank;
      EXPECT_TRUE(torch::equal(input, ReduceScatterInput(rank, w, n)))
          << "the input is left as it was";
    }
  });
}

TEST_P(C10dCommunicatorTest, ReduceScatterWorksInPlaceOnTheRanksChunk) {
  const int64_t w = world();
  const int64_t n = 1000;
  RunGroup(w, [&](int64_t rank, C10dCommunicator& comm) {
    torch::Tensor input = ReduceScatterInput(rank, w, n);
    torch::Tensor output = input.narrow(0, rank * n, n);

    ASSERT_TRUE(comm.ReduceScatter(output, input)->Wait().ok());

    EXPECT_TRUE(torch::equal(output, ReduceScatterExpected(rank, w, n)));
  });
}

TEST_P(C10dCommunicatorTest, AllGatherPutsRankRsInputInChunkR) {
  const int64_t w = world();
  RunGroup(w, [&](int64_t rank, C10dCommunicator& comm) {
    torch::Tensor input =
        torch::full({2, 3}, double(rank)) + torch::arange(6).view({2, 3});
    torch::Tensor output = torch::empty({w * 6});

    ASSERT_TRUE(comm.AllGather(output, input)->Wait().ok());

    for (int64_t r = 0; r < w; ++r) {
      EXPECT_TRUE(torch::equal(output.narrow(0, r * 6, 6),
                               torch::arange(6, torch::kFloat32) + r))
          << "chunk " << r;
    }
  });
}

TEST_P(C10dCommunicatorTest, BroadcastCopiesTheRootsTensor) {
  const int64_t w = world();
  const int64_t root = w - 1;
  RunGroup(w, [&](int64_t rank, C10dCommunicator& comm) {
    torch::Tensor tensor = torch::full({4}, double(rank * 10));

    ASSERT_TRUE(comm.Broadcast(tensor, root)->Wait().ok());

    EXPECT_TRUE(torch::equal(tensor, torch::full({4}, double(root * 10))));
  });
}

TEST_P(C10dCommunicatorTest, WorksIssuedTogetherCompleteInAnyWaitOrder) {
  const int64_t w = world();
  RunGroup(w, [&](int64_t rank, C10dCommunicator& comm) {
    torch::Tensor reduced = torch::ones({3});
    torch::Tensor gathered = torch::empty({w});
    torch::Tensor input = torch::full({1}, double(rank));
    torch::Tensor scattered_in = ReduceScatterInput(rank, w, 4);
    torch::Tensor scattered = torch::empty({4});

    auto a = comm.AllReduce(reduced);
    auto b = comm.ReduceScatter(scattered, scattered_in);
    auto c = comm.AllGather(gathered, input);
    ASSERT_TRUE(c->Wait().ok());
    ASSERT_TRUE(b->Wait().ok());
    ASSERT_TRUE(a->Wait().ok());

    EXPECT_TRUE(a->IsCompleted() && b->IsCompleted() && c->IsCompleted());
    EXPECT_TRUE(torch::equal(reduced, torch::full({3}, double(w))));
    EXPECT_TRUE(torch::equal(scattered, ReduceScatterExpected(rank, w, 4)));
    EXPECT_TRUE(torch::equal(gathered, torch::arange(w, torch::kFloat32)));
  });
}

TEST_P(C10dCommunicatorTest, StatsCountContributedBytesAndBlockedSeconds) {
  const int64_t w = world();
  RunGroup(w, [&](int64_t rank, C10dCommunicator& comm) {
    torch::Tensor a = torch::ones({100});  // 400 bytes
    torch::Tensor in = torch::ones({10});  // 40 bytes
    torch::Tensor out = torch::empty({10 * w});
    torch::Tensor rs_in = torch::ones({10 * w});  // 40 * w bytes
    torch::Tensor rs_out = torch::empty({10});
    ASSERT_TRUE(comm.AllReduce(a)->Wait().ok());
    ASSERT_TRUE(comm.AllGather(out, in)->Wait().ok());
    ASSERT_TRUE(comm.ReduceScatter(rs_out, rs_in)->Wait().ok());
    // Rank 0 arrives late at the barrier: the others are blocked meanwhile.
    if (rank == 0) std::this_thread::sleep_for(milliseconds(300));
    ASSERT_TRUE(comm.Barrier().ok());

    const CommStats stats = comm.TakeStats();
    EXPECT_EQ(stats.bytes, 400 + 40 + 40 * w);
    if (rank != 0) {
      EXPECT_GE(stats.seconds, 0.25);
    }
    const CommStats again = comm.TakeStats();
    EXPECT_EQ(again.bytes, 0);
    EXPECT_EQ(again.seconds, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, C10dCommunicatorTest,
                         testing::Values(2, 3, 4),
                         [](const testing::TestParamInfo<int64_t>& info) {
                           return "World" + std::to_string(info.param);
                         });

TEST(C10dCommunicatorSingleRankTest, CollectivesAreIdentities) {
  RunGroup(1, [](int64_t, C10dCommunicator& comm) {
    torch::Tensor t = torch::arange(4, torch::kFloat32);
    torch::Tensor out = torch::empty({4});
    ASSERT_TRUE(comm.AllReduce(t)->Wait().ok());
    ASSERT_TRUE(comm.ReduceScatter(out, t)->Wait().ok());
    EXPECT_TRUE(torch::equal(t, torch::arange(4, torch::kFloat32)));
    EXPECT_TRUE(torch::equal(out, t));
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

TEST(C10dCommunicatorSingleRankTest, MismatchedSizesAreRejectedAtOnce) {
  RunGroup(1, [](int64_t, C10dCommunicator& comm) {
    torch::Tensor input = torch::ones({6});
    torch::Tensor output = torch::empty({4});

    absl::Status s = comm.ReduceScatter(output, input)->Wait();

    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(),
                HasSubstr("reduce_scatter: input must have world_size (1)"));
    torch::Tensor strided = torch::ones({4, 4}).t();
    EXPECT_EQ(comm.AllReduce(strided)->Wait().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

TEST(C10dCommunicatorRendezvousTest, MissingRankTimesOutNamingTheAddress) {
  const int port = FreePort();
  const SteadyClock::time_point start = SteadyClock::now();

  auto comm = C10dCommunicator::Create(Env(0, 2, port), milliseconds(1000),
                                       torch::kCPU);

  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_THAT(comm.status().message(),
              HasSubstr("rendezvous of rank 0 of 2 at 127.0.0.1:" +
                        std::to_string(port)));
  EXPECT_LT(SecondsSince(start), 3.0);
}

// Another process holds MASTER_PORT: rank 0 cannot serve the store, and
// says so in a way the launchers recognise (they retry on another port).
TEST(C10dCommunicatorRendezvousTest, TakenPortIsReportedAsTaken) {
  int port = 0;
  const int holder = HoldLoopbackPort(&port);
  ASSERT_GE(holder, 0) << std::strerror(errno);

  auto comm = C10dCommunicator::Create(Env(0, 2, port), milliseconds(2000),
                                       torch::kCPU);
  close(holder);

  ASSERT_FALSE(comm.ok());
  EXPECT_TRUE(IsRendezvousPortTaken(comm.status())) << comm.status();
  EXPECT_THAT(comm.status().message(),
              HasSubstr("127.0.0.1:" + std::to_string(port)));
}

// A world of one needs no agreed port: it serves its store on one the
// kernel picks, so a taken MASTER_PORT (two single-rank DDP runs at once
// with the default 29500) does not stop it.
TEST(C10dCommunicatorRendezvousTest, AWorldOfOneIgnoresATakenPort) {
  int port = 0;
  const int holder = HoldLoopbackPort(&port);
  ASSERT_GE(holder, 0) << std::strerror(errno);
  auto comm = C10dCommunicator::Create(Env(0, 1, port), milliseconds(2000),
                                       torch::kCPU);
  close(holder);
  ASSERT_TRUE(comm.ok()) << comm.status();
  torch::Tensor t = torch::ones({4});
  ASSERT_TRUE((*comm)->AllReduce(t)->Wait().ok());
  EXPECT_TRUE(torch::equal(t, torch::ones({4})));
}

TEST(C10dCommunicatorRendezvousTest, AbsentStoreHostTimesOut) {
  const int port = FreePort();
  const SteadyClock::time_point start = SteadyClock::now();

  auto comm = C10dCommunicator::Create(Env(1, 2, port), milliseconds(1000),
                                       torch::kCPU);

  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_THAT(comm.status().message(), HasSubstr("rendezvous of rank 1 of 2"));
  EXPECT_LT(SecondsSince(start), 3.0);
}

TEST(C10dCommunicatorFailureTest, SilentButAliveRankTimesOutWithNoOneLost) {
  const milliseconds timeout{1000};
  std::promise<void> rank0_done;
  std::shared_future<void> rank0_done_future = rank0_done.get_future().share();
  RunGroup(
      2,
      [&](int64_t rank, C10dCommunicator& comm) {
        if (rank == 1) {
          // Alive (heartbeating, connected) but never joins the collective.
          rank0_done_future.wait();
          return;
        }
        torch::Tensor t = torch::ones({3});
        const SteadyClock::time_point start = SteadyClock::now();

        absl::Status s = comm.AllReduce(t)->Wait();
        const double took = SecondsSince(start);
        rank0_done.set_value();

        EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
        EXPECT_THAT(s.message(),
                    HasSubstr("all_reduce timed out after 1.0 s on rank 0: no "
                              "rank lost (all heartbeats current)"));
        // The timeout, then up to a heartbeat interval to see rank 1 beat.
        EXPECT_LT(took, 1.0 + 1.0 + 0.5);
      },
      timeout);
}

// ---------------------------------------------------------------------------
// A rank in another process, so that it can be killed or frozen.

constexpr char kPeerFilter[] =
    "--gtest_filter=C10dCommunicatorPeer.DISABLED_PeerProcess";

// Run only as a child of the tests below: joins the group as the rank given
// in SHARDTRAIN_PEER, does one all_reduce, then waits to be killed.
TEST(C10dCommunicatorPeer, DISABLED_PeerProcess) {
  const char* spec = std::getenv("SHARDTRAIN_PEER");  // "rank world port"
  if (spec == nullptr) GTEST_SKIP() << "only run by the lost-rank tests";
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  int rank = 0, world = 0, port = 0;
  ASSERT_EQ(std::sscanf(spec, "%d %d %d", &rank, &world, &port), 3);
  auto comm =
      C10dCommunicator::Create(Env(rank, world, port), kTimeout, torch::kCPU);
  ASSERT_TRUE(comm.ok()) << comm.status();
  torch::Tensor t = torch::ones({3});
  ASSERT_TRUE((*comm)->AllReduce(t)->Wait().ok());
  std::this_thread::sleep_for(std::chrono::seconds(60));
}

class PeerProcess {
 public:
  PeerProcess(int rank, int world, int port) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
    env_strings.push_back("SHARDTRAIN_PEER=" + std::to_string(rank) + " " +
                          std::to_string(world) + " " + std::to_string(port));
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    std::string filter = kPeerFilter;
    std::string disabled = "--gtest_also_run_disabled_tests";
    char* argv[] = {exe.data(), filter.data(), disabled.data(), nullptr};
    EXPECT_EQ(
        posix_spawn(&pid_, exe.c_str(), nullptr, nullptr, argv, envp.data()),
        0);
  }
  ~PeerProcess() { Kill(); }

  void Signal(int signo) { kill(pid_, signo); }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

TEST(C10dCommunicatorFailureTest, KilledRankIsNamedPromptly) {
  const int port = FreePort();
  PeerProcess peer(/*rank=*/1, /*world=*/2, port);
  auto comm = C10dCommunicator::Create(Env(0, 2, port), kTimeout, torch::kCPU);
  ASSERT_TRUE(comm.ok()) << comm.status();
  torch::Tensor t = torch::ones({3});
  ASSERT_TRUE((*comm)->AllReduce(t)->Wait().ok());  // both ranks are up

  peer.Kill();
  const SteadyClock::time_point start = SteadyClock::now();
  absl::Status s = (*comm)->AllReduce(t)->Wait();
  const double took = SecondsSince(start);

  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("all_reduce failed on rank 0: rank 1 lost "
                                     "(no heartbeat for "));
  // Gloo notices the closed connection at once; naming the rank takes the
  // heartbeat's stale_after (3 s) plus up to one beat.
  std::cout << "lost rank named after " << took << " s: " << s.message()
            << "\n";
  EXPECT_LT(took, 3.0 + 1.0 + 0.5);
  // The group stays broken, and says why without another wait.
  const SteadyClock::time_point again = SteadyClock::now();
  EXPECT_THAT((*comm)->Barrier().message(), HasSubstr("rank 1 lost"));
  EXPECT_LT(SecondsSince(again), 0.5);
  const SteadyClock::time_point destroy = SteadyClock::now();
  comm->reset();
  EXPECT_LT(SecondsSince(destroy), 1.0);
}

TEST(C10dCommunicatorFailureTest, FrozenRankIsNamedAfterTheTimeout) {
  const int port = FreePort();
  const milliseconds timeout{2000};
  PeerProcess peer(/*rank=*/1, /*world=*/2, port);
  auto comm = C10dCommunicator::Create(Env(0, 2, port), timeout, torch::kCPU,
                                       Patient());
  ASSERT_TRUE(comm.ok()) << comm.status();
  torch::Tensor first = torch::ones({3});  // the peer's one all_reduce
  ASSERT_TRUE((*comm)->AllReduce(first)->Wait().ok());
  torch::Tensor t = torch::ones({1000});

  peer.Signal(SIGSTOP);
  const SteadyClock::time_point start = SteadyClock::now();
  torch::Tensor chunk = t.narrow(0, 0, 500);
  absl::Status s = (*comm)->ReduceScatter(chunk, t)->Wait();
  const double took = SecondsSince(start);

  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("reduce_scatter timed out after 2.0 s on "
                                     "rank 0: rank 1 lost"));
  std::cout << "frozen rank named after " << took << " s: " << s.message()
            << "\n";
  EXPECT_LT(took, 2.0 + 3.0 + 1.0 + 0.5);
}

TEST(C10dCommunicatorFailureTest, LostStoreHostIsNamedAsRankZero) {
  const int port = FreePort();
  PeerProcess peer(/*rank=*/0, /*world=*/2, port);
  auto comm = C10dCommunicator::Create(Env(1, 2, port), kTimeout, torch::kCPU);
  ASSERT_TRUE(comm.ok()) << comm.status();
  torch::Tensor t = torch::ones({3});
  ASSERT_TRUE((*comm)->AllReduce(t)->Wait().ok());

  peer.Kill();
  const SteadyClock::time_point start = SteadyClock::now();
  absl::Status s = (*comm)->AllReduce(t)->Wait();
  const double took = SecondsSince(start);

  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("all_reduce failed on rank 1: rank 0 (the "
                                     "store host) lost (store unreachable: "));
  std::cout << "lost store host named after " << took << " s: " << s.message()
            << "\n";
  EXPECT_LT(took, 1.5);
}

TEST(C10dCommunicatorFailureTest, FrozenStoreHostIsNamedAsRankZero) {
  const int port = FreePort();
  const milliseconds timeout{2000};
  PeerProcess peer(/*rank=*/0, /*world=*/2, port);
  auto comm = C10dCommunicator::Create(Env(1, 2, port), timeout, torch::kCPU,
                                       Patient());
  ASSERT_TRUE(comm.ok()) << comm.status();
  torch::Tensor t = torch::ones({3});
  ASSERT_TRUE((*comm)->AllReduce(t)->Wait().ok());

  peer.Signal(SIGSTOP);
  const SteadyClock::time_point start = SteadyClock::now();
  absl::Status s = (*comm)->AllReduce(t)->Wait();
  const double took = SecondsSince(start);

  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("all_reduce timed out after 2.0 s on rank "
                                     "1: rank 0 (the store host) lost (store "
                                     "unreachable: no answer for "));
  std::cout << "frozen store host named after " << took << " s: " << s.message()
            << "\n";
  EXPECT_LT(took, 2.0 + 3.0 + 0.5);
  // The heartbeat thread is stuck on the frozen store; destruction does not
  // wait for it beyond one heartbeat interval.
  const SteadyClock::time_point destroy = SteadyClock::now();
  comm->reset();
  EXPECT_LT(SecondsSince(destroy), 1.5);
}

TEST(C10dCommunicatorShutdownTest, StoreHostStaysUntilTheOtherRanksHaveLeft) {
  const int port = FreePort();
  SteadyClock::time_point rank0_gone, rank1_leaving;
  auto run = [&](int64_t rank) {
    auto comm =
        C10dCommunicator::Create(Env(rank, 2, port), kTimeout, torch::kCPU);
    ASSERT_TRUE(comm.ok()) << comm.status();
    torch::Tensor t = torch::ones({3});
    ASSERT_TRUE((*comm)->AllReduce(t)->Wait().ok());
    if (rank == 1) {
      std::this_thread::sleep_for(milliseconds(500));  // e.g. a checkpoint
      rank1_leaving = SteadyClock::now();
    }
    comm->reset();
    if (rank == 0) rank0_gone = SteadyClock::now();
  };
  std::thread rank0(run, 0), rank1(run, 1);
  rank0.join();
  rank1.join();

  EXPECT_GE(rank0_gone, rank1_leaving);
}

TEST(C10dCommunicatorShutdownTest, StoreHostDoesNotWaitLongForADeadRank) {
  const int port = FreePort();
  PeerProcess peer(/*rank=*/1, /*world=*/2, port);
  auto comm = C10dCommunicator::Create(Env(0, 2, port), kTimeout, torch::kCPU);
  ASSERT_TRUE(comm.ok()) << comm.status();
  torch::Tensor t = torch::ones({3});
  ASSERT_TRUE((*comm)->AllReduce(t)->Wait().ok());
  peer.Kill();  // dies without leaving; no collective notices

  const SteadyClock::time_point start = SteadyClock::now();
  comm->reset();

  // Its heartbeat goes stale (3 s) plus a second of margin; not kTimeout.
  EXPECT_LT(SecondsSince(start), 3.0 + 1.0 + 1.5);
}

}  // namespace
}  // namespace shardtrain
