#include "core/run/lr_schedule.h"

#include <gtest/gtest.h>

namespace shardtrain {
namespace {

TEST(LrScheduleTest, WarmsUpLinearlyToThePeak) {
  LrSchedule schedule(1e-3, 0.1, /*warmup_steps=*/10, /*total_steps=*/100);
  EXPECT_DOUBLE_EQ(schedule.At(0), 1e-4);
  EXPECT_DOUBLE_EQ(schedule.At(4), 5e-4);
  EXPECT_DOUBLE_EQ(schedule.At(9), 1e-3);
}

TEST(LrScheduleTest, DecaysByCosineToTheMinimumAtTheLastStep) {
  LrSchedule schedule(1e-3, 0.1, 10, 100);
  EXPECT_DOUBLE_EQ(schedule.At(10), 1e-3);
  EXPECT_NEAR(schedule.At(99), 1e-4, 1e-15);
  // Halfway through the decay the cosine is at its midpoint.
  LrSchedule no_warmup(1.0, 0.0, 0, 101);
  EXPECT_NEAR(no_warmup.At(50), 0.5, 1e-12);
  for (int64_t step = 11; step < 100; ++step) {
    EXPECT_LT(schedule.At(step), schedule.At(step - 1)) << step;
  }
}

TEST(LrScheduleTest, ConstantWhenThereIsNothingToDecay) {
  LrSchedule schedule(3e-4, 0.1, 0, 1);
  EXPECT_DOUBLE_EQ(schedule.At(0), 3e-4);
}

}  // namespace
}  // namespace shardtrain
