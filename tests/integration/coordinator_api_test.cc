// shardtraind's API and failure handling against a real daemon whose workers
// are fake_worker processes (tests/tools): fast enough for hundreds of jobs,
// real enough that every process, socket and database write is the real one.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "protos/reflection_subset.grpc.pb.h"
#include "protos/standard_services.grpc.pb.h"
#include "tests/integration/daemon_harness.h"

namespace shardtrain {
namespace {

using test::Daemon;
using test::DaemonOptions;
using test::FakeSpec;
using test::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

class CoordinatorApiTest : public test::FakeWorkerDaemonTest {};

TEST_F(CoordinatorApiTest, QuickJobSucceedsAndItsReportIsStored) {
  auto daemon = StartDaemon({});
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("quick", data_), &job));
  EXPECT_EQ(job.state(), v1::QUEUED);
  EXPECT_EQ(job.id(), "job-000001");

  job = daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(30));
  EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << daemon->log();
  EXPECT_GT(job.start_time_unix_ms(), 0);
  EXPECT_GE(job.end_time_unix_ms(), job.start_time_unix_ms());
  ASSERT_EQ(daemon->Metrics(job.id()).size(), 1u);
  EXPECT_DOUBLE_EQ(daemon->Metrics(job.id())[0].loss(), 10.0);
  EXPECT_EQ(job.last_step().step(), 1);
}

// A daemon started directly logs to its own stderr: `daemon status` says
// so rather than naming a log file it does not write.
TEST_F(CoordinatorApiTest, DaemonStatusSaysWhereADirectlyStartedDaemonLogs) {
  auto daemon = StartDaemon({});
  const test::CommandResult status = test::RunCommand(
      absl::StrCat(test::BinDir(), "/shardtrain daemon status --state-dir ",
                   daemon->state_dir()));
  EXPECT_EQ(status.exit_code, 0) << status.out << status.err;
  EXPECT_THAT(status.out, HasSubstr("shardtraind is running"));
  EXPECT_THAT(status.out, HasSubstr("log: its own stderr"));
  EXPECT_THAT(status.out, Not(HasSubstr("shardtraind.log")));
}

TEST_F(CoordinatorApiTest,
       AtLeastFiftyMalformedSpecsAreRejectedAndNothingStored) {
  auto daemon = StartDaemon({});
  const v1::JobSpec good = FakeSpec("quick", data_);
  std::vector<std::pair<std::string, std::function<void(v1::JobSpec&)>>> cases =
      {
          {"world_size", [](v1::JobSpec& s) { s.set_world_size(0); }},
          {"world_size", [](v1::JobSpec& s) { s.set_world_size(-3); }},
          {"world_size",
           [](v1::JobSpec& s) {
             s.set_world_size(3);
             s.mutable_strategy()->set_name("ddp");
           }},
          {"world_size",
           [](v1::JobSpec& s) {
             s.set_world_size(100000);
             s.mutable_strategy()->set_name("ddp");
           }},
          {"world_size",
           [](v1::JobSpec& s) { s.set_world_size(2); }},  // single on 2
          {"model", [](v1::JobSpec& s) { s.set_model("gpt5"); }},
          {"model", [](v1::JobSpec& s) { s.set_model(""); }},
          {"model",
           [](v1::JobSpec& s) {
             s.set_model("custom:n_layer=-1,n_head=2,n_embd=64");
           }},
          {"model",
           [](v1::JobSpec& s) {
             s.set_model("custom:n_layer=2,n_head=3,n_embd=64");
           }},
          {"model", [](v1::JobSpec& s) { s.set_model("custom:banana"); }},
          {"model",
           [](v1::JobSpec& s) { s.set_model(std::string(100000, 'm')); }},
          {"data", [](v1::JobSpec& s) { s.set_data(""); }},
          {"data", [](v1::JobSpec& s) { s.set_data("/nonexistent/dir"); }},
          {"data", [](v1::JobSpec& s) { s.set_data("/tmp"); }},  // no train.bin
          {"data",
           [](v1::JobSpec& s) { s.set_data(std::string(200000, 'd')); }},
          {"strategy",
           [](v1::JobSpec& s) { s.mutable_strategy()->set_name("zero5"); }},
          {"strategy",
           [](v1::JobSpec& s) {
             s.mutable_strategy()->set_name(std::string(5000, 's'));
           }},
          {"bucket",
           [](v1::JobSpec& s) { s.mutable_strategy()->set_bucket_mb(-1); }},
          {"bucket",
           [](v1::JobSpec& s) { s.mutable_strategy()->set_bucket_mb(0); }},
          {"timeout",
           [](v1::JobSpec& s) {
             s.mutable_strategy()->set_comm_timeout_seconds(-5);
           }},
          {"batch_size",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_batch_size(-4); }},
          {"batch_size",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_batch_size(0); }},
          {"seq_len",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_seq_len(0); }},
          {"seq_len",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_seq_len(-1); }},
          {"seq_len",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_seq_len(100000); }},
          {"grad_accum",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_grad_accum(0); }},
          {"grad_accum",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_grad_accum(-2); }},
          {"max_steps",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_max_steps(-1); }},
          {"epochs",
           [](v1::JobSpec& s) {
             s.mutable_trainer()->set_max_steps(0);
             s.mutable_trainer()->set_epochs(0);
           }},
          {"lr", [](v1::JobSpec& s) { s.mutable_trainer()->set_lr(-1e-3); }},
          {"lr", [](v1::JobSpec& s) { s.mutable_trainer()->set_lr(0); }},
          {"lr",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_lr(std::nan("")); }},
          {"lr", [](v1::JobSpec& s) { s.mutable_trainer()->set_lr(INFINITY); }},
          {"min_lr_ratio",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_min_lr_ratio(1.5); }},
          {"min_lr_ratio",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_min_lr_ratio(-0.1); }},
          {"warmup_steps",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_warmup_steps(-10); }},
          {"weight_decay",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_weight_decay(-0.1); }},
          {"beta1",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_beta1(1.0); }},
          {"beta1",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_beta1(-0.5); }},
          {"beta2",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_beta2(1.2); }},
          {"eps", [](v1::JobSpec& s) { s.mutable_trainer()->set_eps(0); }},
          {"eps", [](v1::JobSpec& s) { s.mutable_trainer()->set_eps(-1e-8); }},
          {"precision",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_precision("fp8"); }},
          {"precision",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_precision(""); }},
          {"eval_every",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_eval_every(-1); }},
          {"eval_steps",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_eval_steps(0); }},
          {"checkpoint_every",
           [](v1::JobSpec& s) {
             s.mutable_trainer()->set_checkpoint_every(-3);
           }},
          {"peak_flops",
           [](v1::JobSpec& s) { s.mutable_trainer()->set_peak_flops(-1); }},
          {"init_from",
           [](v1::JobSpec& s) {
             s.mutable_trainer()->set_init_from("/no/such/model.bin");
           }},
          {"max_restarts", [](v1::JobSpec& s) { s.set_max_restarts(-1); }},
          {"max_restarts", [](v1::JobSpec& s) { s.set_max_restarts(1000000); }},
          {"priority", [](v1::JobSpec& s) { s.set_priority(1 << 30); }},
          {"name",
           [](v1::JobSpec& s) { s.set_name(std::string(1 << 20, 'n')); }},
          {"labels",
           [](v1::JobSpec& s) { (*s.mutable_labels())["bad key!"] = "v"; }},
          {"labels", [](v1::JobSpec& s) { (*s.mutable_labels())[""] = "v"; }},
          {"labels",
           [](v1::JobSpec& s) {
             (*s.mutable_labels())["k"] = std::string(100000, 'v');
           }},
          {"labels",
           [](v1::JobSpec& s) {
             for (int i = 0; i < 40; ++i)
               (*s.mutable_labels())[absl::StrCat("k", i)] = "v";
           }},
          {"device_kind", [](v1::JobSpec& s) { s.set_device_kind(v1::GPU); }},
          {"device_kind",
           [](v1::JobSpec& s) {
             s.set_device_kind(static_cast<v1::DeviceKind>(42));
           }},
      };
  ASSERT_GE(cases.size(), 50u);
  for (const auto& [field, mutate] : cases) {
    v1::JobSpec spec = good;
    mutate(spec);
    v1::Job job;
    const grpc::Status status = daemon->Submit(spec, &job);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << field << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(field)) << field;
    EXPECT_LT(status.error_message().size(), 1000u) << "message echoes input";
  }
  // Nothing was stored, and the daemon still serves.
  grpc::ClientContext context;
  v1::ListJobsRequest request;
  v1::ListJobsResponse list;
  ASSERT_TRUE(daemon->jobs().ListJobs(&context, request, &list).ok());
  EXPECT_EQ(list.jobs_size(), 0);
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(good, &job));
  EXPECT_EQ(job.id(), "job-000001");
}

TEST_F(CoordinatorApiTest,
       ConcurrentSubmissionsAreStoredOnceAndRunInPriorityOrder) {
  const std::string order_file = dir_ / "order.txt";
  DaemonOptions options;
  options.cpu_slots = 1;
  options.env = {{"SHARDTRAIN_FAKE_ORDER_FILE", order_file}};
  auto daemon = StartDaemon(options);
  // A job holds the only slot while the others are submitted, so they all
  // queue and their start order is the scheduler's choice alone. Its
  // priority is above theirs, so none of them preempts it.
  v1::Job blocker;
  v1::JobSpec holder = FakeSpec("hold", data_);
  holder.set_priority(3);
  ASSERT_GRPC_OK(daemon->Submit(holder, &blocker));
  ASSERT_EQ(daemon
                ->WaitFor(
                    blocker.id(),
                    [](const v1::Job& j) { return j.state() == v1::RUNNING; },
                    absl::Seconds(30))
                .state(),
            v1::RUNNING);

  constexpr int kClients = 8;
  constexpr int kPerClient = 25;
  std::vector<std::vector<v1::Job>> accepted(kClients);
  std::vector<std::thread> clients;
  std::atomic<int> failures{0};
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto stub = v1::JobService::NewStub(daemon->channel());
      for (int i = 0; i < kPerClient; ++i) {
        v1::JobSpec spec = FakeSpec("quick", data_);
        spec.set_priority((c * kPerClient + i) % 3);
        (*spec.mutable_labels())["client"] = std::to_string(c);
        grpc::ClientContext context;
        v1::SubmitJobRequest request;
        *request.mutable_spec() = spec;
        v1::Job job;
        if (stub->SubmitJob(&context, request, &job).ok()) {
          accepted[c].push_back(job);
        } else {
          ++failures;
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  ASSERT_EQ(failures.load(), 0);

  // All stored once: ids unique, and ListJobs (paged) returns exactly them.
  std::set<std::string> ids;
  for (const auto& jobs : accepted)
    for (const v1::Job& job : jobs) ids.insert(job.id());
  ASSERT_EQ(ids.size(), static_cast<size_t>(kClients * kPerClient));
  std::vector<v1::Job> listed;
  std::string token;
  do {
    grpc::ClientContext context;
    v1::ListJobsRequest request;
    request.set_page_size(37);
    request.set_page_token(token);
    v1::ListJobsResponse page;
    ASSERT_TRUE(daemon->jobs().ListJobs(&context, request, &page).ok());
    listed.insert(listed.end(), page.jobs().begin(), page.jobs().end());
    token = page.next_page_token();
  } while (!token.empty());
  ASSERT_EQ(listed.size(), ids.size() + 1);
  std::set<std::string> listed_ids;
  for (const v1::Job& job : listed) listed_ids.insert(job.id());
  EXPECT_EQ(listed_ids.size(), listed.size()) << "a job was listed twice";
  for (const std::string& id : ids) EXPECT_TRUE(listed_ids.count(id)) << id;

  // The queue reports why each job waits.
  {
    grpc::ClientContext context;
    v1::Cluster cluster;
    ASSERT_TRUE(daemon->cluster().GetCluster(&context, {}, &cluster).ok());
    ASSERT_EQ(cluster.devices_size(), 1);
    EXPECT_EQ(cluster.devices(0).job_id(), blocker.id());
    ASSERT_EQ(cluster.queue_size(), kClients * kPerClient);
    EXPECT_EQ(cluster.queue(0).priority(), 2);
    EXPECT_THAT(cluster.queue(0).reason(), HasSubstr("needs 1 device, 0 free"));
    EXPECT_THAT(cluster.queue(1).reason(), HasSubstr("behind"));
  }

  // Release the slot; every job runs, in priority order, FIFO within one.
  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(blocker.id());
  v1::Job cancelled;
  ASSERT_TRUE(daemon->jobs().CancelJob(&context, cancel, &cancelled).ok());
  auto started_jobs = [&] {
    return std::vector<std::string>(
        absl::StrSplit(test::ReadFile(order_file), '\n', absl::SkipEmpty()));
  };
  ASSERT_TRUE(
      test::WaitUntil([&] { return started_jobs().size() == ids.size() + 1; },
                      absl::Seconds(240)))
      << daemon->log();
  const std::vector<std::string> started = started_jobs();
  std::vector<v1::Job> expected;
  for (const auto& jobs : accepted)
    expected.insert(expected.end(), jobs.begin(), jobs.end());
  std::sort(expected.begin(), expected.end(),
            [](const v1::Job& a, const v1::Job& b) {
              if (a.spec().priority() != b.spec().priority())
                return a.spec().priority() > b.spec().priority();
              return a.id() < b.id();  // ids are zero-padded submission numbers
            });
  ASSERT_EQ(started.front(), blocker.id());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(started[i + 1], expected[i].id()) << "start #" << i + 1;
  }
  for (const v1::Job& job : expected) {
    EXPECT_EQ(
        daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(30)).state(),
        v1::SUCCEEDED);
  }
}

TEST_F(CoordinatorApiTest, FailuresAreClassifiedWithRankAndLogTail) {
  DaemonOptions options;
  options.cpu_slots = 4;
  options.heartbeat_interval = 0.2;
  options.heartbeat_timeout = 2;
  options.rendezvous_timeout = 3;
  auto daemon = StartDaemon(options);
  struct Case {
    std::string mode;
    int world;
    v1::FailureReason reason;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"exit:3", 1, v1::EXIT_CODE, "exit code 3"},
      {"exit:2", 1, v1::INVALID_SPEC, "was refused (exit code 2)"},
      {"oom", 1, v1::OOM, "out of memory"},
      {"enospc", 1, v1::EXIT_CODE,
       "exit code 1 (no space left on device: ENOSPC writing under "},
      {"hang", 1, v1::HANG, "no heartbeat"},
      {"no-register", 2, v1::RENDEZVOUS_TIMEOUT, "did not join"},
  };
  for (const Case& c : cases) {
    v1::Job job;
    ASSERT_GRPC_OK(daemon->Submit(FakeSpec(c.mode, data_, c.world), &job));
    job = daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(30));
    ASSERT_EQ(job.state(), v1::FAILED) << c.mode << daemon->log();
    EXPECT_EQ(job.failure().reason(), c.reason) << c.mode << job.DebugString();
    EXPECT_THAT(job.failure().message(), HasSubstr(c.message)) << c.mode;
    EXPECT_EQ(job.failure().rank(), 0) << c.mode;
    ASSERT_GT(job.failure().log_tail_size(), 0) << c.mode;
    std::string tail;
    for (const std::string& line : job.failure().log_tail())
      tail += line + "\n";
    EXPECT_THAT(tail, HasSubstr(absl::StrCat("mode '", c.mode, "'"))) << c.mode;
    if (c.mode == "oom") {
      EXPECT_THAT(tail, HasSubstr("CUDA out of memory"));
    }
    EXPECT_TRUE(
        test::WaitUntil([&] { return daemon->WorkerPids(job.id()).empty(); },
                        absl::Seconds(10)))
        << c.mode << ": workers left behind";
  }
}

TEST_F(CoordinatorApiTest, CancelStopsAHeldJobAndCancelOfFinishedJobIsRefused) {
  DaemonOptions options;
  options.grace_period = 2;
  auto daemon = StartDaemon(options);
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("hold", data_, 2), &job));
  job = daemon->WaitFor(
      job.id(), [](const v1::Job& j) { return j.state() == v1::RUNNING; },
      absl::Seconds(30));
  ASSERT_EQ(job.state(), v1::RUNNING);
  ASSERT_EQ(daemon->WorkerPids(job.id()).size(), 2u);

  grpc::ClientContext context;
  v1::CancelJobRequest request;
  request.set_job_id(job.id());
  v1::Job response;
  ASSERT_TRUE(daemon->jobs().CancelJob(&context, request, &response).ok());
  job = daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(10));
  EXPECT_EQ(job.state(), v1::CANCELLED);
  EXPECT_TRUE(daemon->WorkerPids(job.id()).empty());

  grpc::ClientContext again;
  const grpc::Status status =
      daemon->jobs().CancelJob(&again, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  grpc::ClientContext unknown;
  request.set_job_id("job-999999");
  EXPECT_EQ(daemon->jobs().CancelJob(&unknown, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(CoordinatorApiTest, WatchStartsWithTheJobAndEndsAtItsTerminalState) {
  auto daemon = StartDaemon({});
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("flood:50", data_, 2), &job));
  grpc::ClientContext context;
  v1::WatchJobRequest request;
  request.set_job_id(job.id());
  auto reader = daemon->jobs().WatchJob(&context, request);
  v1::WatchJobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  ASSERT_TRUE(event.has_job());
  EXPECT_EQ(event.job().id(), job.id());
  std::vector<v1::JobState> states;
  int steps = 0;
  while (reader->Read(&event)) {
    if (event.has_state_change())
      states.push_back(event.state_change().state());
    if (event.has_step()) ++steps;
  }
  EXPECT_TRUE(reader->Finish().ok());
  ASSERT_FALSE(states.empty());
  EXPECT_EQ(states.back(), v1::SUCCEEDED);
  EXPECT_NE(std::find(states.begin(), states.end(), v1::RUNNING), states.end());
  EXPECT_EQ(steps, 100);  // 50 steps x 2 ranks

  // A late watcher gets the final job at once, then the whole stored
  // history, then the stream ends.
  grpc::ClientContext late;
  auto late_reader = daemon->jobs().WatchJob(&late, request);
  ASSERT_TRUE(late_reader->Read(&event));
  EXPECT_EQ(event.job().state(), v1::SUCCEEDED);
  std::set<std::pair<int, int64_t>> replayed;
  while (late_reader->Read(&event)) {
    ASSERT_TRUE(event.has_step());
    replayed.insert({event.step().rank(), event.step().step()});
  }
  EXPECT_EQ(replayed.size(), 100u);
  EXPECT_TRUE(late_reader->Finish().ok());
}

TEST_F(CoordinatorApiTest, StreamLogsTailsAndFollowsPerRank) {
  auto daemon = StartDaemon({});
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("quick", data_, 2), &job));
  ASSERT_EQ(
      daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(30)).state(),
      v1::SUCCEEDED);
  auto read_all = [&](std::optional<int> rank, int tail, bool follow) {
    grpc::ClientContext context;
    v1::StreamLogsRequest request;
    request.set_job_id(job.id());
    if (rank) request.set_rank(*rank);
    request.set_tail(tail);
    request.set_follow(follow);
    auto reader = daemon->jobs().StreamLogs(&context, request);
    std::vector<v1::LogLine> lines;
    v1::LogLine line;
    while (reader->Read(&line)) lines.push_back(line);
    EXPECT_TRUE(reader->Finish().ok());
    return lines;
  };
  const std::vector<v1::LogLine> all = read_all(std::nullopt, 0, false);
  ASSERT_GE(all.size(), 4u);  // the coordinator's header + the fake's line, x2
  std::set<int> ranks;
  for (const v1::LogLine& l : all) ranks.insert(l.rank());
  EXPECT_EQ(ranks, (std::set<int>{0, 1}));
  const std::vector<v1::LogLine> one = read_all(1, 1, false);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].rank(), 1);
  EXPECT_THAT(one[0].line(), HasSubstr("rank 1 mode 'quick'"));
  // Following a finished job returns what is there and ends.
  EXPECT_EQ(read_all(0, 0, true).size(), all.size() / 2);

  grpc::ClientContext context;
  v1::StreamLogsRequest bad;
  bad.set_job_id(job.id());
  bad.set_rank(5);
  auto reader = daemon->jobs().StreamLogs(&context, bad);
  v1::LogLine line;
  EXPECT_FALSE(reader->Read(&line));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorApiTest, HealthAndReflectionAnswerStandardClients) {
  auto daemon = StartDaemon({});
  auto health = grpc::health::v1::Health::NewStub(daemon->channel());
  for (const char* service : {"", "shardtrain.v1.JobService"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, request, &response).ok()) << service;
    EXPECT_EQ(response.status(),
              grpc::health::v1::HealthCheckResponse::SERVING);
  }
  auto reflection =
      grpc::reflection::v1alpha::ServerReflection::NewStub(daemon->channel());
  grpc::ClientContext context;
  auto stream = reflection->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("*");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::set<std::string> services;
  for (const auto& s : response.list_services_response().service())
    services.insert(s.name());
  EXPECT_TRUE(services.count("shardtrain.v1.JobService"));
  EXPECT_TRUE(services.count("shardtrain.v1.ClusterService"));
  EXPECT_TRUE(services.count("grpc.health.v1.Health"));
}

class BearerToken : public grpc::MetadataCredentialsPlugin {
 public:
  explicit BearerToken(std::string token) : token_(std::move(token)) {}
  grpc::Status GetMetadata(
      grpc::string_ref, grpc::string_ref, const grpc::AuthContext&,
      std::multimap<grpc::string, grpc::string>* metadata) override {
    metadata->insert({"authorization", "Bearer " + token_});
    return grpc::Status::OK;
  }
  bool IsBlocking() const override { return false; }

 private:
  std::string token_;
};

TEST_F(CoordinatorApiTest, WithAuthTokenEveryCallNeedsTheToken) {
  test::WriteFile(dir_ / "token", "s3cret-token\n");
  chmod((dir_ / "token").c_str(), 0600);  // a secret: owner only
  DaemonOptions options;
  options.extra_flags = {"--auth-token-file", dir_ / "token"};
  auto daemon = StartDaemon(options);
  v1::JobSpec spec = FakeSpec("quick", data_);
  for (const std::string& header : {std::string(), std::string("Bearer wrong"),
                                    std::string("s3cret-token")}) {
    grpc::ClientContext context;
    if (!header.empty()) context.AddMetadata("authorization", header);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::Job job;
    EXPECT_EQ(daemon->jobs().SubmitJob(&context, request, &job).error_code(),
              grpc::StatusCode::UNAUTHENTICATED)
        << header;
    grpc::ClientContext list_context;
    if (!header.empty()) list_context.AddMetadata("authorization", header);
    v1::ListJobsResponse list;
    EXPECT_EQ(daemon->jobs().ListJobs(&list_context, {}, &list).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext cluster_context;
    v1::Cluster cluster;
    EXPECT_EQ(daemon->cluster()
                  .GetCluster(&cluster_context, {}, &cluster)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer s3cret-token");
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::Job job;
  ASSERT_TRUE(daemon->jobs().SubmitJob(&context, request, &job).ok());
  // Workers authenticate with the job's secret, not the token: the job runs.
  grpc::ClientContext get_context;
  get_context.AddMetadata("authorization", "Bearer s3cret-token");
  ASSERT_TRUE(test::WaitUntil(
      [&] {
        grpc::ClientContext c;
        c.AddMetadata("authorization", "Bearer s3cret-token");
        v1::GetJobRequest r;
        r.set_job_id(job.id());
        v1::Job j;
        daemon->jobs().GetJob(&c, r, &j);
        return j.state() == v1::SUCCEEDED;
      },
      absl::Seconds(30)));
}

// Roles and quotas on a shared host, through the API with two users and an
// admin: a user cannot raise a job above the classes opened to users, nor
// name an admin's class (a higher one, or one never preempted); and an
// elastic job of alice's (quota 2), shrunk for an admin's urgent job, does
// not grow back past her quota once she runs a second job.
TEST_F(CoordinatorApiTest, RolesGovernPriorityAndQuotasHoldForGrowth) {
  test::WriteFile(dir_ / "tokens",
                  "alice-token,alice,user,2\nbob-token,bob,user\n"
                  "ops-token,ops,admin\n");
  chmod((dir_ / "tokens").c_str(), 0600);
  DaemonOptions options;
  options.cpu_slots = 3;
  options.extra_flags = {"--auth-token-file", dir_ / "tokens",
                         "--priority-class",  "urgent=100",
                         "--priority-class",  "pinned=1,preemptible=false",
                         "--priority-class",  "batch=10,open=true"};
  auto daemon = StartDaemon(options);
  auto as = [&](const std::string& user) {
    daemon->set_token(user + "-token");
    return daemon.get();
  };
  v1::Job job;
  v1::JobSpec raised = FakeSpec("quick", data_);
  raised.set_priority(1000);
  grpc::Status refused = as("alice")->Submit(raised, &job);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(refused.error_message(),
              HasSubstr("may set a priority of at most 10"));
  for (const char* admins : {"urgent", "pinned"}) {
    v1::JobSpec spec = FakeSpec("quick", data_);
    spec.set_priority_class(admins);
    refused = as("bob")->Submit(spec, &job);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(refused.error_message(),
                HasSubstr(absl::StrCat("'", admins, "' is for admins")));
  }
  v1::JobSpec batch = FakeSpec("quick", data_);
  batch.set_priority_class("batch");
  ASSERT_GRPC_OK(as("bob")->Submit(batch, &job));
  EXPECT_EQ(job.priority(), 10);
  ASSERT_GRPC_OK(as("ops")->Submit(raised, &job));
  EXPECT_EQ(job.priority(), 1000);

  // Quotas: every grant, growth included.
  v1::JobSpec elastic_spec = FakeSpec("hold-checkpoint", data_, 2);
  elastic_spec.mutable_trainer()->set_batch_size(3);
  elastic_spec.mutable_trainer()->set_checkpoint_every(5);
  elastic_spec.mutable_elastic()->set_min_world_size(1);
  v1::Job elastic;
  ASSERT_GRPC_OK(as("alice")->Submit(elastic_spec, &elastic));
  auto running_at = [](int world) {
    return [world](const v1::Job& j) {
      return j.state() == v1::RUNNING && j.world_size() == world;
    };
  };
  // The quick jobs above end first; then alice's takes 2 of the 3 slots.
  ASSERT_EQ(as("ops")
                ->WaitFor(elastic.id(), running_at(2), absl::Seconds(30))
                .state(),
            v1::RUNNING);
  v1::JobSpec urgent_spec = FakeSpec("hold", data_, 2);
  urgent_spec.set_priority_class("urgent");
  v1::Job urgent;
  ASSERT_GRPC_OK(as("ops")->Submit(urgent_spec, &urgent));
  EXPECT_EQ(daemon->WaitFor(elastic.id(), running_at(1), absl::Seconds(30))
                .world_size(),
            1);
  EXPECT_EQ(
      daemon->WaitFor(urgent.id(), running_at(2), absl::Seconds(30)).state(),
      v1::RUNNING);
  v1::Job second;
  ASSERT_GRPC_OK(as("alice")->Submit(FakeSpec("hold", data_), &second));
  ASSERT_GRPC_OK(as("ops")->Cancel(urgent.id(), &urgent));
  EXPECT_EQ(
      daemon->WaitFor(second.id(), running_at(1), absl::Seconds(30)).state(),
      v1::RUNNING);
  // A slot is free now, but alice holds her 2: her elastic job stays at 1
  // through many scheduling rounds (50 ms each).
  const absl::Time watch_until = absl::Now() + absl::Seconds(2);
  while (absl::Now() < watch_until) {
    const v1::Job now = daemon->Get(elastic.id());
    ASSERT_EQ(now.state(), v1::RUNNING) << now.state_reason();
    ASSERT_EQ(now.world_size(), 1);
    absl::SleepFor(absl::Milliseconds(100));
  }
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer ops-token");
  v1::Cluster cluster;
  ASSERT_GRPC_OK(daemon->cluster().GetCluster(&context, {}, &cluster));
  int alices = 0;
  for (const auto& device : cluster.devices()) {
    alices += device.job_id() == elastic.id() || device.job_id() == second.id();
  }
  EXPECT_EQ(alices, 2);
  as("ops")->Cancel(elastic.id(), &job);
  as("ops")->Cancel(second.id(), &job);
}

TEST_F(CoordinatorApiTest, TlsServesTlsClientsAndRefusesPlaintext) {
  const std::string cert = dir_ / "cert.pem";
  const std::string key = dir_ / "key.pem";
  const test::CommandResult openssl = test::RunCommand(
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
      key + " -out " + cert);
  ASSERT_EQ(openssl.exit_code, 0) << openssl.err;
  DaemonOptions options;
  options.extra_flags = {"--tls-cert", cert, "--tls-key", key};
  options.worker_binary = test::FakeWorker();
  auto daemon = std::make_unique<Daemon>(dir_ / "state", options);
  std::string error;
  ASSERT_TRUE(daemon->Start(&error, /*insecure_channel=*/false)) << error;

  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = test::ReadFile(cert);
  daemon->Connect(grpc::SslCredentials(ssl));
  {
    grpc::ClientContext context;
    v1::Cluster cluster;
    EXPECT_TRUE(daemon->cluster().GetCluster(&context, {}, &cluster).ok());
    EXPECT_EQ(cluster.devices_size(), 2);
  }
  daemon->Connect(grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(3));
  v1::Cluster cluster;
  EXPECT_FALSE(daemon->cluster().GetCluster(&context, {}, &cluster).ok());
  // The workers' channel (Unix socket) still works: a job runs.
  daemon->Connect(grpc::SslCredentials(ssl));
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("quick", data_), &job));
  const v1::Job done =
      daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(30));
  EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString() << daemon->log();
}

TEST_F(CoordinatorApiTest, SigtermStopsWorkersAndARestartKeepsEverything) {
  DaemonOptions options;
  options.grace_period = 2;
  auto daemon = StartDaemon(options);
  v1::Job held, queued_behind, done;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("quick", data_), &done));
  ASSERT_EQ(
      daemon->WaitFor(done.id(), test::IsTerminal, absl::Seconds(30)).state(),
      v1::SUCCEEDED);
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("hold", data_, 2), &held));
  ASSERT_EQ(daemon
                ->WaitFor(
                    held.id(),
                    [](const v1::Job& j) { return j.state() == v1::RUNNING; },
                    absl::Seconds(30))
                .state(),
            v1::RUNNING);
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("quick", data_), &queued_behind));
  const std::vector<int> workers = daemon->WorkerPids(held.id());
  ASSERT_EQ(workers.size(), 2u);

  daemon->Signal(SIGTERM);
  const int status = daemon->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(WIFEXITED(status))
      << status << " signal " << WTERMSIG(status) << daemon->log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(daemon->WorkerPids(held.id()).empty());
  EXPECT_THAT(daemon->log(), HasSubstr("shutting down"));

  // Restarted: the finished job and its metrics are there; the held job had
  // no restarts left, so it failed with COORDINATOR_RESTART; the queued one
  // was still queued and now runs.
  auto again = StartDaemon(options);
  EXPECT_EQ(again->Get(done.id()).state(), v1::SUCCEEDED);
  EXPECT_EQ(again->Metrics(done.id()).size(), 1u);
  const v1::Job failed = again->Get(held.id());
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure().reason(), v1::COORDINATOR_RESTART);
  EXPECT_EQ(
      again->WaitFor(queued_behind.id(), test::IsTerminal, absl::Seconds(30))
          .state(),
      v1::SUCCEEDED);
}

TEST_F(CoordinatorApiTest, PrometheusEndpointExportsJobsStepsAndFailures) {
  DaemonOptions options;
  options.extra_flags = {"--metrics-retention", "2"};
  auto daemon = StartDaemon(options);
  v1::Job ok, failed;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("flood:5", data_, 2), &ok));
  ASSERT_EQ(
      daemon->WaitFor(ok.id(), test::IsTerminal, absl::Seconds(30)).state(),
      v1::SUCCEEDED);
  const std::string text = daemon->ScrapeMetrics();
  const std::string series = absl::StrCat(
      "{job=\"", ok.id(), "\",mesh=\"ddp2\",rank=\"1\",strategy=\"ddp\"}");
  EXPECT_THAT(text, HasSubstr("shardtrain_build_info{version=\"0.1.0\"} 1"));
  EXPECT_THAT(text, HasSubstr("shardtrain_job_submissions_total 1"));
  EXPECT_THAT(text, HasSubstr("shardtrain_jobs{state=\"succeeded\"} 1"));
  EXPECT_THAT(text, HasSubstr("shardtrain_jobs{state=\"running\"} 0"));
  EXPECT_THAT(text, HasSubstr("shardtrain_devices{kind=\"cpu\"} 2"));
  EXPECT_THAT(text, HasSubstr("shardtrain_train_step" + series + " 5"));
  EXPECT_THAT(text,
              HasSubstr("shardtrain_train_loss" + series + " 2"));  // 10 / 5
  EXPECT_THAT(text, HasSubstr("shardtrain_tokens_total" + series + " 5120"));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat(
                  "shardtrain_step_duration_seconds_count{job=\"", ok.id(),
                  "\",mesh=\"ddp2\",rank=\"1\",strategy=\"ddp\"} 5")));
  // The exposition is valid for Prometheus.
  const test::CommandResult check =
      test::RunCommand("promtool check metrics", text);
  EXPECT_EQ(check.exit_code, 0) << check.out << check.err;

  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("exit:4", data_), &failed));
  ASSERT_EQ(
      daemon->WaitFor(failed.id(), test::IsTerminal, absl::Seconds(30)).state(),
      v1::FAILED);
  EXPECT_TRUE(test::WaitUntil(
      [&] {
        return absl::StrContains(
            daemon->ScrapeMetrics(),
            "shardtrain_job_failures_total{reason=\"exit_code\"} 1");
      },
      absl::Seconds(5)));
  // Finished jobs' series go after the retention (2 s), counts stay.
  EXPECT_TRUE(test::WaitUntil(
      [&] { return !absl::StrContains(daemon->ScrapeMetrics(), ok.id()); },
      absl::Seconds(10)));
  EXPECT_THAT(daemon->ScrapeMetrics(),
              HasSubstr("shardtrain_jobs{state=\"succeeded\"} 1"));
}

// A pipeline job's ranks report their stage: the bubble and point-to-point
// series carry it as a label.
TEST_F(CoordinatorApiTest, PrometheusEndpointExportsPipelineStages) {
  auto daemon = StartDaemon({});
  v1::Job job;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("stages:3", data_, 2), &job));
  ASSERT_EQ(
      daemon->WaitFor(job.id(), test::IsTerminal, absl::Seconds(30)).state(),
      v1::SUCCEEDED);
  const std::string text = daemon->ScrapeMetrics();
  for (const int rank : {0, 1}) {
    const std::string series =
        absl::StrCat("{job=\"", job.id(), "\",mesh=\"ddp2\",rank=\"", rank,
                     "\",stage=\"", rank, "\",strategy=\"ddp\"}");
    EXPECT_THAT(text, HasSubstr("shardtrain_pipeline_bubble_seconds" + series +
                                " 0.005"));
    EXPECT_THAT(text,
                HasSubstr("shardtrain_p2p_bytes_total" + series + " 12288"));
  }
  // A job without stages has none of these series.
  v1::Job plain;
  ASSERT_GRPC_OK(daemon->Submit(FakeSpec("flood:2", data_, 2), &plain));
  ASSERT_EQ(
      daemon->WaitFor(plain.id(), test::IsTerminal, absl::Seconds(30)).state(),
      v1::SUCCEEDED);
  EXPECT_THAT(daemon->ScrapeMetrics(),
              Not(HasSubstr("shardtrain_p2p_bytes_total{job=\"" + plain.id())));
}

TEST_F(CoordinatorApiTest, SecondDaemonOnTheSameStateDirIsRefused) {
  auto daemon = StartDaemon({});
  DaemonOptions options;
  options.worker_binary = test::FakeWorker();
  Daemon second(dir_ / "state", options);
  std::string error;
  EXPECT_FALSE(second.Start(&error));
  EXPECT_THAT(error, HasSubstr("in use by another shardtraind"));
  grpc::ClientContext context;
  v1::Cluster cluster;
  EXPECT_TRUE(daemon->cluster().GetCluster(&context, {}, &cluster).ok());
}

// One daemon per listen address: a second one (its own state directory)
// on the first one's port refuses to start and names the first, rather
// than sharing the port (SO_REUSEPORT) and half of its submissions.
TEST_F(CoordinatorApiTest, SecondDaemonOnTheSameListenAddressIsRefused) {
  auto daemon = StartDaemon({});
  DaemonOptions options;
  options.worker_binary = test::FakeWorker();
  options.listen = daemon->address();
  Daemon second(dir_ / "other-state", options);
  std::string error;
  EXPECT_FALSE(second.Start(&error));
  EXPECT_THAT(
      error, HasSubstr(absl::StrCat("--listen: ", daemon->address(),
                                    " is taken by pid ", daemon->pid(), " (")));
  EXPECT_THAT(error, HasSubstr("shardtraind"));
  grpc::ClientContext context;
  v1::Cluster cluster;
  EXPECT_TRUE(daemon->cluster().GetCluster(&context, {}, &cluster).ok());
}

// A mistyped flag: exit 2 and the flag meant, before anything starts.
TEST_F(CoordinatorApiTest, AMistypedFlagIsAUsageErrorNamingTheFlagMeant) {
  const test::CommandResult r =
      test::RunCommand(absl::StrCat(test::BinDir(), "/shardtraind --state-dir ",
                                    dir_ / "typo", " --heartbeat-timout 5"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("unknown option --heartbeat-timout; did you "
                               "mean --heartbeat-timeout?"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "typo/shardtraind.db"));
}

}  // namespace
}  // namespace shardtrain
