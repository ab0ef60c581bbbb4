// FakeClock: time that moves only when a test says so.
#ifndef SHARDTRAIN_TESTS_FAKES_FAKE_CLOCK_H_
#define SHARDTRAIN_TESTS_FAKES_FAKE_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "server/clock.h"

namespace shardtrain {

class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'800'000'000))
      : now_(start) {}
  absl::Time Now() override {
    absl::MutexLock lock(&mutex_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mutex_);
    now_ += d;
  }

 private:
  absl::Mutex mutex_;
  absl::Time now_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_FAKE_CLOCK_H_
