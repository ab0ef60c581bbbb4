// Clock: where the coordinator reads the time, so tests can move it.
#ifndef SHARDTRAIN_SERVER_CLOCK_H_
#define SHARDTRAIN_SERVER_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardtrain {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
};

class RealClock : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_CLOCK_H_
