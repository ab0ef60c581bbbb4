// ProbeListener against listeners that accept and ones that stopped: a
// socket in listen() whose owner never calls accept() is what gRPC's
// listener becomes after a descriptor flood.
#include "server/listener_probe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

// A TCP listener on 127.0.0.1 (or a Unix one at `path`) that accepts only
// when told to; accepted connections are held open, silent.
class Listener {
 public:
  explicit Listener(const std::string& path = "") {
    if (path.empty()) {
      fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
      socklen_t length = sizeof(a);
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &length);
      address_ = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
    } else {
      fd_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
      EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
      address_ = "unix:" + path;
    }
    EXPECT_EQ(::listen(fd_, 16), 0);
  }
  ~Listener() {
    stop_ = true;
    if (acceptor_.joinable()) {
      ::shutdown(fd_, SHUT_RDWR);
      acceptor_.join();
    }
    for (int fd : accepted_) ::close(fd);
    ::close(fd_);
  }
  // From now on every connection is accepted (and, with `speak`, greeted
  // with one byte, as an insecure HTTP/2 server sends its SETTINGS).
  void StartAccepting(bool speak) {
    acceptor_ = std::thread([this, speak] {
      while (!stop_) {
        const int fd = ::accept(fd_, nullptr, nullptr);
        if (fd < 0) return;
        if (speak) (void)!::write(fd, "x", 1);
        accepted_.push_back(fd);
      }
    });
  }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::vector<int> accepted_;
};

TEST(ListenerProbeTest, AListenerThatStoppedAcceptingIsFoundOut) {
  Listener listener;
  const absl::Time start = absl::Now();
  const absl::Status status =
      ProbeListener(listener.address(), absl::Milliseconds(500));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr("never accepted"));
  EXPECT_THAT(status.message(), HasSubstr(listener.address()));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(450));
}

// A TLS server says nothing until the client does: taken is enough.
TEST(ListenerProbeTest, ASilentListenerThatAcceptsPasses) {
  Listener listener;
  listener.StartAccepting(/*speak=*/false);
  EXPECT_TRUE(ProbeListener(listener.address(), absl::Seconds(10)).ok());
}

TEST(ListenerProbeTest, UnixListenersAreProbedToo) {
  test::TempDir dir;
  Listener stopped(dir / "stopped.sock");
  EXPECT_THAT(
      ProbeListener(stopped.address(), absl::Milliseconds(300)).message(),
      HasSubstr("never accepted"));
  Listener serving(dir / "serving.sock");
  serving.StartAccepting(/*speak=*/true);
  EXPECT_TRUE(ProbeListener(serving.address(), absl::Seconds(10)).ok());
}

TEST(ListenerProbeTest, NobodyListeningIsRefused) {
  std::string address;
  {
    Listener gone;
    address = gone.address();
  }
  const absl::Status status = ProbeListener(address, absl::Seconds(2));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr("connect: Connection refused"));
}

}  // namespace
}  // namespace shardtrain
