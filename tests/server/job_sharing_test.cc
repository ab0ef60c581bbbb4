// A shared host in the JobManager: owners and who may cancel, device
// quotas, priority classes, and preemption that checkpoints and requeues.
// Driven by hand as in job_manager_test.cc (fake processes and clock).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <map>
#include <thread>

#include "common/exit_codes.h"
#include "core/plan/step_time_plan.h"
#include "google/protobuf/util/json_util.h"
#include "proto/job_config.h"
#include "server/job_manager.h"
#include "tests/server/job_manager_fixture.h"

namespace shardtrain {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

const Caller kAlice{"alice", false};
const Caller kBob{"bob", false};
const Caller kOps{"ops", true};

class JobSharingTest : public test::JobManagerFixture {
 protected:
  void SetUp() override {
    test::JobManagerFixture::SetUp();
    // The tests say when a preempted rank has saved its checkpoint.
    launcher_.set_checkpoint_on_usr1(false);
  }
  // Ranks that answer the shutdown's checkpoint request at once, so the
  // manager's shutdown does not wait out the grace period.
  void TearDown() override { launcher_.set_checkpoint_on_usr1(true); }

  void Configure(JobManagerOptions& options) override {
    // Both open to users: these tests are about what classes do, the roles
    // test about who may name them.
    options.priority_classes = {{"prod", {50, false, true}},
                                {"urgent", {100, true, true}}};
    options.preempt_grace = absl::Seconds(30);
  }

  // The pids spawned by the next Tick, registered.
  std::vector<int> TickAndRegister() {
    const size_t before = launcher_.spawned().size();
    manager_->Tick();
    const std::vector<int> spawned = launcher_.spawned();
    std::vector<int> pids(spawned.begin() + before, spawned.end());
    for (int pid : pids) {
      EXPECT_TRUE(manager_->RegisterWorker(Identity(pid)).ok());
    }
    return pids;
  }

  static v1::JobSpec WithPriority(v1::JobSpec spec, int priority) {
    spec.set_priority(priority);
    return spec;
  }

  v1::Job Get(const std::string& id) { return *manager_->Get(id); }

  // This host's rates as the step-time model reads them from the cache
  // (the fixture's own): 8 cores at 10 GFLOP/s a thread, links of
  // `latency` seconds and `bandwidth` bytes/s.
  static HostRates CacheRates(double latency, double bandwidth) {
    HostRates rates;
    rates.device = "cpu";
    rates.cores = 8;
    rates.flops_per_thread = 1e10;
    rates.compute_model = "gpt2-tiny";
    rates.optimizer_seconds_per_parameter = 1e-8;
    rates.intra_node = {latency, bandwidth};
    rates.measured_at = "2026-01-01 00:00 UTC";
    EXPECT_TRUE(SaveHostRates(rates).ok());
    return rates;
  }

  // The spec.json of job `id`'s latest attempt: what its ranks train.
  v1::JobSpec AttemptSpec(const std::string& id) {
    v1::JobSpec written;
    EXPECT_TRUE(
        google::protobuf::util::JsonStringToMessage(
            test::ReadFile(dir_ / ("jobs/" + id + "/spec.json")), &written)
            .ok());
    return written;
  }

  // The messages of job `id`'s stored events, in order.
  std::vector<std::string> EventMessages(const std::string& id) {
    std::vector<std::string> said;
    absl::StatusOr<std::vector<v1::JobEvent>> stored = store_->GetEvents(id);
    EXPECT_TRUE(stored.ok()) << stored.status();
    for (const v1::JobEvent& e : stored.value_or(std::vector<v1::JobEvent>{})) {
      said.push_back(e.message());
    }
    return said;
  }
};

// The host's 8 cores are shared by every rank on it: a job alone gets 4
// threads for each of its 2 ranks; one that starts beside it gets its
// share, 8 / 4 ranks = 2, not 4 more per rank on the same cores.
TEST_F(JobSharingTest, AJobBesideAnotherGetsItsShareOfTheCores) {
  const std::string first = manager_->Submit(Spec(2), kAlice)->id();
  const std::vector<int> alone = TickAndRegister();
  ASSERT_EQ(alone.size(), 2u);
  for (int pid : alone) EXPECT_EQ(launcher_.Env(pid, "OMP_NUM_THREADS"), "4");
  const std::string second = manager_->Submit(Spec(2), kBob)->id();
  const std::vector<int> beside = TickAndRegister();
  ASSERT_EQ(beside.size(), 2u);
  for (int pid : beside) {
    EXPECT_EQ(launcher_.Env(pid, "SHARDTRAIN_JOB_ID"), second);
    EXPECT_EQ(launcher_.Env(pid, "OMP_NUM_THREADS"), "2");
  }
  EXPECT_EQ(Get(first).state(), v1::RUNNING);
}

TEST_F(JobSharingTest, AJobIsItsOwnersAndOnlyTheyOrAnAdminMayCancelIt) {
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(1), kAlice);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->owner(), "alice");
  EXPECT_EQ(Get(job->id()).owner(), "alice");

  absl::StatusOr<v1::Job> by_bob = manager_->Cancel(job->id(), kBob);
  EXPECT_EQ(by_bob.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(by_bob.status().message(),
              HasSubstr("belongs to alice; only alice or an admin may cancel"));
  EXPECT_EQ(Get(job->id()).state(), v1::QUEUED);

  // Running, too: bob is refused, an admin is not.
  const std::vector<int> pids = TickAndRegister();
  ASSERT_EQ(Get(job->id()).state(), v1::RUNNING);
  EXPECT_FALSE(manager_->Cancel(job->id(), kBob).ok());
  manager_->Tick();
  EXPECT_THAT(launcher_.process(pids[0]).signals, Not(Contains(SIGTERM)));
  EXPECT_TRUE(manager_->Cancel(job->id(), kOps).ok());
  manager_->Tick();
  EXPECT_THAT(launcher_.process(pids[0]).signals, Contains(SIGTERM));

  // A job submitted without a token belongs to nobody: admins only.
  absl::StatusOr<v1::Job> anonymous = manager_->Submit(Spec(1));
  ASSERT_TRUE(anonymous.ok());
  EXPECT_EQ(anonymous->owner(), "");
  EXPECT_THAT(manager_->Cancel(anonymous->id(), kAlice).status().message(),
              HasSubstr("belongs to no user"));
  EXPECT_TRUE(manager_->Cancel(anonymous->id(), kOps).ok());
}

TEST_F(JobSharingTest, AQuotaHoldsJobsBackAndRefusesWhatCanNeverFit) {
  manager_ = NewManager([](JobManagerOptions& options) {
    options.device_quota = [](const std::string& user) {
      return user == "alice" ? 2 : 0;
    };
  });
  absl::StatusOr<v1::Job> too_big = manager_->Submit(Spec(3), kAlice);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(too_big.status().message(),
              HasSubstr("world_size: got 3; alice's quota is 2 devices"));

  const std::string first = manager_->Submit(Spec(2), kAlice)->id();
  const std::string second = manager_->Submit(Spec(1), kAlice)->id();
  const std::string bobs = manager_->Submit(Spec(1), kBob)->id();
  manager_->Tick();
  EXPECT_EQ(Get(first).state(), v1::STARTING);
  EXPECT_EQ(Get(second).state(), v1::QUEUED);
  EXPECT_EQ(Get(second).state_reason(),
            "alice holds 2 of their 2 devices (quota); this job needs 1");
  EXPECT_EQ(Get(bobs).state(), v1::STARTING);  // not held up behind it
  // The cluster view says the same.
  const ClusterView view = manager_->Cluster();
  ASSERT_EQ(view.queue.size(), 1u);
  EXPECT_THAT(view.queue[0].state_reason(), HasSubstr("alice holds 2 of"));
}

TEST_F(JobSharingTest, PriorityClassesSetPriorityAndPreemptibility) {
  v1::JobSpec spec = Spec(1);
  spec.set_priority_class("batch");
  absl::StatusOr<v1::Job> unknown = manager_->Submit(spec, kAlice);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("priority_class: 'batch' is not one of prod, urgent"));

  spec.set_priority_class("prod");
  spec.set_priority(-5);  // the class's priority wins
  absl::StatusOr<v1::Job> prod = manager_->Submit(spec, kAlice);
  ASSERT_TRUE(prod.ok()) << prod.status();
  EXPECT_EQ(prod->priority(), 50);
  EXPECT_FALSE(prod->preemptible());
  absl::StatusOr<v1::Job> plain = manager_->Submit(WithPriority(Spec(1), 7));
  EXPECT_EQ(plain->priority(), 7);
  EXPECT_TRUE(plain->preemptible());
}

// Roles govern priority: a user names only the classes an admin opened and
// sets a raw priority no higher than the highest of them; an admin-only
// class (above them, or never preempted) and higher raw priorities are an
// admin's. Nothing refused is stored.
TEST_F(JobSharingTest, OnlyAnAdminSetsAPriorityAboveTheOpenClasses) {
  manager_ = NewManager([](JobManagerOptions& options) {
    options.priority_classes = {{"batch", {10, true, true}},
                                {"critical", {200, true, false}},
                                {"pinned", {5, false, false}}};
  });
  auto refused = [&](const v1::JobSpec& spec, const Caller& caller) {
    absl::StatusOr<v1::Job> job = manager_->Submit(spec, caller);
    EXPECT_EQ(job.status().code(), absl::StatusCode::kPermissionDenied)
        << spec.ShortDebugString();
    return std::string(job.status().message());
  };
  EXPECT_THAT(refused(WithPriority(Spec(1), 1000), kAlice),
              AllOf(HasSubstr("priority: got 1000"),
                    HasSubstr("alice is a user, who may set a priority of at "
                              "most 10")));
  EXPECT_THAT(refused(WithPriority(Spec(1), 11), kAlice),
              HasSubstr("at most 10"));
  v1::JobSpec critical = Spec(1);
  critical.set_priority_class("critical");
  EXPECT_THAT(refused(critical, kAlice),
              AllOf(HasSubstr("priority_class: 'critical' is for admins"),
                    HasSubstr("(batch;")));
  v1::JobSpec pinned = Spec(1);  // never preempted: an admin's to grant
  pinned.set_priority_class("pinned");
  EXPECT_THAT(refused(pinned, kBob), HasSubstr("'pinned' is for admins"));
  EXPECT_TRUE(manager_->List({})->jobs.empty());

  v1::JobSpec batch = Spec(1);
  batch.set_priority_class("batch");
  absl::StatusOr<v1::Job> open = manager_->Submit(batch, kAlice);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(open->priority(), 10);
  EXPECT_TRUE(manager_->Submit(WithPriority(Spec(1), 10), kAlice).ok());
  EXPECT_TRUE(manager_->Submit(WithPriority(Spec(1), -50), kBob).ok());
  absl::StatusOr<v1::Job> by_admin = manager_->Submit(pinned, kOps);
  ASSERT_TRUE(by_admin.ok()) << by_admin.status();
  EXPECT_FALSE(by_admin->preemptible());
  EXPECT_TRUE(manager_->Submit(WithPriority(Spec(1), 1000), kOps).ok());
  EXPECT_TRUE(manager_->Submit(critical, kOps).ok());

  // No class open to users: their ceiling is 0.
  manager_ = NewManager([](JobManagerOptions& options) {
    options.priority_classes = {{"critical", {200, true, false}}};
  });
  EXPECT_THAT(refused(WithPriority(Spec(1), 1), kAlice),
              HasSubstr("at most 0"));
}

// An elastic job grows back only within its owner's quota: alice (quota 2)
// holds her shrunk elastic job's device and a 1-rank job; the devices freed
// when the urgent job ends are not hers to take.
TEST_F(JobSharingTest, AnElasticJobGrowsBackOnlyWithinItsOwnersQuota) {
  manager_ = NewManager([](JobManagerOptions& options) {
    options.device_quota = [](const std::string& user) {
      return user == "alice" ? 2 : 0;
    };
  });
  const std::string elastic =
      manager_->Submit(ElasticSpec(2, 1), kAlice)->id();  // 6 sequences
  const std::vector<int> first = TickAndRegister();
  ASSERT_EQ(first.size(), 2u);
  v1::JobSpec urgent_spec = Spec(3);
  urgent_spec.set_priority_class("urgent");
  const std::string urgent = manager_->Submit(urgent_spec, kOps)->id();
  manager_->Tick();
  ASSERT_EQ(Get(elastic).state(), v1::PREEMPTED);
  for (int pid : first) launcher_.Exit(pid, ExitStatus{kExitPreempted, 0});
  const std::vector<int> second = TickAndRegister();
  ASSERT_EQ(second.size(), 4u);  // 1 for the elastic job, 3 urgent
  ASSERT_EQ(Get(elastic).world_size(), 1);
  const std::string small = manager_->Submit(Spec(1), kAlice)->id();
  std::vector<int> urgent_pids;
  for (int pid : second) {
    if (launcher_.Env(pid, "SHARDTRAIN_JOB_ID") == urgent) {
      urgent_pids.push_back(pid);
    }
  }
  ASSERT_EQ(urgent_pids.size(), 3u);
  for (int pid : urgent_pids) launcher_.Exit(pid, ExitStatus{0, 0});
  TickAndRegister();  // the urgent job ends; alice's second one starts
  ASSERT_EQ(Get(urgent).state(), v1::SUCCEEDED);
  for (int i = 0; i < 3; ++i) TickAndRegister();
  EXPECT_EQ(Get(small).state(), v1::RUNNING);
  const v1::Job kept = Get(elastic);
  EXPECT_EQ(kept.state(), v1::RUNNING);
  EXPECT_EQ(kept.world_size(), 1);
  EXPECT_EQ(kept.remeshes(), 1);  // shrunk once, never grown
  int alices = 0;
  for (const ClusterView::Holder& holder : manager_->Cluster().holders) {
    alices += holder.job_id == elastic || holder.job_id == small;
  }
  EXPECT_EQ(alices, 2);
}

// The whole preemption: a low-priority job holds every device; an urgent
// one arrives; the low one's ranks are asked (SIGUSR1) to checkpoint and
// stop, it is PREEMPTED, then QUEUED once they have, without using a
// restart; the urgent one runs; the low one resumes (--resume).
TEST_F(JobSharingTest, APreemptedJobCheckpointsRequeuesAndResumes) {
  const std::string low = manager_->Submit(Spec(4, 0), kAlice)->id();
  const std::vector<int> low_pids = TickAndRegister();
  ASSERT_EQ(low_pids.size(), 4u);
  ASSERT_EQ(Get(low).state(), v1::RUNNING);

  v1::JobSpec urgent_spec = Spec(2);
  urgent_spec.set_priority_class("urgent");
  const std::string urgent = manager_->Submit(urgent_spec, kBob)->id();
  manager_->Tick();
  EXPECT_EQ(Get(low).state(), v1::PREEMPTED);
  EXPECT_THAT(Get(low).state_reason(),
              HasSubstr("preempted for " + urgent + " (priority 100)"));
  EXPECT_THAT(Get(urgent).state_reason(), HasSubstr("preempting " + low));
  manager_->Tick();  // the signal goes out after the decision
  for (int pid : low_pids) {
    EXPECT_THAT(launcher_.process(pid).signals, Contains(SIGUSR1));
    EXPECT_THAT(launcher_.process(pid).signals, Not(Contains(SIGTERM)));
  }
  // Progress reports during the checkpoint do not tell the ranks to quit.
  EXPECT_FALSE(*manager_->Heartbeat(Identity(low_pids[0])));

  for (int pid : low_pids) {
    launcher_.Exit(pid, ExitStatus{kExitPreempted, 0});
  }
  // One round: the low job's ranks are gone, it is queued again, and the
  // urgent one starts on 2 of the devices it gave back.
  const std::vector<int> urgent_pids = TickAndRegister();
  EXPECT_EQ(urgent_pids.size(), 2u);
  v1::Job preempted = Get(low);
  EXPECT_EQ(preempted.state(), v1::QUEUED);
  EXPECT_EQ(preempted.preemptions(), 1);
  EXPECT_EQ(preempted.restarts(), 0);
  EXPECT_THAT(preempted.state_reason(), HasSubstr("needs 4 devices, 2 free"));
  EXPECT_EQ(Get(urgent).state(), v1::RUNNING);

  // The urgent job ends; in the same round the low one resumes.
  for (int pid : urgent_pids) launcher_.Exit(pid, ExitStatus{0, 0});
  const std::vector<int> resumed = TickAndRegister();
  EXPECT_EQ(Get(urgent).state(), v1::SUCCEEDED);
  ASSERT_EQ(resumed.size(), 4u);
  EXPECT_EQ(Get(low).state(), v1::RUNNING);
  EXPECT_THAT(launcher_.process(resumed[0]).spec.argv, Contains("--resume"));
  EXPECT_THAT(launcher_.process(low_pids[0]).spec.argv,
              Not(Contains("--resume")));
  EXPECT_EQ(Get(low).restarts(), 0);
}

// A rank that ignores the request is killed after --preempt-grace; the job
// is requeued all the same (it resumes from its previous checkpoint).
TEST_F(JobSharingTest, RanksThatIgnoreTheRequestAreKilledAfterTheGrace) {
  const std::string low = manager_->Submit(Spec(4), kAlice)->id();
  const std::vector<int> pids = TickAndRegister();
  ASSERT_EQ(pids.size(), 4u);
  ASSERT_TRUE(manager_->Submit(WithPriority(Spec(1), 10), kBob).ok());
  manager_->Tick();
  manager_->Tick();
  ASSERT_EQ(Get(low).state(), v1::PREEMPTED);
  clock_.Advance(absl::Seconds(29));
  manager_->Tick();
  EXPECT_THAT(launcher_.process(pids[0]).signals, Not(Contains(SIGKILL)));
  clock_.Advance(absl::Seconds(2));
  manager_->Tick();
  manager_->Tick();
  EXPECT_THAT(launcher_.process(pids[0]).signals, Contains(SIGKILL));
  manager_->Tick();
  EXPECT_EQ(Get(low).state(), v1::QUEUED);
  EXPECT_EQ(Get(low).preemptions(), 1);
  EXPECT_EQ(Get(low).restarts(), 0);
}

TEST_F(JobSharingTest, NonPreemptibleAndEqualPriorityJobsAreNeverPreempted) {
  v1::JobSpec prod = Spec(4);
  prod.set_priority_class("prod");
  const std::string pinned = manager_->Submit(prod, kAlice)->id();
  TickAndRegister();
  v1::JobSpec urgent = Spec(1);
  urgent.set_priority_class("urgent");
  const std::string waiting = manager_->Submit(urgent, kBob)->id();
  manager_->Tick();
  manager_->Tick();
  EXPECT_EQ(Get(pinned).state(), v1::RUNNING);
  EXPECT_EQ(Get(waiting).state(), v1::QUEUED);
  EXPECT_THAT(Get(waiting).state_reason(), HasSubstr("needs 1 device, 0 free"));
}

// A coordinator that dies while a job is being preempted: the next one
// queues the job again (its ranks' checkpoint, or the one before, is where
// it resumes), counting the preemption, not a restart.
TEST_F(JobSharingTest, ACoordinatorKilledMidPreemptionRequeuesTheJob) {
  const std::string low = manager_->Submit(Spec(4), kAlice)->id();
  TickAndRegister();
  ASSERT_TRUE(manager_->Submit(WithPriority(Spec(2), 10), kBob).ok());
  manager_->Tick();
  ASSERT_EQ(Get(low).state(), v1::PREEMPTED);
  Crash(std::move(manager_));
  manager_ = NewManager();
  const v1::Job after = Get(low);
  EXPECT_EQ(after.state(), v1::QUEUED);
  EXPECT_EQ(after.preemptions(), 1);
  EXPECT_EQ(after.restarts(), 0);
  EXPECT_EQ(after.owner(), "alice");
}

// An elastic job on every device is shrunk, not stopped, for an urgent
// job: it checkpoints, continues at the largest world that leaves room
// (RESTARTING, no restart used), and grows back once the devices are free.
TEST_F(JobSharingTest, AnElasticJobShrinksInsteadOfStoppingAndGrowsBack) {
  v1::JobSpec spec = ElasticSpec(4, 1);  // 12 sequences: 1, 2, 3 or 4 ranks
  const std::string elastic = manager_->Submit(spec, kAlice)->id();
  const std::vector<int> first = TickAndRegister();
  ASSERT_EQ(first.size(), 4u);
  v1::StepMetrics step;
  step.set_step(5);
  step.set_total_steps(100);
  step.set_step_seconds(1);
  step.set_tokens_per_second(4000);
  ASSERT_TRUE(manager_->ReportProgress(Identity(first[0]), {step}).ok());

  v1::JobSpec urgent_spec = Spec(1);
  urgent_spec.set_priority_class("urgent");
  const std::string urgent = manager_->Submit(urgent_spec, kBob)->id();
  manager_->Tick();
  EXPECT_EQ(Get(elastic).state(), v1::PREEMPTED);
  EXPECT_THAT(Get(elastic).state_reason(),
              HasSubstr("shrinking from 4 to 3 ranks for " + urgent));
  for (int pid : first) launcher_.Exit(pid, ExitStatus{kExitPreempted, 0});
  const std::vector<int> second = TickAndRegister();
  // 3 ranks for it, 1 for the urgent job, in one round.
  ASSERT_EQ(second.size(), 4u);
  v1::Job shrunk = Get(elastic);
  EXPECT_EQ(shrunk.state(), v1::RUNNING);
  EXPECT_EQ(shrunk.world_size(), 3);
  EXPECT_EQ(shrunk.remeshes(), 1);
  EXPECT_EQ(shrunk.restarts(), 0);
  EXPECT_EQ(shrunk.preemptions(), 0);
  EXPECT_THAT(shrunk.resize_reason(),
              HasSubstr("shrunk from 4 to 3 ranks for " + urgent));
  EXPECT_EQ(Get(urgent).state(), v1::RUNNING);
  std::vector<int> elastic_pids, urgent_pids;
  for (int pid : second) {
    (launcher_.Env(pid, "SHARDTRAIN_JOB_ID") == elastic ? elastic_pids
                                                        : urgent_pids)
        .push_back(pid);
  }
  ASSERT_EQ(elastic_pids.size(), 3u);
  EXPECT_THAT(launcher_.process(elastic_pids[0]).spec.argv,
              Contains("--resume"));

  // The urgent job ends: the elastic one grows back to 4.
  for (int pid : urgent_pids) launcher_.Exit(pid, ExitStatus{0, 0});
  manager_->Tick();
  EXPECT_EQ(Get(urgent).state(), v1::SUCCEEDED);
  manager_->Tick();
  for (int pid : elastic_pids) {
    EXPECT_THAT(launcher_.process(pid).signals, Contains(SIGUSR1));
    launcher_.Exit(pid, ExitStatus{kExitPreempted, 0});
  }
  const std::vector<int> third = TickAndRegister();
  ASSERT_EQ(third.size(), 4u);
  v1::Job grown = Get(elastic);
  EXPECT_EQ(grown.world_size(), 4);
  EXPECT_EQ(grown.remeshes(), 2);
  EXPECT_EQ(grown.restarts(), 0);
  EXPECT_THAT(grown.resize_reason(), HasSubstr("grown from 3 to 4 ranks"));
  // Nothing else holds a device; nothing is left reserved.
  const ClusterView view = manager_->Cluster();
  for (const ClusterView::Holder& holder : view.holders) {
    EXPECT_EQ(holder.job_id, elastic);
  }
}

// An elastic job with pipeline stages: shrunk for an urgent job, it
// continues on the mesh the planner chooses for its 8 sequences per step
// at 2 ranks (this host's rates cached: with links that cost nothing, tp2,
// with no pipeline bubble and half of AdamW's work per rank, is the
// fastest), then grows back to its own mesh at
// its own size. Each attempt's spec.json holds the mesh its ranks train,
// Job.mesh names it and the events say what was chosen and predicted.
TEST_F(JobSharingTest, AnElasticPipelineJobContinuesOnThePlannersMesh) {
  CacheRates(1e-9, 1e15);

  v1::JobSpec spec = ElasticSpec(4, 1);  // pp2 x ddp2, batch 4 per replica
  spec.mutable_strategy()->set_pipeline_stages(2);
  spec.mutable_strategy()->set_micro_batches(2);
  spec.mutable_trainer()->set_batch_size(4);
  const std::string elastic = manager_->Submit(spec, kAlice)->id();
  const std::vector<int> first = TickAndRegister();
  ASSERT_EQ(first.size(), 4u);
  EXPECT_EQ(Get(elastic).mesh(), "pp2xddp2");
  v1::StepMetrics step;
  step.set_step(5);
  step.set_total_steps(100);
  step.set_step_seconds(1);
  step.set_tokens_per_second(4000);
  ASSERT_TRUE(manager_->ReportProgress(Identity(first[0]), {step}).ok());

  v1::JobSpec urgent_spec = Spec(2);
  urgent_spec.set_priority_class("urgent");
  const std::string urgent = manager_->Submit(urgent_spec, kBob)->id();
  manager_->Tick();
  EXPECT_THAT(Get(elastic).state_reason(),
              HasSubstr("shrinking from 4 to 2 ranks for " + urgent));
  for (int pid : first) launcher_.Exit(pid, ExitStatus{kExitPreempted, 0});
  const std::vector<int> second = TickAndRegister();
  ASSERT_EQ(second.size(), 4u);
  v1::JobSpec shrunk = AttemptSpec(elastic);
  EXPECT_EQ(shrunk.strategy().name(), "single");
  EXPECT_EQ(shrunk.strategy().pipeline_stages(), 1);
  EXPECT_EQ(shrunk.strategy().tensor_parallel(), 2);
  // The same 8 sequences per step, in one replica at no more than the 4
  // per micro-step it ran with.
  EXPECT_EQ(shrunk.trainer().batch_size(), 4);
  EXPECT_EQ(shrunk.trainer().grad_accum(), 2);
  v1::Job job = Get(elastic);
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(job.mesh(), "tp2");
  std::vector<std::string> said = EventMessages(elastic);
  EXPECT_THAT(said, Contains(HasSubstr("pp2xddp2 at 4 ranks (4000 tokens/s) "
                                       "-> 2 ranks")));
  EXPECT_THAT(said, Contains(AllOf(HasSubstr("trains tp2 at 2 of 4 ranks, "),
                                   HasSubstr("tokens/s predicted: the fastest "
                                             "of 3 meshes of 2 ranks"))));
  // Its first step on the new mesh, measured beside the prediction.
  std::vector<int> elastic_pids, urgent_pids;
  for (int pid : second) {
    (launcher_.Env(pid, "SHARDTRAIN_JOB_ID") == elastic ? elastic_pids
                                                        : urgent_pids)
        .push_back(pid);
  }
  ASSERT_EQ(elastic_pids.size(), 2u);
  step.set_step(6);
  step.set_tokens_per_second(2500);
  clock_.Advance(absl::Seconds(7));
  ASSERT_TRUE(manager_->ReportProgress(Identity(elastic_pids[0]), {step}).ok());
  said = EventMessages(elastic);
  EXPECT_THAT(said, Contains(AllOf(HasSubstr("re-meshed pp2xddp2 -> tp2: "
                                             "2500 tokens/s ("),
                                   HasSubstr(" predicted), was 4000; 7.0 s "
                                             "without a step"))));
  EXPECT_DOUBLE_EQ(Get(elastic).remesh_seconds_lost(), 7);

  // The urgent job ends: back to 4 ranks on its own mesh.
  for (int pid : urgent_pids) launcher_.Exit(pid, ExitStatus{0, 0});
  manager_->Tick();
  manager_->Tick();
  for (int pid : elastic_pids)
    launcher_.Exit(pid, ExitStatus{kExitPreempted, 0});
  ASSERT_EQ(TickAndRegister().size(), 4u);
  const v1::JobSpec grown = AttemptSpec(elastic);
  EXPECT_EQ(grown.strategy().name(), "ddp");
  EXPECT_EQ(grown.strategy().pipeline_stages(), 2);
  EXPECT_EQ(grown.trainer().batch_size(), 4);
  EXPECT_EQ(grown.trainer().grad_accum(), 1);
  EXPECT_EQ(Get(elastic).mesh(), "pp2xddp2");
  EXPECT_EQ(Get(elastic).remeshes(), 2);
  EXPECT_THAT(EventMessages(elastic),
              Contains(AllOf(HasSubstr("trains pp2xddp2 at 4 of 4 ranks, "),
                             HasSubstr(" tokens/s predicted: its own mesh at "
                                       "its own world size"))));
}

// Strategy auto may be elastic: auto picks its mesh at its own 4 ranks,
// and shrunk to 2 the planner picks again among every strategy, for the
// same 12 sequences per step; Job.mesh says auto chose both.
TEST_F(JobSharingTest, AnElasticAutoJobIsPickedForAgainAtEachSize) {
  CacheRates(50e-6, 1e9);
  v1::JobSpec spec = ElasticSpec(4, 1);  // 3 per rank: 12 per step
  spec.mutable_strategy()->set_name("auto");
  const std::string elastic = manager_->Submit(spec, kAlice)->id();
  const std::vector<int> first = TickAndRegister();
  ASSERT_EQ(first.size(), 4u);
  EXPECT_EQ(Get(elastic).mesh().rfind("auto: ", 0), 0u) << Get(elastic).mesh();
  const auto global = [](const v1::JobSpec& s) {
    TrainConfig c;
    c.pipeline_stages = std::max<int64_t>(1, s.strategy().pipeline_stages());
    c.tensor_parallel = std::max<int64_t>(1, s.strategy().tensor_parallel());
    return s.trainer().batch_size() *
           std::max<int64_t>(1, s.trainer().grad_accum()) *
           c.DataParallelSize(s.world_size());
  };
  EXPECT_NE(AttemptSpec(elastic).strategy().name(), "auto");

  v1::JobSpec urgent_spec = Spec(2);
  urgent_spec.set_priority_class("urgent");
  ASSERT_TRUE(manager_->Submit(urgent_spec, kBob).ok());
  manager_->Tick();
  for (int pid : first) launcher_.Exit(pid, ExitStatus{kExitPreempted, 0});
  ASSERT_EQ(TickAndRegister().size(), 4u);
  const v1::JobSpec shrunk = AttemptSpec(elastic);
  EXPECT_NE(shrunk.strategy().name(), "auto");
  EXPECT_EQ(shrunk.world_size(), 2);
  EXPECT_EQ(global(shrunk), 12);
  const v1::Job job = Get(elastic);
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(job.mesh().rfind("auto: ", 0), 0u) << job.mesh();
  EXPECT_EQ(job.mesh(),
            absl::StrCat("auto: ", JobMeshName(shrunk, shrunk.world_size())));
}

// A preempted job whose ranks did not all save the checkpoint asked for
// (rank 0 could not write it) is queued all the same, and says so: which
// rank, how it ended, and that it resumes from the checkpoint before.
TEST_F(JobSharingTest, APreemptionWhoseCheckpointFailedSaysSo) {
  const std::string low = manager_->Submit(Spec(4), kAlice)->id();
  const std::vector<int> pids = TickAndRegister();
  ASSERT_EQ(pids.size(), 4u);
  v1::JobSpec urgent = Spec(2);
  urgent.set_priority_class("urgent");
  ASSERT_TRUE(manager_->Submit(urgent, kBob).ok());
  manager_->Tick();
  ASSERT_EQ(Get(low).state(), v1::PREEMPTED);
  launcher_.Exit(pids[0], ExitStatus{1, 0});
  for (size_t i = 1; i < pids.size(); ++i) {
    launcher_.Exit(pids[i], ExitStatus{kExitPreempted, 0});
  }
  manager_->Tick();
  const v1::Job queued = Get(low);
  EXPECT_EQ(queued.state(), v1::QUEUED);
  EXPECT_EQ(queued.preemptions(), 1);
  EXPECT_EQ(queued.restarts(), 0);
  EXPECT_THAT(EventMessages(low),
              Contains(HasSubstr("resumes from its latest checkpoint (the one "
                                 "asked for was not saved: rank 0 ended "
                                 "with exit code 1; ")));
}

// Goodput: device-seconds held count from the launch to the release; a
// step's device-seconds are its seconds times its ranks, and a step run
// again replaces its earlier run.
TEST_F(JobSharingTest, GoodputCountsHeldAndKeptDeviceSeconds) {
  const std::string id = manager_->Submit(Spec(2), kAlice)->id();
  const std::vector<int> pids = TickAndRegister();
  ASSERT_EQ(pids.size(), 2u);
  clock_.Advance(absl::Seconds(10));
  v1::StepMetrics step;
  step.set_rank(0);
  step.set_step(1);
  step.set_total_steps(2);
  step.set_step_seconds(4);
  ASSERT_TRUE(manager_->ReportProgress(Identity(pids[0]), {step}).ok());
  v1::Job job = Get(id);
  EXPECT_DOUBLE_EQ(job.device_seconds_held(), 20);  // 2 devices x 10 s
  EXPECT_DOUBLE_EQ(job.device_seconds_kept(), 8);   // 4 s x 2 ranks
  // Step 1 again (after a restart, say): it replaces the first run.
  step.set_step_seconds(3);
  ASSERT_TRUE(manager_->ReportProgress(Identity(pids[0]), {step}).ok());
  EXPECT_DOUBLE_EQ(Get(id).device_seconds_kept(), 6);
  // Rank 1's reports do not count twice.
  step.set_rank(1);
  ASSERT_TRUE(manager_->ReportProgress(Identity(pids[1]), {step}).ok());
  EXPECT_DOUBLE_EQ(Get(id).device_seconds_kept(), 6);
  // Held until the devices are given back.
  clock_.Advance(absl::Seconds(5));
  for (int pid : pids) launcher_.Exit(pid, ExitStatus{0, 0});
  manager_->Tick();
  job = Get(id);
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_DOUBLE_EQ(job.device_seconds_held(), 30);
  clock_.Advance(absl::Seconds(50));
  manager_->Tick();
  EXPECT_DOUBLE_EQ(Get(id).device_seconds_held(), 30);
}

// A coordinator's shutdown asks the ranks for a checkpoint (SIGUSR1), as a
// preemption does: a job whose ranks all saved one is queued again and the
// next coordinator resumes it without using a restart.
TEST_F(JobSharingTest, AShutdownCheckpointsRunningJobsAndQueuesThemAgain) {
  launcher_.set_checkpoint_on_usr1(true);  // ranks that save and exit 85
  const std::string id = manager_->Submit(Spec(2), kAlice)->id();
  const std::vector<int> pids = TickAndRegister();
  ASSERT_EQ(pids.size(), 2u);
  manager_->Shutdown();
  for (int pid : pids) {
    EXPECT_THAT(launcher_.process(pid).signals, Contains(SIGUSR1));
    EXPECT_THAT(launcher_.process(pid).signals, Not(Contains(SIGTERM)));
  }
  EXPECT_EQ(Get(id).state(), v1::QUEUED);
  EXPECT_EQ(Get(id).preemptions(), 1);
  manager_.reset();
  manager_ = NewManager();
  const std::vector<int> resumed = TickAndRegister();
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(Get(id).state(), v1::RUNNING);
  EXPECT_EQ(Get(id).restarts(), 0);
  EXPECT_THAT(launcher_.process(resumed[0]).spec.argv, Contains("--resume"));

  // Ranks that do not save one (killed after the grace): as before, the
  // job stays active and the next coordinator restarts it.
  launcher_.set_checkpoint_on_usr1(false);
  std::thread stop([&] { manager_->Shutdown(); });
  for (int i = 0; i < 200 && Get(id).state() == v1::RUNNING; ++i) {
    clock_.Advance(absl::Seconds(1));
    absl::SleepFor(absl::Milliseconds(20));
  }
  stop.join();
  EXPECT_EQ(Get(id).state(), v1::RUNNING);  // in the store: resumed or failed
  EXPECT_EQ(Get(id).preemptions(), 1);
}

TEST(PriorityClassFlagTest, ParsesClassesAndNamesMistakes) {
  absl::StatusOr<std::map<std::string, PriorityClass>> classes =
      ParsePriorityClasses(
          {"urgent=100", "prod=50,preemptible=false", "batch=10,open=true"});
  ASSERT_TRUE(classes.ok()) << classes.status();
  EXPECT_EQ(classes->at("urgent").priority, 100);
  EXPECT_TRUE(classes->at("urgent").preemptible);
  EXPECT_FALSE(classes->at("prod").preemptible);
  // Admins' unless opened.
  EXPECT_FALSE(classes->at("urgent").open);
  EXPECT_FALSE(classes->at("prod").open);
  EXPECT_TRUE(classes->at("batch").open);
  EXPECT_THAT(ParsePriorityClasses({"x"}).status().message(),
              HasSubstr("--priority-class 'x': no NAME=PRIORITY"));
  EXPECT_THAT(ParsePriorityClasses({"x=high"}).status().message(),
              HasSubstr("priority 'high' is not a whole number"));
  EXPECT_THAT(ParsePriorityClasses({"x=1,preemptable=no"}).status().message(),
              HasSubstr("unknown setting 'preemptable=no'"));
  EXPECT_THAT(ParsePriorityClasses({"x=1", "x=2"}).status().message(),
              HasSubstr("class x is defined twice"));
}

// The running job's pace says when it ends (Job.eta_seconds) and so when
// the waiting head starts; a 1-device job fits beside the head's need at
// that moment and is backfilled, a 2-device one is not.
TEST_F(JobSharingTest, TheRunningJobsPaceGivesTheHeadItsStartAndBackfills) {
  const std::string running = manager_->Submit(Spec(2), kAlice)->id();
  const std::vector<int> pids = TickAndRegister();
  ASSERT_EQ(pids.size(), 2u);
  v1::StepMetrics step;
  step.set_step(3);
  step.set_total_steps(53);
  step.set_step_seconds(2);
  step.set_rank(0);
  ASSERT_TRUE(manager_->ReportProgress(Identity(pids[0]), {step}).ok());
  EXPECT_DOUBLE_EQ(Get(running).eta_seconds(), 100);

  const std::string head = manager_->Submit(Spec(3), kBob)->id();
  const std::string two = manager_->Submit(Spec(2), kBob)->id();
  const std::string one = manager_->Submit(Spec(1), kBob)->id();
  const ClusterView view = manager_->Cluster();
  EXPECT_EQ(view.head, head);
  ASSERT_TRUE(view.head_predicted_start.has_value());
  EXPECT_EQ(*view.head_predicted_start, clock_.Now() + absl::Seconds(100));
  manager_->Tick();
  EXPECT_EQ(Get(head).state(), v1::QUEUED);
  EXPECT_THAT(
      Get(head).state_reason(),
      HasSubstr("needs 3 devices, 2 free; predicted to start in 1m40s"));
  EXPECT_EQ(Get(two).state(), v1::QUEUED);
  EXPECT_EQ(Get(one).state(), v1::STARTING);
  EXPECT_THAT(Get(one).state_reason(),
              HasSubstr("backfilled ahead of " + head));
}

// Before a running job reports its first step, the step-time model over
// this host's cached rates predicts its end: the head's start is known and
// a job that fits the gap is backfilled at once.
TEST_F(JobSharingTest, BeforeItsFirstStepTheStepTimeModelPredictsItsEnd) {
  const HostRates rates = CacheRates(50e-6, 1e9);
  v1::JobSpec spec = Spec(2);
  spec.mutable_trainer()->set_max_steps(50);
  const std::string running = manager_->Submit(spec, kAlice)->id();
  const absl::Time launched = clock_.Now();
  ASSERT_EQ(TickAndRegister().size(), 2u);
  absl::StatusOr<TrainConfig> config =
      TrainConfigFromJobSpec(Get(running).spec(), "/");
  ASSERT_TRUE(config.ok());
  absl::StatusOr<StepTimePlan> step = PlanStepTime(*config, 2, 2, rates);
  ASSERT_TRUE(step.ok()) << step.status();

  const std::string head = manager_->Submit(Spec(3), kBob)->id();
  const std::string one = manager_->Submit(Spec(1), kBob)->id();
  const ClusterView view = manager_->Cluster();
  EXPECT_EQ(view.head, head);
  ASSERT_TRUE(view.head_predicted_start.has_value());
  EXPECT_LE(
      absl::AbsDuration(*view.head_predicted_start -
                        (launched + absl::Seconds(50 * step->step_seconds))),
      absl::Milliseconds(1));
  manager_->Tick();
  EXPECT_EQ(Get(head).state(), v1::QUEUED);
  EXPECT_EQ(Get(one).state(), v1::STARTING);
  EXPECT_THAT(Get(one).state_reason(),
              HasSubstr("backfilled ahead of " + head));
}

}  // namespace
}  // namespace shardtrain
