// FakeClock: time that moves only when a test says so.
//
// Code under test waits through Clock::WaitUntil. A waiter is "parked" while
// it waits there having seen the current time and found its deadline still
// ahead; Advance() starts a new time, so every waiter must look again (it
// wakes within a millisecond of real time) before it counts as parked.
// RunUntil() therefore moves time only when every thread the test expects is
// parked, so the code sees each step however slowly the machine runs it:
// tests assert on fake seconds, never on a loaded machine's wall clock.
#ifndef SHARDTRAIN_TESTS_FAKES_FAKE_CLOCK_H_
#define SHARDTRAIN_TESTS_FAKES_FAKE_CLOCK_H_

#include <cstdint>
#include <functional>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/clock.h"

namespace shardtrain {

class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'800'000'000))
      : now_(start) {}

  absl::Time Now() override {
    absl::MutexLock lock(&mutex_);
    return now_;
  }

  bool WaitUntil(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) override {
    int64_t generation;
    {
      absl::MutexLock lock(&mutex_);
      if (now_ >= deadline) return true;
      generation = generation_;
      ++parked_;
    }
    // A short real wait: Advance() need not know the waiters' condition
    // variables, and a signal still wakes the waiter at once.
    cv->WaitWithTimeout(mu, absl::Milliseconds(1));
    absl::MutexLock lock(&mutex_);
    if (generation == generation_) --parked_;
    return now_ >= deadline;
  }

  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mutex_);
    now_ += d;
    ++generation_;
    parked_ = 0;
  }

  // Threads waiting in WaitUntil that have seen the current time.
  int parked() {
    absl::MutexLock lock(&mutex_);
    return parked_;
  }

  // Advances time by `step` whenever `threads` waiters are parked, until
  // done() holds or `limit` of fake time has passed; returns the fake time
  // that passed. Gives up after 60 s of real time (a thread that never
  // parks), returning what passed so far.
  absl::Duration RunUntil(const std::function<bool()>& done, int threads,
                          absl::Duration step = absl::Milliseconds(5),
                          absl::Duration limit = absl::Seconds(60)) {
    const absl::Time start = Now();
    const absl::Time real_limit = absl::Now() + absl::Seconds(60);
    while (!done() && Now() - start < limit && absl::Now() < real_limit) {
      if (parked() >= threads) {
        Advance(step);
      } else {
        absl::SleepFor(absl::Microseconds(100));
      }
    }
    return Now() - start;
  }

 private:
  absl::Mutex mutex_;
  absl::Time now_ ABSL_GUARDED_BY(mutex_);
  int64_t generation_ ABSL_GUARDED_BY(mutex_) = 0;
  int parked_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_FAKE_CLOCK_H_
