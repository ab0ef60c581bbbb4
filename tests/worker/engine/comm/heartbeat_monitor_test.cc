// HeartbeatMonitor over an in-memory store: which ranks it calls lost, how
// soon, and what it says when the store itself goes away. Time is a
// FakeClock: every bound below is in fake seconds, exact however loaded the
// machine is.
#include "worker/engine/comm/heartbeat_monitor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tests/fakes/fake_clock.h"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

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

  // Store calls blocked by Hang().
  int blocked() {
    std::lock_guard<std::mutex> lock(mutex_);
    return blocked_;
  }

  absl::Status Set(const std::string& key, int64_t value) {
    std::unique_lock<std::mutex> lock(mutex_);
    WaitWhileHanging(lock);
    if (failing_) return absl::UnavailableError("Connection reset by peer");
    values_[key] = value;
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> Get(const std::string& key) {
    std::unique_lock<std::mutex> lock(mutex_);
    WaitWhileHanging(lock);
    if (failing_) return absl::UnavailableError("Connection reset by peer");
    auto it = values_.find(key);
    return it == values_.end() ? 0 : it->second;
  }

 private:
  void WaitWhileHanging(std::unique_lock<std::mutex>& lock) {
    ++blocked_;
    cv_.wait(lock, [&] { return !hanging_; });
    --blocked_;
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  bool failing_ = false;
  bool hanging_ = false;
  int blocked_ = 0;
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

constexpr absl::Duration kInterval = absl::Milliseconds(50);
constexpr absl::Duration kStaleAfter = absl::Milliseconds(300);

class HeartbeatMonitorTest : public testing::Test {
 protected:
  std::unique_ptr<HeartbeatMonitor> Start(int64_t rank, int64_t world) {
    HeartbeatOptions options;
    options.interval = absl::ToChronoMilliseconds(kInterval);
    options.stale_after = absl::ToChronoMilliseconds(kStaleAfter);
    options.clock = &clock_;
    return std::make_unique<HeartbeatMonitor>(
        std::make_unique<FakeStore>(host_), rank, world, options);
  }

  // Runs `monitor`'s Diagnose() on a thread of its own while time moves
  // whenever `threads` waiters (monitor threads + this caller) are parked;
  // `took` receives the fake time it took.
  HeartbeatDiagnosis DiagnoseOnFakeTime(HeartbeatMonitor& monitor, int threads,
                                        absl::Duration* took) {
    HeartbeatDiagnosis diagnosis;
    std::atomic<bool> done{false};
    std::thread caller([&] {
      diagnosis = monitor.Diagnose();
      done = true;
    });
    *took = clock_.RunUntil([&] { return done.load(); }, threads);
    caller.join();
    return diagnosis;
  }

  FakeClock clock_;
  std::shared_ptr<FakeStoreHost> host_ = std::make_shared<FakeStoreHost>();
};

TEST_F(HeartbeatMonitorTest, AllRanksBeatingMeansNoneLost) {
  auto rank0 = Start(0, 3);
  auto rank1 = Start(1, 3);
  auto rank2 = Start(2, 3);

  absl::Duration took;
  HeartbeatDiagnosis diagnosis = DiagnoseOnFakeTime(*rank0, 4, &took);

  EXPECT_FALSE(diagnosis.any_lost()) << diagnosis.ToString();
  EXPECT_EQ(diagnosis.ToString(), "no rank lost (all heartbeats current)");
  // Alive ranks are recognised by their next beat, well before stale_after.
  EXPECT_LE(took, kInterval + kInterval / 2) << took;
}

TEST_F(HeartbeatMonitorTest, StoppedRankIsNamedAfterStaleAfter) {
  auto rank0 = Start(0, 3);
  auto rank1 = Start(1, 3);
  auto rank2 = Start(2, 3);
  rank2.reset();  // rank 2 stops beating

  absl::Duration took;
  HeartbeatDiagnosis diagnosis = DiagnoseOnFakeTime(*rank0, 3, &took);

  ASSERT_EQ(diagnosis.lost.size(), 1u) << diagnosis.ToString();
  EXPECT_EQ(diagnosis.lost[0].rank, 2);
  EXPECT_GE(diagnosis.lost[0].silent_seconds, 0.3);
  EXPECT_FALSE(diagnosis.store_lost);
  EXPECT_THAT(diagnosis.ToString(),
              HasSubstr("rank 2 lost (no heartbeat for 0.3 s)"));
  // Lost after stale_after, and within a poll of it.
  EXPECT_GE(took, kStaleAfter);
  EXPECT_LE(took, kStaleAfter + kInterval / 2) << took;
}

TEST_F(HeartbeatMonitorTest, RankThatNeverBeatIsLost) {
  auto rank1 = Start(1, 2);  // rank 0 never started

  absl::Duration took;
  HeartbeatDiagnosis diagnosis = DiagnoseOnFakeTime(*rank1, 2, &took);

  ASSERT_EQ(diagnosis.lost.size(), 1u) << diagnosis.ToString();
  EXPECT_EQ(diagnosis.lost[0].rank, 0);
  EXPECT_GE(took, kStaleAfter);
}

TEST_F(HeartbeatMonitorTest, SeveralLostRanksAreListed) {
  auto rank0 = Start(0, 4);
  auto rank2 = Start(2, 4);

  absl::Duration took;
  HeartbeatDiagnosis diagnosis = DiagnoseOnFakeTime(*rank0, 3, &took);

  ASSERT_EQ(diagnosis.lost.size(), 2u) << diagnosis.ToString();
  EXPECT_THAT(diagnosis.ToString(),
              HasSubstr("ranks 1, 3 lost (no heartbeat for "));
}

TEST_F(HeartbeatMonitorTest, FailingStoreMeansTheStoreHostIsLost) {
  auto rank0 = Start(0, 2);
  auto rank1 = Start(1, 2);
  host_->Fail();

  absl::Duration took;
  HeartbeatDiagnosis diagnosis = DiagnoseOnFakeTime(*rank1, 3, &took);

  EXPECT_TRUE(diagnosis.store_lost);
  EXPECT_EQ(diagnosis.ToString(),
            "rank 0 (the store host) lost (store unreachable: Connection reset "
            "by peer)");
  EXPECT_LT(took, kStaleAfter);  // an error is an answer at once
}

TEST_F(HeartbeatMonitorTest, HangingStoreStillGivesAnAnswerInTime) {
  auto rank0 = Start(0, 2);
  auto rank1 = Start(1, 2);
  host_->Hang();

  // Only the caller is sure to park: the monitors' threads hang in the
  // store once they next touch it.
  absl::Duration took;
  HeartbeatDiagnosis diagnosis = DiagnoseOnFakeTime(*rank1, 1, &took);
  host_->Resume();  // lets the monitors' threads finish so they can be joined

  EXPECT_TRUE(diagnosis.store_lost);
  EXPECT_THAT(diagnosis.ToString(),
              HasSubstr("store unreachable: no answer for 0.3 s"));
  EXPECT_GE(took, kStaleAfter);
  EXPECT_LE(took, kStaleAfter + kInterval / 2) << took;
}

TEST_F(HeartbeatMonitorTest, ConcurrentDiagnosesAgree) {
  auto rank0 = Start(0, 3);
  auto rank1 = Start(1, 3);
  HeartbeatDiagnosis first, second;
  std::atomic<int> done{0};
  std::thread one([&] {
    first = rank0->Diagnose();
    ++done;
  });
  std::thread two([&] {
    second = rank0->Diagnose();
    ++done;
  });
  clock_.RunUntil([&] { return done.load() == 2; }, 4);
  one.join();
  two.join();

  EXPECT_THAT(first.ToString(), HasSubstr("rank 2 lost (no heartbeat for "));
  EXPECT_THAT(second.ToString(), HasSubstr("rank 2 lost (no heartbeat for "));
}

TEST_F(HeartbeatMonitorTest, DestructorStopsTheThreadAtOnce) {
  auto rank0 = Start(0, 2);
  const absl::Time before = clock_.Now();
  rank0.reset();  // returns without the fake clock moving at all
  EXPECT_EQ(clock_.Now(), before);
}

TEST_F(HeartbeatMonitorTest, DestructorDoesNotWaitForeverOnAHungStore) {
  auto rank1 = Start(1, 2);
  host_->Hang();
  // Time moves until the monitor's next beat is stuck in the store.
  clock_.RunUntil([&] { return host_->blocked() > 0; }, 1);
  ASSERT_EQ(host_->blocked(), 1);

  std::atomic<bool> done{false};
  std::thread destroy([&] {
    rank1.reset();
    done = true;
  });
  const absl::Duration took = clock_.RunUntil(
      [&] { return done.load(); }, 1, absl::Milliseconds(5), absl::Seconds(10));
  destroy.join();
  host_->Resume();  // the thread left behind finishes its call and ends

  // It waited for the call for max(interval, 100 ms), and no longer.
  EXPECT_GE(took, absl::Milliseconds(100));
  EXPECT_LE(took, absl::Milliseconds(105)) << took;
  EXPECT_TRUE(done);
}

}  // namespace
}  // namespace shardtrain
