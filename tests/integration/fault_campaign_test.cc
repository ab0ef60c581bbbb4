// The fault campaign: faults injected into a real shardtraind (fake workers,
// loopback only), counted. Each test prints one line
//   fault-campaign: <fault>: trials N, survived S, lost L (<details>)
// that docs/reliability.md collects, and fails on any loss.
// (A corrupted checkpoint is the trainer's to survive: trainer_test's
// ResumeFallsBackPastACorruptedCheckpoint.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/data/token_file.h"
#include "tests/integration/daemon_harness.h"

namespace shardtrain {
namespace {

using test::Daemon;
using test::DaemonOptions;
using test::FakeSpec;
using test::TempDir;
using ::testing::HasSubstr;

void Report(const std::string& fault, int trials, int survived, int lost,
            const std::string& details) {
  std::printf("fault-campaign: %s: trials %d, survived %d, lost %d (%s)\n",
              fault.c_str(), trials, survived, lost, details.c_str());
  std::fflush(stdout);
}

// Polls until job `id` is RUNNING (or 30 s pass); returns its state then.
v1::JobState WaitRunning(Daemon& daemon, const std::string& id) {
  return daemon
      .WaitFor(
          id, [](const v1::Job& j) { return j.state() == v1::RUNNING; },
          absl::Seconds(30))
      .state();
}

class FaultCampaignTest : public test::FakeWorkerDaemonTest {};

// An 8 MiB tmpfs at `path` for the disk-full faults, unmounted when it goes
// out of scope. Mounting needs CAP_SYS_ADMIN: without it mounted() is false
// and why_not() says so (the test then reports Skipped).
class SmallDisk {
 public:
  explicit SmallDisk(std::string path) : path_(std::move(path)) {
    std::filesystem::create_directories(path_);
    mounted_ = mount("tmpfs", path_.c_str(), "tmpfs", 0, "size=8m") == 0;
    if (!mounted_) {
      why_not_ =
          absl::StrCat("cannot mount a tmpfs to fill (", std::strerror(errno),
                       "): the disk-full fault needs CAP_SYS_ADMIN");
    }
  }
  ~SmallDisk() {
    if (mounted_) umount2(path_.c_str(), MNT_DETACH);
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;
  bool mounted() const { return mounted_; }
  const std::string& why_not() const { return why_not_; }
  // Fills the file system to its last 4 KiB block; Free() gives it back.
  void Fill() const {
    std::ofstream filler(path_ + "/filler", std::ios::binary);
    const std::string block(4096, 'x');
    while (filler.write(block.data(), block.size())) {
    }
  }
  void Free() const { std::filesystem::remove(path_ + "/filler"); }

 private:
  std::string path_;
  bool mounted_ = false;
  std::string why_not_;
};

// kill -9 of one rank at a random moment of a 2-rank job: the job fails that
// attempt (SIGNAL), restarts, and succeeds.
TEST_F(FaultCampaignTest, RankKilledAtARandomStepRestartsAndSucceeds) {
  constexpr int kTrials = 20;
  auto daemon = StartDaemon({});
  std::mt19937 rng(2026);
  int survived = 0;
  std::vector<int> delays_ms;
  for (int trial = 0; trial < kTrials; ++trial) {
    v1::Job job;
    ASSERT_GRPC_OK(daemon->Submit(
        FakeSpec("slow:50", data_, 2, /*max_restarts=*/1), &job));
    ASSERT_EQ(daemon
                  ->WaitFor(
                      job.id(),
                      [](const v1::Job& j) {
                        return j.state() == v1::RUNNING || test::IsTerminal(j);
                      },
                      absl::Seconds(30))
                  .state(),
              v1::RUNNING);
    const int delay = std::uniform_int_distribution<int>(0, 800)(rng);
    delays_ms.push_back(delay);
    absl::SleepFor(absl::Milliseconds(delay));
    const std::vector<int> pids = daemon->WorkerPids(job.id());
    if (!pids.empty()) {
      kill(pids[std::uniform_int_distribution<size_t>(0, pids.size() - 1)(rng)],
           SIGKILL);
    }
    const v1::Job done = daemon->WaitFor(
        job.id(), [](const v1::Job& j) { return test::IsTerminal(j); },
        absl::Seconds(60));
    // Killed mid-run: one restart. A kill that came as the job ended may
    // find nothing left to kill: no restart then, and that is fine too.
    const bool ok = done.state() == v1::SUCCEEDED &&
                    done.restarts() == (pids.empty() ? 0 : 1);
    EXPECT_TRUE(ok) << "trial " << trial << ": " << done.ShortDebugString();
    survived += ok;
  }
  Report(
      "rank kill -9 at a random step", kTrials, survived, kTrials - survived,
      absl::StrFormat("2-rank jobs of 50 steps, kill after %d-%d ms, "
                      "max_restarts 1",
                      *std::min_element(delays_ms.begin(), delays_ms.end()),
                      *std::max_element(delays_ms.begin(), delays_ms.end())));
}

// Preemptions that go wrong: the preempted job's ranks ignore the checkpoint
// request (killed after --preempt-grace), or the coordinator is killed while
// a job is PREEMPTED. Either way the urgent job runs, the preempted one is
// queued again and runs again (a preemption, not a restart), and nothing is
// stuck or lost.
TEST_F(FaultCampaignTest, BotchedPreemptionsLeaveNoJobStuckOrLost) {
  constexpr int kTrials = 3;
  auto one_trial = [&](Daemon* daemon, bool kill_coordinator,
                       std::unique_ptr<Daemon>* restarted) {
    v1::Job low, high;
    EXPECT_GRPC_OK(daemon->Submit(FakeSpec("hold-deaf", data_, 2), &low));
    if (WaitRunning(*daemon, low.id()) != v1::RUNNING) return false;
    v1::JobSpec urgent = FakeSpec("quick", data_);
    urgent.set_priority(10);
    EXPECT_GRPC_OK(daemon->Submit(urgent, &high));
    Daemon* now = daemon;
    if (kill_coordinator) {
      const v1::Job preempted = daemon->WaitFor(
          low.id(), [](const v1::Job& j) { return j.state() == v1::PREEMPTED; },
          absl::Seconds(30));
      if (preempted.state() != v1::PREEMPTED) return false;
      daemon->Signal(SIGKILL);
      daemon->WaitExit(absl::Seconds(10));
      DaemonOptions options;
      options.extra_flags = {"--preempt-grace", "60"};
      *restarted = StartDaemon(options);
      now = restarted->get();
    }
    const v1::Job urgent_done =
        now->WaitFor(high.id(), test::IsTerminal, absl::Seconds(60));
    const v1::Job again = now->WaitFor(
        low.id(),
        [](const v1::Job& j) {
          return (j.state() == v1::RUNNING && j.preemptions() > 0) ||
                 test::IsTerminal(j);
        },
        absl::Seconds(60));
    const bool ok = urgent_done.state() == v1::SUCCEEDED &&
                    again.state() == v1::RUNNING && again.preemptions() == 1 &&
                    again.restarts() == 0;
    EXPECT_TRUE(ok) << urgent_done.ShortDebugString() << "\n"
                    << again.ShortDebugString();
    v1::Job cancelled;
    EXPECT_GRPC_OK(now->Cancel(low.id(), &cancelled));
    EXPECT_EQ(
        now->WaitFor(low.id(), test::IsTerminal, absl::Seconds(30)).state(),
        v1::CANCELLED);
    return ok;
  };

  int survived = 0;
  {
    DaemonOptions options;
    options.extra_flags = {"--preempt-grace", "1"};
    auto daemon = StartDaemon(options, dir_ / "deaf");
    for (int trial = 0; trial < kTrials; ++trial) {
      survived += one_trial(daemon.get(), false, nullptr);
    }
  }
  Report("preempted ranks ignore the checkpoint request", kTrials, survived,
         kTrials - survived,
         "2-rank job ignoring SIGUSR1, killed after --preempt-grace 1 s; "
         "requeued and running again");

  survived = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    DaemonOptions options;
    options.extra_flags = {"--preempt-grace", "60"};
    auto daemon = StartDaemon(options);
    std::unique_ptr<Daemon> restarted;
    survived += one_trial(daemon.get(), true, &restarted);
  }
  Report("coordinator kill -9 while a job is PREEMPTED", kTrials, survived,
         kTrials - survived,
         "the next coordinator queues it again; it runs after the urgent job");
}

// A preempted job whose checkpoint directory cannot be written (a read-only
// file system mounted over it, which root cannot write either): its ranks
// fail to save the checkpoint asked for and exit 1. The job is queued again
// all the same, saying the checkpoint was not saved and that it resumes
// from the one before, and runs again once the urgent job is done: nothing
// stuck, nothing lost.
TEST_F(FaultCampaignTest, AnUnwritableCheckpointDirectoryLeavesNoJobStuck) {
  constexpr int kTrials = 3;
  DaemonOptions options;
  options.extra_flags = {"--preempt-grace", "30"};
  auto daemon = StartDaemon(options);
  int survived = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    v1::Job low, high;
    ASSERT_GRPC_OK(daemon->Submit(FakeSpec("hold-checkpoint", data_, 2), &low));
    ASSERT_EQ(WaitRunning(*daemon, low.id()), v1::RUNNING);
    const std::string checkpoints =
        daemon->state_dir() + "/jobs/" + low.id() + "/checkpoints";
    std::filesystem::create_directories(checkpoints);
    if (mount("tmpfs", checkpoints.c_str(), "tmpfs", MS_RDONLY, "size=1m") !=
        0) {
      GTEST_SKIP() << "cannot mount a read-only file system over "
                   << checkpoints << " (" << std::strerror(errno)
                   << "): the fault needs CAP_SYS_ADMIN";
    }
    // Its state changes as they happen, until it ends.
    grpc::ClientContext watch_context;
    v1::WatchJobRequest watch_request;
    watch_request.set_job_id(low.id());
    auto reader = daemon->jobs().WatchJob(&watch_context, watch_request);
    std::vector<std::string> changes;
    std::atomic<bool> watching{false};
    std::thread watcher([&] {
      v1::WatchJobEvent event;
      while (reader->Read(&event)) {
        watching = true;  // the first event: the job as it is now
        if (event.has_state_change()) {
          changes.push_back(event.state_change().message());
        }
      }
    });
    // The stream is served before the preemption it must see (the call is
    // asynchronous: without this the preemption can come first).
    ASSERT_TRUE(
        test::WaitUntil([&] { return watching.load(); }, absl::Seconds(10)));
    v1::JobSpec urgent = FakeSpec("sleep:1000", data_);
    urgent.set_priority(10);
    ASSERT_GRPC_OK(daemon->Submit(urgent, &high));
    const v1::Job urgent_done =
        daemon->WaitFor(high.id(), test::IsTerminal, absl::Seconds(60));
    const v1::Job again = daemon->WaitFor(
        low.id(),
        [](const v1::Job& j) {
          return (j.state() == v1::RUNNING && j.preemptions() > 0) ||
                 test::IsTerminal(j);
        },
        absl::Seconds(60));
    umount2(checkpoints.c_str(), MNT_DETACH);
    const std::string log = test::ReadFile(daemon->state_dir() + "/jobs/" +
                                           low.id() + "/rank-0.log");
    v1::Job cancelled;
    EXPECT_GRPC_OK(daemon->Cancel(low.id(), &cancelled));
    EXPECT_EQ(
        daemon->WaitFor(low.id(), test::IsTerminal, absl::Seconds(30)).state(),
        v1::CANCELLED);
    watcher.join();  // the stream ends with the job
    const bool said = std::any_of(
        changes.begin(), changes.end(), [](const std::string& message) {
          return absl::StrContains(
              message,
              "queued again, resumes from its latest checkpoint (the one "
              "asked for was not saved: rank ");
        });
    const bool ok =
        said && absl::StrContains(log, "cannot write the checkpoint") &&
        urgent_done.state() == v1::SUCCEEDED && again.state() == v1::RUNNING &&
        again.preemptions() == 1 && again.restarts() == 0;
    EXPECT_TRUE(ok) << absl::StrJoin(changes, "\n") << "\n"
                    << urgent_done.ShortDebugString() << "\n"
                    << again.ShortDebugString() << "\n"
                    << log;
    survived += ok;
  }
  Report("a preempted job's checkpoint directory is unwritable", kTrials,
         survived, kTrials - survived,
         "read-only file system over checkpoints/; its ranks fail the save "
         "and exit 1; queued again saying so, running again after the urgent "
         "job");
}

// kill -9 of the coordinator while 4 clients submit as fast as they can:
// every submission it acknowledged is there after a restart.
TEST_F(FaultCampaignTest,
       CoordinatorKilledDuringSubmitBurstsLosesNoAcknowledgedJob) {
  constexpr int kTrials = 3;
  constexpr int kClients = 4;
  int acknowledged_total = 0;
  int lost_total = 0;
  int survived = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    std::set<std::string> acknowledged;
    std::mutex mutex;
    {
      auto daemon = StartDaemon({});
      std::atomic<bool> stop{false};
      std::vector<std::thread> clients;
      for (int c = 0; c < kClients; ++c) {
        clients.emplace_back([&] {
          auto channel = grpc::CreateChannel(
              daemon->address(), grpc::InsecureChannelCredentials());
          auto stub = v1::JobService::NewStub(channel);
          while (!stop) {
            grpc::ClientContext context;
            context.set_deadline(std::chrono::system_clock::now() +
                                 std::chrono::seconds(5));
            v1::SubmitJobRequest request;
            *request.mutable_spec() = FakeSpec("quick", data_);
            v1::Job job;
            if (stub->SubmitJob(&context, request, &job).ok()) {
              std::lock_guard<std::mutex> lock(mutex);
              acknowledged.insert(job.id());
            } else {
              absl::SleepFor(absl::Milliseconds(5));
            }
          }
        });
      }
      absl::SleepFor(absl::Milliseconds(300 + 200 * trial));
      daemon->Signal(SIGKILL);
      daemon->WaitExit(absl::Seconds(10));
      stop = true;
      for (std::thread& t : clients) t.join();
    }
    auto restarted = StartDaemon({});
    std::set<std::string> present;
    v1::ListJobsRequest request;
    request.set_page_size(1000);
    do {
      grpc::ClientContext context;
      v1::ListJobsResponse list;
      ASSERT_GRPC_OK(restarted->jobs().ListJobs(&context, request, &list));
      for (const v1::Job& job : list.jobs()) present.insert(job.id());
      request.set_page_token(list.next_page_token());
    } while (!request.page_token().empty());
    int lost = 0;
    for (const std::string& id : acknowledged) {
      if (present.count(id) == 0) {
        ++lost;
        ADD_FAILURE() << "trial " << trial << ": acknowledged " << id
                      << " is gone after the restart";
      }
    }
    acknowledged_total += static_cast<int>(acknowledged.size());
    lost_total += lost;
    survived += lost == 0 && !acknowledged.empty();
    EXPECT_FALSE(acknowledged.empty()) << "the burst submitted nothing";
  }
  Report("coordinator kill -9 during submit bursts", kTrials, survived,
         kTrials - survived,
         absl::StrFormat("%d clients; %d submissions acknowledged, %d of them "
                         "missing after restart",
                         kClients, acknowledged_total, lost_total));
}

// A rank stopped with SIGSTOP (alive, silent) fails its job as HANG within
// the heartbeat timeout.
TEST_F(FaultCampaignTest, StalledRankIsDetectedAsHangWithinTheTimeout) {
  constexpr int kTrials = 3;
  constexpr double kTimeout = 3;
  constexpr double kGrace = 1;  // then the stopped rank is SIGKILLed
  DaemonOptions options;
  options.heartbeat_interval = 0.5;
  options.heartbeat_timeout = kTimeout;
  options.grace_period = kGrace;
  auto daemon = StartDaemon(options);
  int survived = 0;
  double worst = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    v1::Job job;
    ASSERT_GRPC_OK(daemon->Submit(FakeSpec("hold", data_, 2), &job));
    ASSERT_EQ(WaitRunning(*daemon, job.id()), v1::RUNNING);
    const std::vector<int> pids = daemon->WorkerPids(job.id());
    ASSERT_EQ(pids.size(), 2u);
    const absl::Time stopped = absl::Now();
    kill(pids[trial % 2], SIGSTOP);
    const v1::Job done = daemon->WaitFor(
        job.id(), [](const v1::Job& j) { return test::IsTerminal(j); },
        absl::Seconds(30));
    const double took = absl::ToDoubleSeconds(absl::Now() - stopped);
    worst = std::max(worst, took);
    kill(pids[trial % 2], SIGCONT);  // let it take its SIGKILL, if pending
    const bool ok = done.state() == v1::FAILED &&
                    done.failure().reason() == v1::HANG &&
                    took < kTimeout + kGrace + 1.5;
    EXPECT_TRUE(ok) << "trial " << trial << " (" << took
                    << " s): " << done.ShortDebugString();
    survived += ok;
  }
  Report("rank SIGSTOP", kTrials, survived, kTrials - survived,
         absl::StrFormat("FAILED as HANG at most %.1f s after the stop, with "
                         "a %.0f s heartbeat timeout + %.0f s grace",
                         worst, kTimeout, kGrace));
}

// The state directory's disk fills up: submissions are refused with a clear
// status, every stored job stays readable, and once space is freed the
// daemon takes work again.
TEST_F(FaultCampaignTest, FullDiskRefusesNewWorkAndLosesNothingStored) {
  const std::string state = dir_ / "small-state";
  SmallDisk disk(state);
  if (!disk.mounted()) GTEST_SKIP() << disk.why_not();
  DaemonOptions options;
  options.extra_flags = {"--min-free-mb", "1"};
  int trials = 0, survived = 0;
  std::string refusal;
  {
    auto daemon = StartDaemon(options, state);
    std::vector<std::string> stored;
    for (int i = 0; i < 3; ++i) {
      v1::Job job;
      ASSERT_GRPC_OK(daemon->Submit(FakeSpec("quick", data_), &job));
      stored.push_back(job.id());
    }
    for (const std::string& id : stored) {
      ASSERT_EQ(
          daemon
              ->WaitFor(
                  id, [](const v1::Job& j) { return test::IsTerminal(j); },
                  absl::Seconds(30))
              .state(),
          v1::SUCCEEDED);
    }
    disk.Fill();
    for (int i = 0; i < 5; ++i) {
      ++trials;
      v1::Job job;
      const grpc::Status status =
          daemon->Submit(FakeSpec("quick", data_), &job);
      const bool refused =
          status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
          absl::StrContains(status.error_message(), "free");
      EXPECT_TRUE(refused) << status.error_message();
      refusal = status.error_message();
      // Everything stored is still there and readable.
      bool all_there = true;
      for (const std::string& id : stored) {
        all_there = all_there && daemon->Get(id).state() == v1::SUCCEEDED;
      }
      EXPECT_TRUE(all_there);
      survived += refused && all_there;
    }
    disk.Free();
    v1::Job after;
    EXPECT_TRUE(daemon->Submit(FakeSpec("quick", data_), &after).ok())
        << "space freed: submissions work again";
  }
  {
    // And after a restart on that disk, nothing is missing.
    auto daemon = StartDaemon(options, state);
    grpc::ClientContext context;
    v1::ListJobsResponse list;
    ASSERT_GRPC_OK(daemon->jobs().ListJobs(&context, {}, &list));
    EXPECT_EQ(list.jobs_size(), 4);
  }
  Report("state directory disk full", trials, survived, trials - survived,
         "8 MiB tmpfs filled; refusal: " + refusal.substr(0, 60) + "...");
}

// Cancels on a full disk: a cancel the daemon acknowledges must survive a
// restart (it was stored first); one it cannot store is refused with the
// reason and changes nothing. Queued jobs (cancelled at once) and running
// ones (stopped) both.
TEST_F(FaultCampaignTest, CancelsAreAcknowledgedOnlyOnceStored) {
  const std::string state = dir_ / "full-state";
  SmallDisk disk(state);
  if (!disk.mounted()) GTEST_SKIP() << disk.why_not();
  DaemonOptions options;
  options.cpu_slots = 2;
  options.extra_flags = {"--min-free-mb", "1"};
  std::vector<std::string> ids;
  std::vector<bool> acknowledged;
  int refused = 0;
  {
    auto daemon = StartDaemon(options, state);
    for (int i = 0; i < 4; ++i) {  // two run (2 slots), two stay queued
      v1::Job job;
      ASSERT_GRPC_OK(daemon->Submit(FakeSpec("hold", data_), &job));
      ids.push_back(job.id());
    }
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(WaitRunning(*daemon, ids[i]), v1::RUNNING);
    }
    disk.Fill();
    for (const std::string& id : ids) {
      grpc::ClientContext context;
      v1::CancelJobRequest request;
      request.set_job_id(id);
      v1::Job answer;
      const grpc::Status status =
          daemon->jobs().CancelJob(&context, request, &answer);
      acknowledged.push_back(status.ok());
      if (!status.ok()) {
        ++refused;
        EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
        EXPECT_THAT(status.error_message(), HasSubstr("could not be stored"));
      }
    }
    daemon->Signal(SIGKILL);  // no chance to store anything more
    daemon->WaitExit(absl::Seconds(10));
  }
  disk.Free();
  auto daemon = StartDaemon(options, state);
  int kept = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const v1::Job job = daemon->Get(ids[i]);
    if (acknowledged[i]) {
      EXPECT_EQ(job.state(), v1::CANCELLED)
          << ids[i]
          << " was acknowledged as cancelled; after the restart it is "
          << v1::JobState_Name(job.state());
      kept += job.state() == v1::CANCELLED;
    } else {
      EXPECT_NE(job.state(), v1::CANCELLED) << ids[i];
    }
  }
  const int acked = static_cast<int>(ids.size()) - refused;
  Report("cancel on a full disk", static_cast<int>(ids.size()), kept + refused,
         acked - kept,
         absl::StrFormat("%d refused as not stored, %d acknowledged and still "
                         "CANCELLED after kill -9 and restart",
                         refused, kept));
}

// The other write paths on a full disk: step metrics arriving, a job
// ending, the next job's launch files. The daemon answers throughout; what
// happened while nothing could be stored (a job succeeded) is kept and
// stored once space returns, so a kill -9 after that loses nothing; steps
// the store refused are sent again by the worker and stored once each.
TEST_F(FaultCampaignTest, EveryWritePathOnAFullDiskCatchesUpWhenSpaceReturns) {
  const std::string state = dir_ / "full-writes";
  SmallDisk disk(state);
  if (!disk.mounted()) GTEST_SKIP() << disk.why_not();
  DaemonOptions options;
  options.cpu_slots = 2;
  options.extra_flags = {"--min-free-mb", "1"};
  constexpr int kSteps = 150;  // 3 s of steps, 20 ms apart
  std::string stepping, ending, next;
  int answered = 0, slow_answers = 0;
  std::map<std::string, v1::JobState> before_kill;
  {
    auto daemon = StartDaemon(options, state);
    v1::Job job;
    ASSERT_GRPC_OK(
        daemon->Submit(FakeSpec(absl::StrCat("slow:", kSteps), data_), &job));
    stepping = job.id();
    ASSERT_GRPC_OK(daemon->Submit(FakeSpec("sleep:1500", data_), &job));
    ending = job.id();
    ASSERT_GRPC_OK(daemon->Submit(FakeSpec("quick", data_), &job));
    next = job.id();  // queued: launched when `ending` frees its slot
    for (const std::string& id : {stepping, ending}) {
      ASSERT_EQ(WaitRunning(*daemon, id), v1::RUNNING);
    }
    disk.Fill();
    // Full for 3 s: `ending` exits 0 and `next` is launched meanwhile;
    // every call is answered promptly.
    const absl::Time full_until = absl::Now() + absl::Seconds(3);
    v1::JobState ending_state = v1::RUNNING;
    while (absl::Now() < full_until) {
      const absl::Time asked = absl::Now();
      ending_state = daemon->Get(ending).state();
      ++answered;
      slow_answers += absl::Now() - asked > absl::Seconds(1);
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_EQ(ending_state, v1::SUCCEEDED)
        << "a job that ended on a full disk is seen to have ended";
    EXPECT_EQ(slow_answers, 0);
    disk.Free();
    for (const std::string& id : {stepping, ending, next}) {
      const v1::Job done = daemon->WaitFor(
          id, [](const v1::Job& j) { return test::IsTerminal(j); },
          absl::Seconds(60));
      EXPECT_TRUE(test::IsTerminal(done)) << id;
      before_kill[id] = done.state();
    }
    EXPECT_EQ(before_kill[stepping], v1::SUCCEEDED);
    // Launched while full: it ran, or failed naming the disk.
    const v1::Job launched = daemon->Get(next);
    if (launched.state() != v1::SUCCEEDED) {
      EXPECT_THAT(launched.state_reason(), HasSubstr("No space left"))
          << launched.DebugString();
    }
    // Give the supervisor a tick to store what it kept, then no chance to
    // store anything more.
    absl::SleepFor(absl::Seconds(1));
    daemon->Signal(SIGKILL);
    daemon->WaitExit(absl::Seconds(10));
  }
  auto daemon = StartDaemon(options, state);
  int kept = 0;
  for (const auto& [id, was] : before_kill) {
    const v1::JobState now = daemon->Get(id).state();
    EXPECT_EQ(now, was) << id << " was " << v1::JobState_Name(was)
                        << " before kill -9; after the restart "
                        << v1::JobState_Name(now);
    kept += now == was;
  }
  std::vector<v1::StepMetrics> steps = daemon->Metrics(stepping);
  std::set<int64_t> distinct;
  for (const v1::StepMetrics& step : steps) distinct.insert(step.step());
  EXPECT_EQ(steps.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(distinct.size(), static_cast<size_t>(kSteps));
  EXPECT_GE(answered, 20);
  Report(
      "every write path on a full disk", 3, kept, 3 - kept,
      absl::StrFormat("3 s full while %d steps streamed, a job ended and "
                      "one launched; %d calls answered, %d slower than "
                      "1 s; %zu of %d steps stored once each; states the "
                      "same after kill -9 and restart",
                      kSteps, answered, slow_answers, distinct.size(), kSteps));
}

// train.bin turned into a FIFO, truncated, replaced by a symlink, removed
// and restored, as fast as a thread can, while jobs are submitted: the
// daemon reads nothing but each file's header (never blocking on a FIFO,
// never mapping), so every call is answered promptly, the daemon lives, and
// every accepted job ends.
TEST_F(FaultCampaignTest, AChangingTrainBinNeverStallsOrKillsTheDaemon) {
  const std::string data = dir_ / "flipping";
  std::filesystem::create_directories(data);
  const std::string train = data + "/train.bin";
  std::vector<uint16_t> tokens(4096, 11);
  ASSERT_TRUE(WriteTokenFile(dir_ / "good.bin", tokens).ok());
  std::filesystem::copy_file(dir_ / "good.bin", train);
  auto daemon = StartDaemon({});
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    for (int i = 0; !stop; ++i) {
      std::error_code ec;
      std::filesystem::remove(train, ec);
      switch (i % 4) {
        case 0:
          mkfifo(train.c_str(), 0600);
          break;
        case 1:
          std::filesystem::copy_file(dir_ / "good.bin", train, ec);
          truncate(train.c_str(), 600);  // mid-header
          break;
        case 2:
          std::filesystem::create_symlink(dir_ / "good.bin", train, ec);
          break;
        default:
          std::filesystem::copy_file(dir_ / "good.bin", train, ec);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
  });
  constexpr int kSubmissions = 40;
  int accepted = 0, answered_promptly = 0;
  std::vector<std::string> ids;
  double slowest = 0;
  for (int i = 0; i < kSubmissions; ++i) {
    const absl::Time start = absl::Now();
    v1::Job job;
    const grpc::Status status = daemon->Submit(FakeSpec("quick", data), &job);
    const v1::Job got = status.ok() ? daemon->Get(job.id()) : v1::Job();
    const double took = absl::ToDoubleSeconds(absl::Now() - start);
    slowest = std::max(slowest, took);
    answered_promptly += took < 2.0;
    if (status.ok()) {
      ++accepted;
      ids.push_back(job.id());
      EXPECT_EQ(got.id(), job.id());
    } else {
      EXPECT_FALSE(status.error_message().empty());
    }
  }
  stop = true;
  flipper.join();
  EXPECT_EQ(answered_promptly, kSubmissions) << "slowest " << slowest << " s";
  // Fatal: a dead daemon would leave every wait below to time out.
  ASSERT_TRUE(daemon->Running()) << "the daemon died:\n" << daemon->log();
  int ended = 0;
  for (const std::string& id : ids) {
    ended += test::IsTerminal(daemon->WaitFor(
        id, [](const v1::Job& j) { return test::IsTerminal(j); },
        absl::Seconds(60)));
  }
  EXPECT_EQ(ended, accepted);
  Report("train.bin flipped (FIFO, truncated, symlink, removed) during submits",
         kSubmissions, answered_promptly, kSubmissions - answered_promptly,
         absl::StrFormat("%d accepted, all ended; slowest answer %.2f s",
                         accepted, slowest));
}

// Hostile inputs under --path-root: --init-from directories inside the root
// whose files lead out of it (to a secret, to /dev/zero), FIFOs where a file
// is expected. Each submission is refused at once, naming the file and the
// cause without quoting the outside file; the daemon stays up.
TEST_F(FaultCampaignTest, HostileInputsUnderAPathRootAreRefusedByName) {
  namespace fs = std::filesystem;
  const std::string root = dir_ / "root";
  fs::create_directories(root + "/data");
  fs::create_directories(dir_ / "outside");
  test::WriteFile(dir_ / "outside/secret", "SECRET-CONTENTS");
  ASSERT_TRUE(
      WriteTokenFile(root + "/data/train.bin", std::vector<uint16_t>(4096, 11))
          .ok());
  struct Case {
    std::string name;
    std::function<std::string()> make;  // returns the init_from path
    std::string expected;
  };
  auto dir_with = [&](const std::string& dir, const std::string& file,
                      const std::string& target) {
    fs::create_directories(
        fs::path(root + "/" + dir + "/" + file).parent_path());
    test::WriteFile(root + "/" + dir + "/config.json", "{}");
    fs::create_symlink(target, root + "/" + dir + "/" + file);
    return root + "/" + dir;
  };
  const std::vector<Case> cases = {
      {"weights linked outside",
       [&] {
         return dir_with("hf", "model.safetensors", dir_ / "outside/secret");
       },
       "trainer.init_from (model.safetensors)"},
      {"metadata linked outside",
       [&] {
         return dir_with("ckpt", "checkpoint.json", dir_ / "outside/secret");
       },
       "trainer.init_from (checkpoint.json)"},
      {"latest linked to /dev/zero",
       [&] { return dir_with("run", "checkpoints/latest", "/dev/zero"); },
       "trainer.init_from (checkpoints/latest)"},
      {"a FIFO as the model",
       [&] {
         mkfifo((root + "/fifo.bin").c_str(), 0600);
         return root + "/fifo.bin";
       },
       "is a FIFO"},
  };
  auto daemon = StartDaemon({.extra_flags = {"--path-root", root}});
  int refused_by_name = 0, leaked = 0;
  double slowest = 0;
  for (const Case& c : cases) {
    v1::JobSpec spec = FakeSpec("hostile", root + "/data");
    spec.mutable_trainer()->set_init_from(c.make());
    const absl::Time start = absl::Now();
    v1::Job job;
    const grpc::Status status = daemon->Submit(spec, &job);
    slowest = std::max(slowest, absl::ToDoubleSeconds(absl::Now() - start));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name;
    EXPECT_THAT(status.error_message(), HasSubstr(c.expected)) << c.name;
    refused_by_name += !status.ok() && status.error_message().find(
                                           c.expected) != std::string::npos;
    leaked += status.error_message().find("SECRET") != std::string::npos;
  }
  EXPECT_EQ(leaked, 0);
  ASSERT_TRUE(daemon->Running()) << "the daemon died:\n" << daemon->log();
  Report("hostile init_from directories and FIFOs under --path-root",
         static_cast<int>(cases.size()), refused_by_name,
         static_cast<int>(cases.size()) - refused_by_name,
         absl::StrFormat("refused at submit naming the file, %d leaked "
                         "outside bytes; slowest answer %.2f s",
                         leaked, slowest));
}

}  // namespace
}  // namespace shardtrain
