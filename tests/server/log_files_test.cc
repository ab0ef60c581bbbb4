#include "server/log_files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

void Append(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::app) << text;
}

TEST(ReadLastLinesTest, ReturnsTheLastNLinesWithOrWithoutFinalNewline) {
  test::TempDir dir;
  const std::string path = dir / "log";
  Append(path, "one\ntwo\nthree\n");
  EXPECT_THAT(ReadLastLines(path, 2), ElementsAre("two", "three"));
  Append(path, "four");
  EXPECT_THAT(ReadLastLines(path, 2), ElementsAre("three", "four"));
  EXPECT_THAT(ReadLastLines(path, 10),
              ElementsAre("one", "two", "three", "four"));
  EXPECT_THAT(ReadLastLines(dir / "missing", 3), IsEmpty());
}

TEST(LogFollowerTest, ReturnsOnlyCompleteNewLinesOnEachPoll) {
  test::TempDir dir;
  const std::string path = dir / "log";
  LogFollower follower(path, 0);
  EXPECT_THAT(follower.Poll(), IsEmpty());  // not there yet
  Append(path, "a\nb");
  EXPECT_THAT(follower.Poll(), ElementsAre("a"));
  Append(path, "c\nd\n");
  EXPECT_THAT(follower.Poll(), ElementsAre("bc", "d"));
  EXPECT_THAT(follower.Poll(), IsEmpty());
  Append(path, "tail");
  EXPECT_THAT(follower.Poll(), IsEmpty());
  EXPECT_EQ(follower.TakePartial(), "tail");
}

TEST(LogFollowerTest, StartsWithTheTailThenFollows) {
  test::TempDir dir;
  const std::string path = dir / "log";
  Append(path, "1\n2\n3\n4\n");
  LogFollower follower(path, 2);
  EXPECT_THAT(follower.Poll(), ElementsAre("3", "4"));
  Append(path, "5\n");
  EXPECT_THAT(follower.Poll(), ElementsAre("5"));
}

}  // namespace
}  // namespace shardtrain
