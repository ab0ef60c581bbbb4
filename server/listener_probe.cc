#include "server/listener_probe.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/net_route.h"

namespace shardtrain {
namespace {

// How often the kernel's table is read while the probe waits.
constexpr absl::Duration kPollStep = absl::Milliseconds(50);

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  const int fd_;
};

// Waits for `events` on `fd` until `deadline`; false on timeout.
bool WaitFor(int fd, short events, absl::Time deadline) {
  while (true) {
    const int ms =
        static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (ms <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, ms);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

absl::Status Unavailable(const std::string& address, const std::string& what) {
  return absl::UnavailableError(absl::StrCat(address, ": ", what));
}

// How /proc/net/tcp{,6} write an IPv4 or IPv6 address and port; an IPv4
// one also in its IPv4-mapped form (a dual-stack listener's sockets).
std::vector<std::string> KernelNames(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    const int port = ntohs(in.sin_port);
    return {absl::StrFormat("%08X:%04X", in.sin_addr.s_addr, port),
            absl::StrFormat("0000000000000000FFFF0000%08X:%04X",
                            in.sin_addr.s_addr, port)};
  }
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
  uint32_t words[4];
  std::memcpy(words, in6.sin6_addr.s6_addr, sizeof(words));
  return {absl::StrFormat("%08X%08X%08X%08X:%04X", words[0], words[1], words[2],
                          words[3], ntohs(in6.sin6_port))};
}

// Whether the server side of the connection from `client` to `server` has
// been accepted: the kernel lists a connection still in the listener's
// queue with inode 0 (no process holds it yet), an accepted one with its
// descriptor's inode.
bool AcceptedByServer(const sockaddr_storage& client,
                      const sockaddr_storage& server) {
  const std::vector<std::string> locals = KernelNames(server);
  const std::vector<std::string> remotes = KernelNames(client);
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream table(path);
    std::string line;
    std::getline(table, line);  // the column titles
    while (std::getline(table, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid,
          timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >>
          retransmits >> uid >> timeout >> inode;
      if (absl::c_linear_search(locals, local) &&
          absl::c_linear_search(remotes, remote)) {
        return inode != "0";
      }
    }
  }
  return false;
}

// Connects a non-blocking socket to `addr` by `deadline`, then waits until
// the server has accepted it: it sends something (an insecure HTTP/2
// server's SETTINGS), closes it, or (TCP) the kernel shows it accepted (a
// TLS server waits for the client to speak first). Nothing is sent, so the
// server logs no failed handshake.
absl::Status ProbeSocketAddress(const std::string& address,
                                const sockaddr* addr, socklen_t length,
                                absl::Time deadline) {
  Socket s(
      ::socket(addr->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (s.fd() < 0) {
    return Unavailable(address, absl::StrCat("cannot open a socket to probe (",
                                             std::strerror(errno), ")"));
  }
  if (::connect(s.fd(), addr, length) != 0) {
    if (errno != EINPROGRESS && errno != EAGAIN) {
      return Unavailable(address,
                         absl::StrCat("connect: ", std::strerror(errno)));
    }
    if (!WaitFor(s.fd(), POLLOUT, deadline)) {
      return Unavailable(address, "no connection (the backlog is full)");
    }
    int error = 0;
    socklen_t size = sizeof(error);
    ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &error, &size);
    if (error != 0) {
      return Unavailable(address,
                         absl::StrCat("connect: ", std::strerror(error)));
    }
  }
  const bool tcp = addr->sa_family == AF_INET || addr->sa_family == AF_INET6;
  sockaddr_storage client{}, server{};
  socklen_t client_length = sizeof(client);
  ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&client), &client_length);
  std::memcpy(&server, addr, std::min<size_t>(length, sizeof(server)));
  while (true) {
    if (tcp && AcceptedByServer(client, server)) return absl::OkStatus();
    const absl::Time next = std::min(deadline, absl::Now() + kPollStep);
    if (WaitFor(s.fd(), POLLIN | POLLHUP | POLLERR | POLLRDHUP, next)) {
      return absl::OkStatus();
    }
    if (absl::Now() >= deadline) break;
  }
  return Unavailable(address,
                     "connected but never accepted (the server stopped "
                     "accepting connections)");
}

}  // namespace

absl::Status ProbeListener(const std::string& address, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::string_view path = address;
  if (absl::ConsumePrefix(&path, "unix-abstract:")) {
    sockaddr_un un{};
    un.sun_family = AF_UNIX;
    if (path.size() + 1 >= sizeof(un.sun_path)) {
      return Unavailable(address, "the socket name is too long");
    }
    std::memcpy(un.sun_path + 1, path.data(), path.size());
    return ProbeSocketAddress(
        address, reinterpret_cast<sockaddr*>(&un),
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 +
                               path.size()),
        deadline);
  }
  if (absl::ConsumePrefix(&path, "unix:")) {
    sockaddr_un un{};
    un.sun_family = AF_UNIX;
    if (path.size() >= sizeof(un.sun_path)) {
      return Unavailable(address, "the socket path is too long");
    }
    std::memcpy(un.sun_path, path.data(), path.size());
    return ProbeSocketAddress(address, reinterpret_cast<sockaddr*>(&un),
                              sizeof(un), deadline);
  }
  std::string host = HostOfAddress(address);
  const std::string port = address.substr(address.rfind(':') + 1);
  // A wildcard listener is reached on loopback.
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return Unavailable(address,
                       absl::StrCat("cannot resolve: ", gai_strerror(rc)));
  }
  absl::Status status =
      ProbeSocketAddress(address, found->ai_addr, found->ai_addrlen, deadline);
  ::freeaddrinfo(found);
  return status;
}

}  // namespace shardtrain
