#include "common/net_route.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

std::string AddressText(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (address->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(address)->sin_addr,
              text, sizeof(text));
  } else if (address->sa_family == AF_INET6) {
    inet_ntop(AF_INET6,
              &reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

// The interface that holds `address`, "" when none does.
std::string InterfaceOf(const std::string& address) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr) continue;
    if (AddressText(entry->ifa_addr) == address) {
      name = entry->ifa_name;
      break;
    }
  }
  freeifaddrs(list);
  return name;
}

// Every address `host` resolves to (a numeric one to itself); none when it
// does not resolve.
std::vector<sockaddr_storage> Resolve(const std::string& host) {
  std::vector<sockaddr_storage> addresses;
  if (host.empty()) return addresses;
  addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return addresses;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    sockaddr_storage address;
    memset(&address, 0, sizeof(address));
    memcpy(&address, a->ai_addr,
           std::min<size_t>(a->ai_addrlen, sizeof(address)));
    addresses.push_back(address);
  }
  freeaddrinfo(found);
  return addresses;
}

bool IsLoopback(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    return (ntohl(in.sin_addr.s_addr) >> 24) == 127;
  }
  if (address.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    return IN6_IS_ADDR_LOOPBACK(&in6.sin6_addr);
  }
  return false;
}

bool IsWildcard(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in&>(address).sin_addr.s_addr ==
           htonl(INADDR_ANY);
  }
  if (address.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    return IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr);
  }
  return false;
}

bool IsUnixSocket(const std::string& address) {
  return absl::StartsWith(address, "unix:") ||
         absl::StartsWith(address, "unix-abstract:");
}

// `address` without a gRPC target scheme (dns:///, ipv4:, ipv6:).
std::string WithoutScheme(const std::string& address) {
  for (const char* scheme : {"dns:///", "ipv4:", "ipv6:"}) {
    if (absl::StartsWith(address, scheme)) {
      return address.substr(strlen(scheme));
    }
  }
  return address;
}

}  // namespace

std::string HostOfAddress(const std::string& address) {
  if (IsUnixSocket(address)) return "";
  std::string host = WithoutScheme(address);
  // gRPC's ipv4:/ipv6: targets may list several addresses: the first.
  host = host.substr(0, host.find(','));
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    return close == std::string::npos ? "" : host.substr(1, close - 1);
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return host;  // no port
  const size_t colon = host.rfind(':');
  return colon == std::string::npos ? host : host.substr(0, colon);
}

bool IsLoopbackAddress(const std::string& address) {
  if (IsUnixSocket(address)) return true;
  // An unbracketed IPv6 form is ambiguous: "::0:1" is the address ::1 to
  // one reader and the wildcard "::0" on port 1 to another (the metrics
  // server splits at the last colon). Not loopback, whichever is meant.
  const std::string bare = WithoutScheme(address);
  if (!absl::StartsWith(bare, "[") && bare.find(':') != bare.rfind(':')) {
    return false;
  }
  const std::vector<sockaddr_storage> resolved =
      Resolve(HostOfAddress(address));
  if (resolved.empty()) return false;
  for (const sockaddr_storage& one : resolved) {
    if (!IsLoopback(one)) return false;
  }
  return true;
}

bool IsThisHost(const std::string& address) {
  if (IsUnixSocket(address)) return true;
  const std::string host = HostOfAddress(address);
  if (host.empty()) return absl::StartsWith(address, ":");  // the wildcard
  const std::vector<sockaddr_storage> resolved = Resolve(host);
  std::vector<std::string> own;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
      if (entry->ifa_addr != nullptr)
        own.push_back(AddressText(entry->ifa_addr));
    }
    freeifaddrs(list);
  }
  for (const sockaddr_storage& one : resolved) {
    if (IsLoopback(one) || IsWildcard(one)) return true;
    const std::string text =
        AddressText(reinterpret_cast<const sockaddr*>(&one));
    for (const std::string& mine : own) {
      if (!text.empty() && text == mine) return true;
    }
  }
  return false;
}

absl::StatusOr<LocalRoute> LocalRouteTo(const std::string& host) {
  addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  // Any port: connect() on a UDP socket only picks the route.
  if (const int rc = getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* candidate = found; candidate != nullptr;
       candidate = candidate->ai_next) {
    const int fd = socket(candidate->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = strerror(errno);
      continue;
    }
    sockaddr_storage local;
    socklen_t length = sizeof(local);
    if (connect(fd, candidate->ai_addr, candidate->ai_addrlen) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) {
      last_error = strerror(errno);
      close(fd);
      continue;
    }
    close(fd);
    LocalRoute route;
    route.address = AddressText(reinterpret_cast<sockaddr*>(&local));
    route.interface = InterfaceOf(route.address);
    freeaddrinfo(found);
    return route;
  }
  freeaddrinfo(found);
  return absl::UnavailableError(
      absl::StrCat("no route from this host to ", host, ": ", last_error));
}

}  // namespace shardtrain
