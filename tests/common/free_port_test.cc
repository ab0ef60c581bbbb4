#include "common/free_port.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace shardtrain {
namespace free_port_test {

// A picker that hands out `ports` in order.
std::function<absl::StatusOr<int>()> Sequence(std::vector<int> ports) {
  auto next = std::make_shared<size_t>(0);
  return [ports, next]() -> absl::StatusOr<int> {
    return ports[std::min(ports.size() - 1, (*next)++)];
  };
}

// The kernel may offer the port a retry just lost again: the picker skips
// every port it handed out lately, and only those.
TEST(FreshPortPickerTest, NeverRepeatsARecentPort) {
  FreshPortPicker picker(/*remember=*/2,
                         Sequence({5000, 5000, 5001, 5000, 5001, 5002, 5000}));
  EXPECT_EQ(*picker.Pick(), 5000);
  EXPECT_EQ(*picker.Pick(), 5001);  // 5000 again skipped
  EXPECT_EQ(*picker.Pick(), 5002);  // 5000 and 5001 skipped
  EXPECT_EQ(*picker.Pick(), 5000);  // two picks ago: forgotten
}

TEST(FreshPortPickerTest, SaysSoWhenOnlyRecentPortsComeBack) {
  FreshPortPicker picker(/*remember=*/4, Sequence({7000}));
  ASSERT_TRUE(picker.Pick().ok());
  const absl::StatusOr<int> again = picker.Pick();
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(again.status().message()),
              testing::HasSubstr("no free port outside the last 1"));
}

TEST(FreshPortPickerTest, RealPortsAreDistinctAndBindable) {
  FreshPortPicker picker;
  std::set<int> ports;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<int> port = picker.Pick();
    ASSERT_TRUE(port.ok()) << port.status();
    EXPECT_GT(*port, 0);
    ports.insert(*port);
  }
  EXPECT_EQ(ports.size(), 5u);
}

}  // namespace free_port_test
}  // namespace shardtrain
