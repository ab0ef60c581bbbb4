// JobManagerFixture: a JobManager driven by hand — a LocalJobLauncher over a
// fake ProcessSpawner stands in for processes, a fake clock for time, Tick()
// for the supervisor thread — over a real store in a temporary state dir.
// Shared by the JobManager's tests and the Slurm launcher's.
#ifndef SHARDTRAIN_TESTS_SERVER_JOB_MANAGER_FIXTURE_H_
#define SHARDTRAIN_TESTS_SERVER_JOB_MANAGER_FIXTURE_H_

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/job_manager.h"
#include "server/local_job_launcher.h"
#include "tests/fakes/fake_clock.h"
#include "tests/fakes/fake_process_spawner.h"
#include "tests/test_util.h"

namespace shardtrain::test {

class JobManagerFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_ / "data");
    // The step-time model's rates (elastic re-meshing) are the test's own.
    setenv("XDG_CACHE_HOME", (dir_ / "cache").c_str(), 1);
    WriteFile(dir_ / "data/train.bin", "x");
    auto store = JobStore::Open(dir_ / "state.db");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    manager_ = NewManager();
  }

  // Four CPU slots, 8 cores, heartbeat timeout 30 s, rendezvous 60 s, grace
  // 10 s; Configure() (a fixture's) then `tweak` (a test's) adjust them.
  std::unique_ptr<JobManager> NewManager(
      const std::function<void(JobManagerOptions&)>& tweak = nullptr) {
    JobManagerOptions options;
    options.state_dir = dir_.path();
    options.worker_binary = "/bin/shardtrain-worker";
    options.worker_address = "unix:/tmp/test.sock";
    for (int i = 0; i < 4; ++i)
      options.devices.push_back({i, v1::CPU, "cpu slot", 0});
    options.cpu_cores = 8;
    options.heartbeat_timeout = absl::Seconds(30);
    options.rendezvous_timeout = absl::Seconds(60);
    options.grace_period = absl::Seconds(10);
    options.resolve_data =
        [this](const std::string&) -> absl::StatusOr<std::string> {
      if (on_resolve_) on_resolve_();
      return dir_ / "data";
    };
    Configure(options);
    if (tweak) tweak(options);
    auto manager =
        JobManager::Create(options, store_.get(), launcher(), &clock_);
    EXPECT_TRUE(manager.ok()) << manager.status();
    (*manager)->ResumeInterruptedJobs();
    return std::move(*manager);
  }

  // What the local rank with process id `pid` presents to WorkerService.
  v1::WorkerIdentity Identity(int pid) {
    v1::WorkerIdentity w;
    w.set_job_id(launcher_.Env(pid, "SHARDTRAIN_JOB_ID"));
    w.set_secret(launcher_.Env(pid, "SHARDTRAIN_JOB_SECRET"));
    w.set_rank(std::stoi(launcher_.Env(pid, "RANK")));
    w.set_pid(pid);
    return w;
  }

  virtual void Configure(JobManagerOptions&) {}
  // The backend the manager drives: local processes over the fake
  // ProcessSpawner unless a fixture says otherwise.
  virtual AttemptLauncher* launcher() { return &local_; }

  // Spec(world, max_restarts) that may continue on `min_world` ranks: 3
  // sequences per rank per step, a checkpoint every 5 steps.
  static v1::JobSpec ElasticSpec(int world, int min_world,
                                 int max_restarts = 2) {
    v1::JobSpec spec = Spec(world, max_restarts);
    spec.mutable_trainer()->set_batch_size(3);
    spec.mutable_trainer()->set_checkpoint_every(5);
    spec.mutable_elastic()->set_min_world_size(min_world);
    return spec;
  }

  // gpt2-tiny on the fixture's data; single device for one rank, else DDP.
  static v1::JobSpec Spec(int world, int max_restarts = 0) {
    v1::JobSpec spec;
    spec.set_model("gpt2-tiny");
    spec.set_data("data");
    spec.mutable_strategy()->set_name(world == 1 ? "single" : "ddp");
    spec.set_world_size(world);
    spec.set_max_restarts(max_restarts);
    return spec;
  }

  // The coordinator dies without shutting down: the manager is never
  // destroyed (nothing it would do on the way out happens), and stays
  // reachable so leak checkers know it is kept on purpose.
  static void Crash(std::unique_ptr<JobManager> manager) {
    static auto* crashed = new std::vector<std::unique_ptr<JobManager>>;
    crashed->push_back(std::move(manager));
  }

  TempDir dir_;
  // Runs inside the data resolver (at submit, and in a launch's preparation).
  std::function<void()> on_resolve_;
  FakeClock clock_;
  FakeProcessSpawner launcher_;
  // Devices the local launcher reports lost (a GPU off the bus).
  std::vector<int> lost_devices_;
  LocalJobLauncher local_{&launcher_, [this] { return lost_devices_; }};
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobManager> manager_;
};

}  // namespace shardtrain::test

#endif  // SHARDTRAIN_TESTS_SERVER_JOB_MANAGER_FIXTURE_H_
