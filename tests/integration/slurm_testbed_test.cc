// shardtraind --launcher slurm against a real Slurm: Debian's slurmctld and
// three slurmd, each in its own network namespace on this machine
// (scripts/slurm-testbed), real shardtrain-worker ranks training gpt2-tiny on
// two nodes over Gloo. Needs root (namespaces); without it, or without
// Slurm installed, every test skips saying why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "tests/integration/daemon_harness.h"

namespace shardtrain {
namespace {

using test::Daemon;
using test::DaemonOptions;
using test::TempDir;
using ::testing::HasSubstr;

constexpr char kBridgeAddress[] = "10.231.77.1";

std::string Testbed() {
  return std::string(SHARDTRAIN_SOURCE_DIR) + "/scripts/slurm-testbed";
}

v1::JobSpec TinySpec(const std::string& strategy, int steps,
                     int max_restarts = 0) {
  v1::JobSpec spec;
  spec.set_name(absl::StrCat("slurm-", strategy));
  spec.set_model("gpt2-tiny");
  spec.set_data("brown");
  spec.mutable_strategy()->set_name(strategy);
  spec.set_world_size(2);
  spec.set_max_restarts(max_restarts);
  v1::TrainerOptions* t = spec.mutable_trainer();
  t->set_batch_size(2);
  t->set_seq_len(64);
  t->set_max_steps(steps);
  t->set_lr(1e-3);
  t->set_checkpoint_every(2);
  return spec;
}

// Rank 0's loss at each step, as stored by the coordinator.
std::map<int64_t, double> Losses(Daemon& daemon, const std::string& id) {
  std::map<int64_t, double> losses;
  for (const v1::StepMetrics& s : daemon.Metrics(id)) {
    if (s.rank() == 0) losses[s.step()] = s.loss();
  }
  return losses;
}

class SlurmTestbedTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<CommandResult> check =
        RunCommand({Testbed(), "check"}, {}, 60);
    if (!check.ok() || !check->ok()) {
      skip_reason_ =
          new std::string(check.ok() ? check->out + check->err
                                     : std::string(check.status().message()));
      return;
    }
    bed_ = new TempDir();
    absl::StatusOr<CommandResult> up =
        RunCommand({Testbed(), "up", *bed_ / "bed", "3"}, {}, 180);
    if (!up.ok() || !up->ok()) {
      up_error_ = new std::string(up.ok() ? up->out + up->err
                                          : std::string(up.status().message()));
    }
  }
  static void TearDownTestSuite() {
    if (bed_ != nullptr) {
      (void)RunCommand({Testbed(), "down", *bed_ / "bed"}, {}, 60);
      delete bed_;
      bed_ = nullptr;
    }
  }

  void SetUp() override {
    if (skip_reason_ != nullptr) {
      GTEST_SKIP() << "no Slurm test bed on this machine: " << *skip_reason_;
    }
    ASSERT_EQ(up_error_, nullptr)
        << "the test bed did not start: " << *up_error_;
  }

  static std::string SlurmConf() { return *bed_ / "bed/slurm.conf"; }

  // A Slurm command's stdout (the test fails when it fails).
  static std::string Slurm(const std::vector<std::string>& argv) {
    absl::StatusOr<CommandResult> result =
        RunCommand(argv, {{"SLURM_CONF", SlurmConf()}}, 60);
    EXPECT_TRUE(result.ok() && result->ok())
        << argv[0] << ": "
        << (result.ok() ? result->err : std::string(result.status().message()));
    return result.ok() ? result->out : "";
  }

  // `ranks`: Slurm's tasks per node, or the local daemon's CPU slots.
  std::unique_ptr<Daemon> StartDaemon(const std::string& state, bool slurm,
                                      int ranks = 0) {
    DaemonOptions options;
    if (!slurm && ranks > 0) options.cpu_slots = ranks;
    // Longer than Slurm takes to end a job whose node is powered off
    // (SlurmdTimeout 5 s, then NODE_FAIL: 16-30 s on the test bed), so a lost
    // node is named as one and not found first as a rank's silence.
    options.heartbeat_timeout = 45;
    options.rendezvous_timeout = 120;
    options.grace_period = 5;
    if (slurm) {
      options.extra_flags = {"--launcher", "slurm", "--worker-listen",
                             absl::StrCat(kBridgeAddress, ":0"),
                             // A private bridge of this machine only.
                             "--insecure", "--slurm-tasks-per-node",
                             absl::StrCat(ranks > 0 ? ranks : 1)};
      options.env = {{"SLURM_CONF", SlurmConf()}};
    }
    auto daemon = std::make_unique<Daemon>(dir_ / state, std::move(options));
    std::string error;
    EXPECT_TRUE(daemon->Start(&error)) << error;
    return daemon;
  }

  // Rank 0's losses of `cluster`'s job `id` against the same `steps` of DDP
  // trained uninterrupted on this host (2 ranks x 3 sequences: the 6 per
  // step of the test bed's elastic jobs), each within 1e-5 relative; prints
  // the largest difference under `what`.
  void ExpectTheLossesOfAnUninterruptedRun(Daemon& cluster,
                                           const std::string& id, int steps,
                                           const std::string& what) {
    auto local = StartDaemon("local", /*slurm=*/false);
    v1::JobSpec whole = TinySpec("ddp", steps);
    whole.mutable_trainer()->set_batch_size(3);
    v1::Job reference;
    ASSERT_GRPC_OK(local->Submit(whole, &reference));
    const v1::Job done =
        local->WaitFor(reference.id(), test::IsTerminal, absl::Seconds(600));
    ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString();
    const std::map<int64_t, double> expected = Losses(*local, done.id());
    const std::map<int64_t, double> got = Losses(cluster, id);
    ASSERT_EQ(expected.size(), static_cast<size_t>(steps));
    ASSERT_EQ(got.size(), static_cast<size_t>(steps));
    double worst = 0;
    for (const auto& [step, loss] : expected) {
      const double diff = std::abs(got.at(step) - loss) / std::abs(loss);
      EXPECT_LE(diff, 1e-5) << "step " << step;
      worst = std::max(worst, diff);
    }
    std::cout << "slurm test bed: " << what
              << " vs uninterrupted: largest relative loss difference " << worst
              << " over " << steps << " steps\n";
  }

  // The Slurm job of the job's current attempt.
  std::string SlurmJobOf(const std::string& state, const std::string& id) {
    std::string slurm_job =
        test::ReadFile(dir_ / (state + "/jobs/" + id + "/slurm_job_id"));
    while (!slurm_job.empty() && slurm_job.back() == '\n') slurm_job.pop_back();
    return slurm_job;
  }

  static TempDir* bed_;
  static std::string* skip_reason_;
  static std::string* up_error_;
  TempDir dir_;
};

TempDir* SlurmTestbedTest::bed_ = nullptr;
std::string* SlurmTestbedTest::skip_reason_ = nullptr;
std::string* SlurmTestbedTest::up_error_ = nullptr;

TEST_F(SlurmTestbedTest, DdpAndFsdpOnTwoNodesTrainAsOnOneHost) {
  auto cluster = StartDaemon("slurm", /*slurm=*/true);
  v1::Job ddp, fsdp, pp2;
  ASSERT_GRPC_OK(cluster->Submit(TinySpec("ddp", 6), &ddp));
  ASSERT_GRPC_OK(cluster->Submit(TinySpec("fsdp", 6), &fsdp));
  // Two pipeline stages, one per node: activations and their gradients go
  // point-to-point between the nodes; one replica on the global batch (4).
  v1::JobSpec pipeline = TinySpec("single", 6);
  pipeline.set_name("slurm-pp2");
  pipeline.mutable_strategy()->set_pipeline_stages(2);
  pipeline.mutable_strategy()->set_micro_batches(2);
  pipeline.mutable_trainer()->set_batch_size(4);
  ASSERT_GRPC_OK(cluster->Submit(pipeline, &pp2));

  // `shardtrain cluster`'s data: Slurm's nodes and partition.
  {
    grpc::ClientContext context;
    v1::Cluster view;
    ASSERT_GRPC_OK(cluster->cluster().GetCluster(&context, {}, &view));
    EXPECT_EQ(view.launcher(), "slurm");
    EXPECT_EQ(view.backend_error(), "");
    ASSERT_EQ(view.nodes_size(), 3);
    EXPECT_EQ(view.nodes(1).address(), "10.231.77.12");
    EXPECT_EQ(view.node_group_kind(), "partition");
    ASSERT_EQ(view.node_groups_size(), 1);
    EXPECT_EQ(view.node_groups(0).name(), "testbed");
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    // The deprecated names carry the same view.
    ASSERT_EQ(view.slurm_nodes_size(), 3);
    EXPECT_EQ(view.slurm_nodes(1).address(), "10.231.77.12");
    ASSERT_EQ(view.slurm_partitions_size(), 1);
#pragma GCC diagnostic pop
    EXPECT_EQ(view.devices_size(), 3);  // 3 nodes x 1 task
    // And as `shardtrain cluster` prints it.
    absl::StatusOr<CommandResult> cli =
        RunCommand({test::BinDir() + "/shardtrain", "cluster", "--address",
                    cluster->address()},
                   {}, 60);
    ASSERT_TRUE(cli.ok() && cli->ok()) << (cli.ok() ? cli->err : "");
    EXPECT_THAT(cli->out, HasSubstr("launcher: slurm"));
    EXPECT_THAT(cli->out, HasSubstr("testbed*"));
    EXPECT_THAT(cli->out, HasSubstr("10.231.77.13"));
  }

  std::map<int64_t, double> slurm_losses[3];
  int i = 0;
  for (const v1::Job& submitted : {ddp, fsdp, pp2}) {
    const v1::Job job =
        cluster->WaitFor(submitted.id(), test::IsTerminal, absl::Seconds(600));
    ASSERT_EQ(job.state(), v1::SUCCEEDED)
        << job.DebugString() << cluster->log()
        << test::ReadFile(dir_ / ("slurm/jobs/" + job.id() + "/rank-0.log"));
    // Two nodes, one task each, and the ranks ran in their namespaces.
    const std::string record =
        Slurm({"scontrol", "show", "job", "-o", SlurmJobOf("slurm", job.id())});
    EXPECT_THAT(record, HasSubstr("NumNodes=2 "));
    EXPECT_THAT(record, HasSubstr("JobState=COMPLETED"));
    slurm_losses[i++] = Losses(*cluster, job.id());
  }
  ASSERT_EQ(slurm_losses[0].size(), 6u);
  EXPECT_THAT(test::ReadFile(dir_ / ("slurm/jobs/" + pp2.id() + "/rank-0.log")),
              HasSubstr("mesh: 2 pipeline stages x single 1"));

  // The same DDP job on one host (the local launcher).
  auto local = StartDaemon("local", /*slurm=*/false);
  v1::Job reference;
  ASSERT_GRPC_OK(local->Submit(TinySpec("ddp", 6), &reference));
  const v1::Job done =
      local->WaitFor(reference.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString();
  const std::map<int64_t, double> local_losses = Losses(*local, done.id());
  ASSERT_EQ(local_losses.size(), 6u);
  double worst = 0;
  for (const auto& [step, loss] : local_losses) {
    for (int s = 0; s < 3; ++s) {
      const double other = slurm_losses[s].at(step);
      EXPECT_LE(std::abs(loss - other), 1e-5 * std::abs(loss))
          << (s == 0   ? "ddp"
              : s == 1 ? "fsdp"
                       : "pp2")
          << " on Slurm, step " << step << ": " << other << " vs " << loss
          << " on one host";
      worst = std::max(worst, std::abs(loss - other) / std::abs(loss));
    }
  }
  std::cout << "slurm test bed: 2 nodes x 1 rank, ddp, fsdp and 2 pipeline "
               "stages vs one host: "
               "largest relative loss difference "
            << worst << " over " << local_losses.size() << " steps\n";
}

// HSDP on two nodes of two ranks: the shard groups are the nodes (the
// group size defaults to the ranks per node Slurm gives each task), the
// replicas all-reduce one shard across the nodes, and the job trains as the
// same HSDP job does on one host.
TEST_F(SlurmTestbedTest, HsdpShardsWithinEachNodeAndReplicatesAcrossTwo) {
  auto cluster = StartDaemon("slurm", /*slurm=*/true, /*ranks=*/2);
  v1::JobSpec spec = TinySpec("hsdp", 4);
  spec.set_world_size(4);
  v1::Job job;
  ASSERT_GRPC_OK(cluster->Submit(spec, &job));
  job = cluster->WaitFor(job.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(job.state(), v1::SUCCEEDED)
      << job.DebugString() << cluster->log()
      << test::ReadFile(dir_ / ("slurm/jobs/" + job.id() + "/rank-0.log"));
  const std::string record =
      Slurm({"scontrol", "show", "job", "-o", SlurmJobOf("slurm", job.id())});
  EXPECT_THAT(record, HasSubstr("NumNodes=2 "));
  EXPECT_THAT(record, HasSubstr("NumTasks=4 "));
  // Rank 0 speaks for the job in its log.
  EXPECT_THAT(test::ReadFile(dir_ / ("slurm/jobs/" + job.id() + "/rank-0.log")),
              HasSubstr("hsdp: 2 shard groups of 2 ranks"));
  std::map<int64_t, double> slurm_losses;
  for (const v1::StepMetrics& s : cluster->Metrics(job.id())) {
    if (s.rank() != 0) continue;
    slurm_losses[s.step()] = s.loss();
    // Across the nodes: the all-reduce of this rank's shard only.
    EXPECT_GT(s.comm_inter_group_bytes(), 0) << s.step();
    EXPECT_LT(s.comm_inter_group_bytes(), s.comm_bytes()) << s.step();
  }
  ASSERT_EQ(slurm_losses.size(), 4u);

  auto local = StartDaemon("local", /*slurm=*/false, /*ranks=*/4);
  spec.mutable_strategy()->set_shard_group_size(2);
  v1::Job reference;
  ASSERT_GRPC_OK(local->Submit(spec, &reference));
  reference =
      local->WaitFor(reference.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(reference.state(), v1::SUCCEEDED) << reference.DebugString();
  const std::map<int64_t, double> local_losses = Losses(*local, reference.id());
  ASSERT_EQ(local_losses.size(), 4u);
  for (const auto& [step, loss] : local_losses) {
    EXPECT_LE(std::abs(loss - slurm_losses.at(step)), 1e-5 * std::abs(loss))
        << "step " << step << ": " << slurm_losses.at(step) << " on Slurm vs "
        << loss << " on one host";
  }
}

TEST_F(SlurmTestbedTest, AKilledRankAndALostNodeRestartFromTheCheckpoint) {
  auto cluster = StartDaemon("slurm", /*slurm=*/true);
  v1::Job job;
  ASSERT_GRPC_OK(
      cluster->Submit(TinySpec("ddp", 40, /*max_restarts=*/2), &job));
  auto reached = [](int step) {
    return [step](const v1::Job& j) {
      return test::IsTerminal(j) ||
             (j.state() == v1::RUNNING && j.last_step().step() >= step);
    };
  };
  v1::Job running = cluster->WaitFor(job.id(), reached(3), absl::Seconds(300));
  ASSERT_EQ(running.state(), v1::RUNNING) << running.DebugString();

  // 1. kill -9 rank 1, wherever Slurm put it.
  int killed = 0;
  for (int pid : test::WorkerPids(job.id())) {
    const std::string env =
        test::ReadFile(absl::StrCat("/proc/", pid, "/environ"));
    if (env.find(std::string("\0SLURM_PROCID=1\0", 16)) != std::string::npos) {
      killed += kill(pid, SIGKILL) == 0;
    }
  }
  ASSERT_EQ(killed, 1);
  v1::Job restarting = cluster->WaitFor(
      job.id(),
      [](const v1::Job& j) {
        return test::IsTerminal(j) || j.state() == v1::RESTARTING ||
               j.restarts() > 0;
      },
      absl::Seconds(120));
  EXPECT_EQ(restarting.restarts(), 1) << restarting.DebugString();
  EXPECT_THAT(cluster->log(), HasSubstr("rank 1 ended: signal KILL"));

  // 2. Power off a node of the second attempt (not the batch host: its loss
  //    is a node failure, not a failed batch script).
  const int done_before = static_cast<int>(running.last_step().step());
  running = cluster->WaitFor(
      job.id(),
      [&](const v1::Job& j) {
        return test::IsTerminal(j) ||
               (j.state() == v1::RUNNING && j.restarts() == 1 &&
                j.last_step().step() > done_before);
      },
      absl::Seconds(300));
  ASSERT_EQ(running.state(), v1::RUNNING) << running.DebugString();
  const std::string record =
      Slurm({"scontrol", "show", "job", "-o", SlurmJobOf("slurm", job.id())});
  const size_t host_at = record.find("BatchHost=node");
  ASSERT_NE(host_at, std::string::npos) << record;
  const int batch_node = record[host_at + 14] - '0';
  const size_t list_at = record.find(" NodeList=");
  ASSERT_NE(list_at, std::string::npos);
  const std::string nodes = record.substr(
      list_at + 10, record.find(' ', list_at + 10) - list_at - 10);
  int victim = 0;
  for (int n = 1; n <= 3; ++n) {
    if (n != batch_node && (absl::StrContains(nodes, absl::StrCat("node", n)) ||
                            absl::StrContains(nodes, absl::StrCat(n)))) {
      victim = n;
      break;
    }
  }
  ASSERT_NE(victim, 0) << nodes;
  ASSERT_TRUE(
      RunCommand({Testbed(), "kill-node", *bed_ / "bed", absl::StrCat(victim)},
                 {}, 60)
          .ok());
  const v1::Job finished =
      cluster->WaitFor(job.id(), test::IsTerminal, absl::Seconds(900));
  // Slurm gives the node back for the next test whatever happened here.
  absl::StatusOr<CommandResult> revived = RunCommand(
      {Testbed(), "revive-node", *bed_ / "bed", absl::StrCat(victim)}, {}, 120);
  EXPECT_TRUE(revived.ok() && revived->ok());
  ASSERT_EQ(finished.state(), v1::SUCCEEDED)
      << finished.DebugString() << cluster->log();
  EXPECT_EQ(finished.restarts(), 2);
  EXPECT_THAT(cluster->log(), HasSubstr("lost a node"));
  // The third attempt resumed from a checkpoint: it did not start at step 1.
  EXPECT_THAT(test::ReadFile(dir_ / ("slurm/jobs/" + job.id() + "/rank-0.log")),
              HasSubstr("resumed from"));
  EXPECT_EQ(finished.last_step().step(), 40);
}

// An elastic job on all three nodes loses one for good: it continues from
// its checkpoint on the two that are left, with the same global batch, and
// trains exactly as if nothing had happened.
TEST_F(SlurmTestbedTest, AnElasticJobContinuesOnTwoNodesWhenOneIsPoweredOff) {
  v1::JobSpec spec = TinySpec("ddp", 12, /*max_restarts=*/1);
  spec.set_world_size(3);  // 3 x 2 = 6 sequences per step
  spec.mutable_elastic()->set_min_world_size(2);
  auto cluster = StartDaemon("slurm", /*slurm=*/true);
  v1::Job job;
  ASSERT_GRPC_OK(cluster->Submit(spec, &job));
  const v1::Job running = cluster->WaitFor(
      job.id(),
      [](const v1::Job& j) {
        return test::IsTerminal(j) ||
               (j.state() == v1::RUNNING && j.last_step().step() >= 4);
      },
      absl::Seconds(300));
  ASSERT_EQ(running.state(), v1::RUNNING) << running.DebugString();

  // Power off a node that is not the batch host.
  const std::string record =
      Slurm({"scontrol", "show", "job", "-o", SlurmJobOf("slurm", job.id())});
  const size_t host_at = record.find("BatchHost=node");
  ASSERT_NE(host_at, std::string::npos) << record;
  const int victim = record[host_at + 14] == '3' ? 2 : 3;
  ASSERT_TRUE(
      RunCommand({Testbed(), "kill-node", *bed_ / "bed", absl::StrCat(victim)},
                 {}, 60)
          .ok());
  const v1::Job finished =
      cluster->WaitFor(job.id(), test::IsTerminal, absl::Seconds(900));
  absl::StatusOr<CommandResult> revived = RunCommand(
      {Testbed(), "revive-node", *bed_ / "bed", absl::StrCat(victim)}, {}, 120);
  EXPECT_TRUE(revived.ok() && revived->ok());
  ASSERT_EQ(finished.state(), v1::SUCCEEDED)
      << finished.DebugString() << cluster->log();
  EXPECT_EQ(finished.restarts(), 1);
  EXPECT_EQ(finished.world_size(), 2);
  EXPECT_THAT(finished.resize_reason(),
              HasSubstr(absl::StrCat("continued at 2 of 3 ranks after losing "
                                     "node",
                                     victim)));
  EXPECT_EQ(finished.last_step().step(), 12);
  // The second attempt: two tasks on the nodes left.
  const std::string second =
      Slurm({"scontrol", "show", "job", "-o", SlurmJobOf("slurm", job.id())});
  EXPECT_THAT(second, HasSubstr("NumNodes=2 "));
  EXPECT_THAT(test::ReadFile(dir_ / ("slurm/jobs/" + job.id() + "/rank-0.log")),
              HasSubstr("resumed from"));

  // The same training, never interrupted: 6 sequences per step on one host.
  ExpectTheLossesOfAnUninterruptedRun(*cluster, job.id(), 12,
                                      "elastic 3 -> 2 nodes");
}

// Under Slurm, an elastic job on all three nodes gives one up for an urgent
// job (its tasks get SIGUSR1 through scancel, save a checkpoint and exit
// 85: a re-mesh, not a failure), continues on two, grows back to three
// when the urgent job ends, and trains exactly as the uninterrupted run.
TEST_F(SlurmTestbedTest, AnElasticJobShrinksForAnUrgentOneAndGrowsBack) {
  v1::JobSpec spec = TinySpec("ddp", 16);
  spec.set_world_size(3);  // 3 x 2 = 6 sequences per step
  spec.mutable_elastic()->set_min_world_size(1);
  auto cluster = StartDaemon("slurm", /*slurm=*/true);
  v1::Job job;
  ASSERT_GRPC_OK(cluster->Submit(spec, &job));
  const v1::Job running = cluster->WaitFor(
      job.id(),
      [](const v1::Job& j) {
        return test::IsTerminal(j) ||
               (j.state() == v1::RUNNING && j.last_step().step() >= 3);
      },
      absl::Seconds(300));
  ASSERT_EQ(running.state(), v1::RUNNING) << running.DebugString();
  v1::JobSpec urgent_spec = TinySpec("single", 2);
  urgent_spec.set_world_size(1);
  urgent_spec.set_priority(10);
  v1::Job urgent;
  ASSERT_GRPC_OK(cluster->Submit(urgent_spec, &urgent));
  const v1::Job shrunk = cluster->WaitFor(
      job.id(),
      [](const v1::Job& j) {
        return test::IsTerminal(j) ||
               (j.state() == v1::RUNNING && j.world_size() == 2);
      },
      absl::Seconds(300));
  EXPECT_EQ(shrunk.world_size(), 2) << shrunk.DebugString() << cluster->log();
  EXPECT_EQ(cluster->WaitFor(urgent.id(), test::IsTerminal, absl::Seconds(300))
                .state(),
            v1::SUCCEEDED);
  const v1::Job finished =
      cluster->WaitFor(job.id(), test::IsTerminal, absl::Seconds(600));
  ASSERT_EQ(finished.state(), v1::SUCCEEDED)
      << finished.DebugString() << cluster->log();
  EXPECT_EQ(finished.restarts(), 0);
  EXPECT_EQ(finished.preemptions(), 0);
  EXPECT_EQ(finished.remeshes(), 2);
  EXPECT_EQ(finished.world_size(), 3);
  EXPECT_THAT(finished.resize_reason(), HasSubstr("grown from 2 to 3 ranks"));
  EXPECT_THAT(test::ReadFile(dir_ / ("slurm/jobs/" + job.id() + "/rank-0.log")),
              HasSubstr("stopping after step"));

  ExpectTheLossesOfAnUninterruptedRun(
      *cluster, job.id(), 16, "elastic 3 -> 2 -> 3 nodes around an urgent job");
}

TEST_F(SlurmTestbedTest, CancelLeavesNothingInSlurmsQueue) {
  auto cluster = StartDaemon("slurm", /*slurm=*/true);
  v1::Job job;
  ASSERT_GRPC_OK(cluster->Submit(TinySpec("fsdp", 1000), &job));
  const v1::Job running = cluster->WaitFor(
      job.id(),
      [](const v1::Job& j) {
        return test::IsTerminal(j) || j.state() == v1::RUNNING;
      },
      absl::Seconds(300));
  ASSERT_EQ(running.state(), v1::RUNNING) << running.DebugString();
  grpc::ClientContext context;
  v1::CancelJobRequest request;
  request.set_job_id(job.id());
  v1::Job cancelled;
  ASSERT_GRPC_OK(cluster->jobs().CancelJob(&context, request, &cancelled));
  const v1::Job done =
      cluster->WaitFor(job.id(), test::IsTerminal, absl::Seconds(120));
  EXPECT_EQ(done.state(), v1::CANCELLED) << done.DebugString();
  EXPECT_EQ(Slurm({"squeue", "-h", "-o", "%i %j %T"}), "");
  // The tasks end on Slurm's SIGTERM, which can reach them after squeue has
  // let the job go.
  EXPECT_TRUE(test::WaitUntil(
      [&] { return test::WorkerPids(job.id()).empty(); }, absl::Seconds(30)))
      << "ranks left running 30 s after the cancel";
}

}  // namespace
}  // namespace shardtrain
