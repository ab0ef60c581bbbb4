#include "client/host_load.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace shardtrain::cli {
namespace {

// A child process running `script` under sh, with `args` after it on its
// command line, in a process group of its own: the group (grandchildren
// included, which would otherwise keep ctest's output pipe open) is killed
// when it goes out of scope.
class Child {
 public:
  Child(const std::string& script, std::vector<std::string> args = {}) {
    args.insert(args.begin(), {"sh", "-c", script});
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
    EXPECT_EQ(posix_spawnp(&pid_, "sh", nullptr, &attr, argv.data(), environ),
              0);
    posix_spawnattr_destroy(&attr);
  }
  ~Child() {
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  int pid() const { return pid_; }

 private:
  pid_t pid_ = 0;
};

constexpr char kSpin[] = "while :; do :; done";
constexpr char kIdle[] = "sleep 60";
// A rank whose work is done by a process it starts.
constexpr char kSpinInAChild[] = "sh -c 'while :; do :; done' & wait";

JobPids Fixed(std::vector<int> pids) {
  return [pids] { return pids; };
}

TEST(HostLoadSamplerTest, CountsTheRanksAndTheirChildrenApartFromOthers) {
  Child rank_a(kSpinInAChild);
  Child rank_b(kIdle);
  // Names job-a's id in its arguments, as the ranks do, but is not a rank:
  // other use all the same.
  Child impostor(kSpin, {"--job-id", "job-a"});
  // Two samplers over the same seconds: one for the spinning job, one for a
  // job whose only process sleeps. What the first counts as its job, the
  // second counts as other use; whatever else the host runs, both see.
  HostLoadSampler a(Fixed({rank_a.pid()}), absl::Milliseconds(250));
  HostLoadSampler b(Fixed({rank_b.pid()}), absl::Milliseconds(250));
  absl::SleepFor(absl::Seconds(2));
  const HostLoad load_a = a.Stop();
  const HostLoad load_b = b.Stop();

  ASSERT_TRUE(load_a.measured);
  ASSERT_TRUE(load_b.measured);
  EXPECT_EQ(load_a.cores,
            static_cast<int>(std::thread::hardware_concurrency()));
  EXPECT_NEAR(load_a.seconds, 2.0, 0.5);
  // Each spinner gets at least a good part of a core, even on a busy host.
  EXPECT_GT(load_a.job_cores_mean, 0.3);    // the rank's child
  EXPECT_GT(load_a.other_cores_mean, 0.3);  // the impostor
  EXPECT_LT(load_b.job_cores_mean, 0.1);    // sleeping
  // The job's spinner is other use to b, and only to b.
  EXPECT_NEAR(load_b.other_cores_mean - load_a.other_cores_mean,
              load_a.job_cores_mean, 0.25);
  EXPECT_GE(load_a.other_cores_peak, load_a.other_cores_mean * 0.5);
}

// A restarted attempt has new ranks: the sampler follows what the
// coordinator reports now, and a process started from a rank is the job's
// from its first sample, whatever it execs into afterwards.
TEST(HostLoadSamplerTest, FollowsTheRanksTheCoordinatorReportsNow) {
  Child first(kIdle);
  Child second("sleep 0.5; exec sh -c 'while :; do :; done'");
  std::atomic<int> rank{first.pid()};
  HostLoadSampler sampler([&] { return std::vector<int>{rank.load()}; },
                          absl::Milliseconds(200));
  absl::SleepFor(absl::Milliseconds(300));
  rank = second.pid();  // the restart
  absl::SleepFor(absl::Seconds(2));
  const HostLoad load = sampler.Stop();
  ASSERT_TRUE(load.measured);
  EXPECT_GT(load.job_cores_mean, 0.3);
}

TEST(HostLoadSamplerTest, NothingIsMeasuredWithoutAProcessOfTheJobHere) {
  // Ranks on other hosts: this host's load says nothing about them.
  HostLoadSampler none(Fixed({}), absl::Milliseconds(100));
  HostLoadSampler elsewhere(Fixed({0}), absl::Milliseconds(100));
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_FALSE(none.Stop().measured);
  EXPECT_FALSE(elsewhere.Stop().measured);
}

TEST(HostLoadSamplerTest, AHogStartedMidRunDisturbsIt) {
  Child job(kIdle);
  HostLoadSampler sampler(Fixed({job.pid()}), absl::Milliseconds(250));
  absl::SleepFor(absl::Milliseconds(500));
  HostLoad load;
  {
    Child hog(kSpin);
    absl::SleepFor(absl::Milliseconds(1500));
    load = sampler.Stop();
  }
  ASSERT_TRUE(load.measured);
  EXPECT_GT(load.other_cores_peak, 0.5);
  if (load.cores <= 4) EXPECT_TRUE(Disturbs(load));
}

}  // namespace
}  // namespace shardtrain::cli
