// The Slurm launcher: parsers on output recorded from Debian's slurm-wlm
// 22.05, the batch script, and the JobManager driving a fake Slurm (the real
// one: tests/integration/slurm_testbed_test.cc).
#include "server/slurm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/exit_codes.h"
#include "server/job_manager.h"
#include "server/slurm_job_launcher.h"
#include "tests/fakes/fake_slurm_client.h"
#include "tests/server/job_manager_fixture.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// Recorded from the test bed (scripts/slurm-testbed).
constexpr char kFailedJob[] =
    "JobId=2 JobName=t2.sh UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901758 Nice=0 Account=(null) QOS=(null) JobState=FAILED "
    "Reason=NonZeroExitCode Dependency=(null) Requeue=0 Restarts=0 BatchFlag=1 "
    "Reboot=0 ExitCode=143:0 RunTime=00:00:02 TimeLimit=UNLIMITED "
    "NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 "
    "Command=/tmp/stb/t2.sh WorkDir=/tmp/stb StdErr=/tmp/stb/batch2.log "
    "StdIn=/dev/null StdOut=/tmp/stb/batch2.log Power= \n";
constexpr char kNodeLines[] =
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 "
    "CPUTot=2 CPULoad=1.61 AvailableFeatures=(null) ActiveFeatures=(null) "
    "Gres=(null) NodeAddr=10.231.77.11 NodeHostName=node1 Version=22.05.8 "
    "RealMemory=1 AllocMem=0 FreeMem=22322 Sockets=2 Boards=1 State=IDLE "
    "ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=testbed  BootTime=2026-12-01T10:30:14\n"
    "NodeName=node2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=2 "
    "CPUTot=2 Gres=gpu:h200:8(S:0-1) NodeAddr=10.231.77.12 NodeHostName=node2 "
    "State=DOWN+NOT_RESPONDING Partitions=testbed,gpu "
    "Reason=Not responding [root@2026-12-01T10:35:44]\n";
constexpr char kPartitionLine[] =
    "PartitionName=testbed AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL "
    "AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE Nodes=node[1-3] "
    "PriorityJobFactor=1 State=UP TotalCPUs=6 TotalNodes=3 "
    "SelectTypeParameters=NONE\n";

TEST(SlurmParseTest, ScontrolJob) {
  absl::StatusOr<SlurmJobInfo> info = ParseScontrolJob(kFailedJob);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->job_id, "2");
  EXPECT_EQ(info->state, "FAILED");
  EXPECT_EQ(info->reason, "NonZeroExitCode");
  EXPECT_EQ(info->exit_code, 143);
  EXPECT_EQ(info->signal, 0);
  EXPECT_EQ(info->nodes, "node[1-2]");
  EXPECT_EQ(info->batch_host, "node1");
  EXPECT_TRUE(info->Ended());
  EXPECT_FALSE(info->Waiting());
  EXPECT_FALSE(ParseScontrolJob("slurm_load_jobs error").ok());
}

TEST(SlurmParseTest, SacctSkipsStepsAndReadsCancelledBy) {
  absl::StatusOr<SlurmJobInfo> info = ParseSacctJob(
      "7|CANCELLED by 0|0:15|node[1-2]\n7.batch|CANCELLED|0:15|node1\n");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->job_id, "7");
  EXPECT_EQ(info->state, "CANCELLED by 0");
  EXPECT_EQ(info->signal, 15);
  EXPECT_TRUE(info->Ended());
  EXPECT_EQ(ParseSacctJob("").status().code(), absl::StatusCode::kNotFound);
}

TEST(SlurmParseTest, NodesWithGpusStatesAndReasonsWithSpaces) {
  const std::vector<SlurmNode> nodes = ParseScontrolNodes(kNodeLines);
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].name, "node1");
  EXPECT_EQ(nodes[0].address, "10.231.77.11");
  EXPECT_EQ(nodes[0].state, "IDLE");
  EXPECT_EQ(nodes[0].cpus, 2);
  EXPECT_EQ(nodes[0].gpus, 0);
  EXPECT_THAT(nodes[0].partitions, ElementsAre("testbed"));
  EXPECT_EQ(nodes[1].state, "DOWN+NOT_RESPONDING");
  EXPECT_EQ(nodes[1].cpus_allocated, 1);
  EXPECT_EQ(nodes[1].gpus, 8);
  EXPECT_THAT(nodes[1].partitions, ElementsAre("testbed", "gpu"));
}

TEST(SlurmParseTest, Partitions) {
  const std::vector<SlurmPartition> partitions =
      ParseScontrolPartitions(kPartitionLine);
  ASSERT_EQ(partitions.size(), 1u);
  EXPECT_EQ(partitions[0].name, "testbed");
  EXPECT_EQ(partitions[0].state, "UP");
  EXPECT_EQ(partitions[0].nodes, "node[1-3]");
  EXPECT_EQ(partitions[0].total_nodes, 3);
  EXPECT_EQ(partitions[0].total_cpus, 6);
  EXPECT_TRUE(partitions[0].is_default);
}

TEST(SlurmParseTest, SbatchJobId) {
  EXPECT_EQ(*ParseSbatchJobId("4\n"), "4");
  EXPECT_EQ(*ParseSbatchJobId("123;cluster-a\n"), "123");
  absl::StatusOr<std::string> bad = ParseSbatchJobId("Submitted batch job\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("no job id"));
}

TEST(SlurmParseTest, SlotsCountTheDefaultOrNamedPartitionsNodes) {
  const std::vector<SlurmNode> nodes = ParseScontrolNodes(kNodeLines);
  const std::vector<SlurmPartition> partitions =
      ParseScontrolPartitions(kPartitionLine);
  SlurmOptions options;
  options.tasks_per_node = 2;
  EXPECT_EQ(*SlurmSlotCount(nodes, partitions, options), 4);
  options.partition = "gpu";
  options.gpus_per_node = 8;
  EXPECT_EQ(*SlurmSlotCount(nodes, partitions, options), 8);
  options.partition = "nope";
  absl::StatusOr<int> none = SlurmSlotCount(nodes, partitions, options);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("'nope'"));
}

SlurmJobInfo Ended(const std::string& state, int exit_code = 0,
                   int signal = 0) {
  SlurmJobInfo info;
  info.job_id = "9";
  info.state = state;
  info.exit_code = exit_code;
  info.signal = signal;
  info.nodes = "node[1-2]";
  return info;
}

TEST(SlurmClassifyTest, NamesTheFirstFailedTaskNotTheOnesSrunTerminated) {
  // srun's lines as recorded when task 1 was killed with SIGKILL.
  const std::vector<std::string> log = {
      "srun: error: node2: task 1: Killed",
      "srun: launch/slurm: _step_signal: Terminating StepId=2.0",
      "srun: error: node1: task 0: Terminated",
  };
  SlurmOutcome outcome = ClassifySlurmEnd(Ended("FAILED", 143), log);
  EXPECT_FALSE(outcome.success);
  EXPECT_EQ(outcome.reason, v1::SIGNAL);
  EXPECT_EQ(outcome.rank, 1);
  EXPECT_THAT(outcome.message, HasSubstr("rank 1 ended: signal KILL"));

  outcome =
      ClassifySlurmEnd(Ended("FAILED", 3),
                       {"srun: error: node1: task 0: Terminated",
                        "srun: error: node2: task 1: Exited with exit code 3"});
  EXPECT_EQ(outcome.reason, v1::EXIT_CODE);
  EXPECT_EQ(outcome.rank, 1);
  EXPECT_EQ(outcome.exit_code, 3);
}

// Slurm's own preemption (SIGTERM, which the ranks take as a checkpoint
// request under Slurm) and ours (SIGUSR1) end the job without a failure:
// the ranks exit kExitPreempted and the job is queued again.
TEST(SlurmClassifyTest, APreemptionIsNoFailure) {
  SlurmOutcome outcome = ClassifySlurmEnd(Ended("PREEMPTED", 0, 15), {});
  EXPECT_TRUE(outcome.preempted);
  EXPECT_FALSE(outcome.success);
  EXPECT_EQ(outcome.exit_code, kExitPreempted);
  EXPECT_THAT(outcome.message, HasSubstr("was preempted by Slurm"));
  outcome = ClassifySlurmEnd(
      Ended("FAILED", kExitPreempted),
      {absl::StrCat("srun: error: node1: task 0: Exited with exit code ",
                    kExitPreempted)});
  EXPECT_TRUE(outcome.preempted);
  EXPECT_FALSE(
      ClassifySlurmEnd(Ended("FAILED", 3),
                       {"srun: error: node1: task 0: Exited with exit code 3"})
          .preempted);
}

TEST(SlurmClassifyTest, NodeFailureOomCancelAndSuccess) {
  SlurmJobInfo lost = Ended("NODE_FAIL", 0, 15);
  lost.reason = "NodeDown";
  SlurmOutcome outcome = ClassifySlurmEnd(lost, {});
  EXPECT_EQ(outcome.reason, v1::NODE_FAILURE);
  EXPECT_EQ(outcome.rank, -1);
  EXPECT_THAT(outcome.message, HasSubstr("lost a node (nodes node[1-2])"));
  EXPECT_THAT(outcome.message, HasSubstr("NodeDown"));

  EXPECT_EQ(ClassifySlurmEnd(Ended("OUT_OF_MEMORY"), {}).reason, v1::OOM);
  EXPECT_EQ(
      ClassifySlurmEnd(Ended("FAILED", 1),
                       {"slurmstepd: error: Detected 1 oom-kill event(s)"})
          .reason,
      v1::OOM);
  EXPECT_THAT(ClassifySlurmEnd(Ended("CANCELLED by 0"), {}).message,
              HasSubstr("cancelled outside shardtraind"));
  EXPECT_THAT(ClassifySlurmEnd(Ended("TIMEOUT"), {}).message,
              HasSubstr("time limit"));
  EXPECT_TRUE(ClassifySlurmEnd(Ended("COMPLETED"), {}).success);
}

RankLaunch Launch(int world) {
  RankLaunch launch;
  launch.worker_binary = "/opt/shard train/shardtrain-worker";
  launch.job_id = "job-7";
  launch.job_dir = "/state/jobs/job-7";
  launch.spec_path = "/state/jobs/job-7/spec.json";
  launch.world_size = world;
  launch.coordinator_address = "10.0.0.1:50552";
  launch.secret = "s3cret";
  launch.heartbeat_seconds = 2;
  for (int r = 0; r < world; ++r) {
    launch.log_paths.push_back(
        absl::StrCat("/state/jobs/job-7/rank-", r, ".log"));
  }
  return launch;
}

TEST(SlurmPlanTest, CpuRanksSpreadOverNodesWithPerRankLogs) {
  SlurmOptions options;
  options.tasks_per_node = 2;
  options.cpus_per_task = 3;
  options.partition = "cpu";
  options.extra_sbatch_args = {"--account=ml"};
  RankLaunch launch = Launch(3);
  launch.resume = true;
  const SlurmLaunchPlan plan = PlanSlurmLaunch(launch, options, "/b.log");
  EXPECT_THAT(
      plan.sbatch_args,
      testing::IsSupersetOf(std::vector<std::string>{
          "--parsable", "--no-requeue", "--nodes=2", "--ntasks=3",
          "--ntasks-per-node=2", "--cpus-per-task=3", "--output=/b.log",
          "--partition=cpu", "--account=ml", "--job-name=shardtrain-job-7"}));
  EXPECT_THAT(plan.sbatch_args, Not(testing::Contains(HasSubstr("--gpus"))));
  EXPECT_THAT(plan.script,
              HasSubstr("--output='/state/jobs/job-7/rank-%t.log'"));
  EXPECT_THAT(plan.script, HasSubstr("exec srun --kill-on-bad-exit=1"));
  // Arguments are quoted for the shell (the path has a space).
  EXPECT_THAT(plan.script, HasSubstr("'/opt/shard train/shardtrain-worker' "
                                     "'--spec' '/state/jobs/job-7/spec.json'"));
  EXPECT_THAT(plan.script, HasSubstr("'--threads' '3'"));
  EXPECT_THAT(plan.script, HasSubstr("'--resume'"));
  EXPECT_THAT(plan.script, HasSubstr("NodeAddr"));
  std::map<std::string, std::string> env(plan.env.begin(), plan.env.end());
  EXPECT_EQ(env["SHARDTRAIN_COORDINATOR"], "10.0.0.1:50552");
  EXPECT_EQ(env["SHARDTRAIN_JOB_SECRET"], "s3cret");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "3");
  EXPECT_EQ(env["SHARDTRAIN_CHECKPOINT_ON_SIGTERM"], "1");
  // Ranks take their place from Slurm's variables, never from these.
  for (const char* name :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    EXPECT_EQ(env.count(name), 0u) << name;
  }
}

TEST(SlurmPlanTest, GpuRanksOnePerGpu) {
  SlurmOptions options;
  options.gpus_per_node = 4;
  const SlurmLaunchPlan plan = PlanSlurmLaunch(Launch(8), options, "/b.log");
  EXPECT_THAT(plan.sbatch_args,
              testing::IsSupersetOf(std::vector<std::string>{
                  "--nodes=2", "--ntasks=8", "--ntasks-per-node=4",
                  "--gpus-per-node=4"}));
  EXPECT_THAT(plan.script, Not(HasSubstr("--threads")));
}

TEST(SlurmPlanTest, ShellQuote) {
  EXPECT_EQ(ShellQuote("a b"), "'a b'");
  EXPECT_EQ(ShellQuote("it's"), "'it'\\''s'");
}

TEST(SlurmCapacityTest, NodeStatesAreReadWordByWord) {
  for (const char* state : {"IDLE", "MIXED", "ALLOCATED",
                            "IDLE+CLOUD+POWERED_DOWN", "COMPLETING"}) {
    EXPECT_TRUE(SlurmNodeUsable(state)) << state;
  }
  for (const char* state :
       {"DOWN*", "IDLE*", "MIXED+DRAIN", "DRAINED", "DOWN+NOT_RESPONDING",
        "IDLE+MAINT", "FUTURE", "IDLE+REBOOT_REQUESTED", "UNKNOWN", ""}) {
    EXPECT_FALSE(SlurmNodeUsable(state)) << state;
  }
  std::vector<SlurmNode> nodes(3);
  for (int n = 0; n < 3; ++n) {
    nodes[n].name = "node" + std::to_string(n + 1);
    nodes[n].state = n == 1 ? "MIXED+DRAIN" : "IDLE";
    nodes[n].partitions = {"gpu"};
  }
  SlurmPartition partition;
  partition.name = "gpu";
  partition.state = "UP";
  partition.is_default = true;
  SlurmOptions options;
  options.gpus_per_node = 4;
  absl::StatusOr<SlurmCapacity> up =
      SlurmPartitionCapacity(nodes, {partition}, options);
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(up->slots, 12);
  EXPECT_EQ(up->usable_slots, 8);
  EXPECT_THAT(up->unusable_nodes, ElementsAre("node2 (MIXED+DRAIN)"));
  partition.state = "DOWN";
  EXPECT_EQ(SlurmPartitionCapacity(nodes, {partition}, options)->usable_slots,
            0);
}

// --- The JobManager with --launcher slurm, against a fake Slurm. ---

class SlurmJobManagerTest : public test::JobManagerFixture {
 protected:
  void Configure(JobManagerOptions& options) override {
    options.worker_address = "10.231.77.1:50552";
  }
  AttemptLauncher* launcher() override { return &slurm_launcher_; }
  // The manager uses slurm_, which goes before the fixture's members.
  void TearDown() override { manager_.reset(); }

  // Rank r of the Slurm job's attempt, as it registers from its node.
  v1::WorkerIdentity Identity(const std::string& slurm_job, int rank) {
    const FakeSlurmClient::Job job = slurm_.job(slurm_job);
    std::map<std::string, std::string> env(job.plan.env.begin(),
                                           job.plan.env.end());
    v1::WorkerIdentity w;
    w.set_job_id(env["SHARDTRAIN_JOB_ID"]);
    w.set_secret(env["SHARDTRAIN_JOB_SECRET"]);
    w.set_rank(rank);
    w.set_pid(40000 + rank);  // a pid on another node
    return w;
  }

  // One supervision round a poll interval later.
  void Step() {
    clock_.Advance(absl::Seconds(1));
    manager_->Tick();
  }

  // Submits, lets Slurm start it and every rank register.
  std::string StartRunning(const v1::JobSpec& spec, std::string* slurm_job) {
    absl::StatusOr<v1::Job> job = manager_->Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    manager_->Tick();
    EXPECT_FALSE(slurm_.submitted().empty());
    *slurm_job = slurm_.submitted().back();
    slurm_.SetState(*slurm_job, "RUNNING");
    Step();
    for (int r = 0; r < spec.world_size(); ++r) {
      EXPECT_TRUE(manager_->RegisterWorker(Identity(*slurm_job, r)).ok());
    }
    EXPECT_EQ(manager_->Get(job->id())->state(), v1::RUNNING);
    return job->id();
  }

  FakeSlurmClient slurm_;  // the fixture's launcher_ must stay unused
  SlurmJobLauncher slurm_launcher_{&slurm_, SlurmOptions{}, absl::Seconds(1)};
};

TEST_F(SlurmJobManagerTest, AJobIsOneSbatchAllocationThatSucceedsWithSlurm) {
  std::string slurm_job;
  const std::string id = StartRunning(Spec(2), &slurm_job);
  EXPECT_TRUE(launcher_.spawned().empty());  // nothing forked here
  const FakeSlurmClient::Job submitted = slurm_.job(slurm_job);
  EXPECT_THAT(submitted.plan.sbatch_args,
              testing::IsSupersetOf(std::vector<std::string>{"--ntasks=2"}));
  EXPECT_EQ(submitted.script_path,
            dir_ / ("jobs/" + id + "/slurm-attempt-1.sh"));
  EXPECT_TRUE(std::filesystem::exists(submitted.script_path));
  EXPECT_EQ(test::ReadFile(dir_ / ("jobs/" + id + "/slurm_job_id")),
            slurm_job + "\n");
  // A rank presenting another pid later is refused: the first one counts.
  v1::WorkerIdentity other = Identity(slurm_job, 0);
  other.set_pid(1);
  EXPECT_FALSE(manager_->Heartbeat(other).ok());
  EXPECT_TRUE(manager_->Heartbeat(Identity(slurm_job, 0)).ok());

  slurm_.SetState(slurm_job, "COMPLETED");
  Step();
  Step();
  EXPECT_EQ(manager_->Get(id)->state(), v1::SUCCEEDED);
}

TEST_F(SlurmJobManagerTest, TheRendezvousClockStartsWhenSlurmStartsTheJob) {
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(2));
  ASSERT_TRUE(job.ok());
  manager_->Tick();
  const std::string slurm_job = slurm_.submitted().back();
  // Two minutes in Slurm's queue (rendezvous timeout: 60 s) is no failure.
  for (int i = 0; i < 120; ++i) Step();
  v1::Job waiting = *manager_->Get(job->id());
  EXPECT_EQ(waiting.state(), v1::STARTING);
  EXPECT_THAT(waiting.state_reason(), HasSubstr("PENDING: Resources"));
  slurm_.SetState(slurm_job, "RUNNING");
  for (int i = 0; i < 65; ++i) Step();
  v1::Job failed = *manager_->Get(job->id());
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::RENDEZVOUS_TIMEOUT);
  // Stopping it went through Slurm.
  EXPECT_THAT(slurm_.job(slurm_job).signals, testing::Contains(SIGTERM));
}

TEST_F(SlurmJobManagerTest, ALostNodeRestartsTheJobFromItsCheckpoint) {
  std::string slurm_job;
  const std::string id = StartRunning(Spec(2, /*max_restarts=*/1), &slurm_job);
  slurm_.SetState(slurm_job, "NODE_FAIL", "NodeDown", 0, 15);
  Step();  // the poll sees the loss; the job restarts at once
  v1::Job restarting = *manager_->Get(id);
  EXPECT_EQ(restarting.state(), v1::RESTARTING);
  EXPECT_THAT(restarting.state_reason(), HasSubstr("lost a node"));
  Step();
  ASSERT_EQ(slurm_.submitted().size(), 2u);
  const std::string second = slurm_.submitted().back();
  EXPECT_THAT(slurm_.job(second).script_path, HasSubstr("slurm-attempt-2.sh"));
  EXPECT_THAT(test::ReadFile(slurm_.job(second).script_path),
              HasSubstr("'--resume'"));
  slurm_.SetState(second, "RUNNING");
  Step();
  // The first attempt's secret no longer works.
  EXPECT_FALSE(manager_->RegisterWorker(Identity(slurm_job, 0)).ok());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(manager_->RegisterWorker(Identity(second, r)).ok());
  }
  EXPECT_EQ(manager_->Get(id)->state(), v1::RUNNING);

  // No restarts left: the second loss fails the job, naming it.
  slurm_.SetState(second, "NODE_FAIL", "NodeDown");
  Step();
  Step();
  v1::Job failed = *manager_->Get(id);
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::NODE_FAILURE);
  EXPECT_THAT(failed.failure().message(), HasSubstr("Slurm job " + second));
}

TEST_F(SlurmJobManagerTest, AKilledRankIsNamedWithItsLog) {
  std::string slurm_job;
  const std::string id = StartRunning(Spec(2), &slurm_job);
  test::WriteFile(dir_ / ("jobs/" + id + "/slurm-attempt-1.log"),
                  "srun: error: node2: task 1: Killed\n"
                  "srun: error: node1: task 0: Terminated\n");
  {
    std::ofstream log(dir_ / ("jobs/" + id + "/rank-1.log"), std::ios::app);
    log << "step 3 loss 9.1\n";
  }
  slurm_.SetState(slurm_job, "FAILED", "NonZeroExitCode", 137);
  Step();
  Step();
  v1::Job failed = *manager_->Get(id);
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::SIGNAL);
  EXPECT_EQ(failed.failure().rank(), 1);
  EXPECT_THAT(failed.failure().log_tail(),
              testing::Contains("step 3 loss 9.1"));
}

TEST_F(SlurmJobManagerTest, CancelSignalsThroughSlurmAndEndsCancelled) {
  std::string slurm_job;
  const std::string id = StartRunning(Spec(2), &slurm_job);
  slurm_.set_exit_on_sigterm(false);  // ranks ignore TERM: scancel ends it
  ASSERT_TRUE(manager_->Cancel(id).ok());
  Step();
  EXPECT_THAT(slurm_.job(slurm_job).signals, ElementsAre(SIGTERM));
  for (int i = 0; i < 12; ++i) Step();
  EXPECT_THAT(slurm_.job(slurm_job).signals, ElementsAre(SIGTERM, SIGKILL));
  EXPECT_EQ(manager_->Get(id)->state(), v1::CANCELLED);
}

TEST_F(SlurmJobManagerTest, ARefusedSubmissionFailsTheJobWithSbatchsWords) {
  slurm_.set_refuse("sbatch: error: invalid partition specified: gpu");
  absl::StatusOr<v1::Job> job = manager_->Submit(Spec(2));
  ASSERT_TRUE(job.ok());
  manager_->Tick();
  v1::Job failed = *manager_->Get(job->id());
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_THAT(failed.failure().message(), HasSubstr("invalid partition"));
  // Its slots are free again.
  EXPECT_TRUE(manager_->Submit(Spec(4)).ok());
}

TEST_F(SlurmJobManagerTest, AJobSlurmForgotFailsNamingIt) {
  std::string slurm_job;
  const std::string id = StartRunning(Spec(2), &slurm_job);
  slurm_.Forget(slurm_job);
  Step();
  Step();
  v1::Job failed = *manager_->Get(id);
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_THAT(failed.failure().message(),
              HasSubstr("no record of job " + slurm_job));
}

TEST_F(SlurmJobManagerTest, ANewCoordinatorCancelsTheSlurmJobItFindsRunning) {
  std::string slurm_job;
  const std::string id = StartRunning(Spec(2, /*max_restarts=*/1), &slurm_job);
  // The coordinator dies; the next one starts on the same state.
  Crash(std::move(manager_));
  manager_ = NewManager();
  EXPECT_THAT(slurm_.job(slurm_job).signals, ElementsAre(SIGKILL));
  EXPECT_EQ(manager_->Get(id)->state(), v1::RESTARTING);
  manager_->Tick();
  EXPECT_EQ(slurm_.submitted().size(), 2u);
}

// An elastic job whose node is lost for good (Slurm marks it DOWN) is
// resubmitted on the nodes that are left.
TEST_F(SlurmJobManagerTest, AnElasticJobContinuesOnTheNodesThatAreLeft) {
  for (int n = 1; n <= 3; ++n) {
    SlurmNode node;
    node.name = "node" + std::to_string(n);
    node.state = "ALLOCATED";
    node.partitions = {"debug"};
    slurm_.nodes_.push_back(node);
  }
  SlurmPartition partition;
  partition.name = "debug";
  partition.is_default = true;
  slurm_.partitions_ = {partition};
  v1::JobSpec spec = ElasticSpec(3, 2);
  spec.mutable_trainer()->set_batch_size(2);  // 6 sequences per step
  std::string slurm_job;
  const std::string id = StartRunning(spec, &slurm_job);

  slurm_.nodes_[2].state = "DOWN*";
  slurm_.SetState(slurm_job, "NODE_FAIL", "NodeDown");
  Step();

  const v1::Job restarting = *manager_->Get(id);
  ASSERT_EQ(restarting.state(), v1::RESTARTING) << restarting.state_reason();
  EXPECT_EQ(restarting.world_size(), 2);
  EXPECT_EQ(restarting.resize_reason(),
            "continued at 2 of 3 ranks after losing node3 (DOWN*)");
  ASSERT_EQ(slurm_.submitted().size(), 2u);
  EXPECT_THAT(slurm_.job(slurm_.submitted().back()).plan.sbatch_args,
              testing::Contains("--ntasks=2"));
}

}  // namespace
}  // namespace shardtrain
