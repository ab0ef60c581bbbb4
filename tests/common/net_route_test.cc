#include "common/net_route.h"

#include <gtest/gtest.h>

namespace shardtrain {
namespace {

TEST(LocalRouteTest, LoopbackIsReachedThroughLo) {
  absl::StatusOr<LocalRoute> route = LocalRouteTo("127.0.0.1");
  ASSERT_TRUE(route.ok()) << route.status();
  EXPECT_EQ(route->address, "127.0.0.1");
  EXPECT_EQ(route->interface, "lo");
}

TEST(LocalRouteTest, NamesResolveFirst) {
  absl::StatusOr<LocalRoute> route = LocalRouteTo("localhost");
  ASSERT_TRUE(route.ok()) << route.status();
  EXPECT_TRUE(route->address == "127.0.0.1" || route->address == "::1")
      << route->address;
  EXPECT_EQ(route->interface, "lo");
}

TEST(LocalRouteTest, AnUnresolvableHostIsNamed) {
  absl::StatusOr<LocalRoute> route = LocalRouteTo("no-such-host.invalid");
  ASSERT_FALSE(route.ok());
  EXPECT_EQ(route.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(route.status().message().find("no-such-host.invalid"),
            std::string::npos);
}

}  // namespace
}  // namespace shardtrain
