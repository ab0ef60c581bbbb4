// Clock: where code that waits on time reads it, so tests can move it. The
// coordinator's job timeouts and the workers' heartbeat monitor take one;
// tests pass tests/fakes/fake_clock.h.
#ifndef SHARDTRAIN_COMMON_CLOCK_H_
#define SHARDTRAIN_COMMON_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardtrain {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;

  // Waits on `cv` (with `mu` held, as absl::CondVar::Wait) until it is
  // signalled or this clock reaches `deadline`; returns true when the
  // deadline has passed. Like any condition wait it may also return early:
  // callers re-check their condition and the time.
  virtual bool WaitUntil(absl::CondVar* cv, absl::Mutex* mu,
                         absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
};

class RealClock : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  bool WaitUntil(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) override {
    return cv->WaitWithDeadline(mu, deadline);
  }
};

// The process's real clock.
inline Clock* SystemClock() {
  static RealClock* clock = new RealClock;
  return clock;
}

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_CLOCK_H_
