// LocalRouteTo: which of this host's addresses and interfaces reaches a
// given host — what a rank binds Gloo to and names in NCCL_SOCKET_IFNAME
// when the rendezvous host is elsewhere (several nodes, or network
// namespaces). Asks the kernel's routing table (a UDP socket connected to
// the host sends nothing); torch-free.
#ifndef SHARDTRAIN_COMMON_NET_ROUTE_H_
#define SHARDTRAIN_COMMON_NET_ROUTE_H_

#include <string>

#include "absl/status/statusor.h"

namespace shardtrain {

struct LocalRoute {
  std::string address;    // this host's address on the way, e.g. 10.0.0.5
  std::string interface;  // its interface, e.g. eth0 ("" if none matches)
};

// `host` is a name or a numeric IPv4/IPv6 address. NotFound when it does
// not resolve, Unavailable when no route leads there; both name the host.
absl::StatusOr<LocalRoute> LocalRouteTo(const std::string& host);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_NET_ROUTE_H_
