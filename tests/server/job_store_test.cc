// JobStore against real SQLite files in a scratch folder: schema versioning,
// the jobs/events/metrics contracts, group commit under concurrency, and
// durability when the writing process dies without closing.
#include "server/job_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

StoredJob MakeJob(const std::string& id, int64_t seq,
                  v1::JobState state = v1::QUEUED) {
  StoredJob job;
  job.job.set_id(id);
  job.job.set_state(state);
  job.job.mutable_spec()->set_name("name-" + id);
  job.seq = seq;
  job.secret = "secret-" + id;
  return job;
}

v1::JobEvent MakeEvent(v1::JobState state, const std::string& message,
                       int64_t time_unix_ms = 1000) {
  v1::JobEvent event;
  event.set_time_unix_ms(time_unix_ms);
  event.set_state(state);
  event.set_message(message);
  return event;
}

v1::StepMetrics MakeStep(int rank, int64_t step, double loss = 1.0) {
  v1::StepMetrics m;
  m.set_rank(rank);
  m.set_step(step);
  m.set_loss(loss);
  return m;
}

std::unique_ptr<JobStore> OpenOrDie(const std::string& path) {
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

// Runs `sql` on its own connection (beside any open JobStore) and returns the
// first column of the first row as text, "" when there is none.
std::string Query(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  std::string value;
  if (sqlite3_open(path.c_str(), &db) == SQLITE_OK) {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK &&
        sqlite3_step(stmt) == SQLITE_ROW &&
        sqlite3_column_text(stmt, 0) != nullptr) {
      value = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
    }
    sqlite3_finalize(stmt);
  }
  sqlite3_close(db);
  return value;
}

void ExecOrFail(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* error = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &error);
  EXPECT_EQ(rc, SQLITE_OK) << (error != nullptr ? error : "");
  sqlite3_free(error);
  sqlite3_close(db);
}

std::vector<std::pair<int, int64_t>> RankSteps(
    const std::vector<v1::StepMetrics>& steps) {
  std::vector<std::pair<int, int64_t>> out;
  for (const v1::StepMetrics& m : steps) out.emplace_back(m.rank(), m.step());
  return out;
}

// ---------------------------------------------------------------------------
// Opening and schema versions

TEST(JobStoreTest, OpenCreatesTablesAtCurrentSchemaVersion) {
  test::TempDir dir;
  const std::string path = dir / "state.db";

  std::unique_ptr<JobStore> store = OpenOrDie(path);

  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Query(path, "PRAGMA user_version"),
            std::to_string(JobStore::kSchemaVersion));
  EXPECT_EQ(Query(path,
                  "SELECT group_concat(name) FROM (SELECT name FROM "
                  "sqlite_master WHERE type = 'table' AND name LIKE 'job%' "
                  "ORDER BY name)"),
            "job_events,job_metrics,jobs");
  EXPECT_EQ(Query(path, "PRAGMA journal_mode"), "wal");
}

TEST(JobStoreTest, ReopenKeepsJobsEventsAndMetrics) {
  test::TempDir dir;
  const std::string path = dir / "state.db";
  {
    std::unique_ptr<JobStore> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(
        store->InsertJob(MakeJob("a", 1), MakeEvent(v1::QUEUED, "submitted"))
            .ok());
    ASSERT_TRUE(store->AppendMetrics("a", {MakeStep(0, 1, 2.5)}).ok());
  }

  std::unique_ptr<JobStore> store = OpenOrDie(path);

  ASSERT_NE(store, nullptr);
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].job.id(), "a");
  EXPECT_EQ((*jobs)[0].job.spec().name(), "name-a");
  EXPECT_EQ((*jobs)[0].secret, "secret-a");
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->GetEvents("a");
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].message(), "submitted");
  absl::StatusOr<std::vector<v1::StepMetrics>> steps =
      store->GetMetrics("a", std::nullopt, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 1u);
  EXPECT_DOUBLE_EQ((*steps)[0].loss(), 2.5);
}

TEST(JobStoreTest, OpenRejectsNewerSchemaNamingPathAndBothVersions) {
  test::TempDir dir;
  const std::string path = dir / "state.db";
  const int newer = JobStore::kSchemaVersion + 1;
  ExecOrFail(path, "PRAGMA user_version = " + std::to_string(newer));

  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);

  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(store.status().message(), HasSubstr(path));
  EXPECT_THAT(store.status().message(),
              HasSubstr("schema version " + std::to_string(newer)));
  EXPECT_THAT(store.status().message(),
              HasSubstr("(" + std::to_string(JobStore::kSchemaVersion) + ")"));
  EXPECT_EQ(Query(path, "PRAGMA user_version"), std::to_string(newer));
}

TEST(JobStoreTest, UnreadableRecordIsDataLossNamingTheJob) {
  test::TempDir dir;
  const std::string path = dir / "state.db";
  std::unique_ptr<JobStore> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->InsertJob(MakeJob("broken", 1), MakeEvent(v1::QUEUED, "")).ok());
  ExecOrFail(path, "UPDATE jobs SET record = x'ff' WHERE id = 'broken'");

  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();

  EXPECT_EQ(jobs.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(jobs.status().message(), HasSubstr("'broken'"));
}

// ---------------------------------------------------------------------------
// Jobs and events

TEST(JobStoreTest, InsertJobRejectsTakenIdOrSeq) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->InsertJob(MakeJob("a", 1), MakeEvent(v1::QUEUED, "")).ok());

  absl::Status same_id =
      store->InsertJob(MakeJob("a", 2), MakeEvent(v1::QUEUED, ""));
  absl::Status same_seq =
      store->InsertJob(MakeJob("b", 1), MakeEvent(v1::QUEUED, ""));

  EXPECT_EQ(same_id.code(), absl::StatusCode::kAlreadyExists) << same_id;
  EXPECT_EQ(same_seq.code(), absl::StatusCode::kAlreadyExists) << same_seq;
  // The failed inserts left neither a job nor an event behind.
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ(jobs->size(), 1u);
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->GetEvents("a");
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_EQ(events->size(), 1u);
  EXPECT_EQ(Query(dir / "state.db", "SELECT COUNT(*) FROM job_events"), "1");
}

TEST(JobStoreTest, UpdateJobOfUnknownIdIsNotFound) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);

  absl::Status status =
      store->UpdateJob(MakeJob("ghost", 1), MakeEvent(v1::RUNNING, "started"));

  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("ghost"));
  EXPECT_EQ(Query(dir / "state.db", "SELECT COUNT(*) FROM job_events"), "0");
}

TEST(JobStoreTest, UpdateJobReplacesRecordAppendsEventAndKeepsSeqAndSecret) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->InsertJob(MakeJob("a", 7), MakeEvent(v1::QUEUED, "submitted", 1))
          .ok());
  StoredJob running = MakeJob("a", /*seq=*/99, v1::RUNNING);
  running.secret = "another secret";
  running.worker_pids = {101, 102};
  running.worker_pgid = 101;

  ASSERT_TRUE(
      store->UpdateJob(running, MakeEvent(v1::RUNNING, "started", 2)).ok());
  ASSERT_TRUE(store->UpdateJob(running, std::nullopt).ok());

  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  const StoredJob& job = (*jobs)[0];
  EXPECT_EQ(job.job.state(), v1::RUNNING);
  EXPECT_EQ(job.seq, 7);
  EXPECT_EQ(job.secret, "secret-a");
  EXPECT_THAT(job.worker_pids, ElementsAre(101, 102));
  EXPECT_EQ(job.worker_pgid, 101);
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->GetEvents("a");
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[0].state(), v1::QUEUED);
  EXPECT_EQ((*events)[1].state(), v1::RUNNING);
  EXPECT_EQ((*events)[1].message(), "started");
  EXPECT_EQ((*events)[1].time_unix_ms(), 2);
}

TEST(JobStoreTest, LoadJobsReturnsSubmissionOrderAndMaxSeqTheLargest) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);
  absl::StatusOr<int64_t> empty_max = store->MaxSeq();
  for (const auto& [id, seq] : std::vector<std::pair<std::string, int64_t>>{
           {"c", 30}, {"a", 10}, {"b", 20}}) {
    ASSERT_TRUE(
        store->InsertJob(MakeJob(id, seq), MakeEvent(v1::QUEUED, "")).ok());
  }

  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  absl::StatusOr<int64_t> max_seq = store->MaxSeq();

  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::vector<std::string> ids;
  for (const StoredJob& job : *jobs) ids.push_back(job.job.id());
  EXPECT_THAT(ids, ElementsAre("a", "b", "c"));
  ASSERT_TRUE(empty_max.ok()) << empty_max.status();
  EXPECT_EQ(*empty_max, 0);
  ASSERT_TRUE(max_seq.ok()) << max_seq.status();
  EXPECT_EQ(*max_seq, 30);
}

// ---------------------------------------------------------------------------
// Metrics

TEST(JobStoreTest, AppendMetricsReplacesAReportedStep) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->InsertJob(MakeJob("a", 1), MakeEvent(v1::QUEUED, "")).ok());
  ASSERT_TRUE(
      store->AppendMetrics("a", {MakeStep(0, 5, 3.0), MakeStep(1, 5, 3.1)})
          .ok());

  // Rank 0 restarted from a checkpoint and reports step 5 again.
  ASSERT_TRUE(store->AppendMetrics("a", {MakeStep(0, 5, 2.0)}).ok());

  absl::StatusOr<std::vector<v1::StepMetrics>> steps =
      store->GetMetrics("a", std::nullopt, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 2u);
  EXPECT_DOUBLE_EQ((*steps)[0].loss(), 2.0);
  EXPECT_DOUBLE_EQ((*steps)[1].loss(), 3.1);
  // The loss column, kept for ad-hoc SQL, follows the record.
  EXPECT_EQ(Query(dir / "state.db",
                  "SELECT loss FROM job_metrics WHERE rank = 0 AND step = 5"),
            "2.0");
}

// A diverged run reports NaN and infinite losses: stored and read back
// exactly (SQLite would store a NaN REAL as NULL, which the column refuses).
TEST(JobStoreTest, NonFiniteLossesAreStoredAndReadBack) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->InsertJob(MakeJob("a", 1), MakeEvent(v1::QUEUED, "")).ok());
  const double inf = std::numeric_limits<double>::infinity();

  absl::Status appended = store->AppendMetrics(
      "a", {MakeStep(0, 1, 5.0), MakeStep(0, 2, std::nan("")),
            MakeStep(0, 3, inf), MakeStep(0, 4, -inf)});

  ASSERT_TRUE(appended.ok()) << appended;
  absl::StatusOr<std::vector<v1::StepMetrics>> steps =
      store->GetMetrics("a", std::nullopt, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 4u);
  EXPECT_DOUBLE_EQ((*steps)[0].loss(), 5.0);
  EXPECT_TRUE(std::isnan((*steps)[1].loss()));
  EXPECT_EQ((*steps)[2].loss(), inf);
  EXPECT_EQ((*steps)[3].loss(), -inf);
  EXPECT_EQ(
      Query(dir / "state.db", "SELECT loss FROM job_metrics WHERE step = 2"),
      "nan");
}

TEST(JobStoreTest, GetMetricsFiltersByJobRankAndFromStepOrderedByStepThenRank) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->InsertJob(MakeJob("a", 1), MakeEvent(v1::QUEUED, "")).ok());
  ASSERT_TRUE(
      store->InsertJob(MakeJob("b", 2), MakeEvent(v1::QUEUED, "")).ok());
  ASSERT_TRUE(
      store
          ->AppendMetrics("a", {MakeStep(1, 3), MakeStep(0, 3), MakeStep(1, 1),
                                MakeStep(0, 2), MakeStep(0, 1)})
          .ok());
  ASSERT_TRUE(store->AppendMetrics("b", {MakeStep(0, 2)}).ok());

  absl::StatusOr<std::vector<v1::StepMetrics>> all =
      store->GetMetrics("a", std::nullopt, 0);
  absl::StatusOr<std::vector<v1::StepMetrics>> from_2 =
      store->GetMetrics("a", std::nullopt, 2);
  absl::StatusOr<std::vector<v1::StepMetrics>> rank_1 =
      store->GetMetrics("a", 1, 0);
  absl::StatusOr<std::vector<v1::StepMetrics>> rank_0_from_3 =
      store->GetMetrics("a", 0, 3);

  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_TRUE(from_2.ok()) << from_2.status();
  ASSERT_TRUE(rank_1.ok()) << rank_1.status();
  ASSERT_TRUE(rank_0_from_3.ok()) << rank_0_from_3.status();
  EXPECT_THAT(RankSteps(*all), ElementsAre(Pair(0, 1), Pair(1, 1), Pair(0, 2),
                                           Pair(0, 3), Pair(1, 3)));
  EXPECT_THAT(RankSteps(*from_2),
              ElementsAre(Pair(0, 2), Pair(0, 3), Pair(1, 3)));
  EXPECT_THAT(RankSteps(*rank_1), ElementsAre(Pair(1, 1), Pair(1, 3)));
  EXPECT_THAT(RankSteps(*rank_0_from_3), ElementsAre(Pair(0, 3)));
}

TEST(JobStoreTest, AppendMetricsForUnknownJobIsNotFoundAndStoresNothing) {
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);

  absl::Status status =
      store->AppendMetrics("ghost", {MakeStep(0, 1), MakeStep(0, 2)});

  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("ghost"));
  absl::StatusOr<int64_t> count = store->CountMetrics();
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, 0);
}

TEST(JobStoreTest, ConcurrentAppendsAreEachCommittedExactlyOnce) {
  constexpr int kThreads = 8;
  constexpr int kCallsPerThread = 500;
  test::TempDir dir;
  std::unique_ptr<JobStore> store = OpenOrDie(dir / "state.db");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->InsertJob(MakeJob("a", 1), MakeEvent(v1::QUEUED, "")).ok());

  std::vector<absl::Status> first_error(kThreads);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kThreads; ++rank) {
    threads.emplace_back([&, rank] {
      for (int step = 0; step < kCallsPerThread && first_error[rank].ok();
           ++step) {
        first_error[rank] = store->AppendMetrics("a", {MakeStep(rank, step)});
      }
    });
  }
  for (std::thread& t : threads) t.join();

  for (int rank = 0; rank < kThreads; ++rank) {
    EXPECT_TRUE(first_error[rank].ok())
        << "rank " << rank << ": " << first_error[rank];
  }
  absl::StatusOr<int64_t> count = store->CountMetrics();
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, kThreads * kCallsPerThread);
  absl::StatusOr<std::vector<v1::StepMetrics>> steps =
      store->GetMetrics("a", std::nullopt, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  std::set<std::pair<int, int64_t>> distinct;
  for (const auto& rank_step : RankSteps(*steps)) distinct.insert(rank_step);
  EXPECT_EQ(steps->size(), static_cast<size_t>(kThreads * kCallsPerThread));
  EXPECT_EQ(distinct.size(), static_cast<size_t>(kThreads * kCallsPerThread));
  EXPECT_EQ(*distinct.begin(), std::make_pair(0, int64_t{0}));
  EXPECT_EQ(*distinct.rbegin(),
            std::make_pair(kThreads - 1, int64_t{kCallsPerThread - 1}));
}

TEST(JobStoreTest, CommittedRowsSurviveAProcessThatExitsWithoutClosing) {
  test::TempDir dir;
  const std::string path = dir / "state.db";

  // Nothing is open in this process when it forks; the child writes and then
  // leaves without destructors, as a killed coordinator would.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
    if (!store.ok()) _exit(2);
    if (!(*store)->InsertJob(MakeJob("a", 1), MakeEvent(v1::QUEUED, "")).ok())
      _exit(3);
    if (!(*store)->AppendMetrics("a", {MakeStep(0, 1), MakeStep(0, 2)}).ok())
      _exit(4);
    _exit(0);
  }
  int wait_status = 0;
  ASSERT_EQ(waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFEXITED(wait_status));
  ASSERT_EQ(WEXITSTATUS(wait_status), 0);
  // The child never checkpointed, so its commits are in the WAL alone.
  ASSERT_TRUE(std::filesystem::exists(path + "-wal"));
  ASSERT_GT(std::filesystem::file_size(path + "-wal"), 0u);

  std::unique_ptr<JobStore> store = OpenOrDie(path);

  ASSERT_NE(store, nullptr);
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  absl::StatusOr<std::vector<v1::StepMetrics>> steps =
      store->GetMetrics("a", 0, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  EXPECT_THAT(RankSteps(*steps), ElementsAre(Pair(0, 1), Pair(0, 2)));
}

}  // namespace
}  // namespace shardtrain
