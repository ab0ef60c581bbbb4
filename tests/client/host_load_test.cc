#include "client/host_load.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace shardtrain::cli {
namespace {

// A child process running `script` under sh, its command line ending in
// "--job-id <job_id>" when job_id is not empty; killed when it goes out of
// scope.
class Child {
 public:
  Child(const std::string& script, const std::string& job_id) {
    std::vector<std::string> args = {"sh", "-c", script};
    if (!job_id.empty()) {
      args.push_back("--job-id");  // $0 and $1 of the script: unused
      args.push_back(job_id);
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawnp(&pid_, "sh", nullptr, nullptr, argv.data(), environ),
              0);
  }
  ~Child() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

 private:
  pid_t pid_ = 0;
};

constexpr char kSpin[] = "while :; do :; done";
constexpr char kIdle[] = "sleep 60; :";

TEST(HostLoadSamplerTest, CountsTheJobsProcessesApartFromOthers) {
  Child job_spinner(kSpin, "job-a");
  Child idle_job(kIdle, "job-b");
  Child other_spinner(kSpin, "");
  // Two samplers over the same seconds: one for the spinning job, one for a
  // job whose only process sleeps. What the first counts as its job, the
  // second counts as other use; whatever else the host runs, both see.
  HostLoadSampler a("job-a", absl::Milliseconds(250));
  HostLoadSampler b("job-b", absl::Milliseconds(250));
  absl::SleepFor(absl::Seconds(2));
  const HostLoad load_a = a.Stop();
  const HostLoad load_b = b.Stop();

  ASSERT_TRUE(load_a.measured);
  ASSERT_TRUE(load_b.measured);
  EXPECT_EQ(load_a.cores,
            static_cast<int>(std::thread::hardware_concurrency()));
  EXPECT_NEAR(load_a.seconds, 2.0, 0.5);
  // Each spinner gets at least a good part of a core, even on a busy host.
  EXPECT_GT(load_a.job_cores_mean, 0.3);
  EXPECT_GT(load_a.other_cores_mean, 0.3);  // the other spinner
  EXPECT_LT(load_b.job_cores_mean, 0.1);    // sleeping
  // The job spinner is other use to b, and only to b.
  EXPECT_NEAR(load_b.other_cores_mean - load_a.other_cores_mean,
              load_a.job_cores_mean, 0.25);
  EXPECT_GE(load_a.other_cores_peak, load_a.other_cores_mean * 0.5);
}

TEST(HostLoadSamplerTest, NothingIsMeasuredWithoutAProcessOfTheJobHere) {
  // Ranks on other hosts: this host's load says nothing about them.
  HostLoadSampler sampler("job-elsewhere", absl::Milliseconds(100));
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_FALSE(sampler.Stop().measured);
}

TEST(HostLoadSamplerTest, AHogStartedMidRunDisturbsIt) {
  Child job(kIdle, "job-c");
  HostLoadSampler sampler("job-c", absl::Milliseconds(250));
  absl::SleepFor(absl::Milliseconds(500));
  HostLoad load;
  {
    Child hog(kSpin, "");
    absl::SleepFor(absl::Milliseconds(1500));
    load = sampler.Stop();
  }
  ASSERT_TRUE(load.measured);
  EXPECT_GT(load.other_cores_peak, 0.5);
  if (load.cores <= 4) EXPECT_TRUE(Disturbs(load));
}

}  // namespace
}  // namespace shardtrain::cli
