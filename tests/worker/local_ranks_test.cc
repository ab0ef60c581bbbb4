// LocalRanks with `sh -c` ranks: environment, prefixed output, exit codes,
// and who is reported as failing first.
#include "worker/local_ranks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>

#include "common/free_port.h"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using SteadyClock = std::chrono::steady_clock;

struct Launched {
  absl::StatusOr<LocalRanksResult> result;
  std::string out;
  std::string err;
  double seconds;
};

// Runs `script` under /bin/sh as `nproc` ranks.
Launched Launch(int nproc, const std::string& script,
                std::chrono::milliseconds grace = std::chrono::seconds(5)) {
  LocalRanksOptions options;
  options.nproc = nproc;
  options.program = "/bin/sh";
  options.argv = {"sh", "-c", script};
  options.grace = grace;
  std::ostringstream out, err;
  const SteadyClock::time_point start = SteadyClock::now();
  LocalRanks launcher(options, out, err);
  absl::StatusOr<LocalRanksResult> result = launcher.Run();
  const double seconds =
      std::chrono::duration<double>(SteadyClock::now() - start).count();
  return {std::move(result), out.str(), err.str(), seconds};
}

TEST(LocalRanksTest, RanksSeeTorchrunVariablesAndOutputIsPrefixed) {
  Launched l = Launch(3,
                      "echo \"out $RANK/$WORLD_SIZE local $LOCAL_RANK/"
                      "$LOCAL_WORLD_SIZE at $MASTER_ADDR\"; "
                      "echo \"err $RANK port $MASTER_PORT\" >&2");

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  EXPECT_EQ(l.result->exit_code, 0);
  EXPECT_EQ(l.result->first_failure.rank, -1);
  for (int r = 0; r < 3; ++r) {
    const std::string rank = std::to_string(r);
    EXPECT_THAT(l.out, HasSubstr("[rank " + rank + "] out " + rank +
                                 "/3 local " + rank + "/3 at 127.0.0.1\n"));
    EXPECT_THAT(l.err, HasSubstr("[rank " + rank + "] err " + rank + " port "));
  }
  EXPECT_THAT(l.err, Not(HasSubstr("port 0\n")));
  EXPECT_THAT(l.err, Not(HasSubstr("[launcher]")));
}

TEST(LocalRanksTest, OneNodeOfSeveralRunsItsSliceOfTheGlobalRanks) {
  LocalRanksOptions options;
  options.nproc = 2;
  options.nnodes = 3;
  options.node_rank = 1;
  options.master_addr = "node0.example";  // never contacted by sh
  options.program = "/bin/sh";
  options.argv = {"sh", "-c",
                  "echo \"$RANK/$WORLD_SIZE local $LOCAL_RANK node "
                  "$GROUP_RANK at $MASTER_ADDR:$MASTER_PORT\""};
  std::ostringstream out, err;
  absl::StatusOr<LocalRanksResult> result = LocalRanks(options, out, err).Run();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 0);
  EXPECT_THAT(out.str(),
              HasSubstr("[rank 2] 2/6 local 0 node 1 at node0.example:29500"));
  EXPECT_THAT(out.str(),
              HasSubstr("[rank 3] 3/6 local 1 node 1 at node0.example:29500"));

  // Several nodes need node 0's address, and a node index inside the run.
  options.master_addr = "127.0.0.1";
  EXPECT_THAT(LocalRanks(options, out, err).Run().status().message(),
              HasSubstr("--master-addr"));
  options.master_addr = "node0.example";
  options.node_rank = 3;
  EXPECT_THAT(LocalRanks(options, out, err).Run().status().message(),
              HasSubstr("--node-rank"));
}

TEST(LocalRanksTest, EveryRankGetsTheSamePort) {
  Launched l = Launch(2, "echo $MASTER_PORT");

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  const size_t first = l.out.find("] ");
  const std::string port =
      l.out.substr(first + 2, l.out.find('\n') - first - 2);
  EXPECT_THAT(l.out, HasSubstr("[rank 0] " + port + "\n"));
  EXPECT_THAT(l.out, HasSubstr("[rank 1] " + port + "\n"));
}

// Rank 0 exits with kExitRendezvousPortTaken the first time (as when another
// process took the picked port before it bound it): every rank starts again,
// on another port, and the run succeeds.
TEST(LocalRanksTest, TakenRendezvousPortStartsTheRanksAgainOnAnotherPort) {
  char dir_template[] = "/tmp/launcher-port-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string mark = std::string(dir_template) + "/tried";
  Launched l = Launch(
      2, "echo port $MASTER_PORT; if [ \"$RANK\" = 0 ] && [ ! -e " + mark +
             " ]; then touch " + mark + "; exit 75; fi; sleep 0.2");

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  EXPECT_EQ(l.result->exit_code, 0) << l.err;
  EXPECT_THAT(l.err, HasSubstr("was taken before rank 0 could bind it; "
                               "starting the ranks again on another port"));
  // Rank 0 printed two different ports.
  const size_t first = l.out.find("[rank 0] port ");
  const size_t second = l.out.find("[rank 0] port ", first + 1);
  ASSERT_NE(second, std::string::npos) << l.out;
  EXPECT_NE(l.out.substr(first, l.out.find('\n', first) - first),
            l.out.substr(second, l.out.find('\n', second) - second));
  std::remove(mark.c_str());
  rmdir(dir_template);
}

// A port the user chose is theirs: no silent move to another.
TEST(LocalRanksTest, ANamedPortIsNotRetried) {
  LocalRanksOptions options;
  options.nproc = 1;
  options.program = "/bin/sh";
  options.argv = {"sh", "-c", "exit 75"};
  options.master_port = 29999;
  std::ostringstream out, err;
  LocalRanks launcher(options, out, err);
  absl::StatusOr<LocalRanksResult> result = launcher.Run();

  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 75);
  EXPECT_THAT(err.str(), Not(HasSubstr("another port")));
}

TEST(LocalRanksTest, LinesAreKeptWholeAndAnUnterminatedLastLineIsEnded) {
  Launched l = Launch(1, "printf 'a\\nb'; printf 'c\\nd'");

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  EXPECT_EQ(l.out, "[rank 0] a\n[rank 0] bc\n[rank 0] d\n");
}

// Ranks slow to start (many on few cores) are not silence: until one prints,
// the launcher says how many run and for how long; after that, nothing.
TEST(LocalRanksTest, SaysTheRanksRunUntilOnePrints) {
  LocalRanksOptions options;
  options.nproc = 2;
  options.program = "/bin/sh";
  options.argv = {"sh", "-c", "sleep 1.2; echo up; sleep 1"};
  options.progress_every = std::chrono::milliseconds(500);
  std::ostringstream out, err;
  LocalRanks launcher(options, out, err);
  absl::StatusOr<LocalRanksResult> result = launcher.Run();

  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 0);
  EXPECT_THAT(err.str(), HasSubstr("[launcher] 2 of 2 ranks running for "));
  EXPECT_THAT(err.str(), HasSubstr(" s, none has printed yet (loading and "
                                   "joining the process group)\n"));
  // At 0.5 s and 1.0 s, maybe 1.5 s on a busy host; never after "up" (1.2 s
  // and the last second of silence).
  const std::string text = err.str();
  size_t lines = 0;
  for (size_t at = text.find("none has printed"); at != std::string::npos;
       at = text.find("none has printed", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 2u);
  EXPECT_LE(lines, 3u);
  EXPECT_THAT(out.str(), HasSubstr("[rank 1] up\n"));
}

TEST(LocalRanksTest, FailingRankStopsTheOthersAndIsReportedFirst) {
  Launched l = Launch(3,
                      "if [ \"$RANK\" = 1 ]; then echo bye; exit 3; fi; "
                      "sleep 30");

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  EXPECT_EQ(l.result->exit_code, 3);
  EXPECT_EQ(l.result->first_failure.rank, 1);
  EXPECT_EQ(l.result->first_failure.Describe(), "exit code 3");
  EXPECT_EQ(l.result->ranks[0].signal, SIGTERM);
  EXPECT_EQ(l.result->ranks[2].signal, SIGTERM);
  EXPECT_THAT(l.out, HasSubstr("[rank 1] bye\n"));
  EXPECT_THAT(l.err, HasSubstr("[launcher] rank 1 failed first (exit code 3); "
                               "stopping the other ranks\n"));
  EXPECT_THAT(l.err, HasSubstr("[launcher] rank 1 failed first (exit code 3); "
                               "other ranks: 0: stopped, signal TERM, 2: "
                               "stopped, signal TERM\n"));
  EXPECT_LT(l.seconds, 5.0);
}

TEST(LocalRanksTest, RankKilledBySignalIsReportedByName) {
  Launched l =
      Launch(2, "if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; sleep 30");

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  EXPECT_EQ(l.result->first_failure.rank, 1);
  EXPECT_EQ(l.result->first_failure.Describe(), "signal KILL");
  EXPECT_EQ(l.result->exit_code, 128 + SIGKILL);
  EXPECT_THAT(l.err, HasSubstr("rank 1 failed first (signal KILL)"));
}

TEST(LocalRanksTest, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  const std::string ready =
      testing::TempDir() + "launcher_trap_set_" + std::to_string(getpid());
  std::remove(ready.c_str());
  const std::chrono::milliseconds grace(300);
  // Rank 1 fails only once rank 0 ignores SIGTERM.
  Launched l = Launch(2,
                      "if [ \"$RANK\" = 1 ]; then "
                      "  while [ ! -e " +
                          ready +
                          " ]; do sleep 0.01; done; "
                          "  exit 1; "
                          "fi; "
                          "trap '' TERM; touch " +
                          ready + "; sleep 30",
                      grace);
  std::remove(ready.c_str());

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  EXPECT_EQ(l.result->first_failure.rank, 1);
  EXPECT_EQ(l.result->ranks[0].signal, SIGKILL);
  EXPECT_THAT(l.err, HasSubstr("other ranks: 0: stopped, signal KILL"));
  EXPECT_GE(l.seconds, 0.3);
  EXPECT_LT(l.seconds, 3.0);
}

TEST(LocalRanksTest, SigtermToTheLauncherStopsAllRanks) {
  // Rank 0 plays the user: it sends SIGTERM to the launcher (its parent).
  Launched l = Launch(2,
                      "if [ \"$RANK\" = 0 ]; then kill -TERM $PPID; fi; "
                      "sleep 30");

  ASSERT_TRUE(l.result.ok()) << l.result.status();
  EXPECT_EQ(l.result->interrupted_by, SIGTERM);
  EXPECT_EQ(l.result->exit_code, 128 + SIGTERM);
  EXPECT_EQ(l.result->first_failure.rank, -1);
  EXPECT_EQ(l.result->ranks[0].signal, SIGTERM);
  EXPECT_EQ(l.result->ranks[1].signal, SIGTERM);
  EXPECT_THAT(l.err,
              HasSubstr("[launcher] received SIGTERM; stopping all ranks"));
  EXPECT_LT(l.seconds, 5.0);
}

TEST(LocalRanksTest, ProgramThatCannotRunIsAnError) {
  LocalRanksOptions options;
  options.nproc = 2;
  options.program = "/nonexistent/shardtrain-train";
  std::ostringstream out, err;

  absl::StatusOr<LocalRanksResult> result = LocalRanks(options, out, err).Run();

  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      result.status().message(),
      HasSubstr("rank 0: cannot run /nonexistent/shardtrain-train: No such "
                "file or directory"));
}

TEST(LocalRanksTest, PickFreePortGivesABindablePort) {
  absl::StatusOr<int> port = PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();

  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(*port));
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  close(fd);
}

}  // namespace
}  // namespace shardtrain
