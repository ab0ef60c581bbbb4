// JobManager driven by hand: a fake launcher stands in for processes, a fake
// clock for time, and Tick() for the supervisor thread; the store is real.
#include "server/job_manager.h"

#include <gmock/gmock.h>
#include <google/protobuf/unknown_field_set.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <future>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/exit_codes.h"
#include "server/dataset_locator.h"
#include "tests/server/job_manager_fixture.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class JobManagerTest : public test::JobManagerFixture {
 protected:
  // Submits, launches and registers every rank; returns the ranks' pids.
  std::vector<int> StartRunning(const v1::JobSpec& spec, std::string* id) {
    absl::StatusOr<v1::Job> job = manager_->Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    *id = job->id();
    const size_t before = launcher_.spawned().size();
    manager_->Tick();
    const std::vector<int> spawned = launcher_.spawned();
    std::vector<int> pids(spawned.begin() + before, spawned.end());
    for (int pid : pids)
      EXPECT_TRUE(manager_->RegisterWorker(Identity(pid)).ok());
    EXPECT_EQ(manager_->Get(*id)->state(), v1::RUNNING);
    return pids;
  }
};

TEST_F(JobManagerTest,
       LaunchGivesEachRankTorchrunVariablesAndAShareOfTheCores) {
  std::string id;
  const std::vector<int> pids = StartRunning(Spec(2), &id);
  ASSERT_EQ(pids.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(launcher_.Env(pids[r], "RANK"), std::to_string(r));
    EXPECT_EQ(launcher_.Env(pids[r], "WORLD_SIZE"), "2");
    EXPECT_EQ(launcher_.Env(pids[r], "MASTER_ADDR"), "127.0.0.1");
    EXPECT_EQ(launcher_.Env(pids[r], "SHARDTRAIN_COORDINATOR"),
              "unix:/tmp/test.sock");
    EXPECT_THAT(launcher_.process(pids[r]).spec.argv,
                testing::IsSupersetOf(std::vector<std::string>{
                    "--threads", "4", "--job-id", id}));
  }
  EXPECT_EQ(launcher_.Env(pids[0], "MASTER_PORT"),
            launcher_.Env(pids[1], "MASTER_PORT"));
  // A job asking for the threads of a 2-rank job (a study's equal
  // threads), alone on the host once the first has finished: one rank,
  // half the cores.
  for (int pid : pids) launcher_.Exit(pid, ExitStatus{0, 0});
  manager_->Tick();
  ASSERT_EQ(manager_->Get(id)->state(), v1::SUCCEEDED);
  v1::JobSpec one = Spec(1);
  one.mutable_trainer()->set_threads_as_ranks(2);
  std::string single;
  const std::vector<int> alone = StartRunning(one, &single);
  ASSERT_EQ(alone.size(), 1u);
  EXPECT_THAT(
      launcher_.process(alone[0]).spec.argv,
      testing::IsSupersetOf(std::vector<std::string>{"--threads", "4"}));
  EXPECT_EQ(launcher_.process(pids[1]).spec.process_group, pids[0]);
}

TEST_F(JobManagerTest, ALaunchPreparesItsFilesWithoutHoldingTheLock) {
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(2));
  ASSERT_TRUE(job.ok()) << job.status();
  bool other_call_finished = false;
  on_resolve_ = [&] {
    // Another RPC while the launch resolves its data: it must not wait for
    // the launch.
    auto get = std::async(std::launch::async,
                          [&] { return manager_->Get(job->id()); });
    other_call_finished =
        get.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    if (other_call_finished) {
      EXPECT_EQ(get.get()->state(), v1::STARTING);
    }
  };
  manager_->Tick();
  on_resolve_ = nullptr;

  EXPECT_TRUE(other_call_finished);
  EXPECT_EQ(launcher_.spawned().size(), 2u);
  EXPECT_TRUE(
      std::filesystem::exists(dir_ / ("jobs/" + job->id() + "/spec.json")));
}

// The database was lost (a zero-byte file opens as a new, empty one) but job
// directories remain: refused at start, not ids and directories reused.
TEST_F(JobManagerTest, AnEmptiedDatabaseBesideJobDirectoriesIsRefused) {
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(1));
  ASSERT_TRUE(job.ok()) << job.status();
  manager_->Tick();
  ASSERT_TRUE(std::filesystem::exists(dir_ / ("jobs/" + job->id())));
  manager_.reset();
  store_.reset();
  std::filesystem::remove(dir_ / "state.db-wal");
  std::filesystem::remove(dir_ / "state.db-shm");
  std::filesystem::resize_file(dir_ / "state.db", 0);
  auto store = JobStore::Open(dir_ / "state.db");
  ASSERT_TRUE(store.ok()) << store.status();
  store_ = std::move(*store);

  JobManagerOptions options;
  options.state_dir = dir_.path();
  options.devices.push_back({0, v1::CPU, "cpu slot", 0});
  options.resolve_data =
      [](const std::string& d) -> absl::StatusOr<std::string> { return d; };
  auto manager = JobManager::Create(options, store_.get(), &local_, &clock_);

  EXPECT_EQ(manager.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(manager.status().message(), HasSubstr("1 job directories"));
  EXPECT_THAT(manager.status().message(), HasSubstr("lost or truncated"));
}

// An id no job has is named in the error only when it could be an id: a huge
// or binary one is summarised by its length.
TEST_F(JobManagerTest, UnknownIdsAreNamedOnlyWhenShortAndPrintable) {
  EXPECT_THAT(manager_->Get("job-999999").status().message(),
              HasSubstr("no job 'job-999999'"));
  const std::string huge(100000, 'a');
  const absl::Status big = manager_->Get(huge).status();
  EXPECT_EQ(big.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(big.message().size(), 200u);
  EXPECT_THAT(big.message(), HasSubstr("100000 bytes"));
  EXPECT_THAT(manager_->Cancel(std::string("job\x1b[2J")).status().message(),
              testing::Not(HasSubstr("\x1b")));
}

// A field this version does not know (here 1 MiB under field number 9999)
// is not stored, and what is stored stays within the spec's bounds.
TEST_F(JobManagerTest, UnknownFieldsAreDroppedNotStored) {
  v1::JobSpec spec = Spec(1);
  spec.GetReflection()->MutableUnknownFields(&spec)->AddLengthDelimited(
      9999, std::string(1 << 20, 'x'));
  ASSERT_GT(spec.ByteSizeLong(), 1u << 20);

  absl::StatusOr<v1::Job> job = manager_->Submit(spec);

  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_LT(job->spec().ByteSizeLong(), 4096u);
  EXPECT_LT(std::filesystem::file_size(dir_ / "state.db") +
                (std::filesystem::exists(dir_ / "state.db-wal")
                     ? std::filesystem::file_size(dir_ / "state.db-wal")
                     : 0),
            1u << 20);
  EXPECT_LT(manager_->Get(job->id())->ByteSizeLong(), 4096u);
}

TEST_F(JobManagerTest, SubmissionsAreRefusedWhileTheStateDirIsNearlyFull) {
  manager_.reset();
  manager_ = NewManager([](JobManagerOptions& options) {
    options.min_free_bytes = int64_t{1} << 60;  // more than any disk has
  });
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(1));
  EXPECT_EQ(job.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(job.status().message(), HasSubstr("--min-free-mb"));
  absl::StatusOr<ListJobsPage> page = manager_->List({});
  ASSERT_TRUE(page.ok());
  EXPECT_TRUE(page->jobs.empty());  // nothing half-stored
}

TEST_F(JobManagerTest, PathRootsConfineDataAndInitFrom) {
  std::filesystem::create_directories(dir_ / "root");
  absl::StatusOr<PathRoots> roots = PathRoots::Create({dir_ / "root"});
  ASSERT_TRUE(roots.ok());
  manager_.reset();
  manager_ = NewManager(
      [&](JobManagerOptions& options) { options.path_roots = *roots; });
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(1));  // data: "data"
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("data: 'data' is outside"));
  v1::JobSpec brown = Spec(1);
  brown.set_data("brown");  // the built-in dataset is not a path
  EXPECT_TRUE(manager_->Submit(brown).ok());
}

// The data directory lies inside the root but its train.bin is a symlink to
// a file outside: refused, naming the file, and the rank launch carries the
// roots so ranks check the file they open too.
TEST_F(JobManagerTest, PathRootsResolveEveryDataFileNotOnlyTheDirectory) {
  std::filesystem::create_directories(dir_ / "root/data");
  std::filesystem::create_directories(dir_ / "outside");
  test::WriteFile(dir_ / "outside/secret", "not for jobs");
  std::filesystem::create_symlink(dir_ / "outside/secret",
                                  dir_ / "root/data/train.bin");
  absl::StatusOr<PathRoots> roots = PathRoots::Create({dir_ / "root"});
  ASSERT_TRUE(roots.ok());
  manager_.reset();
  manager_ = NewManager(
      [&](JobManagerOptions& options) { options.path_roots = *roots; });
  v1::JobSpec spec = Spec(1);
  spec.set_data(dir_ / "root/data");

  absl::StatusOr<v1::Job> job = manager_->Submit(spec);

  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("data (train.bin)"));
  EXPECT_THAT(job.status().message(), HasSubstr("is outside"));
}

// An --init-from directory inside the root whose files link out of it once
// trained on the outside model: each entry is resolved at submit (and the
// ranks check the files they open again).
TEST_F(JobManagerTest, PathRootsResolveWhatAnInitFromDirectoryHolds) {
  std::filesystem::create_directories(dir_ / "root/model");
  std::filesystem::create_directories(dir_ / "root/run/checkpoints");
  std::filesystem::create_directories(dir_ / "outside");
  test::WriteFile(dir_ / "outside/secret", "not for jobs");
  test::WriteFile(dir_ / "root/model/config.json", "{}");
  std::filesystem::create_symlink(dir_ / "outside/secret",
                                  dir_ / "root/model/model.safetensors");
  std::filesystem::create_symlink(dir_ / "outside/secret",
                                  dir_ / "root/run/checkpoints/latest");
  absl::StatusOr<PathRoots> roots = PathRoots::Create({dir_ / "root"});
  ASSERT_TRUE(roots.ok());
  manager_.reset();
  manager_ = NewManager(
      [&](JobManagerOptions& options) { options.path_roots = *roots; });
  v1::JobSpec spec = Spec(1);
  spec.set_data("brown");

  spec.mutable_trainer()->set_init_from(dir_ / "root/model");
  absl::StatusOr<v1::Job> job = manager_->Submit(spec);
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(),
              HasSubstr("trainer.init_from (model.safetensors)"));
  EXPECT_THAT(job.status().message(), HasSubstr("is outside"));

  spec.mutable_trainer()->set_init_from(dir_ / "root/run");
  job = manager_->Submit(spec);
  EXPECT_THAT(job.status().message(),
              HasSubstr("trainer.init_from (checkpoints/latest)"));
}

// Under --path-root a job reads back what it wrote: its own directory (the
// checkpoints a resume loads) is one of its ranks' read roots on every
// launch, the elastic relaunch included; the rest of the state directory
// (other jobs, the database) is not.
TEST_F(JobManagerTest, PathRootsLetAJobsRanksReadItsOwnDirectoryOnly) {
  std::filesystem::create_directories(dir_ / "root");
  absl::StatusOr<PathRoots> roots = PathRoots::Create({dir_ / "root"});
  ASSERT_TRUE(roots.ok());
  manager_.reset();
  manager_ = NewManager(
      [&](JobManagerOptions& options) { options.path_roots = *roots; });
  std::string id;
  // The built-in dataset, which the ranks prepare in the state directory
  // (the fixture's resolver puts it in dir/data).
  v1::JobSpec spec = ElasticSpec(4, 2);
  spec.set_data("brown");
  const std::vector<int> pids = StartRunning(spec, &id);
  ASSERT_EQ(pids.size(), 4u);
  const std::string state = std::filesystem::canonical(dir_.path()).string();
  const auto expect_roots = [&](int pid) {
    const std::vector<std::string> ranks_roots =
        absl::StrSplit(launcher_.Env(pid, "SHARDTRAIN_PATH_ROOTS"), ':');
    EXPECT_THAT(ranks_roots,
                testing::UnorderedElementsAre(
                    std::filesystem::canonical(dir_ / "root").string(),
                    state + "/data", state + "/jobs/" + id))
        << "pid " << pid;
  };
  for (int pid : pids) expect_roots(pid);

  lost_devices_ = {3};
  launcher_.Exit(pids[3], ExitStatus{-1, SIGKILL});
  manager_->Tick();
  manager_->Tick();
  ASSERT_EQ(manager_->Get(id)->state(), v1::RESTARTING);
  const std::vector<int> all = launcher_.spawned();
  ASSERT_EQ(all.size(), 7u);
  for (auto it = all.end() - 3; it != all.end(); ++it) expect_roots(*it);
}

// A FIFO train.bin was reported as "has no train.bin".
TEST_F(JobManagerTest, TheDatasetLocatorNamesAFifoTrainBinAsAFifo) {
  std::filesystem::create_directories(dir_ / "fifo-data");
  ASSERT_EQ(::mkfifo((dir_ / "fifo-data/train.bin").c_str(), 0600), 0);
  const DataResolver locate = MakeDatasetLocator(dir_ / "locator-state");
  absl::StatusOr<std::string> data = locate(dir_ / "fifo-data");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(),
              HasSubstr("train.bin' is a FIFO, not a regular file"));
}

TEST_F(JobManagerTest, AFifoAsInitFromIsNamedAsAFifo) {
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  v1::JobSpec spec = Spec(1);
  spec.mutable_trainer()->set_init_from(dir_ / "fifo");
  absl::StatusOr<v1::Job> job = manager_->Submit(spec);
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("is a FIFO"));
}

// A rank refused a file (a train.bin swapped to outside the root between
// submit and launch): the failure says so and is not restarted.
TEST_F(JobManagerTest, ARankThatRefusedAnInputFailsTheJobNamingIt) {
  std::string id;
  std::vector<int> pids = StartRunning(Spec(2, /*max_restarts=*/2), &id);
  launcher_.Exit(pids[0], ExitStatus{kExitInputRefused, 0});
  manager_->Tick();
  launcher_.Exit(pids[1], ExitStatus{1, 0});
  manager_->Tick();
  manager_->Tick();

  const v1::Job job = *manager_->Get(id);
  EXPECT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.failure().reason(), v1::INVALID_SPEC);
  EXPECT_THAT(job.failure().message(), HasSubstr("--path-root"));
  EXPECT_EQ(job.restarts(), 0);
}

TEST_F(JobManagerTest, ACancelWhileTheLaunchIsPreparedStartsNoRank) {
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(2));
  ASSERT_TRUE(job.ok()) << job.status();
  on_resolve_ = [&] { EXPECT_TRUE(manager_->Cancel(job->id()).ok()); };
  manager_->Tick();
  on_resolve_ = nullptr;

  EXPECT_TRUE(launcher_.spawned().empty());
  EXPECT_EQ(manager_->Get(job->id())->state(), v1::CANCELLED);
  EXPECT_THAT(manager_->Get(job->id())->state_reason(),
              HasSubstr("before its ranks started"));
  for (const ClusterView::Holder& holder : manager_->Cluster().holders) {
    EXPECT_EQ(holder.job_id, "");  // its devices are free again
  }
}

TEST_F(JobManagerTest, WorkersWithAWrongSecretPidOrRankAreRefused) {
  std::string id;
  const std::vector<int> pids = StartRunning(Spec(2), &id);
  v1::WorkerIdentity w = Identity(pids[0]);
  w.set_secret("guess");
  EXPECT_TRUE(absl::IsPermissionDenied(manager_->Heartbeat(w).status()));
  w = Identity(pids[0]);
  w.set_pid(4242);
  EXPECT_TRUE(absl::IsPermissionDenied(manager_->Heartbeat(w).status()));
  w = Identity(pids[0]);
  w.set_rank(7);
  EXPECT_TRUE(
      absl::IsPermissionDenied(manager_->ReportProgress(w, {}).status()));
  EXPECT_TRUE(manager_->Heartbeat(Identity(pids[0])).ok());
}

TEST_F(JobManagerTest,
       MissedHeartbeatsFailWithHangAndStuckRanksAreKilledAfterGrace) {
  launcher_.set_exit_on_sigterm(false);
  std::string id;
  const std::vector<int> pids = StartRunning(Spec(2), &id);
  clock_.Advance(absl::Seconds(20));
  ASSERT_TRUE(manager_->Heartbeat(Identity(pids[0])).ok());
  clock_.Advance(absl::Seconds(15));  // rank 1 silent for 35 s, rank 0 for 15 s
  manager_->Tick();
  EXPECT_THAT(launcher_.process(pids[0]).signals, ElementsAre(SIGTERM));
  EXPECT_EQ(manager_->Get(id)->state(), v1::RUNNING);  // still stopping
  clock_.Advance(absl::Seconds(11));
  manager_->Tick();
  EXPECT_THAT(launcher_.process(pids[1]).signals,
              ElementsAre(SIGTERM, SIGKILL));
  manager_->Tick();
  const v1::Job job = *manager_->Get(id);
  ASSERT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.failure().reason(), v1::HANG);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_THAT(job.failure().message(), HasSubstr("no heartbeat for 35s"));
  // Its devices are free again: a 4-rank job starts.
  std::string next;
  StartRunning(Spec(4), &next);
  launcher_.set_exit_on_sigterm(true);  // let the teardown stop it promptly
}

TEST_F(JobManagerTest, RanksThatNeverJoinFailWithRendezvousTimeout) {
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(2));
  manager_->Tick();
  const v1::WorkerIdentity rank0 = Identity(launcher_.spawned()[0]);
  ASSERT_TRUE(manager_->RegisterWorker(rank0).ok());
  for (int i = 0; i < 2; ++i) {  // rank 0 stays alive: only rank 1 is late
    clock_.Advance(absl::Seconds(25));
    manager_->Tick();
    ASSERT_TRUE(manager_->Heartbeat(rank0).ok());
  }
  clock_.Advance(absl::Seconds(11));
  manager_->Tick();
  manager_->Tick();
  const v1::Job failed = *manager_->Get(job->id());
  ASSERT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::RENDEZVOUS_TIMEOUT);
  EXPECT_EQ(failed.failure().rank(), 1);
  EXPECT_THAT(failed.failure().message(),
              HasSubstr("rank 1 did not join within 1m"));
}

TEST_F(JobManagerTest, RestartsUpToMaxRestartsThenFails) {
  std::string id;
  std::vector<int> pids = StartRunning(Spec(2, /*max_restarts=*/2), &id);
  for (int attempt = 1; attempt <= 3; ++attempt) {
    launcher_.Exit(pids[1], ExitStatus{1, 0});
    manager_->Tick();  // rank 1 failed: rank 0 is told to stop
    manager_->Tick();  // rank 0 reaped: restart or fail
    const v1::Job job = *manager_->Get(id);
    if (attempt <= 2) {
      ASSERT_EQ(job.state(), v1::RESTARTING) << attempt;
      EXPECT_EQ(job.restarts(), attempt);
      const std::vector<int> all = launcher_.spawned();
      pids.assign(all.end() - 2, all.end());
      EXPECT_THAT(launcher_.process(pids[0]).spec.argv,
                  testing::Contains("--resume"));
      for (int pid : pids)
        ASSERT_TRUE(manager_->RegisterWorker(Identity(pid)).ok());
      EXPECT_EQ(manager_->Get(id)->state(), v1::RUNNING);
    } else {
      ASSERT_EQ(job.state(), v1::FAILED);
      EXPECT_EQ(job.restarts(), 2);
      EXPECT_EQ(job.failure().reason(), v1::EXIT_CODE);
      EXPECT_EQ(job.failure().rank(), 1);
    }
  }
  EXPECT_EQ(launcher_.spawned().size(), 6u);
}

// A rank that exits kExitDiverged: the job fails as DIVERGED at once, with
// restarts left, since a restart would diverge again at the same step.
TEST_F(JobManagerTest, ADivergedRunFailsAsDivergedWithoutARestart) {
  std::string id;
  std::vector<int> pids = StartRunning(Spec(2, /*max_restarts=*/2), &id);
  launcher_.Exit(pids[0], ExitStatus{kExitDiverged, 0});
  manager_->Tick();
  launcher_.Exit(pids[1], ExitStatus{1, 0});
  manager_->Tick();
  manager_->Tick();

  const v1::Job job = *manager_->Get(id);
  EXPECT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.failure().reason(), v1::DIVERGED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_THAT(job.failure().message(), HasSubstr("training diverged"));
  EXPECT_EQ(launcher_.spawned().size(), 2u);
}

TEST_F(JobManagerTest,
       AfterACrashRunningJobsResumeOrFailAndQueuedJobsStayQueued) {
  std::string resumable, fragile;
  const std::vector<int> old_pids = StartRunning(Spec(2, 1), &resumable);
  StartRunning(Spec(2, 0), &fragile);
  absl::StatusOr<v1::Job> queued = manager_->Submit(Spec(1));
  Crash(std::move(manager_));

  manager_ = NewManager();
  EXPECT_THAT(launcher_.orphans_killed(),
              testing::Contains(std::make_pair(old_pids[0], resumable)));
  const v1::Job failed = *manager_->Get(fragile);
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::COORDINATOR_RESTART);
  EXPECT_EQ(manager_->Get(resumable)->state(), v1::RESTARTING);
  EXPECT_EQ(manager_->Get(resumable)->restarts(), 1);
  EXPECT_EQ(manager_->Get(queued->id())->state(), v1::QUEUED);
  const size_t before = launcher_.spawned().size();
  manager_->Tick();
  EXPECT_EQ(launcher_.spawned().size(), before + 3);  // 2 resumed + 1 queued
  EXPECT_EQ(manager_->Get(queued->id())->state(), v1::STARTING);
}

TEST_F(JobManagerTest, ACancelUnderWayWhenTheCoordinatorDiesIsNotLost) {
  launcher_.set_exit_on_sigterm(false);  // ranks slow to stop
  std::string id;
  StartRunning(Spec(2, /*max_restarts=*/3), &id);
  ASSERT_TRUE(manager_->Cancel(id).ok());
  EXPECT_EQ(manager_->Get(id)->state(), v1::RUNNING);
  Crash(std::move(manager_));  // dies before the ranks are gone

  manager_ = NewManager();
  const v1::Job job = *manager_->Get(id);
  EXPECT_EQ(job.state(), v1::CANCELLED);
  EXPECT_EQ(job.restarts(), 0);
}

TEST_F(JobManagerTest,
       ASpawnFailingAfterTheFirstRankFailsTheJobAndFreesItsDevices) {
  launcher_.FailSpawnAfter(1);
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(2, /*max_restarts=*/2));
  manager_->Tick();  // rank 0 starts, rank 1 cannot: rank 0 is stopped
  EXPECT_EQ(manager_->Get(job->id())->state(), v1::STARTING);
  manager_->Tick();  // rank 0 reaped
  const v1::Job failed = *manager_->Get(job->id());
  ASSERT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.restarts(), 0);  // the same launch would fail again
  EXPECT_THAT(failed.failure().message(), HasSubstr("could not start rank 1"));
  launcher_.FailSpawnAfter(-1);
  std::string next;
  StartRunning(Spec(4), &next);  // all four devices are free again
}

TEST_F(JobManagerTest, CancellingAQueuedJobEndsItAtOnce) {
  std::string running;
  StartRunning(Spec(4), &running);
  absl::StatusOr<v1::Job> waiting = manager_->Submit(Spec(1));
  manager_->Tick();
  EXPECT_THAT(manager_->Get(waiting->id())->state_reason(),
              HasSubstr("0 free"));
  ASSERT_TRUE(manager_->Cancel(waiting->id()).ok());
  EXPECT_EQ(manager_->Get(waiting->id())->state(), v1::CANCELLED);
  EXPECT_TRUE(
      absl::IsFailedPrecondition(manager_->Cancel(waiting->id()).status()));
}

// A rank the job does not have is an error naming the ranks it has, not an
// empty answer.
TEST_F(JobManagerTest, MetricsOfARankTheJobDoesNotHaveAreRefused) {
  std::string id;
  StartRunning(Spec(2), &id);
  EXPECT_TRUE(manager_->Metrics(id, 1, 0).ok());
  for (int rank : {2, 5, -1}) {
    const absl::Status refused = manager_->Metrics(id, rank, 0).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << rank;
    EXPECT_THAT(refused.message(),
                HasSubstr(" has ranks 0 to 1 (world size 2)"));
  }
}

// --- Elastic jobs ---

// A device is lost for good (a GPU off the bus): the elastic job continues
// from its checkpoint on the ranks it can still have, with the same global
// batch (12 sequences: 3 ranks x 2 x accumulation 2), and says so.
TEST_F(JobManagerTest, AnElasticJobContinuesSmallerWhenADeviceIsLost) {
  std::string id;
  const std::vector<int> pids = StartRunning(ElasticSpec(4, 2), &id);
  ASSERT_EQ(pids.size(), 4u);
  lost_devices_ = {3};
  launcher_.Exit(pids[3], ExitStatus{-1, SIGKILL});
  manager_->Tick();  // rank 3 failed: the others are told to stop
  manager_->Tick();  // all ended: restart at the size that can run

  const v1::Job restarting = *manager_->Get(id);
  ASSERT_EQ(restarting.state(), v1::RESTARTING) << restarting.state_reason();
  EXPECT_EQ(restarting.restarts(), 1);
  EXPECT_EQ(restarting.world_size(), 3);
  EXPECT_EQ(restarting.resize_reason(),
            "continued at 3 of 4 ranks after losing device 3");
  const std::vector<int> all = launcher_.spawned();
  ASSERT_EQ(all.size(), 7u);
  const std::vector<int> next(all.end() - 3, all.end());
  for (int pid : next) {
    EXPECT_EQ(launcher_.Env(pid, "WORLD_SIZE"), "3");
    EXPECT_THAT(launcher_.process(pid).spec.argv,
                testing::Contains("--resume"));
  }
  const std::string spec_json =
      test::ReadFile(dir_ / ("jobs/" + id + "/spec.json"));
  EXPECT_THAT(spec_json, HasSubstr("\"batch_size\": \"2\""));
  EXPECT_THAT(spec_json, HasSubstr("\"grad_accum\": \"2\""));
  EXPECT_EQ(manager_->Cluster().holders[3].job_id, "");  // the lost device
  for (int pid : next)
    ASSERT_TRUE(manager_->RegisterWorker(Identity(pid)).ok());
  EXPECT_EQ(manager_->Get(id)->state(), v1::RUNNING);
  // The lost device is no one's: a new job waits rather than run on it.
  absl::StatusOr<v1::Job> queued = manager_->Submit(Spec(1));
  ASSERT_TRUE(queued.ok());
  manager_->Tick();
  EXPECT_EQ(manager_->Get(queued->id())->state(), v1::QUEUED);

  absl::StatusOr<std::vector<v1::JobEvent>> events = store_->GetEvents(id);
  ASSERT_TRUE(events.ok());
  bool said = false;
  for (const v1::JobEvent& event : *events) {
    said = said || absl::StrContains(event.message(),
                                     "continued at 3 of 4 ranks after losing "
                                     "device 3 (elastic.min_world_size 2; the "
                                     "same 12 sequences per step)");
  }
  EXPECT_TRUE(said);
}

// Without `elastic`, today's behaviour: the restart asks for the full world.
TEST_F(JobManagerTest, WithoutElasticALostDeviceRestartsAtTheFullSize) {
  std::string id;
  const std::vector<int> pids = StartRunning(Spec(4, /*max_restarts=*/1), &id);
  lost_devices_ = {3};
  launcher_.Exit(pids[3], ExitStatus{-1, SIGKILL});
  manager_->Tick();
  manager_->Tick();
  const v1::Job restarting = *manager_->Get(id);
  EXPECT_EQ(restarting.state(), v1::RESTARTING);
  EXPECT_EQ(restarting.world_size(), 4);
  EXPECT_EQ(launcher_.Env(launcher_.spawned().back(), "WORLD_SIZE"), "4");
}

TEST_F(JobManagerTest, AnElasticJobBelowItsMinimumFailsNamingWhatWasLost) {
  std::string id;
  const std::vector<int> pids = StartRunning(ElasticSpec(4, 3), &id);
  lost_devices_ = {2, 3};
  launcher_.Exit(pids[2], ExitStatus{-1, SIGKILL});
  manager_->Tick();
  manager_->Tick();
  const v1::Job failed = *manager_->Get(id);
  ASSERT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::SIGNAL);
  EXPECT_THAT(failed.failure().message(),
              HasSubstr("cannot continue: 2 of 4 ranks can run after losing "
                        "device 2, device 3, and elastic.min_world_size is 3"));
  for (const ClusterView::Holder& holder : manager_->Cluster().holders) {
    EXPECT_EQ(holder.job_id, "");
  }
}

// After a coordinator restart an elastic job is sized like after any loss:
// it continues on what can run instead of failing for want of devices.
TEST_F(JobManagerTest, AfterACrashAnElasticJobContinuesOnWhatIsLeft) {
  std::string id;
  StartRunning(ElasticSpec(4, 2), &id);
  Crash(std::move(manager_));
  lost_devices_ = {0, 1};
  manager_ = NewManager();
  EXPECT_EQ(manager_->Get(id)->restarts(), 1);
  manager_->Tick();
  const v1::Job job = *manager_->Get(id);
  EXPECT_EQ(job.state(), v1::RESTARTING);
  EXPECT_EQ(job.restarts(), 1);  // counted once
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(launcher_.Env(launcher_.spawned().back(), "WORLD_SIZE"), "2");
}

TEST_F(JobManagerTest, ElasticSpecsAreCheckedAtSubmit) {
  v1::JobSpec too_many = ElasticSpec(2, 3);
  EXPECT_THAT(manager_->Submit(too_many).status().message(),
              HasSubstr("elastic.min_world_size: got 3; must be in [0, 2]"));
  v1::JobSpec no_checkpoints = ElasticSpec(2, 1);
  no_checkpoints.mutable_trainer()->clear_checkpoint_every();
  EXPECT_THAT(manager_->Submit(no_checkpoints).status().message(),
              HasSubstr("set trainer.checkpoint_every"));
}

}  // namespace
}  // namespace shardtrain
