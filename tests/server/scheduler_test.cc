#include "server/scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SchedulerTest, HigherPriorityStartsFirstAndFifoWithinAPriority) {
  const ScheduleDecision d =
      Schedule({{"a", 0, 1, 1}, {"b", 5, 2, 1}, {"c", 0, 3, 1}, {"d", 5, 4, 1}},
               {0, 1, 2, 3});
  ASSERT_EQ(d.start.size(), 4u);
  EXPECT_EQ(d.start[0].job_id, "b");
  EXPECT_EQ(d.start[1].job_id, "d");
  EXPECT_EQ(d.start[2].job_id, "a");
  EXPECT_EQ(d.start[3].job_id, "c");
  EXPECT_THAT(d.start[0].devices, ElementsAre(0));
  EXPECT_THAT(d.start[3].devices, ElementsAre(3));
}

TEST(SchedulerTest, AJobNeverStartsOnPartOfItsDevices) {
  const ScheduleDecision d = Schedule({{"big", 0, 1, 4}}, {1, 3});
  EXPECT_TRUE(d.start.empty());
  EXPECT_THAT(d.waiting.at("big"), HasSubstr("needs 4 devices, 2 free"));
}

TEST(SchedulerTest, NothingOvertakesAWaitingHead) {
  // "small" would fit, but starting it could starve "big" forever.
  const ScheduleDecision d =
      Schedule({{"big", 1, 1, 3}, {"small", 0, 2, 1}}, {0, 1});
  EXPECT_TRUE(d.start.empty());
  EXPECT_THAT(d.waiting.at("small"), HasSubstr("behind big"));
}

TEST(SchedulerTest, StartsAsManyAsFitThenWaits) {
  const ScheduleDecision d =
      Schedule({{"a", 0, 1, 2}, {"b", 0, 2, 2}, {"c", 0, 3, 1}}, {0, 1, 2});
  ASSERT_EQ(d.start.size(), 1u);
  EXPECT_THAT(d.start[0].devices, ElementsAre(0, 1));
  EXPECT_THAT(d.waiting.at("b"), HasSubstr("needs 2 devices, 1 free"));
  EXPECT_THAT(d.waiting.at("c"), HasSubstr("behind b"));
}

// --- quotas, preemption and backfill ---

const absl::Time kNow = absl::FromUnixSeconds(1'000'000);

RunningJobRef Running(std::string id, int priority, int devices,
                      absl::Time started, std::string owner = "") {
  RunningJobRef job;
  job.job_id = std::move(id);
  job.priority = priority;
  job.preemptible = true;
  job.owner = std::move(owner);
  job.devices = devices;
  job.started = started;
  return job;
}

TEST(SchedulerTest, AJobOverItsOwnersQuotaWaitsWithoutHoldingUpOthers) {
  ScheduleInput input;
  input.queue = {{"a2", 5, 1, 2, "alice"}, {"b1", 0, 2, 1, "bob"}};
  input.free_devices = {2, 3};
  input.running = {Running("a1", 0, 2, kNow, "alice")};
  input.quota = [](const std::string& user) { return user == "alice" ? 3 : 0; };
  input.now = kNow;
  const ScheduleDecision d = Schedule(input);
  // alice holds 2 of 3: her 2-device job waits (though higher priority and
  // fitting), and bob's starts.
  EXPECT_EQ(d.waiting.at("a2"),
            "alice holds 2 of their 3 devices (quota); this job needs 2");
  ASSERT_EQ(d.start.size(), 1u);
  EXPECT_EQ(d.start[0].job_id, "b1");
  EXPECT_TRUE(d.preempt.empty());
  // Without the quota alice's job starts first.
  input.quota = nullptr;
  EXPECT_EQ(Schedule(input).start[0].job_id, "a2");
}

TEST(SchedulerTest, PreemptsTheLowestPriorityThenTheMostRecentlyStarted) {
  ScheduleInput input;
  input.queue = {{"urgent", 10, 9, 2}};
  input.free_devices = {};
  input.now = kNow;
  input.running = {Running("old-low", 0, 1, kNow - absl::Hours(2)),
                   Running("new-low", 0, 1, kNow - absl::Hours(1)),
                   Running("mid", 5, 1, kNow - absl::Hours(3)),
                   Running("top", 20, 1, kNow - absl::Hours(4))};
  ScheduleDecision d = Schedule(input);
  ASSERT_EQ(d.preempt.size(), 2u);
  EXPECT_EQ(d.preempt[0].job_id, "new-low");
  EXPECT_EQ(d.preempt[1].job_id, "old-low");
  EXPECT_EQ(d.preempt[0].for_job, "urgent");
  EXPECT_TRUE(d.start.empty());  // it starts once they have stopped
  EXPECT_THAT(d.waiting.at("urgent"),
              HasSubstr("preempting new-low (priority 0, 1 device), "
                        "preempting old-low"));

  // One free device: only one job is preempted.
  input.free_devices = {7};
  d = Schedule(input);
  ASSERT_EQ(d.preempt.size(), 1u);
  EXPECT_EQ(d.preempt[0].job_id, "new-low");
}

TEST(SchedulerTest, NeverPreemptsEqualPriorityOrNonPreemptibleJobs) {
  ScheduleInput input;
  input.queue = {{"q", 5, 9, 2}};
  input.now = kNow;
  RunningJobRef pinned = Running("pinned", 0, 1, kNow);
  pinned.preemptible = false;
  input.running = {pinned, Running("peer", 5, 1, kNow)};
  ScheduleDecision d = Schedule(input);
  EXPECT_TRUE(d.preempt.empty());
  EXPECT_THAT(d.waiting.at("q"), HasSubstr("needs 2 devices, 0 free"));
  // Not enough even with every candidate: nobody is preempted for nothing.
  input.running.push_back(Running("low", 0, 1, kNow));
  input.queue = {{"q", 5, 9, 3}};
  EXPECT_TRUE(Schedule(input).preempt.empty());
}

TEST(SchedulerTest, WhileChosenJobsStopNobodyElseIsPreempted) {
  ScheduleInput input;
  input.queue = {{"urgent", 10, 9, 2}};
  input.now = kNow;
  RunningJobRef stopping = Running("stopping", 0, 2, kNow);
  stopping.stopping = true;
  input.running = {stopping, Running("other", 0, 2, kNow)};
  const ScheduleDecision d = Schedule(input);
  EXPECT_TRUE(d.preempt.empty());
  EXPECT_THAT(d.waiting.at("urgent"),
              HasSubstr("waiting for stopping to stop"));
}

// An elastic job gives up only what is missing, at a world it may run at;
// when the queue is empty again it grows back onto the free devices.
TEST(SchedulerTest, ElasticJobsShrinkForTheHeadAndGrowBack) {
  ScheduleInput input;
  input.queue = {{"urgent", 10, 9, 2}};
  input.free_devices = {};
  input.now = kNow;
  RunningJobRef elastic = Running("elastic", 0, 8, kNow - absl::Hours(1));
  elastic.worlds = {2, 4, 8};  // 3, 5, 6, 7 do not share its batch
  input.running = {elastic};
  ScheduleDecision d = Schedule(input);
  ASSERT_EQ(d.preempt.size(), 1u);
  EXPECT_EQ(d.preempt[0].job_id, "elastic");
  EXPECT_EQ(d.preempt[0].shrink_to, 4);
  EXPECT_THAT(d.waiting.at("urgent"),
              HasSubstr("shrinking elastic (priority 0) from 8 to 4 devices"));
  // Needing 7: its smallest world (2) gives 6, and a stopped job the rest.
  input.queue = {{"urgent", 10, 9, 7}};
  input.running.push_back(Running("other", 0, 1, kNow));
  d = Schedule(input);
  ASSERT_EQ(d.preempt.size(), 2u);
  EXPECT_EQ(d.preempt[0].job_id, "other");  // started last
  EXPECT_EQ(d.preempt[0].shrink_to, 0);
  EXPECT_EQ(d.preempt[1].job_id, "elastic");
  EXPECT_EQ(d.preempt[1].shrink_to, 2);

  // Later: running at 2 with 5 devices free and nothing queued: it grows
  // to 4 (8 would need 6 more).
  ScheduleInput later;
  later.free_devices = {2, 3, 4, 5, 6};
  later.now = kNow;
  RunningJobRef shrunk = Running("elastic", 0, 2, kNow);
  shrunk.worlds = {2, 4, 8};
  later.running = {shrunk};
  d = Schedule(later);
  ASSERT_EQ(d.grow.size(), 1u);
  EXPECT_EQ(d.grow[0].to_world, 4);
  EXPECT_THAT(d.grow[0].devices, ElementsAre(2, 3));
  // Not while anyone waits for devices.
  later.queue = {{"big", 0, 9, 9}};
  EXPECT_TRUE(Schedule(later).grow.empty());
}

// Growth is a grant like any start: alice (quota 4) holds her elastic job's
// 2 devices and a 1-device job, so her elastic job may not grow to 4 (it
// would hold 5 of 4), and grows only to what her quota leaves once she
// has more room; bob's, without a cap, grows to its full size.
TEST(SchedulerTest, AnElasticJobGrowsOnlyWithinItsOwnersQuota) {
  ScheduleInput input;
  input.free_devices = {3, 4, 5, 6, 7, 8, 9};
  input.now = kNow;
  RunningJobRef elastic = Running("elastic", 0, 2, kNow, "alice");
  elastic.worlds = {1, 2, 3, 4};
  input.running = {elastic, Running("small", 0, 1, kNow, "alice")};
  input.quota = [](const std::string& user) { return user == "alice" ? 4 : 0; };
  ScheduleDecision d = Schedule(input);
  ASSERT_EQ(d.grow.size(), 1u);
  EXPECT_EQ(d.grow[0].to_world, 3);  // 3 + 1 = her 4
  input.quota = [](const std::string& user) { return user == "alice" ? 3 : 0; };
  EXPECT_TRUE(Schedule(input).grow.empty());
  RunningJobRef bobs = Running("bobs", 0, 1, kNow, "bob");
  bobs.worlds = {1, 2, 4};
  input.running.push_back(bobs);
  d = Schedule(input);
  ASSERT_EQ(d.grow.size(), 1u);
  EXPECT_EQ(d.grow[0].job_id, "bobs");
  EXPECT_EQ(d.grow[0].to_world, 4);
}

TEST(QuotaLedgerTest, SaysWhoMayHoldHowManyMore) {
  QuotaLedger ledger(
      [](const std::string& user) { return user == "alice" ? 3 : 0; });
  ledger.Hold("alice", 2);
  ledger.Hold("bob", 50);
  EXPECT_EQ(ledger.Headroom("alice"), 1);
  EXPECT_TRUE(ledger.MayHold("alice", 1));
  EXPECT_FALSE(ledger.MayHold("alice", 2));
  EXPECT_TRUE(ledger.MayHold("bob", 1000));
  EXPECT_EQ(ledger.Refusal("alice", 2),
            "alice holds 2 of their 3 devices (quota); this job needs 2");
  ledger.Hold("alice", 2);  // over it (the quota was lowered): no headroom
  EXPECT_EQ(ledger.Headroom("alice"), 0);
  EXPECT_TRUE(QuotaLedger(nullptr).MayHold("anyone", 1 << 20));
}

// EASY backfill: 4 devices; a job on 2 of them ends in 100 s; the head needs
// 3. At its predicted start 4 are free, one more than it needs: a 1-device
// job may start now on a free device, a 2-device job may not (it would
// delay the head).
TEST(SchedulerTest, BackfillsOnlyWhatLeavesTheHeadItsPredictedStart) {
  ScheduleInput input;
  input.queue = {{"head", 0, 1, 3}, {"two", 0, 2, 2}, {"one", 0, 3, 1}};
  input.free_devices = {2, 3};
  input.now = kNow;
  RunningJobRef busy = Running("busy", 0, 2, kNow - absl::Minutes(5));
  busy.predicted_end = kNow + absl::Seconds(100);
  input.running = {busy};
  ScheduleDecision d = Schedule(input);
  ASSERT_EQ(d.start.size(), 1u);
  EXPECT_EQ(d.start[0].job_id, "one");
  EXPECT_TRUE(d.start[0].backfilled);
  EXPECT_THAT(d.start[0].devices, ElementsAre(2));
  EXPECT_THAT(d.waiting.at("two"), HasSubstr("behind head (priority 0)"));
  EXPECT_EQ(d.head, "head");
  ASSERT_TRUE(d.head_predicted_start.has_value());
  EXPECT_EQ(*d.head_predicted_start, kNow + absl::Seconds(100));
  EXPECT_THAT(d.waiting.at("head"), HasSubstr("predicted to start in 1m40s"));

  // 100 s later "busy" ended, "one" (no prediction) still runs: the head
  // starts as predicted.
  ScheduleInput later;
  later.queue = {{"head", 0, 1, 3}, {"two", 0, 2, 2}};
  later.free_devices = {0, 1, 3};
  later.now = kNow + absl::Seconds(100);
  later.running = {Running("one", 0, 1, kNow)};
  d = Schedule(later);
  ASSERT_FALSE(d.start.empty());
  EXPECT_EQ(d.start[0].job_id, "head");
  EXPECT_FALSE(d.start[0].backfilled);
}

// The job the head waits for runs past its predicted end: no predicted
// start in the past, and the reason says what happened; a job that would
// delay the head is not backfilled ahead of it.
TEST(SchedulerTest, APredictedStartIsNeverInThePast) {
  ScheduleInput input;
  input.queue = {{"head", 0, 1, 3}, {"two", 0, 2, 2}};
  input.free_devices = {2, 3};
  input.now = kNow;
  RunningJobRef late = Running("late", 0, 2, kNow - absl::Minutes(5));
  late.predicted_end = kNow - absl::Seconds(2);
  input.running = {late};
  const ScheduleDecision d = Schedule(input);
  EXPECT_EQ(d.head, "head");
  EXPECT_FALSE(d.head_predicted_start.has_value());
  EXPECT_THAT(d.waiting.at("head"),
              HasSubstr("expected to start any moment: the jobs it waits for "
                        "are past their predicted end"));
  EXPECT_TRUE(d.start.empty());
}

TEST(SchedulerTest, WithoutAPredictionNothingOvertakesTheHead) {
  ScheduleInput input;
  input.queue = {{"head", 0, 1, 3}, {"one", 0, 2, 1}};
  input.free_devices = {2, 3};
  input.now = kNow;
  input.running = {Running("busy", 0, 2, kNow)};  // no step reported yet
  const ScheduleDecision d = Schedule(input);
  EXPECT_TRUE(d.start.empty());
  EXPECT_FALSE(d.head_predicted_start.has_value());
  EXPECT_THAT(d.waiting.at("one"), HasSubstr("behind head"));
}

}  // namespace
}  // namespace shardtrain
