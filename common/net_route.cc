#include "common/net_route.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

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

}  // namespace

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
