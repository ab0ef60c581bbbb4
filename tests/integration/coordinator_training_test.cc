// shardtraind end to end with real shardtrain-worker ranks training gpt2-tiny
// on the Brown Corpus over Gloo on loopback: the jobs complete and their
// stored metrics are what the workers logged; cancel, a killed worker (with
// and without restarts) and a killed coordinator behave as specified.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "core/run/step_metrics.h"
#include "tests/integration/daemon_harness.h"

namespace shardtrain {
namespace {

using test::Daemon;
using test::DaemonOptions;
using test::TempDir;
using ::testing::HasSubstr;

v1::JobSpec TinySpec(const std::string& strategy, int world, int steps) {
  v1::JobSpec spec;
  spec.set_name(absl::StrCat("tiny-", strategy));
  spec.set_model("gpt2-tiny");
  spec.set_data("brown");
  spec.mutable_strategy()->set_name(strategy);
  spec.set_world_size(world);
  v1::TrainerOptions* t = spec.mutable_trainer();
  t->set_batch_size(2);
  t->set_seq_len(64);
  t->set_max_steps(steps);
  t->set_lr(1e-3);
  t->set_eval_steps(2);
  t->set_checkpoint_every(4);
  return spec;
}

std::function<bool(const v1::Job&)> ReachedStep(int step) {
  return [step](const v1::Job& job) {
    return test::IsTerminal(job) ||
           (job.state() == v1::RUNNING && job.last_step().step() >= step);
  };
}

// RANK of a worker process, from its environment.
int RankOf(int pid) {
  const std::string environ =
      test::ReadFile(absl::StrCat("/proc/", pid, "/environ"));
  const size_t at = environ.find(std::string("\0RANK=", 6));
  return at == std::string::npos ? -1 : std::atoi(environ.c_str() + at + 6);
}

int PidOfRank(const test::Daemon& daemon, const std::string& job_id, int rank) {
  for (int pid : daemon.WorkerPids(job_id))
    if (RankOf(pid) == rank) return pid;
  return -1;
}

// (rank, step) -> metrics, from the metrics.jsonl the ranks append to (a step
// written twice, before and after a restart, keeps its last line).
std::map<std::pair<int, int64_t>, StepMetrics> WorkerLog(
    const std::string& path) {
  std::map<std::pair<int, int64_t>, StepMetrics> steps;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    absl::StatusOr<StepMetrics> m = StepMetrics::FromJson(line);
    if (m.ok()) steps[{static_cast<int>(m->rank), m->step}] = *m;
  }
  return steps;
}

void ExpectRelNear(double a, double b, double rel, const std::string& what) {
  EXPECT_LE(std::abs(a - b), rel * std::max(std::abs(a), std::abs(b)))
      << what << ": " << a << " vs " << b;
}

class CoordinatorTrainingTest : public ::testing::Test {
 protected:
  std::unique_ptr<Daemon> StartDaemon(DaemonOptions options) {
    auto daemon = std::make_unique<Daemon>(dir_ / "state", std::move(options));
    std::string error;
    EXPECT_TRUE(daemon->Start(&error)) << error;
    return daemon;
  }
  std::string JobDir(const std::string& id) {
    return dir_ / ("state/jobs/" + id);
  }

  TempDir dir_;
};

TEST_F(CoordinatorTrainingTest,
       DdpAndFsdpJobsCompleteAndStoredMetricsEqualWorkerLogs) {
  auto daemon = StartDaemon({});
  v1::Job ddp, fsdp;
  ASSERT_GRPC_OK(daemon->Submit(TinySpec("ddp", 2, 10), &ddp));
  ASSERT_GRPC_OK(daemon->Submit(TinySpec("fsdp", 2, 10), &fsdp));
  // Two CPU slots: the FSDP job waits for the DDP job's devices.
  EXPECT_EQ(daemon->Get(fsdp.id()).state(), v1::QUEUED);

  std::map<std::pair<int, int64_t>, double> loss_by_strategy[2];
  int i = 0;
  for (const v1::Job& submitted : {ddp, fsdp}) {
    const v1::Job job =
        daemon->WaitFor(submitted.id(), test::IsTerminal, absl::Seconds(600));
    ASSERT_EQ(job.state(), v1::SUCCEEDED)
        << job.DebugString()
        << test::ReadFile(JobDir(job.id()) + "/rank-0.log");
    const std::vector<v1::StepMetrics> stored = daemon->Metrics(job.id());
    const auto logged = WorkerLog(JobDir(job.id()) + "/metrics.jsonl");
    ASSERT_EQ(stored.size(), 20u);  // 10 steps x 2 ranks
    ASSERT_EQ(logged.size(), 20u);
    for (const v1::StepMetrics& s : stored) {
      const StepMetrics& w = logged.at({s.rank(), s.step()});
      const std::string where =
          absl::StrCat(job.id(), " rank ", s.rank(), " step ", s.step());
      EXPECT_DOUBLE_EQ(s.loss(), w.loss) << where;
      EXPECT_DOUBLE_EQ(s.grad_norm(), w.grad_norm) << where;
      EXPECT_DOUBLE_EQ(s.lr(), w.lr) << where;
      EXPECT_DOUBLE_EQ(s.step_seconds(), w.step_seconds) << where;
      EXPECT_EQ(s.tokens(), w.tokens) << where;
      EXPECT_EQ(s.memory_peak_bytes(), w.memory_peak_bytes) << where;
      EXPECT_EQ(s.model_state_bytes(), w.model_state_bytes) << where;
      EXPECT_EQ(s.has_val_loss(), w.val_loss >= 0) << where;
      loss_by_strategy[i][{s.rank(), s.step()}] = s.loss();
    }
    EXPECT_EQ(job.last_step().step(), 10);
    EXPECT_EQ(job.last_step().rank(), 0);
    ++i;
  }
  // Same data, seed and global batch: DDP and FSDP train the same model.
  for (const auto& [key, loss] : loss_by_strategy[0]) {
    ExpectRelNear(loss, loss_by_strategy[1].at(key), 1e-5, "ddp vs fsdp loss");
  }
}

TEST_F(CoordinatorTrainingTest,
       CancelMidRunEndsEveryWorkerWithinTheGracePeriod) {
  DaemonOptions options;
  options.grace_period = 3;
  auto daemon = StartDaemon(options);
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(TinySpec("ddp", 2, 100000), &job));
  ASSERT_TRUE(ReachedStep(2)(
      daemon->WaitFor(job.id(), ReachedStep(2), absl::Seconds(300))));
  ASSERT_EQ(daemon->WorkerPids(job.id()).size(), 2u);

  grpc::ClientContext context;
  v1::CancelJobRequest request;
  request.set_job_id(job.id());
  v1::Job response;
  const absl::Time cancelled_at = absl::Now();
  ASSERT_TRUE(daemon->jobs().CancelJob(&context, request, &response).ok());
  ASSERT_TRUE(
      test::WaitUntil([&] { return daemon->WorkerPids(job.id()).empty(); },
                      absl::Seconds(options.grace_period)));
  const absl::Duration gone_after = absl::Now() - cancelled_at;
  const v1::Job final =
      daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(10));
  EXPECT_EQ(final.state(), v1::CANCELLED);
  std::cout << "workers gone " << absl::FormatDuration(gone_after)
            << " after CancelJob\n";
}

// A job whose memory cap is below what its ranks need fails with reason OOM,
// the message naming the cap, and is not restarted into the same wall.
TEST_F(CoordinatorTrainingTest, AJobPastItsMemoryCapFailsOutOfMemory) {
  auto daemon = StartDaemon({});
  v1::JobSpec spec = TinySpec("fsdp", 2, 4);
  spec.mutable_trainer()->set_memory_cap_bytes(int64_t{40} << 20);
  spec.set_max_restarts(2);
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(spec, &job));
  job = daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(120));
  ASSERT_EQ(job.state(), v1::FAILED) << daemon->log();
  EXPECT_EQ(job.failure().reason(), v1::OOM) << job.DebugString();
  std::string tail;
  for (const std::string& line : job.failure().log_tail()) tail += line;
  EXPECT_THAT(tail, HasSubstr("past the memory cap of 40.0 MiB")) << tail;
  EXPECT_EQ(job.restarts(), 0);  // it would only hit the cap again
}

TEST_F(CoordinatorTrainingTest, KilledWorkerFailsTheJobNamingTheRank) {
  auto daemon = StartDaemon({});
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(TinySpec("ddp", 2, 100000), &job));
  ASSERT_TRUE(ReachedStep(2)(
      daemon->WaitFor(job.id(), ReachedStep(2), absl::Seconds(300))));
  const int victim = PidOfRank(*daemon, job.id(), 1);
  ASSERT_GT(victim, 0);
  kill(victim, SIGKILL);

  job = daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(30));
  ASSERT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.failure().reason(), v1::SIGNAL);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_THAT(job.failure().message(),
              HasSubstr("rank 1 ended with signal KILL"));
  EXPECT_GT(job.failure().log_tail_size(), 0);
  EXPECT_TRUE(daemon->WorkerPids(job.id()).empty()) << "rank 0 left running";
}

// Under --path-root, as operators are told to run the daemon: the ranks
// read back the checkpoints they wrote (their job's own directory is one of
// their read roots) and a restart resumes from them.
TEST_F(CoordinatorTrainingTest,
       KilledWorkerWithARestartResumesFromItsCheckpoint) {
  std::filesystem::create_directories(dir_ / "datasets");
  DaemonOptions options;
  options.extra_flags = {"--path-root", dir_ / "datasets"};
  auto daemon = StartDaemon(options);
  // The uninterrupted run the resumed one must reproduce.
  v1::Job reference;
  ASSERT_GRPC_OK(daemon->Submit(TinySpec("ddp", 2, 12), &reference));
  ASSERT_EQ(
      daemon->WaitFor(reference.id(), test::IsTerminal, absl::Seconds(600))
          .state(),
      v1::SUCCEEDED);

  v1::JobSpec spec = TinySpec("ddp", 2, 12);
  spec.set_max_restarts(1);
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(spec, &job));
  // Past the checkpoint of step 4.
  ASSERT_TRUE(ReachedStep(6)(
      daemon->WaitFor(job.id(), ReachedStep(6), absl::Seconds(300))));
  kill(PidOfRank(*daemon, job.id(), 1), SIGKILL);

  EXPECT_EQ(daemon
                ->WaitFor(
                    job.id(),
                    [](const v1::Job& j) {
                      return j.state() == v1::RESTARTING || test::IsTerminal(j);
                    },
                    absl::Seconds(30))
                .state(),
            v1::RESTARTING);
  job = daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString();
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_THAT(test::ReadFile(JobDir(job.id()) + "/rank-0.log"),
              HasSubstr("resumed from"));

  const std::vector<v1::StepMetrics> resumed = daemon->Metrics(job.id());
  const std::vector<v1::StepMetrics> uninterrupted =
      daemon->Metrics(reference.id());
  ASSERT_EQ(resumed.size(), 24u);
  ASSERT_EQ(uninterrupted.size(), 24u);
  for (size_t i = 0; i < resumed.size(); ++i) {
    ASSERT_EQ(resumed[i].step(), uninterrupted[i].step());
    ExpectRelNear(resumed[i].loss(), uninterrupted[i].loss(), 1e-6,
                  absl::StrCat("loss at step ", resumed[i].step()));
  }
}

TEST_F(CoordinatorTrainingTest,
       KilledCoordinatorLosesNothingAndRecoversItsJobs) {
  DaemonOptions options;
  options.cpu_slots = 3;
  auto daemon = StartDaemon(options);
  v1::JobSpec resumable = TinySpec("ddp", 2, 12);
  resumable.set_max_restarts(1);
  v1::JobSpec fragile = TinySpec("single", 1, 100000);
  v1::JobSpec waiting = TinySpec("single", 1, 3);
  v1::Job a, b, c;
  ASSERT_GRPC_OK(daemon->Submit(resumable, &a));
  ASSERT_GRPC_OK(daemon->Submit(fragile, &b));
  ASSERT_GRPC_OK(daemon->Submit(waiting, &c));
  ASSERT_TRUE(ReachedStep(6)(
      daemon->WaitFor(a.id(), ReachedStep(6), absl::Seconds(300))));
  ASSERT_TRUE(ReachedStep(2)(
      daemon->WaitFor(b.id(), ReachedStep(2), absl::Seconds(300))));
  EXPECT_EQ(daemon->Get(c.id()).state(), v1::QUEUED);
  const std::vector<v1::StepMetrics> a_before = daemon->Metrics(a.id());
  const std::vector<v1::StepMetrics> b_before = daemon->Metrics(b.id());

  daemon->Signal(SIGKILL);
  daemon->WaitExit(absl::Seconds(10));
  // The workers die with their coordinator.
  EXPECT_TRUE(test::WaitUntil(
      [&] {
        return daemon->WorkerPids(a.id()).empty() &&
               daemon->WorkerPids(b.id()).empty();
      },
      absl::Seconds(10)));

  auto restarted = StartDaemon(options);
  // Every job is still there; the stored metrics are a superset of what was
  // acknowledged before the kill.
  const v1::Job b_after = restarted->Get(b.id());
  EXPECT_EQ(b_after.state(), v1::FAILED);
  EXPECT_EQ(b_after.failure().reason(), v1::COORDINATOR_RESTART);
  const std::vector<v1::StepMetrics> b_stored = restarted->Metrics(b.id());
  ASSERT_GE(b_stored.size(), b_before.size());
  for (size_t i = 0; i < b_before.size(); ++i) {
    EXPECT_EQ(b_stored[i].SerializeAsString(), b_before[i].SerializeAsString());
  }
  const v1::Job a_done =
      restarted->WaitFor(a.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(a_done.state(), v1::SUCCEEDED) << a_done.DebugString();
  EXPECT_EQ(a_done.restarts(), 1);
  std::map<std::pair<int, int64_t>, double> a_final;
  for (const v1::StepMetrics& s : restarted->Metrics(a.id()))
    a_final[{s.rank(), s.step()}] = s.loss();
  EXPECT_EQ(a_final.size(), 24u);
  for (const v1::StepMetrics& s : a_before) {
    ASSERT_TRUE(a_final.count({s.rank(), s.step()}));
    ExpectRelNear(a_final.at({s.rank(), s.step()}), s.loss(), 1e-6,
                  absl::StrCat("job a step ", s.step()));
  }
  EXPECT_EQ(
      restarted->WaitFor(c.id(), test::IsTerminal, absl::Seconds(600)).state(),
      v1::SUCCEEDED);
}

// A host two users share: alice's low-priority FSDP job holds both slots;
// bob's urgent job takes one. alice's ranks save a checkpoint at the next
// step boundary and stop; her job is PREEMPTED, QUEUED again, and resumes
// once bob's is done, with the losses of an uninterrupted run and no step
// run twice (nothing was lost but the step in flight). bob may not cancel
// her job; an admin may cancel his.
TEST_F(CoordinatorTrainingTest,
       APreemptedJobResumesFromItsCheckpointWithTheLossesOfAnUnbrokenRun) {
  const std::string tokens = dir_ / "tokens";
  test::WriteFile(
      tokens, "tok-alice,alice,user\ntok-bob,bob,user\ntok-ops,ops,admin\n");
  chmod(tokens.c_str(), 0600);
  DaemonOptions options;
  options.extra_flags = {"--auth-token-file", tokens, "--preempt-grace", "60"};
  auto daemon = StartDaemon(options);

  // Only the checkpoint the preemption asks for: none on a schedule.
  v1::JobSpec alices = TinySpec("fsdp", 2, 20);
  alices.mutable_trainer()->set_checkpoint_every(1000);
  daemon->set_token("tok-alice");
  v1::Job reference;
  ASSERT_GRPC_OK(daemon->Submit(alices, &reference));
  ASSERT_EQ(
      daemon->WaitFor(reference.id(), test::IsTerminal, absl::Seconds(600))
          .state(),
      v1::SUCCEEDED);

  v1::Job low;
  ASSERT_GRPC_OK(daemon->Submit(alices, &low));
  EXPECT_EQ(low.owner(), "alice");
  ASSERT_TRUE(ReachedStep(4)(
      daemon->WaitFor(low.id(), ReachedStep(4), absl::Seconds(300))));
  // A priority above the users' is an admin's to set (roles).
  daemon->set_token("tok-ops");
  v1::JobSpec urgent = TinySpec("single", 1, 3);
  urgent.set_priority(10);
  v1::Job high;
  ASSERT_GRPC_OK(daemon->Submit(urgent, &high));
  daemon->set_token("tok-bob");
  v1::Job refused;
  const grpc::Status denied = daemon->Cancel(low.id(), &refused);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(denied.error_message(), HasSubstr("belongs to alice"));

  const v1::Job requeued = daemon->WaitFor(
      low.id(),
      [](const v1::Job& j) {
        return j.preemptions() > 0 || test::IsTerminal(j);
      },
      absl::Seconds(120));
  EXPECT_EQ(requeued.preemptions(), 1) << requeued.DebugString();
  const v1::Job bobs =
      daemon->WaitFor(high.id(), test::IsTerminal, absl::Seconds(300));
  EXPECT_EQ(bobs.state(), v1::SUCCEEDED) << bobs.DebugString();
  daemon->set_token("tok-alice");
  const v1::Job done =
      daemon->WaitFor(low.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString();
  EXPECT_EQ(done.restarts(), 0);
  EXPECT_EQ(done.preemptions(), 1);
  const std::string log = test::ReadFile(JobDir(low.id()) + "/rank-0.log");
  EXPECT_THAT(log, HasSubstr("checkpoint saved"));
  EXPECT_THAT(log, HasSubstr("resumed from"));

  // Every step once: the resumed attempt began where the first stopped.
  const std::vector<v1::StepMetrics> steps = daemon->Metrics(low.id());
  const std::vector<v1::StepMetrics> unbroken = daemon->Metrics(reference.id());
  ASSERT_EQ(steps.size(), 40u);
  ASSERT_EQ(unbroken.size(), 40u);
  std::map<std::pair<int, int64_t>, double> by_step;
  for (const v1::StepMetrics& s : unbroken) {
    by_step[{s.rank(), s.step()}] = s.loss();
  }
  for (const v1::StepMetrics& s : steps) {
    ASSERT_TRUE(by_step.count({s.rank(), s.step()}));
    ExpectRelNear(s.loss(), by_step.at({s.rank(), s.step()}), 1e-5,
                  absl::StrCat("rank ", s.rank(), " step ", s.step()));
  }
  // Goodput: the devices' time while it was preempted and restarting is
  // held but not kept.
  EXPECT_GT(done.device_seconds_kept(), 0);
  EXPECT_LT(done.device_seconds_kept(), done.device_seconds_held());
  const std::string metrics = daemon->ScrapeMetrics();
  EXPECT_THAT(metrics,
              HasSubstr("shardtrain_job_preemptions_total{user=\"alice\"} 1"));
  EXPECT_THAT(metrics,
              HasSubstr("shardtrain_user_goodput_ratio{user=\"alice\"}"));

  // An unknown token is UNAUTHENTICATED; an admin may cancel anyone's job.
  daemon->set_token("tok-nobody");
  v1::Job job;
  EXPECT_EQ(daemon->Submit(urgent, &job).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  daemon->set_token("tok-bob");
  urgent.set_priority(0);  // a user's own level
  urgent.mutable_trainer()->set_max_steps(100000);
  ASSERT_GRPC_OK(daemon->Submit(urgent, &job));
  daemon->set_token("tok-ops");
  ASSERT_GRPC_OK(daemon->Cancel(job.id(), &job));
  EXPECT_EQ(
      daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(60)).state(),
      v1::CANCELLED);
}

// The same host with an elastic job: alice's job on both slots gives one up
// for bob's urgent job instead of stopping (re-meshed to one rank from its
// checkpoint, on `shrunk_mesh`), grows back to two (`own_mesh`) when bob's
// job ends, and trains as an uninterrupted run does, the global batch kept
// throughout.
void ExpectShrinksGrowsBackAndTrainsAsIfUnbroken(Daemon* daemon,
                                                 v1::JobSpec alices,
                                                 const std::string& shrunk_mesh,
                                                 const std::string& own_mesh) {
  alices.mutable_trainer()->set_checkpoint_every(1000);
  v1::Job reference;
  ASSERT_GRPC_OK(daemon->Submit(alices, &reference));
  const v1::Job untouched =
      daemon->WaitFor(reference.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(untouched.state(), v1::SUCCEEDED) << untouched.DebugString();

  alices.mutable_elastic()->set_min_world_size(1);
  alices.set_max_restarts(1);
  v1::Job elastic;
  ASSERT_GRPC_OK(daemon->Submit(alices, &elastic));
  ASSERT_TRUE(ReachedStep(4)(
      daemon->WaitFor(elastic.id(), ReachedStep(4), absl::Seconds(300))));
  EXPECT_EQ(daemon->Get(elastic.id()).mesh(), own_mesh);
  v1::JobSpec urgent = TinySpec("single", 1, 3);
  urgent.set_priority(10);
  v1::Job high;
  ASSERT_GRPC_OK(daemon->Submit(urgent, &high));
  const v1::Job shrunk = daemon->WaitFor(
      elastic.id(),
      [](const v1::Job& j) {
        return (j.state() == v1::RUNNING && j.world_size() == 1) ||
               test::IsTerminal(j);
      },
      absl::Seconds(120));
  EXPECT_EQ(shrunk.world_size(), 1) << shrunk.DebugString();
  EXPECT_EQ(shrunk.mesh(), shrunk_mesh);
  EXPECT_EQ(
      daemon->WaitFor(high.id(), test::IsTerminal, absl::Seconds(300)).state(),
      v1::SUCCEEDED);
  const v1::Job done =
      daemon->WaitFor(elastic.id(), test::IsTerminal, absl::Seconds(600));
  const std::string log = test::ReadFile(daemon->state_dir() + "/jobs/" +
                                         elastic.id() + "/rank-0.log");
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString() << log;
  EXPECT_EQ(done.restarts(), 0);
  EXPECT_EQ(done.preemptions(), 0);
  // Shrunk to 1, then grown back to 2 (its 36 steps left outlast bob's 3
  // by far).
  EXPECT_EQ(done.remeshes(), 2);
  EXPECT_GT(done.remesh_seconds_lost(), 0);
  EXPECT_EQ(done.world_size(), 2);
  EXPECT_EQ(done.mesh(), own_mesh);
  EXPECT_THAT(done.resize_reason(), HasSubstr("grown from 1 to 2 ranks"));
  EXPECT_THAT(log, HasSubstr("resumed from"));
  EXPECT_THAT(log, HasSubstr("elastic: 1 of 2 ranks train " + shrunk_mesh));

  // Rank 0's losses, step by step, against the run that was never touched.
  std::map<int64_t, double> expected, got;
  for (const v1::StepMetrics& s : daemon->Metrics(reference.id())) {
    if (s.rank() == 0) expected[s.step()] = s.loss();
  }
  for (const v1::StepMetrics& s : daemon->Metrics(elastic.id())) {
    if (s.rank() == 0) got[s.step()] = s.loss();
  }
  ASSERT_EQ(expected.size(), 40u);
  ASSERT_EQ(got.size(), 40u);
  for (const auto& [step, loss] : expected) {
    ExpectRelNear(got.at(step), loss, 1e-5, absl::StrCat("step ", step));
  }
  const std::string metrics = daemon->ScrapeMetrics();
  EXPECT_THAT(metrics, HasSubstr("shardtrain_job_remeshes_total{user=\"\"} 2"));
  // Shrinking and growing are re-meshes, not preemptions, as get says.
  EXPECT_THAT(metrics,
              HasSubstr("shardtrain_job_preemptions_total{user=\"\"} 0"));
  // The seconds without a step, as the job counts them.
  const std::string lost_series =
      "shardtrain_job_remesh_lost_seconds_total{user=\"\"} ";
  const size_t at = metrics.find(lost_series);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_NEAR(std::stod(metrics.substr(at + lost_series.size())),
              done.remesh_seconds_lost(), 1e-3);
  EXPECT_THAT(metrics, HasSubstr("shardtrain_queue_wait_seconds_count"));
}

TEST_F(CoordinatorTrainingTest,
       AnElasticJobShrinksForAnUrgentOneGrowsBackAndTrainsAsIfUnbroken) {
  DaemonOptions options;
  options.extra_flags = {"--preempt-grace", "60"};
  auto daemon = StartDaemon(options);
  ExpectShrinksGrowsBackAndTrainsAsIfUnbroken(
      daemon.get(), TinySpec("fsdp", 2, 40), "single", "fsdp2");
}

// With pipeline stages: pp2 continues on the one mesh of one rank and
// returns to its two stages.
TEST_F(CoordinatorTrainingTest,
       AnElasticPipelineJobIsReMeshedAndTrainsAsIfUnbroken) {
  DaemonOptions options;
  options.extra_flags = {"--preempt-grace", "60"};
  auto daemon = StartDaemon(options);
  v1::JobSpec pipeline = TinySpec("single", 2, 40);
  pipeline.mutable_strategy()->set_pipeline_stages(2);
  ExpectShrinksGrowsBackAndTrainsAsIfUnbroken(daemon.get(), pipeline, "single",
                                              "pp2");
}

}  // namespace
}  // namespace shardtrain
