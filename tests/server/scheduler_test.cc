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

}  // namespace
}  // namespace shardtrain
