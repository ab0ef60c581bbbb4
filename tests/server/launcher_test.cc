// The AttemptLauncher backends on their own — LocalJobLauncher over a fake and
// over real processes, SlurmJobLauncher over a fake Slurm — and the JobManager
// driving a third, fake backend through nothing but the interface.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <map>

#include "absl/time/clock.h"
#include "server/attempt_launcher.h"
#include "server/local_job_launcher.h"
#include "server/slurm_job_launcher.h"
#include "tests/fakes/fake_attempt_launcher.h"
#include "tests/fakes/fake_process_spawner.h"
#include "tests/fakes/fake_slurm_client.h"
#include "tests/server/job_manager_fixture.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

RankLaunch Launch(const std::string& job_dir, int world) {
  RankLaunch launch;
  launch.worker_binary = "/bin/shardtrain-worker";
  launch.job_id = "job-000007";
  launch.job_dir = job_dir;
  launch.spec_path = job_dir + "/spec.json";
  launch.world_size = world;
  launch.cpu = true;
  for (int r = 0; r < world; ++r) {
    launch.devices.push_back(r);
    launch.log_paths.push_back(job_dir + "/rank-" + std::to_string(r) + ".log");
  }
  launch.coordinator_address = "unix:/tmp/c.sock";
  launch.secret = "s3cret";
  return launch;
}

// --- LocalJobLauncher ---

TEST(LocalJobLauncherTest, StartsEveryRankInRankZerosGroupOnOneRendezvousPort) {
  test::TempDir dir;
  FakeProcessSpawner processes;
  LocalJobLauncher launcher(&processes);
  Attempt attempt;

  ASSERT_TRUE(launcher.Start(Launch(dir.path(), 3), 2, &attempt).ok());

  ASSERT_EQ(attempt.pids.size(), 3u);
  EXPECT_EQ(attempt.number, 2);
  EXPECT_EQ(attempt.pgid, attempt.pids[0]);
  EXPECT_EQ(attempt.handle, "");
  const std::string port = processes.Env(attempt.pids[0], "MASTER_PORT");
  EXPECT_NE(port, "");
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(processes.Env(attempt.pids[r], "RANK"), std::to_string(r));
    EXPECT_EQ(processes.Env(attempt.pids[r], "MASTER_PORT"), port);
    EXPECT_EQ(processes.process(attempt.pids[r]).spec.process_group,
              r == 0 ? 0 : attempt.pids[0]);
  }
}

TEST(LocalJobLauncherTest,
     ASpawnFailureNamesTheRankAndKeepsThePidsThatStarted) {
  test::TempDir dir;
  FakeProcessSpawner processes;
  processes.FailSpawnAfter(2);
  LocalJobLauncher launcher(&processes);
  Attempt attempt;

  const absl::Status s = launcher.Start(Launch(dir.path(), 4), 1, &attempt);

  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("could not start rank 2: fork"));
  ASSERT_EQ(attempt.pids.size(), 4u);
  EXPECT_NE(attempt.pids[0], 0);
  EXPECT_NE(attempt.pids[1], 0);
  EXPECT_EQ(attempt.pids[2], 0);
  EXPECT_EQ(attempt.pids[3], 0);
}

TEST(LocalJobLauncherTest, PollReportsEachExitOnceAndSignalsOnlyTheGivenRanks) {
  test::TempDir dir;
  FakeProcessSpawner processes;
  LocalJobLauncher launcher(&processes);
  Attempt attempt;
  ASSERT_TRUE(launcher.Start(Launch(dir.path(), 2), 1, &attempt).ok());
  processes.Exit(attempt.pids[1], ExitStatus{3, 0});

  absl::StatusOr<AttemptReport> first = launcher.Poll(attempt, {true, true});
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->exits.size(), 1u);
  EXPECT_EQ(first->exits[0].rank, 1);
  EXPECT_EQ(first->exits[0].status.exit_code, 3);
  EXPECT_FALSE(first->failure.has_value());  // exit statuses speak for it
  EXPECT_TRUE(launcher.Poll(attempt, {true, false})->exits.empty());

  launcher.Signal(attempt, {0}, SIGTERM);
  EXPECT_THAT(processes.process(attempt.pids[0]).signals, ElementsAre(SIGTERM));
  EXPECT_TRUE(processes.process(attempt.pids[1]).signals.empty());
}

TEST(LocalJobLauncherTest, RealRanksStartAndEndOnSigterm) {
  test::TempDir dir;
  // A "worker" that ignores its arguments and waits to be stopped.
  const std::string worker = dir / "worker.sh";
  test::WriteFile(worker, "#!/bin/sh\nexec sleep 60\n");
  std::filesystem::permissions(worker, std::filesystem::perms::owner_all);
  PosixProcessSpawner processes;
  LocalJobLauncher launcher(&processes);
  RankLaunch launch = Launch(dir.path(), 2);
  launch.worker_binary = worker;
  Attempt attempt;
  ASSERT_TRUE(launcher.Start(launch, 1, &attempt).ok());
  EXPECT_TRUE(launcher.Poll(attempt, {true, true})->exits.empty());

  launcher.Signal(attempt, {0, 1}, SIGTERM);
  std::map<int, ExitStatus> ended;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ended.size() < 2 && absl::Now() < deadline) {
    std::vector<bool> running = {!ended.count(0), !ended.count(1)};
    absl::StatusOr<AttemptReport> report = launcher.Poll(attempt, running);
    ASSERT_TRUE(report.ok());
    for (const RankEnd& exit : report->exits) ended[exit.rank] = exit.status;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(ended.size(), 2u);
  EXPECT_EQ(ended[0].signal, SIGTERM)
      << ended[0].ToString() << test::ReadFile(dir / "rank-0.log");
  EXPECT_EQ(ended[1].signal, SIGTERM);
}

// --- SlurmJobLauncher ---

TEST(SlurmJobLauncherTest, StartWritesTheScriptSubmitsItAndRecordsTheJob) {
  test::TempDir dir;
  FakeSlurmClient slurm;
  SlurmJobLauncher launcher(&slurm, SlurmOptions{});
  Attempt attempt;

  ASSERT_TRUE(launcher.Start(Launch(dir.path(), 2), 3, &attempt).ok());

  EXPECT_EQ(attempt.handle, slurm.submitted().back());
  EXPECT_THAT(attempt.summary, HasSubstr("Slurm job " + attempt.handle));
  EXPECT_THAT(attempt.pids, ElementsAre(0, 0));  // learnt at registration
  EXPECT_EQ(slurm.job(attempt.handle).script_path, dir / "slurm-attempt-3.sh");
  EXPECT_TRUE(std::filesystem::exists(dir / "slurm-attempt-3.sh"));
  EXPECT_EQ(test::ReadFile(dir / "slurm_job_id"), attempt.handle + "\n");
}

TEST(SlurmJobLauncherTest, ARefusedSbatchStartsNothingAndSaysWhy) {
  test::TempDir dir;
  FakeSlurmClient slurm;
  slurm.set_refuse("sbatch: error: invalid partition specified: gpu");
  SlurmJobLauncher launcher(&slurm, SlurmOptions{});
  Attempt attempt;

  const absl::Status s = launcher.Start(Launch(dir.path(), 2), 1, &attempt);

  EXPECT_THAT(s.message(), HasSubstr("sbatch refused the job"));
  EXPECT_THAT(s.message(), HasSubstr("invalid partition"));
  EXPECT_EQ(attempt.handle, "");
  EXPECT_THAT(attempt.pids, ElementsAre(0, 0));
}

TEST(SlurmJobLauncherTest, PendingIsWaitingAndAnEndEndsEveryRunningRank) {
  test::TempDir dir;
  FakeSlurmClient slurm;
  SlurmJobLauncher launcher(&slurm, SlurmOptions{});
  Attempt attempt;
  ASSERT_TRUE(launcher.Start(Launch(dir.path(), 3), 1, &attempt).ok());

  absl::StatusOr<AttemptReport> pending =
      launcher.Poll(attempt, {true, true, true});
  ASSERT_TRUE(pending.ok());
  EXPECT_THAT(pending->waiting, HasSubstr("PENDING: Resources"));
  EXPECT_TRUE(pending->exits.empty());

  slurm.SetState(attempt.handle, "RUNNING");
  EXPECT_EQ(launcher.Poll(attempt, {true, true, true})->waiting, "");

  test::WriteFile(dir / "slurm-attempt-1.log",
                  "srun: error: node3: task 2: Killed\n");
  slurm.SetState(attempt.handle, "NODE_FAIL", "NodeDown");
  absl::StatusOr<AttemptReport> ended =
      launcher.Poll(attempt, {true, false, true});
  ASSERT_TRUE(ended.ok());
  ASSERT_EQ(ended->exits.size(), 2u);  // rank 1 had already ended
  EXPECT_EQ(ended->exits[0].rank, 0);
  EXPECT_EQ(ended->exits[1].rank, 2);
  ASSERT_TRUE(ended->failure.has_value());
  EXPECT_EQ(ended->failure->reason, v1::NODE_FAILURE);
  EXPECT_THAT(ended->failure->message, HasSubstr("lost a node"));
  EXPECT_THAT(ended->failure->log_lines,
              ElementsAre("srun: error: node3: task 2: Killed"));
}

TEST(SlurmJobLauncherTest, SigkillIsScancelAndLeftoversAreCancelled) {
  test::TempDir dir;
  FakeSlurmClient slurm;
  slurm.set_exit_on_sigterm(false);
  SlurmJobLauncher launcher(&slurm, SlurmOptions{});
  Attempt attempt;
  ASSERT_TRUE(launcher.Start(Launch(dir.path(), 2), 1, &attempt).ok());

  launcher.Signal(attempt, {0, 1}, SIGTERM);
  launcher.Signal(attempt, {0, 1}, SIGKILL);
  EXPECT_THAT(slurm.job(attempt.handle).signals, ElementsAre(SIGTERM, SIGKILL));
  EXPECT_EQ(slurm.job(attempt.handle).info.state, "CANCELLED");

  // A later coordinator finds the job recorded in the job's directory.
  Attempt second;
  ASSERT_TRUE(launcher.Start(Launch(dir.path(), 2), 2, &second).ok());
  launcher.EndLeftovers("job-000007", dir.path(), {});
  EXPECT_THAT(slurm.job(second.handle).signals, ElementsAre(SIGKILL));
}

// --- The JobManager over a third backend ---

class FakeBackendJobManagerTest : public test::JobManagerFixture {
 protected:
  AttemptLauncher* launcher() override { return &backend_; }
  void TearDown() override { manager_.reset(); }

  // Rank r of attempt `handle`, registering from wherever it runs.
  v1::WorkerIdentity Identity(const std::string& handle, int rank) {
    const FakeAttemptLauncher::Started started = backend_.started(handle);
    v1::WorkerIdentity w;
    w.set_job_id(started.launch.job_id);
    w.set_secret(started.launch.secret);
    w.set_rank(rank);
    w.set_pid(50000 + rank);
    return w;
  }

  std::string StartRunning(const v1::JobSpec& spec, std::string* handle) {
    absl::StatusOr<v1::Job> job = manager_->Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    manager_->Tick();
    EXPECT_FALSE(backend_.handles().empty());
    *handle = backend_.handles().back();
    for (int r = 0; r < spec.world_size(); ++r) {
      EXPECT_TRUE(manager_->RegisterWorker(Identity(*handle, r)).ok());
    }
    EXPECT_EQ(manager_->Get(job->id())->state(), v1::RUNNING);
    return job->id();
  }

  FakeAttemptLauncher backend_;
};

TEST_F(FakeBackendJobManagerTest, AJobRunsAndSucceedsThroughTheInterfaceAlone) {
  std::string handle;
  const std::string id = StartRunning(Spec(2), &handle);
  EXPECT_TRUE(launcher_.spawned().empty());  // nothing forked here
  const FakeAttemptLauncher::Started started = backend_.started(handle);
  EXPECT_EQ(started.launch.world_size, 2);
  EXPECT_EQ(started.attempt.number, 1);
  EXPECT_FALSE(started.launch.resume);

  AttemptReport done;
  done.exits = {{0, {0, 0}}, {1, {0, 0}}};
  backend_.Report(handle, done);
  manager_->Tick();
  EXPECT_EQ(manager_->Get(id)->state(), v1::SUCCEEDED);
}

TEST_F(FakeBackendJobManagerTest, ABackendsFailureIsTheJobsWithItsLogLines) {
  std::string handle;
  const std::string id = StartRunning(Spec(2, /*max_restarts=*/1), &handle);
  AttemptReport lost;
  lost.exits = {{0, {-1, 9}}, {1, {-1, 9}}};
  lost.failure = AttemptFailure{v1::NODE_FAILURE,
                                -1,
                                "pod evicted",
                                {"event: node drained", "event: pod evicted"}};
  backend_.Report(handle, lost);
  manager_->Tick();

  const v1::Job restarting = *manager_->Get(id);
  EXPECT_EQ(restarting.state(), v1::RESTARTING);
  EXPECT_THAT(restarting.state_reason(), HasSubstr("pod evicted"));
  ASSERT_EQ(backend_.handles().size(), 2u);
  EXPECT_TRUE(backend_.started(backend_.handles().back()).launch.resume);

  const std::string second = backend_.handles().back();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(manager_->RegisterWorker(Identity(second, r)).ok());
  }
  backend_.Report(second, lost);
  manager_->Tick();
  const v1::Job failed = *manager_->Get(id);
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::NODE_FAILURE);
  EXPECT_EQ(failed.failure().rank(), -1);
  EXPECT_THAT(failed.failure().log_tail(),
              ElementsAre("event: node drained", "event: pod evicted"));
}

TEST_F(FakeBackendJobManagerTest, CancelSignalsTheRunningRanksThenKills) {
  backend_.set_exit_on_sigterm(false);
  std::string handle;
  const std::string id = StartRunning(Spec(2), &handle);
  ASSERT_TRUE(manager_->Cancel(id).ok());
  manager_->Tick();
  EXPECT_EQ(backend_.started(handle).signals.size(), 1u);
  clock_.Advance(absl::Seconds(11));  // past the grace period
  manager_->Tick();
  manager_->Tick();

  const auto signals = backend_.started(handle).signals;
  ASSERT_EQ(signals.size(), 2u);
  EXPECT_EQ(signals[0].second, SIGTERM);
  EXPECT_THAT(signals[0].first, ElementsAre(0, 1));
  EXPECT_EQ(signals[1].second, SIGKILL);
  EXPECT_EQ(manager_->Get(id)->state(), v1::CANCELLED);
}

TEST_F(FakeBackendJobManagerTest, WaitingForTheBackendHoldsTheRendezvousClock) {
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(2));
  ASSERT_TRUE(job.ok());
  manager_->Tick();
  const std::string handle = backend_.handles().back();
  AttemptReport waiting;
  waiting.waiting = "waiting for 2 nodes";
  for (int i = 0; i < 10; ++i) {  // 100 s; the rendezvous timeout is 60 s
    clock_.Advance(absl::Seconds(10));
    backend_.Report(handle, waiting);
    manager_->Tick();
  }
  EXPECT_EQ(manager_->Get(job->id())->state(), v1::STARTING);
  EXPECT_EQ(manager_->Get(job->id())->state_reason(), "waiting for 2 nodes");
  clock_.Advance(absl::Seconds(61));
  manager_->Tick();
  manager_->Tick();
  EXPECT_EQ(manager_->Get(job->id())->failure().reason(),
            v1::RENDEZVOUS_TIMEOUT);
}

TEST_F(FakeBackendJobManagerTest, ANewCoordinatorEndsTheLeftoversOfItsJobs) {
  std::string handle;
  const std::string id = StartRunning(Spec(2, /*max_restarts=*/1), &handle);
  Crash(std::move(manager_));
  manager_ = NewManager();
  EXPECT_THAT(backend_.leftovers_ended(), ElementsAre(id));
  EXPECT_EQ(manager_->Get(id)->state(), v1::RESTARTING);
}

}  // namespace
}  // namespace shardtrain
