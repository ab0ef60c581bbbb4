// HeartbeatMonitor over an in-memory store: which ranks it calls lost, how
// soon, and what it says when the store itself goes away.
#include "worker/engine/comm/heartbeat_monitor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace shardtrain {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// One key-value map shared by the ranks' store handles. It can be made to
// fail (the host is gone) or to hang (the host is frozen).
class FakeStoreHost {
 public:
  void Fail() {
    std::lock_guard<std::mutex> lock(mutex_);
    failing_ = true;
  }
  void Hang() {
    std::lock_guard<std::mutex> lock(mutex_);
    hanging_ = true;
  }
  void Resume() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      hanging_ = false;
    }
    cv_.notify_all();
  }

  absl::Status Set(const std::string& key, int64_t value) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !hanging_; });
    if (failing_) return absl::UnavailableError("Connection reset by peer");
    values_[key] = value;
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> Get(const std::string& key) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !hanging_; });
    if (failing_) return absl::UnavailableError("Connection reset by peer");
    auto it = values_.find(key);
    return it == values_.end() ? 0 : it->second;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool failing_ = false;
  bool hanging_ = false;
  std::map<std::string, int64_t> values_;
};

// A rank's handle on the host; it keeps the host alive, as a monitor thread
// left behind on a hung call may outlive the test body.
class FakeStore final : public HeartbeatStore {
 public:
  explicit FakeStore(std::shared_ptr<FakeStoreHost> host)
      : host_(std::move(host)) {}
  absl::Status Set(const std::string& key, int64_t value) override {
    return host_->Set(key, value);
  }
  absl::StatusOr<int64_t> Get(const std::string& key) override {
    return host_->Get(key);
  }

 private:
  std::shared_ptr<FakeStoreHost> host_;
};

constexpr HeartbeatOptions kFast{std::chrono::milliseconds(50),
                                 std::chrono::milliseconds(300)};

class HeartbeatMonitorTest : public testing::Test {
 protected:
  std::unique_ptr<HeartbeatMonitor> Start(int64_t rank, int64_t world) {
    return std::make_unique<HeartbeatMonitor>(
        std::make_unique<FakeStore>(host_), rank, world, kFast);
  }
  std::shared_ptr<FakeStoreHost> host_ = std::make_shared<FakeStoreHost>();
};

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST_F(HeartbeatMonitorTest, AllRanksBeatingMeansNoneLost) {
  auto rank0 = Start(0, 3);
  auto rank1 = Start(1, 3);
  auto rank2 = Start(2, 3);

  const Clock::time_point start = Clock::now();
  HeartbeatDiagnosis diagnosis = rank0->Diagnose();

  EXPECT_FALSE(diagnosis.any_lost()) << diagnosis.ToString();
  EXPECT_EQ(diagnosis.ToString(), "no rank lost (all heartbeats current)");
  // Alive ranks are recognised by their next beat, well before stale_after.
  EXPECT_LT(SecondsSince(start), 0.25);
}

TEST_F(HeartbeatMonitorTest, StoppedRankIsNamedAfterStaleAfter) {
  auto rank0 = Start(0, 3);
  auto rank1 = Start(1, 3);
  auto rank2 = Start(2, 3);
  rank2.reset();  // rank 2 stops beating

  const Clock::time_point start = Clock::now();
  HeartbeatDiagnosis diagnosis = rank0->Diagnose();
  const double took = SecondsSince(start);

  ASSERT_EQ(diagnosis.lost.size(), 1u) << diagnosis.ToString();
  EXPECT_EQ(diagnosis.lost[0].rank, 2);
  EXPECT_GE(diagnosis.lost[0].silent_seconds, 0.3);
  EXPECT_FALSE(diagnosis.store_lost);
  EXPECT_THAT(diagnosis.ToString(),
              HasSubstr("rank 2 lost (no heartbeat for 0."));
  EXPECT_GE(took, 0.3);
  EXPECT_LT(took, 0.3 + 2 * 0.05 + 0.1);
}

TEST_F(HeartbeatMonitorTest, RankThatNeverBeatIsLost) {
  auto rank1 = Start(1, 2);  // rank 0 never started

  HeartbeatDiagnosis diagnosis = rank1->Diagnose();

  ASSERT_EQ(diagnosis.lost.size(), 1u) << diagnosis.ToString();
  EXPECT_EQ(diagnosis.lost[0].rank, 0);
}

TEST_F(HeartbeatMonitorTest, SeveralLostRanksAreListed) {
  auto rank0 = Start(0, 4);
  auto rank2 = Start(2, 4);

  HeartbeatDiagnosis diagnosis = rank0->Diagnose();

  ASSERT_EQ(diagnosis.lost.size(), 2u) << diagnosis.ToString();
  EXPECT_THAT(diagnosis.ToString(),
              HasSubstr("ranks 1, 3 lost (no heartbeat for "));
}

TEST_F(HeartbeatMonitorTest, FailingStoreMeansTheStoreHostIsLost) {
  auto rank0 = Start(0, 2);
  auto rank1 = Start(1, 2);
  host_->Fail();

  HeartbeatDiagnosis diagnosis = rank1->Diagnose();

  EXPECT_TRUE(diagnosis.store_lost);
  EXPECT_EQ(diagnosis.ToString(),
            "rank 0 (the store host) lost (store unreachable: Connection reset "
            "by peer)");
}

TEST_F(HeartbeatMonitorTest, HangingStoreStillGivesAnAnswerInTime) {
  auto rank0 = Start(0, 2);
  auto rank1 = Start(1, 2);
  host_->Hang();

  const Clock::time_point start = Clock::now();
  HeartbeatDiagnosis diagnosis = rank1->Diagnose();
  const double took = SecondsSince(start);
  host_->Resume();  // lets the monitors' threads finish so they can be joined

  EXPECT_TRUE(diagnosis.store_lost);
  EXPECT_THAT(diagnosis.ToString(),
              HasSubstr("store unreachable: no answer for"));
  EXPECT_LT(took, 0.3 + 2 * 0.05 + 0.1);
}

TEST_F(HeartbeatMonitorTest, ConcurrentDiagnosesAgree) {
  auto rank0 = Start(0, 3);
  auto rank1 = Start(1, 3);
  HeartbeatDiagnosis first, second;
  std::thread other([&] { first = rank0->Diagnose(); });
  second = rank0->Diagnose();
  other.join();

  EXPECT_THAT(first.ToString(), HasSubstr("rank 2 lost (no heartbeat for "));
  EXPECT_THAT(second.ToString(), HasSubstr("rank 2 lost (no heartbeat for "));
}

TEST_F(HeartbeatMonitorTest, DestructorStopsTheThreadPromptly) {
  auto rank0 = Start(0, 2);
  const Clock::time_point start = Clock::now();
  rank0.reset();
  EXPECT_LT(SecondsSince(start), 0.05);
}

TEST_F(HeartbeatMonitorTest, DestructorDoesNotWaitForeverOnAHungStore) {
  auto rank1 = Start(1, 2);
  host_->Hang();
  std::this_thread::sleep_for(kFast.interval * 2);  // let a beat get stuck

  const Clock::time_point start = Clock::now();
  rank1.reset();
  const double took = SecondsSince(start);
  host_->Resume();  // the thread left behind finishes its call and ends

  EXPECT_GE(took, 0.1);  // it did wait a while for the call
  EXPECT_LT(took, 0.3);
}

}  // namespace
}  // namespace shardtrain
