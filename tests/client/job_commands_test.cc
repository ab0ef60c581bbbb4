// Every job subcommand of the `shardtrain` binary against a real shardtraind:
// exit codes, table/JSON/YAML output, and the comparison study end to end.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/plan/memory_plan.h"
#include "core/plan/step_time_plan.h"
#include "nlohmann/json.hpp"
#include "proto/job_config.h"
#include "tests/integration/daemon_harness.h"

namespace shardtrain {
namespace {

using test::CommandResult;
using test::Daemon;
using test::DaemonOptions;
using test::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

class CliJobCommandsTest : public ::testing::Test {
 protected:
  void StartDaemon(DaemonOptions options) {
    daemon_ = std::make_unique<Daemon>(dir_ / "state", std::move(options));
    std::string error;
    ASSERT_TRUE(daemon_->Start(&error)) << error;
  }
  void StartFakeDaemon(int cpu_slots = 2) {
    std::filesystem::create_directories(dir_ / "data");
    test::WriteFile(dir_ / "data/train.bin", "x");
    DaemonOptions options;
    options.worker_binary = test::FakeWorker();
    options.cpu_slots = cpu_slots;
    StartDaemon(options);
  }
  // Runs `shardtrain ARGS` against the daemon.
  CommandResult Cli(const std::string& args) {
    return test::RunCommand(
        absl::StrCat("SHARDTRAIN_ADDRESS=", daemon_->address(), " ",
                     test::BinDir(), "/shardtrain ", args));
  }
  std::string FakeJob(const std::string& mode, int world = 1) {
    return absl::StrCat(
        "submit --name '", mode, "' --model gpt2-tiny --data ", dir_ / "data",
        " --max-steps 1",
        world > 1 ? absl::StrCat(" --strategy ddp --world-size ", world) : "");
  }

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(CliJobCommandsTest, SubmitPrintsTheIdAndWatchExitsByTheJobsOutcome) {
  StartFakeDaemon();
  CommandResult ok = Cli(FakeJob("quick", 2) + " --watch");
  ASSERT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_EQ(ok.out, "job-000001\n");
  EXPECT_THAT(ok.err, HasSubstr("job-000001 SUCCEEDED"));

  CommandResult failed = Cli(FakeJob("exit:3") + " -w");
  EXPECT_EQ(failed.exit_code, 1) << failed.err;
  EXPECT_THAT(failed.err,
              HasSubstr("EXIT_CODE (rank 0): rank 0 ended with exit code 3"));

  CommandResult watch = Cli("watch job-000001");
  EXPECT_EQ(watch.exit_code, 0);
  EXPECT_THAT(watch.out, HasSubstr("SUCCEEDED"));
  EXPECT_EQ(Cli("watch job-000002").exit_code, 1);
}

TEST_F(CliJobCommandsTest, WatchOnATerminalDrawsAProgressBar) {
  StartFakeDaemon();
  ASSERT_EQ(Cli(FakeJob("slow:40", 2)).exit_code, 0);
  ASSERT_EQ(Cli(FakeJob("slow:40", 2)).exit_code, 0);  // queued behind it
  // util-linux `script` gives the CLI a pseudo-terminal.
  CommandResult tty =
      test::RunCommand(absl::StrCat("script -qec '", test::BinDir(),
                                    "/shardtrain watch job-000001 --address ",
                                    daemon_->address(), "' /dev/null"));
  EXPECT_EQ(tty.exit_code, 0) << tty.out << tty.err;
  EXPECT_THAT(tty.out,
              HasSubstr("[########################] 40/40 | loss 0.2500"));
  EXPECT_THAT(tty.out, HasSubstr("| 51,200 tok/s | ETA"));
  EXPECT_THAT(tty.out, HasSubstr("\r\033[K"));  // redrawn in place
  // Not a terminal: one plain line per step instead.
  CommandResult plain = Cli("watch job-000002");
  EXPECT_THAT(plain.out, Not(HasSubstr("[####")));
  EXPECT_THAT(plain.out, HasSubstr("step 40/40 | loss 0.2500"));
  EXPECT_THAT(plain.out, HasSubstr("step 1/40 | loss 10.0000"));
  // It ends with a summary: how the run ended and where its outputs are.
  const std::string outputs = dir_ / "state/jobs/job-000002";
  EXPECT_THAT(plain.out, HasSubstr("  40 steps, final loss 0.2500"));
  // The fake worker writes only the ranks' logs: nothing else is claimed.
  EXPECT_THAT(plain.out, HasSubstr("  outputs: " + outputs + " (rank-N.log)"));
  EXPECT_THAT(Cli("get job-000002").out, HasSubstr("outputs      " + outputs));
}

TEST_F(CliJobCommandsTest, ReadCommandsPrintTablesJsonAndYaml) {
  StartFakeDaemon();
  ASSERT_EQ(Cli(FakeJob("flood:3", 2) + " --label team=nlp --priority 2 -w")
                .exit_code,
            0);

  CommandResult list = Cli("list");
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_THAT(list.out, HasSubstr("ID"));
  EXPECT_THAT(list.out, HasSubstr("MESH"));
  // Submitted without a token: no owner.
  EXPECT_THAT(list.out, HasSubstr("NAME     OWNER  STATE"));
  EXPECT_THAT(list.out,
              HasSubstr("job-000001  flood:3  -      SUCCEEDED  ddp2"));

  CommandResult json = Cli("list -o json --label team=nlp");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json jobs = nlohmann::json::parse(json.out);
  ASSERT_EQ(jobs["jobs"].size(), 1u);
  const nlohmann::json& job = jobs["jobs"][0];
  EXPECT_EQ(job["id"], "job-000001");
  EXPECT_EQ(job["state"], "SUCCEEDED");
  EXPECT_EQ(job["spec"]["strategy"]["name"], "ddp");
  EXPECT_EQ(job["spec"]["world_size"], 2);
  EXPECT_EQ(job["spec"]["priority"], 2);
  // 64-bit integers as JSON numbers, not protobuf's strings.
  EXPECT_EQ(job["last_step"]["step"], 3);
  EXPECT_EQ(Cli("list -o json --label team=cv").out.find("job-000001"),
            std::string::npos);

  CommandResult yaml = Cli("get job-000001 -o yaml");
  ASSERT_EQ(yaml.exit_code, 0);
  EXPECT_THAT(yaml.out, HasSubstr("id: job-000001"));
  EXPECT_THAT(yaml.out, HasSubstr("state: SUCCEEDED"));

  CommandResult get = Cli("status job-000001");
  EXPECT_THAT(get.out, HasSubstr("state        SUCCEEDED"));
  EXPECT_THAT(get.out, HasSubstr("labels       team=nlp"));
  EXPECT_THAT(get.out, HasSubstr("mesh         ddp2 (2 ranks)"));
  EXPECT_THAT(get.out, Not(HasSubstr(" ago ago")));

  CommandResult csv = Cli("metrics job-000001 --csv");
  ASSERT_EQ(csv.exit_code, 0);
  std::vector<std::string> lines =
      absl::StrSplit(csv.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 1u + 6u);  // header + 3 steps x 2 ranks
  EXPECT_THAT(lines[0], HasSubstr("step,total_steps,epoch,rank,loss"));
  EXPECT_THAT(lines[1], testing::StartsWith("1,3,0,0,10,"));
  CommandResult table = Cli("metrics job-000001");
  EXPECT_THAT(table.out, HasSubstr("STEP  LOSS"));
  EXPECT_EQ(std::vector<std::string>(
                absl::StrSplit(table.out, '\n', absl::SkipEmpty()))
                .size(),
            4u);  // rank 0 only
  const nlohmann::json steps =
      nlohmann::json::parse(Cli("metrics job-000001 -o json").out);
  EXPECT_EQ(steps["steps"].size(), 6u);

  const nlohmann::json cluster =
      nlohmann::json::parse(Cli("cluster -o json").out);
  EXPECT_EQ(cluster["devices"].size(), 2u);
  EXPECT_EQ(cluster["version"], "0.1.0");
  EXPECT_THAT(Cli("cluster").out, HasSubstr("queue empty"));

  CommandResult logs = Cli("logs job-000001 --rank 1 --tail 1");
  EXPECT_EQ(logs.exit_code, 0);
  EXPECT_EQ(logs.out, "fake_worker job-000001 rank 1 mode 'flood:3'\n");
  EXPECT_THAT(Cli("logs job-000001").out,
              HasSubstr("[rank 0] fake_worker job-000001 rank 0"));
}

// `logs -f` into a pipe prints each line as it comes, not when the stream
// ends (a block-buffered stdout held them until then).
// The job views name a job's whole mesh, tensor and pipeline dimensions
// included, in the notation compare takes.
TEST_F(CliJobCommandsTest, ListGetAndWatchNameTheWholeMesh) {
  StartFakeDaemon(/*cpu_slots=*/4);
  const std::string base = absl::StrCat("submit --model gpt2-tiny --data ",
                                        dir_ / "data", " --max-steps 1 -w");
  ASSERT_EQ(
      Cli(base + " --name tp --strategy fsdp --tp 2 --world-size 4").exit_code,
      0);
  ASSERT_EQ(
      Cli(base + " --name pp --strategy ddp --pp 2 --world-size 4").exit_code,
      0);
  ASSERT_EQ(Cli(base + " --name tp1 --tp 2 --world-size 2").exit_code, 0);
  const CommandResult list = Cli("list");
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_THAT(list.out,
              HasSubstr("job-000001  tp    -      SUCCEEDED  fsdp2xtp2"));
  EXPECT_THAT(list.out,
              HasSubstr("job-000002  pp    -      SUCCEEDED  pp2xddp2"));
  EXPECT_THAT(list.out, HasSubstr("job-000003  tp1   -      SUCCEEDED  tp2"));
  EXPECT_THAT(Cli("get job-000001").out,
              HasSubstr("mesh         fsdp2xtp2 (4 ranks)"));
  EXPECT_THAT(Cli("get job-000003").out,
              HasSubstr("mesh         tp2 (2 ranks)"));
  const CommandResult watch = Cli("watch job-000002");
  EXPECT_THAT(watch.out + watch.err,
              HasSubstr("job-000002 (pp2xddp2, gpt2-tiny)"));
}

TEST_F(CliJobCommandsTest, FollowedLogsReachAPipeLineByLine) {
  StartFakeDaemon();
  ASSERT_EQ(Cli(FakeJob("hold")).exit_code, 0);
  ASSERT_TRUE(test::WaitUntil(
      [&] { return !Cli("logs job-000001 --tail 1").out.empty(); },
      absl::Seconds(30)));
  FILE* pipe =
      popen(absl::StrCat("SHARDTRAIN_ADDRESS=", daemon_->address(), " ",
                         test::BinDir(), "/shardtrain logs job-000001 -f")
                .c_str(),
            "r");
  ASSERT_NE(pipe, nullptr);
  pollfd ready{fileno(pipe), POLLIN, 0};
  const int polled = poll(&ready, 1, 20000);
  EXPECT_EQ(polled, 1) << "nothing reached the pipe in 20 s";
  char line[256] = {};
  if (polled == 1) {
    ASSERT_NE(fgets(line, sizeof(line), pipe), nullptr);
    EXPECT_THAT(std::string(line), HasSubstr("job-000001 rank 0"));
  }
  EXPECT_EQ(Cli("cancel job-000001").exit_code, 0);
  EXPECT_EQ(pclose(pipe), 0);  // the stream ends with the job
}

TEST_F(CliJobCommandsTest, CancelStopsARunningJob) {
  StartFakeDaemon();
  ASSERT_EQ(Cli(FakeJob("hold")).exit_code, 0);
  ASSERT_EQ(daemon_
                ->WaitFor(
                    "job-000001",
                    [](const v1::Job& j) { return j.state() == v1::RUNNING; },
                    absl::Seconds(30))
                .state(),
            v1::RUNNING);
  CommandResult cancel = Cli("cancel job-000001");
  EXPECT_EQ(cancel.exit_code, 0) << cancel.err;
  EXPECT_EQ(daemon_->WaitFor("job-000001", test::IsTerminal, absl::Seconds(30))
                .state(),
            v1::CANCELLED);
  CommandResult again = Cli("cancel job-000001");
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_THAT(again.err, HasSubstr("already ended (CANCELLED)"));
  // Its outputs are what its directory holds: no checkpoint was written.
  CommandResult get = Cli("get job-000001");
  EXPECT_THAT(get.out, HasSubstr("outputs"));
  EXPECT_THAT(get.out, Not(HasSubstr("checkpoints/"))) << get.out;
  // A job cancelled in the queue never had outputs.
  ASSERT_EQ(Cli(FakeJob("hold")).exit_code, 0);
  // Both of the daemon's 2 slots, while the job above holds one.
  ASSERT_EQ(Cli(FakeJob("hold", 2)).exit_code, 0);
  CommandResult queued = Cli("cancel job-000003");
  EXPECT_EQ(queued.exit_code, 0) << queued.err;
  EXPECT_EQ(daemon_->WaitFor("job-000003", test::IsTerminal, absl::Seconds(30))
                .state(),
            v1::CANCELLED);
  CommandResult never = Cli("get job-000003");
  EXPECT_THAT(never.out, HasSubstr("none (the job never started)"))
      << never.out;
  EXPECT_EQ(Cli("cancel job-000002").exit_code, 0);
}

TEST_F(CliJobCommandsTest, ErrorsAreOneLineWithTheRightExitCode) {
  StartFakeDaemon();
  // The daemon rejects the spec: a usage error, its message shown as is.
  CommandResult bad = Cli(FakeJob("quick") + " --batch-size -4");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("batch_size"));
  EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
  CommandResult unknown = Cli("get job-424242");
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.err, HasSubstr("no job 'job-424242'"));
  // The command line itself is wrong.
  EXPECT_EQ(Cli("list --output xml").exit_code, 2);
  EXPECT_EQ(Cli("frobnicate").exit_code, 2);
  // No daemon there: exit 3 with a hint.
  CommandResult down = test::RunCommand(
      absl::StrCat(test::BinDir(), "/shardtrain list --address 127.0.0.1:1"));
  EXPECT_EQ(down.exit_code, 3);
  EXPECT_THAT(down.err, HasSubstr("start one with `shardtrain daemon`"));
  // The address came from SHARDTRAIN_ADDRESS: that is what to check.
  CommandResult from_env = test::RunCommand(absl::StrCat(
      "SHARDTRAIN_ADDRESS=127.0.0.1:1 ", test::BinDir(), "/shardtrain list"));
  EXPECT_EQ(from_env.exit_code, 3);
  EXPECT_THAT(from_env.err,
              HasSubstr("no shardtraind at 127.0.0.1:1 (SHARDTRAIN_ADDRESS)"));
  EXPECT_THAT(from_env.err, HasSubstr("check SHARDTRAIN_ADDRESS"));
  EXPECT_THAT(from_env.err, Not(HasSubstr("or set SHARDTRAIN_ADDRESS")));
  // A value of the wrong kind names the kind; a mistyped preset its
  // nearest name.
  CommandResult lr = Cli(FakeJob("quick") + " --lr abc");
  EXPECT_EQ(lr.exit_code, 2);
  EXPECT_THAT(lr.err, HasSubstr("--lr expects a number, got 'abc'"));
  CommandResult steps = Cli(FakeJob("quick") + " --world-size 1.5");
  EXPECT_EQ(steps.exit_code, 2);
  EXPECT_THAT(steps.err,
              HasSubstr("--world-size expects a whole number, got '1.5'"));
  CommandResult preset = test::RunCommand(
      absl::StrCat(test::BinDir(), "/shardtrain plan --model gpt2-mni"));
  EXPECT_EQ(preset.exit_code, 2);
  EXPECT_THAT(preset.err, HasSubstr("(did you mean gpt2-mini?)"));
}

TEST_F(CliJobCommandsTest, TokenComesFromTheEnvironmentOrAFile) {
  std::filesystem::create_directories(dir_ / "data");
  test::WriteFile(dir_ / "data/train.bin", "x");
  test::WriteFile(dir_ / "token", "t0k3n\n");
  chmod((dir_ / "token").c_str(), 0600);
  DaemonOptions options;
  options.worker_binary = test::FakeWorker();
  options.extra_flags = {"--auth-token-file", dir_ / "token"};
  StartDaemon(options);
  EXPECT_EQ(Cli("list").exit_code, 1);
  EXPECT_THAT(Cli("list").err, HasSubstr("SHARDTRAIN_TOKEN"));
  EXPECT_EQ(Cli("list --token-file " + (dir_ / "token")).exit_code, 0);
  EXPECT_EQ(test::RunCommand(
                absl::StrCat("SHARDTRAIN_TOKEN=t0k3n SHARDTRAIN_ADDRESS=",
                             daemon_->address(), " ", test::BinDir(),
                             "/shardtrain cluster"))
                .exit_code,
            0);
}

TEST_F(CliJobCommandsTest, SubmitReadsAJobFileAndFlagsWin) {
  StartFakeDaemon();
  test::WriteFile(
      dir_ / "job.yaml",
      absl::StrCat("name: from-file\nmodel: gpt2-tiny\ndata: ", dir_ / "data",
                   "\nstrategy: ddp\nworld-size: 2\nlr: 0.002\nbatch-size: "
                   "3\nmax-steps: 1\n"
                   "labels:\n  team: nlp\n"));
  CommandResult submit =
      Cli("submit -f " + (dir_ / "job.yaml") + " --lr 0.005 -o json");
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const nlohmann::json job = nlohmann::json::parse(submit.out);
  EXPECT_EQ(job["spec"]["name"], "from-file");
  EXPECT_EQ(job["spec"]["world_size"], 2);
  EXPECT_EQ(job["spec"]["trainer"]["batch_size"], 3);
  EXPECT_DOUBLE_EQ(job["spec"]["trainer"]["lr"].get<double>(), 0.005);
  EXPECT_EQ(job["spec"]["labels"]["team"], "nlp");
  test::WriteFile(dir_ / "bad.yaml", "model: gpt2-tiny\nbatch-sise: 3\n");
  CommandResult bad = Cli("submit -f " + (dir_ / "bad.yaml"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("unknown key 'batch-sise' (did you mean "
                                 "batch_size?)"));
  // The known keys are the job's and the trainer's a job can set.
  EXPECT_THAT(bad.err, HasSubstr("world_size"));
  EXPECT_THAT(bad.err, HasSubstr("priority"));
  EXPECT_THAT(bad.err, HasSubstr("labels"));
  EXPECT_THAT(bad.err, Not(HasSubstr(", threads")));
  // What the daemon sets for every job is refused, not ignored.
  test::WriteFile(dir_ / "out.yaml", "model: gpt2-tiny\nout: /tmp/mine\n");
  CommandResult out = Cli("submit -f " + (dir_ / "out.yaml"));
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_THAT(out.err, HasSubstr("'out' is set by the daemon for every job"));
}

TEST_F(CliJobCommandsTest,
       DaemonStartsALocalCoordinatorOnceAndFindsItAfterwards) {
  // The user's cache is the default home of the state dir.
  const std::string env = absl::StrCat("XDG_CACHE_HOME=", dir_ / "cache", " ");
  const std::string cli = absl::StrCat(env, test::BinDir(), "/shardtrain ");
  // Port 0: the daemon binds a free port itself and says which.
  CommandResult start = test::RunCommand(
      absl::StrCat(cli,
                   "daemon --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 "
                   "--cpu-slots 1"));
  ASSERT_EQ(start.exit_code, 0) << start.out << start.err;
  const std::string prefix = "shardtraind started at ";
  ASSERT_THAT(start.out, HasSubstr(prefix));
  const size_t at = start.out.find(prefix) + prefix.size();
  const std::string address =
      start.out.substr(at, start.out.find(' ', at) - at);
  const std::string state = dir_ / "cache/shardtrain/state";
  EXPECT_TRUE(std::filesystem::exists(state + "/shardtraind.db"));
  const int pid = std::stoi(test::ReadFile(state + "/LOCK"));

  CommandResult again = test::RunCommand(absl::StrCat(
      cli, "daemon --listen ", address, " --metrics-listen 127.0.0.1:0"));
  EXPECT_EQ(again.exit_code, 0);
  EXPECT_THAT(again.out, HasSubstr("already running"));
  // Without --address or SHARDTRAIN_ADDRESS the CLI finds the local daemon.
  CommandResult cluster = test::RunCommand(cli + "cluster -o json");
  EXPECT_EQ(cluster.exit_code, 0) << cluster.err;
  EXPECT_EQ(nlohmann::json::parse(cluster.out)["devices"].size(), 1u);

  CommandResult status = test::RunCommand(cli + "daemon status");
  EXPECT_EQ(status.exit_code, 0) << status.err;
  EXPECT_THAT(status.out,
              HasSubstr(absl::StrCat("shardtraind is running: pid ", pid,
                                     ", listening on ", address)));
  // It logs where `daemon` put it.
  EXPECT_THAT(status.out, HasSubstr(", log " + state + "/shardtraind.log"));
  CommandResult stop = test::RunCommand(cli + "daemon stop");
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  EXPECT_THAT(stop.out,
              HasSubstr(absl::StrCat("stopped shardtraind (pid ", pid, ";")));
  // Gone when stop returns (at most a zombie for init to reap), and its pid
  // not left behind.
  if (kill(pid, 0) == 0) {
    const std::string stat =
        test::ReadFile(absl::StrCat("/proc/", pid, "/stat"));
    EXPECT_THAT(stat.substr(stat.rfind(')')), testing::StartsWith(") Z"))
        << stat;
  }
  EXPECT_EQ(test::ReadFile(state + "/LOCK"), "");
  CommandResult stopped = test::RunCommand(cli + "daemon status");
  EXPECT_EQ(stopped.exit_code, 3);
  EXPECT_THAT(stopped.out, HasSubstr("shardtraind is not running"));

  // A LOCK naming a live process that holds no lock (a daemon killed with
  // -9, its pid since reused): stop signals nothing. Here the pid is this
  // test's own; were it signalled, the test would die.
  test::WriteFile(state + "/LOCK", absl::StrCat(getpid(), "\n"));
  CommandResult stale = test::RunCommand(cli + "daemon stop");
  EXPECT_EQ(stale.exit_code, 0) << stale.err;
  EXPECT_THAT(stale.out, HasSubstr("shardtraind is not running"));
}

// The study end to end with real workers: the report's numbers are the
// stored metrics, and under strong scaling the strategies' losses agree.
TEST_F(CliJobCommandsTest, CompareRunsEveryStrategyAndReportsTheStoredNumbers) {
  StartDaemon({});
  const std::string out = dir_ / "study";
  CommandResult compare =
      Cli(absl::StrCat("compare --strategies single,ddp,fsdp --world-size 2 "
                       "--model gpt2-tiny --data brown "
                       "--batch-size 2 --seq-len 64 --max-steps 5 --eval-every "
                       "5 --eval-steps 2 --out ",
                       out));
  ASSERT_EQ(compare.exit_code, 0) << compare.out << compare.err;
  EXPECT_THAT(compare.out, HasSubstr("| single |"));
  EXPECT_THAT(compare.out, HasSubstr("FSDP peak memory per rank was"));
  EXPECT_THAT(compare.out, HasSubstr(out + "/report.html"));
  for (const char* file :
       {"report.md", "report.html", "single.csv", "ddp.csv", "fsdp.csv"}) {
    EXPECT_TRUE(std::filesystem::exists(out + "/" + file)) << file;
  }
  // Each CSV is the job's stored history; losses agree across strategies.
  std::map<std::string, std::map<std::pair<int, int>, double>> loss;
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(daemon_->jobs().ListJobs(&context, {}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 3);
  // Every run at the threads per rank of the study's largest job (2 ranks),
  // single-device included; the report says so.
  EXPECT_THAT(test::ReadFile(out + "/report.md"),
              HasSubstr("Equal threads: on CPU slots every rank, "
                        "single-device included, computes with the threads "
                        "of a 2-rank job"));
  for (const v1::Job& job : jobs.jobs()) {
    const std::string strategy = job.spec().strategy().name();
    EXPECT_EQ(job.spec().trainer().threads_as_ranks(), 2) << strategy;
    std::ifstream csv(out + "/" + strategy + ".csv");
    std::string line;
    std::getline(csv, line);  // header
    std::vector<std::vector<std::string>> rows;
    while (std::getline(csv, line)) rows.push_back(absl::StrSplit(line, ','));
    const std::vector<v1::StepMetrics> stored = daemon_->Metrics(job.id());
    ASSERT_EQ(rows.size(), stored.size()) << strategy;
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(std::stoll(rows[i][0]), stored[i].step());
      EXPECT_EQ(std::stoi(rows[i][3]), stored[i].rank());
      EXPECT_NEAR(std::stod(rows[i][4]), stored[i].loss(),
                  1e-9 * stored[i].loss());
      loss[strategy][{stored[i].rank(), static_cast<int>(stored[i].step())}] =
          stored[i].loss();
    }
    // The report's final train loss is rank 0's last stored step.
    EXPECT_THAT(
        compare.out,
        HasSubstr(absl::StrFormat(
            "| %s | %d | %d | 5 | %.4f |", strategy, job.spec().world_size(),
            job.spec().trainer().batch_size(), loss[strategy][{0, 5}])));
  }
  for (int step = 1; step <= 5; ++step) {
    const double single = loss["single"][std::make_pair(0, step)];
    for (const char* s : {"ddp", "fsdp"}) {
      const double other = loss[s][std::make_pair(0, step)];
      EXPECT_NEAR(other, single, 1e-5 * single) << s << " step " << step;
    }
  }
}

// --repeat interleaves the strategies' runs, and a CPU hog on the host
// while they train withholds the speed verdict: the report says the speed
// findings are disturbed instead of naming a fastest strategy.
TEST_F(CliJobCommandsTest,
       CompareRepeatsInterleavedAndSaysWhenAHogDisturbedIt) {
  StartDaemon({});
  const std::string out = dir_ / "hogged";
  // Spinners for a quarter of the host's cores (at least one), started
  // before the study and killed after it.
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<pid_t> hogs;
  for (int i = 0; i < std::max(1, (cores + 3) / 4); ++i) {
    char sh[] = "sh", c[] = "-c", loop[] = "while :; do :; done";
    char* argv[] = {sh, c, loop, nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawnp(&pid, "sh", nullptr, nullptr, argv, environ), 0);
    hogs.push_back(pid);
  }
  CommandResult compare =
      Cli(absl::StrCat("compare --strategies single,ddp --world-size 2 "
                       "--repeat 2 --model gpt2-tiny --data brown "
                       "--batch-size 2 --seq-len 32 --max-steps 4 --out ",
                       out));
  for (pid_t pid : hogs) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  ASSERT_EQ(compare.exit_code, 0) << compare.out << compare.err;
  // Round after round: single, ddp, single, ddp.
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(daemon_->jobs().ListJobs(&context, {}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 4);
  std::vector<v1::Job> by_submission(jobs.jobs().begin(), jobs.jobs().end());
  std::sort(by_submission.begin(), by_submission.end(),
            [](const v1::Job& a, const v1::Job& b) {
              return a.submit_time_unix_ms() < b.submit_time_unix_ms() ||
                     (a.submit_time_unix_ms() == b.submit_time_unix_ms() &&
                      a.id() < b.id());
            });
  std::vector<std::string> order;
  for (const v1::Job& job : by_submission) {
    order.push_back(job.spec().strategy().name());
  }
  EXPECT_THAT(order, ::testing::ElementsAre("single", "ddp", "single", "ddp"));
  EXPECT_THAT(compare.err,
              HasSubstr("== 3/4: single (run 2 of 2) on 1 device"));
  for (const char* file : {"single.csv", "single.run2.csv", "ddp.run2.csv"}) {
    EXPECT_TRUE(std::filesystem::exists(out + "/" + file)) << file;
  }
  const std::string md = test::ReadFile(out + "/report.md");
  EXPECT_THAT(md, HasSubstr("Each strategy ran 2 times"));
  EXPECT_THAT(md, HasSubstr("Speed findings are disturbed, so no strategy is "
                            "named fastest"));
  EXPECT_THAT(md, HasSubstr("other processes used"));
  EXPECT_THAT(md, Not(HasSubstr("was the fastest")));
  EXPECT_THAT(compare.out, HasSubstr("speed not compared, the runs were "
                                     "disturbed"));
}

// Model-parallel meshes are study entries: "pp2" is single's data cut over
// two stages, "tp2" its every layer split over two ranks, on the same
// global batch; their report rows, CSVs and losses stand beside single's.
TEST_F(CliJobCommandsTest, CompareTakesPipelineMeshEntries) {
  StartDaemon({});
  const std::string out = dir_ / "mesh";
  CommandResult compare = Cli(absl::StrCat(
      "compare --strategies single,pp2,tp2 --world-size 2 --model llama-tiny "
      "--data brown --batch-size 2 --seq-len 64 --max-steps 3 --eval-steps 1 "
      "--micro-batches 2 --out ",
      out));
  ASSERT_EQ(compare.exit_code, 0) << compare.out << compare.err;
  // A Llama-family study, its report naming the family and the tokens.
  EXPECT_THAT(test::ReadFile(out + "/report.md"),
              HasSubstr("# llama-tiny (Llama) on the Brown Corpus (GPT-2 "
                        "tokens), single vs pp2 vs tp2"));
  EXPECT_TRUE(std::filesystem::exists(out + "/pp2.csv"));
  EXPECT_TRUE(std::filesystem::exists(out + "/tp2.csv"));
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(daemon_->jobs().ListJobs(&context, {}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 3);
  std::map<std::string, std::vector<double>> losses;
  for (const v1::Job& job : jobs.jobs()) {
    const std::string entry = job.spec().labels().at("strategy");
    EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString();
    // The global batch of 2 x 2 replicas, on one rank or on two stages.
    EXPECT_EQ(job.spec().trainer().batch_size(), 4) << entry;
    if (entry == "pp2") {
      EXPECT_EQ(job.spec().strategy().name(), "single");
      EXPECT_EQ(job.spec().strategy().pipeline_stages(), 2);
      EXPECT_EQ(job.spec().world_size(), 2);
    } else if (entry == "tp2") {
      EXPECT_EQ(job.spec().strategy().name(), "single");
      EXPECT_EQ(job.spec().strategy().tensor_parallel(), 2);
      EXPECT_EQ(job.spec().world_size(), 2);
    } else {
      EXPECT_EQ(job.spec().world_size(), 1);
    }
    for (const v1::StepMetrics& m : daemon_->Metrics(job.id())) {
      if (m.rank() == 0) losses[entry].push_back(m.loss());
    }
  }
  for (const char* entry : {"pp2", "tp2"}) {
    ASSERT_EQ(losses[entry].size(), losses["single"].size()) << entry;
    for (size_t i = 0; i < losses[entry].size(); ++i) {
      EXPECT_NEAR(losses[entry][i], losses["single"][i],
                  1e-6 * losses["single"][i])
          << entry << " step " << i + 1;
    }
  }
  EXPECT_THAT(compare.out, HasSubstr("| pp2 | 2 | 4 | 3 |"));
  EXPECT_THAT(compare.out, HasSubstr("| tp2 | 2 | 4 | 3 |"));
  // A mesh naming no strategy is refused before anything runs.
  CommandResult bad =
      Cli("compare --strategies pp2xzero --world-size 4 --model gpt2-tiny "
          "--data brown --out " +
          out + "2");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("'pp2xzero' names no strategy after 'x'"));
  // Every mistaken entry is named at once, before any job is submitted:
  // pp3 needs three ranks, pp2xfsdp2 four.
  CommandResult mistaken =
      Cli("compare --strategies single,pp3,pp2xfsdp2 --world-size 2 "
          "--model gpt2-tiny --data brown --out " +
          out + "3");
  EXPECT_EQ(mistaken.exit_code, 2) << mistaken.out;
  EXPECT_THAT(mistaken.err,
              HasSubstr("pp3 runs on 3 ranks, more than --world-size 2"));
  EXPECT_THAT(mistaken.err,
              HasSubstr("pp2xfsdp2 runs on 4 ranks, more than --world-size 2"));
  EXPECT_THAT(mistaken.err, HasSubstr("Nothing was submitted"));
  grpc::ClientContext after_context;
  v1::ListJobsResponse after;
  ASSERT_TRUE(daemon_->jobs().ListJobs(&after_context, {}, &after).ok());
  EXPECT_EQ(after.jobs_size(), 3);  // the study's three, no more
  // The runs of one global batch are the same training, step for step.
  const std::string md = test::ReadFile(out + "/report.md");
  EXPECT_THAT(md, Not(HasSubstr("not comparable")));
  EXPECT_THAT(md, HasSubstr("training: the loss curves of"));
}

// Strategy auto through the coordinator: it picks the mesh predicted
// fastest when the job starts (rates of a made-up host here, so nothing is
// measured), the ranks train it and their logs say why, and compare sets
// auto beside DDP on the same global batch, the same losses.
TEST_F(CliJobCommandsTest, CompareTakesAutoAndTheCoordinatorPicksTheMesh) {
  const std::string cache = dir_ / "cache";
  ::setenv("XDG_CACHE_HOME", cache.c_str(), 1);
  HostRates rates;
  rates.cores = 2;
  rates.flops_per_thread = 2e10;
  rates.compute_model = "gpt2-tiny";
  rates.optimizer_seconds_per_parameter = 2e-9;
  rates.intra_node = {1e-4, 1e9};
  const absl::Status saved = SaveHostRates(rates);
  ::unsetenv("XDG_CACHE_HOME");
  ASSERT_TRUE(saved.ok()) << saved;
  DaemonOptions options;
  options.env = {{"XDG_CACHE_HOME", cache}};
  StartDaemon(options);
  const std::string out = dir_ / "auto";
  CommandResult compare = Cli(absl::StrCat(
      "compare --strategies ddp,auto --world-size 2 --model gpt2-tiny "
      "--data brown --batch-size 2 --seq-len 64 --max-steps 3 --eval-steps 1 "
      "--out ",
      out));
  ASSERT_EQ(compare.exit_code, 0) << compare.out << compare.err;
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(daemon_->jobs().ListJobs(&context, {}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 2);
  std::map<std::string, std::vector<double>> losses;
  std::string auto_id, chosen;
  for (const v1::Job& job : jobs.jobs()) {
    const std::string entry = job.spec().labels().at("strategy");
    EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString();
    EXPECT_EQ(job.spec().world_size(), 2) << entry;
    if (entry == "auto") {
      auto_id = job.id();
      EXPECT_EQ(job.spec().strategy().name(), "auto");
      ASSERT_TRUE(job.spec().labels().count("auto_mesh")) << job.DebugString();
      chosen = job.spec().labels().at("auto_mesh");
    }
    for (const v1::StepMetrics& m : daemon_->Metrics(job.id())) {
      if (m.rank() == 0) losses[entry].push_back(m.loss());
    }
  }
  // A mesh of the two ranks, as plan --fit names them.
  EXPECT_THAT((std::vector<std::string>{"ddp2", "fsdp2", "pp2", "tp2"}),
              ::testing::Contains(chosen));
  EXPECT_THAT(compare.err, HasSubstr("auto trained " + chosen));
  // The report's row and recommendation name the mesh auto trained, on
  // DDP's global batch.
  EXPECT_THAT(compare.out, HasSubstr("| auto: " + chosen + " | 2 |"));
  const std::string md = test::ReadFile(out + "/report.md");
  EXPECT_THAT(md, Not(HasSubstr("not comparable")));
  ASSERT_EQ(losses["auto"].size(), losses["ddp"].size());
  for (size_t i = 0; i < losses["auto"].size(); ++i) {
    EXPECT_NEAR(losses["auto"][i], losses["ddp"][i], 1e-6 * losses["ddp"][i])
        << "step " << i + 1;
  }
  const CommandResult logs = Cli("logs " + auto_id);
  EXPECT_THAT(logs.out, HasSubstr("auto: chose " + chosen)) << logs.err;
  EXPECT_THAT(logs.out, HasSubstr("meshes of 2 ranks weighed"));

  // An elastic auto job is taken: it is picked for again at each size.
  CommandResult elastic = Cli(
      "submit --strategy auto --world-size 2 --model gpt2-tiny --data "
      "brown --max-steps 2 --checkpoint-every 1 --min-world-size 1 -o json");
  ASSERT_EQ(elastic.exit_code, 0) << elastic.err;
  const nlohmann::json taken = nlohmann::json::parse(elastic.out);
  EXPECT_EQ(taken["spec"]["strategy"]["name"], "auto");
  EXPECT_EQ(taken["spec"]["elastic"]["min_world_size"], 1);
  EXPECT_EQ(Cli("cancel " + taken["id"].get<std::string>()).exit_code, 0);
}

// --memory-budget: every strategy and pipeline mesh at the largest batch
// its plan fits in the budget, each run under that cap; FSDP, holding a
// share of the model, gets a larger batch than DDP, and the table shows
// each batch.
TEST_F(CliJobCommandsTest, CompareUnderAMemoryBudgetRunsEachAtItsOwnBatch) {
  StartDaemon({});
  const std::string out = dir_ / "budget";
  CommandResult compare = Cli(absl::StrCat(
      "compare --strategies ddp,fsdp,pp2 --world-size 2 --model gpt2-tiny "
      "--data brown --seq-len 64 --max-steps 2 --eval-steps 1 "
      "--memory-budget 240MiB --out ",
      out));
  ASSERT_EQ(compare.exit_code, 0) << compare.out << compare.err;
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(daemon_->jobs().ListJobs(&context, {}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 3);
  std::map<std::string, int64_t> batch;
  for (const v1::Job& job : jobs.jobs()) {
    EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString();
    EXPECT_EQ(job.spec().trainer().memory_cap_bytes(), int64_t{240} << 20);
    absl::StatusOr<TrainConfig> config =
        TrainConfigFromJobSpec(job.spec(), "-");
    ASSERT_TRUE(config.ok()) << config.status();
    const std::string strategy = job.spec().labels().at("strategy");
    batch[strategy] = config->batch_size;
    EXPECT_EQ(
        config->batch_size,
        *LargestFittingBatch(*config, 2, PlannableBytes(int64_t{240} << 20)))
        << strategy;
    EXPECT_THAT(compare.out,
                HasSubstr(absl::StrFormat("| %s | 2 | %d |", strategy,
                                          config->batch_size)));
  }
  EXPECT_GT(batch["fsdp"], batch["ddp"]);
  EXPECT_GT(batch["pp2"], 0);
  EXPECT_THAT(test::ReadFile(out + "/report.md"),
              HasSubstr("largest per-rank batch its plan fits"));
}

}  // namespace
}  // namespace shardtrain
