#include "common/net_route.h"

#include <gtest/gtest.h>

#include <string>

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

TEST(AddressTest, HostOfAddressStripsSchemesBracketsAndPorts) {
  EXPECT_EQ(HostOfAddress("10.0.0.5:50551"), "10.0.0.5");
  EXPECT_EQ(HostOfAddress("dns:///node7:50551"), "node7");
  EXPECT_EQ(HostOfAddress("ipv4:10.0.0.5:1,10.0.0.6:1"), "10.0.0.5");
  EXPECT_EQ(HostOfAddress("[::1]:50551"), "::1");
  EXPECT_EQ(HostOfAddress("ipv6:[fe80::1]:50551"), "fe80::1");
  EXPECT_EQ(HostOfAddress("::1"), "::1");
  EXPECT_EQ(HostOfAddress("localhost"), "localhost");
  EXPECT_EQ(HostOfAddress(":50551"), "");
  EXPECT_EQ(HostOfAddress("unix:/run/shardtraind.sock"), "");
}

TEST(AddressTest, OnlyLoopbackAddressesCountAsLoopback) {
  for (const char* loopback :
       {"127.0.0.1:50551", "127.0.0.1:0", "127.1.2.3:9", "localhost:50551",
        "[::1]:50551", "dns:///localhost:50551", "unix:/run/shardtraind.sock",
        "unix-abstract:x"}) {
    EXPECT_TRUE(IsLoopbackAddress(loopback)) << loopback;
  }
  for (const char* open :
       {"0.0.0.0:50551", "[::]:50551", ":50551", "10.0.0.5:50551",
        "myhost:50551", "50551", "128.0.0.1:1", "localhost.evil.com:1",
        "127.anything.example:1", "127.0.0.1.evil.com:1",
        // Unbracketed IPv6: "::0:1" is ::1 whole, or the wildcard on port 1.
        "::0:1", "::1:9464", "::1", "ipv6:::1"}) {
    EXPECT_FALSE(IsLoopbackAddress(open)) << open;
  }
}

TEST(AddressTest, ThisHostIsLoopbackTheWildcardOrAnAddressOfItsOwn) {
  for (const char* here :
       {"localhost:50551", "127.0.0.1:50551", "dns:///localhost:1",
        "[::1]:50551", "0.0.0.0:50551", "[::]:1", "unix:/run/x.sock"}) {
    EXPECT_TRUE(IsThisHost(here)) << here;
  }
  // The address this host routes from is one of its own, loopback or not
  // (a documentation-range destination only picks the route; nothing is
  // sent).
  absl::StatusOr<LocalRoute> route = LocalRouteTo("192.0.2.1");
  if (route.ok()) {
    const std::string own = route->address.find(':') == std::string::npos
                                ? route->address
                                : "[" + route->address + "]";
    EXPECT_TRUE(IsThisHost(own + ":50551")) << own;
  }
  for (const char* elsewhere :
       {"192.0.2.1:50551", "[2001:db8::1]:50551", "no-such-host.invalid:1",
        "[::1", "dns:///:1"}) {
    EXPECT_FALSE(IsThisHost(elsewhere)) << elsewhere;
  }
}

}  // namespace
}  // namespace shardtrain
