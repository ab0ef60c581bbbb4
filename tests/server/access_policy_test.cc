// server/access_policy.h: which listen addresses need a token, which paths
// a job may read, and how many streams a connection and the daemon may hold.
#include "server/access_policy.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TEST(AccessPolicyTest, NonLoopbackMetricsNeedMetricsPublic) {
  EXPECT_TRUE(CheckMetricsListenAllowed("127.0.0.1:9464", false).ok());
  EXPECT_TRUE(CheckMetricsListenAllowed("", false).ok());
  EXPECT_TRUE(CheckMetricsListenAllowed("0.0.0.0:9464", true).ok());
  const absl::Status refused = CheckMetricsListenAllowed("0.0.0.0:9464", false);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("--metrics-public"));
}

TEST(AccessPolicyTest, NonLoopbackListenNeedsATokenOrInsecure) {
  EXPECT_TRUE(CheckListenAllowed("127.0.0.1:1", false, false).ok());
  EXPECT_TRUE(CheckListenAllowed("0.0.0.0:1", true, false).ok());
  EXPECT_TRUE(CheckListenAllowed("0.0.0.0:1", false, true).ok());
  const absl::Status refused = CheckListenAllowed("0.0.0.0:1", false, false);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("--listen: 0.0.0.0:1"));
  EXPECT_THAT(refused.message(), HasSubstr("--insecure"));
}

class PathRootsTest : public testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(dir_ / "root/data");
    fs::create_directories(dir_ / "root2");
    fs::create_directories(dir_ / "rootless");  // shares "root" as a prefix
    fs::create_directories(dir_ / "outside");
    fs::create_symlink(dir_ / "outside", dir_ / "root/escape");
    fs::create_symlink(dir_ / "root/data", dir_ / "outside/inward");
  }
  test::TempDir dir_;
};

TEST_F(PathRootsTest, NoRootsAllowAnything) {
  PathRoots roots;
  EXPECT_FALSE(roots.confined());
  EXPECT_TRUE(roots.Check("data", "/etc").ok());
}

TEST_F(PathRootsTest, PathsResolveInsideARootOrAreRefused) {
  absl::StatusOr<PathRoots> roots =
      PathRoots::Create({dir_ / "root", dir_ / "root2"});
  ASSERT_TRUE(roots.ok()) << roots.status();
  EXPECT_TRUE(roots->confined());
  for (const std::string& inside :
       {dir_ / "root", dir_ / "root/data", dir_ / "root/data/train.bin",
        dir_ / "root/not-yet-there", dir_ / "root2/x",
        dir_ / "outside/inward",  // a link from outside into a root
        dir_ / "root/../root/data"}) {
    EXPECT_TRUE(roots->Check("data", inside).ok()) << inside;
  }
  for (const std::string& outside :
       {dir_ / "outside", dir_ / "root/../outside", dir_ / "root/escape",
        dir_ / "root/escape/x", dir_ / "rootless",
        std::string("/etc/passwd")}) {
    const absl::Status status = roots->Check("trainer.init_from", outside);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << outside;
    EXPECT_THAT(status.message(), HasSubstr("trainer.init_from: '"));
    EXPECT_THAT(status.message(), HasSubstr("--path-root"));
  }
}

TEST_F(PathRootsTest, ARootMustBeAnExistingDirectory) {
  absl::StatusOr<PathRoots> missing = PathRoots::Create({dir_ / "nope"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("--path-root: '"));
}

TEST(StreamLimiterTest, EachConnectionHoldsAtMostTheLimit) {
  StreamLimiter limiter(2, 100, 100);
  auto a = limiter.Acquire("ipv4:127.0.0.1:4000");
  auto b = limiter.Acquire("ipv4:127.0.0.1:4000");
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = limiter.Acquire("ipv4:127.0.0.1:4000");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(c.status().message(),
              HasSubstr("(ipv4:127.0.0.1:4000) already holds 2"));
  // Another local user (same address, its own connection) is not affected.
  EXPECT_TRUE(limiter.Acquire("ipv4:127.0.0.1:4001").ok());
  // Releasing one frees a slot.
  a->reset();
  EXPECT_EQ(limiter.open("ipv4:127.0.0.1:4000"), 1);
  EXPECT_TRUE(limiter.Acquire("ipv4:127.0.0.1:4000").ok());
}

// However many connections or addresses a client uses, the daemon's
// streams (each a thread) stay under the global cap.
TEST(StreamLimiterTest, AllConnectionsTogetherStayUnderTheGlobalCap) {
  StreamLimiter limiter(64, 64, 3);
  std::vector<std::unique_ptr<StreamLimiter::Slot>> held;
  for (int i = 0; i < 3; ++i) {
    auto slot = limiter.Acquire(absl::StrCat("ipv4:127.0.0.", i + 1, ":5000"));
    ASSERT_TRUE(slot.ok());
    held.push_back(std::move(*slot));
  }
  auto refused = limiter.Acquire("ipv4:127.0.0.9:5000");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("--max-streams"));
  EXPECT_EQ(limiter.total(), 3);
  held.pop_back();
  EXPECT_TRUE(limiter.Acquire("ipv4:127.0.0.9:5000").ok());
}

// Nine connections of one process once took all 512 slots: the connections
// of one peer (PeerIdentity) share their own cap.
TEST(StreamLimiterTest, OnePeersConnectionsTogetherStayUnderThePeerCap) {
  StreamLimiter limiter(2, 3, 100, [](const std::string& peer) {
    return peer.substr(0, peer.rfind(':'));  // the address: one peer
  });
  std::vector<std::unique_ptr<StreamLimiter::Slot>> held;
  for (const char* connection :
       {"ipv4:10.0.0.7:1", "ipv4:10.0.0.7:1", "ipv4:10.0.0.7:2"}) {
    auto slot = limiter.Acquire(connection);
    ASSERT_TRUE(slot.ok()) << slot.status();
    held.push_back(std::move(*slot));
  }
  auto refused = limiter.Acquire("ipv4:10.0.0.7:3");  // a fresh connection
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("this client (ipv4:10.0.0.7) already holds 3"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--max-streams-per-peer"));
  // Another peer still gets streams; a released slot is the peer's again.
  EXPECT_TRUE(limiter.Acquire("ipv4:10.0.0.8:1").ok());
  held.pop_back();
  EXPECT_TRUE(limiter.Acquire("ipv4:10.0.0.7:3").ok());
}

// A loopback connection is its local user, found in the kernel's socket
// table; a remote one is its address.
TEST(PeerIdentityTest, ALoopbackConnectionIsItsUserARemoteOneItsAddress) {
  const int server = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(
      ::bind(server, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  ASSERT_EQ(::listen(server, 1), 0);
  socklen_t length = sizeof(address);
  ::getsockname(server, reinterpret_cast<sockaddr*>(&address), &length);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(
      ::connect(client, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  sockaddr_in local{};
  length = sizeof(local);
  ::getsockname(client, reinterpret_cast<sockaddr*>(&local), &length);
  // What gRPC reports on the server side: the client's address and port.
  const std::string peer =
      absl::StrCat("ipv4:127.0.0.1:", ntohs(local.sin_port));
  EXPECT_EQ(PeerIdentity(peer), absl::StrCat("uid ", ::getuid()));
  ::close(client);
  ::close(server);

  EXPECT_EQ(PeerIdentity("ipv4:10.0.0.7:40512"), "ipv4:10.0.0.7");
  EXPECT_EQ(PeerIdentity("ipv6:[2001:db8::1]:40512"), "ipv6:2001:db8::1");
  EXPECT_EQ(PeerIdentity("ipv6:%5B2001:db8::1%5D:40512"), "ipv6:2001:db8::1");
  EXPECT_EQ(PeerIdentity("unix:/run/shardtraind.sock"),
            "unix:/run/shardtraind.sock");
}

// gRPC's clients reach 127.0.0.1 through IPv6 sockets: the kernel lists the
// client in /proc/net/tcp6 as ::ffff:127.0.0.1 while gRPC names the peer
// "ipv4:127.0.0.1:P". Found either way; a loopback peer nobody owns is one
// shared peer, not a cap per connection.
TEST(PeerIdentityTest, AnIpv4MappedLoopbackClientIsItsUser) {
  const int server = ::socket(AF_INET6, SOCK_STREAM, 0);
  ASSERT_GE(server, 0);
  int off = 0;
  ::setsockopt(server, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
  sockaddr_in6 address{};
  address.sin6_family = AF_INET6;
  address.sin6_addr = in6addr_any;
  ASSERT_EQ(
      ::bind(server, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  ASSERT_EQ(::listen(server, 1), 0);
  socklen_t length = sizeof(address);
  ::getsockname(server, reinterpret_cast<sockaddr*>(&address), &length);
  const int client = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 target{};
  target.sin6_family = AF_INET6;
  target.sin6_port = address.sin6_port;
  ASSERT_EQ(inet_pton(AF_INET6, "::ffff:127.0.0.1", &target.sin6_addr), 1);
  ASSERT_EQ(
      ::connect(client, reinterpret_cast<sockaddr*>(&target), sizeof(target)),
      0);
  sockaddr_in6 local{};
  length = sizeof(local);
  ::getsockname(client, reinterpret_cast<sockaddr*>(&local), &length);
  const int port = ntohs(local.sin6_port);
  const std::string user = absl::StrCat("uid ", ::getuid());
  EXPECT_EQ(PeerIdentity(absl::StrCat("ipv4:127.0.0.1:", port)), user);
  EXPECT_EQ(PeerIdentity(absl::StrCat("ipv6:[::ffff:127.0.0.1]:", port)), user);
  ::close(client);
  ::close(server);

  // No socket has these ports' local ends any more: one unknown local peer.
  EXPECT_EQ(PeerIdentity(absl::StrCat("ipv4:127.0.0.1:", port)),
            kUnknownLocalPeer);
  EXPECT_EQ(PeerIdentity(absl::StrCat("ipv6:[::1]:", port)), kUnknownLocalPeer);
  EXPECT_EQ(PeerIdentity(absl::StrCat("ipv6:[::ffff:127.0.0.2]:", port)),
            kUnknownLocalPeer);
}

}  // namespace
}  // namespace shardtrain
