// Backends as rows of a registry (server/backend.h): names, flags and
// validation belong to the row; and a third backend, registered by this test
// alone, runs jobs through the coordinator's whole gRPC API.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"
#include "server/backends.h"
#include "server/coordinator.h"
#include "shardtrain/v1/cluster_service.grpc.pb.h"
#include "shardtrain/v1/job_service.grpc.pb.h"
#include "shardtrain/v1/worker_service.grpc.pb.h"
#include "tests/fakes/fake_backend.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using test::TempDir;
using test::WriteFile;

TEST(BackendRegistryTest, AnUnknownNameIsRefusedNamingTheRegisteredOnes) {
  BackendRegistry registry = BuiltinBackends();
  ASSERT_TRUE(registry.Add(std::make_unique<FakeBackendKind>()).ok());
  EXPECT_EQ(registry.Names(),
            (std::vector<std::string>{"local", "slurm", "fake"}));
  absl::StatusOr<BackendKind*> kind = registry.Get("kubernetes");
  ASSERT_FALSE(kind.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(kind.status()));
  EXPECT_EQ(kind.status().message(),
            "--launcher: 'kubernetes' is not one of local, slurm, fake");
  absl::Status twice = registry.Add(std::make_unique<FakeBackendKind>());
  EXPECT_TRUE(absl::IsAlreadyExists(twice)) << twice;
  EXPECT_NE(registry.LauncherHelp().find("fake (ranks a test drives)"),
            std::string::npos)
      << registry.LauncherHelp();
}

TEST(BackendRegistryTest, EachRowOwnsItsFlagsAndTheirValidation) {
  BackendRegistry registry;
  auto fake = std::make_unique<FakeBackendKind>();
  FakeBackendKind* row = fake.get();
  ASSERT_TRUE(registry.Add(std::move(fake)).ok());
  CLI::App app;
  registry.AddFlags(app);
  app.parse(std::vector<std::string>{"0", "--fake-slots"});  // reversed
  EXPECT_EQ(row->slots(), 0);
  absl::Status s = row->Validate(BackendContext{});
  EXPECT_EQ(s.message(), "--fake-slots: must be >= 1, got 0");
}

TEST(BackendRegistryTest,
     TheCoordinatorRefusesABackendsBadSettingsBeforeStarting) {
  TempDir dir;
  BackendRegistry registry;
  auto fake = std::make_unique<FakeBackendKind>();
  FakeBackendKind* row = fake.get();
  ASSERT_TRUE(registry.Add(std::move(fake)).ok());
  CLI::App app;
  registry.AddFlags(app);
  app.parse(std::vector<std::string>{"0", "--fake-slots"});
  CoordinatorOptions options;
  options.state_dir = dir / "state";
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.worker_binary = "/bin/true";
  options.launcher = "fake";
  options.backends = &registry;
  absl::StatusOr<std::unique_ptr<Coordinator>> c = Coordinator::Start(options);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), "--fake-slots: must be >= 1, got 0");
  EXPECT_EQ(row->created(), nullptr);
  EXPECT_FALSE(std::filesystem::exists(dir / "state"));
}

// The coordinator over the fake backend, reached only through gRPC: what a
// client and a rank would see.
class FakeBackendCoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_ / "data");
    WriteFile(dir_ / "data/train.bin", "x");
    auto fake = std::make_unique<FakeBackendKind>();
    kind_ = fake.get();
    ASSERT_TRUE(registry_.Add(std::move(fake)).ok());
    CLI::App app;
    registry_.AddFlags(app);
    app.parse(std::vector<std::string>{"3", "--fake-slots"});
    CoordinatorOptions options;
    options.state_dir = dir_ / "state";
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "";
    options.worker_binary = "/bin/true";  // never run: the backend starts none
    options.launcher = "fake";
    options.backends = &registry_;
    absl::StatusOr<std::unique_ptr<Coordinator>> c =
        Coordinator::Start(options);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = std::move(*c);
    auto channel = grpc::CreateChannel(coordinator_->address(),
                                       grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel);
    cluster_ = v1::ClusterService::NewStub(channel);
    workers_ = v1::WorkerService::NewStub(channel);
  }

  void TearDown() override {
    if (coordinator_ != nullptr) coordinator_->Shutdown();
  }

  FakeAttemptLauncher& fake() { return kind_->created()->fake(); }

  v1::Job Submit(int world) {
    v1::SubmitJobRequest request;
    v1::JobSpec& spec = *request.mutable_spec();
    spec.set_model("gpt2-tiny");
    spec.set_data(dir_ / "data");
    spec.mutable_strategy()->set_name("ddp");
    spec.set_world_size(world);
    grpc::ClientContext context;
    v1::Job job;
    grpc::Status s = jobs_->SubmitJob(&context, request, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }

  v1::Job Get(const std::string& id) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    grpc::ClientContext context;
    v1::Job job;
    EXPECT_TRUE(jobs_->GetJob(&context, request, &job).ok());
    return job;
  }

  v1::Cluster Cluster() {
    grpc::ClientContext context;
    v1::Cluster cluster;
    EXPECT_TRUE(cluster_->GetCluster(&context, {}, &cluster).ok());
    return cluster;
  }

  // Waits (10 s at most) for `done`, checked every 20 ms.
  static bool WaitFor(const std::function<bool()>& done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!done()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  // The handle of the attempt the fake backend started for the n-th launch.
  std::string Handle(size_t n) {
    EXPECT_TRUE(WaitFor([&] { return fake().handles().size() > n; }));
    return fake().handles().size() > n ? fake().handles()[n] : "";
  }

  // Rank `rank` of attempt `handle` registers over the worker API.
  grpc::Status Register(const std::string& handle, int rank) {
    const FakeAttemptLauncher::Started started = fake().started(handle);
    v1::RegisterRequest request;
    request.mutable_worker()->set_job_id(started.launch.job_id);
    request.mutable_worker()->set_secret(started.launch.secret);
    request.mutable_worker()->set_rank(rank);
    grpc::ClientContext context;
    v1::RegisterResponse response;
    return workers_->Register(&context, request, &response);
  }

  TempDir dir_;
  BackendRegistry registry_;
  FakeBackendKind* kind_ = nullptr;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

TEST_F(FakeBackendCoordinatorTest, AJobRunsOnARegisteredBackendThroughTheApi) {
  const v1::Cluster idle = Cluster();
  EXPECT_EQ(idle.launcher(), "fake");
  ASSERT_EQ(idle.devices_size(), 3);  // --fake-slots 3
  EXPECT_EQ(idle.devices(0).name(), "fake slot");
  ASSERT_EQ(idle.nodes_size(), 1);
  EXPECT_EQ(idle.nodes(0).name(), "fake-node-0");
  EXPECT_EQ(idle.node_group_kind(), "pool");
  ASSERT_EQ(idle.node_groups_size(), 1);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  ASSERT_EQ(idle.slurm_nodes_size(), 1);  // the deprecated alias
  EXPECT_EQ(idle.slurm_nodes(0).partitions(0), "fake-pool");
#pragma GCC diagnostic pop

  const v1::Job job = Submit(2);
  const std::string handle = Handle(0);
  const FakeAttemptLauncher::Started started = fake().started(handle);
  EXPECT_EQ(started.launch.job_id, job.id());
  EXPECT_EQ(started.launch.world_size, 2);
  EXPECT_EQ(started.attempt.number, 1);
  ASSERT_TRUE(Register(handle, 0).ok());
  ASSERT_TRUE(Register(handle, 1).ok());
  ASSERT_TRUE(WaitFor([&] { return Get(job.id()).state() == v1::RUNNING; }));
  int held = 0;
  const v1::Cluster running = Cluster();
  for (const v1::Device& d : running.devices()) held += d.job_id() == job.id();
  EXPECT_EQ(held, 2);

  // The CLI shows a backend it was never told of.
  const test::CommandResult cli = test::RunCommand(
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain cluster --address " + coordinator_->address());
  ASSERT_EQ(cli.exit_code, 0) << cli.err;
  EXPECT_NE(cli.out.find("launcher: fake (ranks run nowhere"),
            std::string::npos)
      << cli.out;
  EXPECT_NE(cli.out.find("POOL"), std::string::npos) << cli.out;
  EXPECT_NE(cli.out.find("fake-node-0"), std::string::npos) << cli.out;
  EXPECT_NE(cli.out.find(job.id() + " rank 1"), std::string::npos) << cli.out;

  AttemptReport done;
  done.exits = {{0, {0, 0}}, {1, {0, 0}}};
  fake().Report(handle, done);
  ASSERT_TRUE(WaitFor([&] { return Get(job.id()).state() == v1::SUCCEEDED; }))
      << v1::JobState_Name(Get(job.id()).state());
  const v1::Cluster after = Cluster();
  for (const v1::Device& d : after.devices()) EXPECT_EQ(d.job_id(), "");
}

TEST_F(FakeBackendCoordinatorTest, CancelReachesTheBackendsRanksAsSigterm) {
  const v1::Job job = Submit(3);
  const std::string handle = Handle(0);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(Register(handle, r).ok());
  ASSERT_TRUE(WaitFor([&] { return Get(job.id()).state() == v1::RUNNING; }));
  v1::CancelJobRequest request;
  request.set_job_id(job.id());
  grpc::ClientContext context;
  v1::Job cancelled;
  ASSERT_TRUE(jobs_->CancelJob(&context, request, &cancelled).ok());
  // The fake's ranks exit on SIGTERM
  // (FakeAttemptLauncher::set_exit_on_sigterm).
  ASSERT_TRUE(WaitFor([&] { return Get(job.id()).state() == v1::CANCELLED; }))
      << v1::JobState_Name(Get(job.id()).state());
  const FakeAttemptLauncher::Started started = fake().started(handle);
  ASSERT_FALSE(started.signals.empty());
  EXPECT_EQ(started.signals.front().first, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(started.signals.front().second, SIGTERM);
}

TEST_F(FakeBackendCoordinatorTest, AJobLargerThanTheBackendsSlotsIsRefused) {
  v1::SubmitJobRequest request;
  v1::JobSpec& spec = *request.mutable_spec();
  spec.set_model("gpt2-tiny");
  spec.set_data(dir_ / "data");
  spec.mutable_strategy()->set_name("ddp");
  spec.set_world_size(4);
  grpc::ClientContext context;
  v1::Job job;
  grpc::Status s = jobs_->SubmitJob(&context, request, &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("3"), std::string::npos)
      << s.error_message();
  EXPECT_TRUE(fake().handles().empty());
}

}  // namespace
}  // namespace shardtrain
