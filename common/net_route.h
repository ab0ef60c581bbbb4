// LocalRouteTo: which of this host's addresses and interfaces reaches a
// given host — what a rank binds Gloo to and names in NCCL_SOCKET_IFNAME
// when the rendezvous host is elsewhere (several nodes, or network
// namespaces). Asks the kernel's routing table (a UDP socket connected to
// the host sends nothing). Also: whether an address is loopback (what a
// server may open without a token) and whether it names this host (where
// a client can watch the coordinator's processes). Torch-free.
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

// The host of a listen or gRPC target address: "10.0.0.5:50551" and
// "dns:///10.0.0.5:50551" -> "10.0.0.5", "[::1]:50551" and
// "ipv6:[::1]:50551" -> "::1", ":50551" -> "". A unix socket
// ("unix:/path", "unix-abstract:name") has no host: "".
std::string HostOfAddress(const std::string& address);

// Whether `address` reaches this host only: a unix socket, 127.0.0.0/8,
// ::1, or a name whose every address is one of those ("localhost" too is
// resolved: a hosts file may map it anywhere). The wildcard (0.0.0.0, ::,
// ":port") is not loopback, nor an unbracketed IPv6 form ("::1:9464" or
// "::0:1": which part is the port depends on the reader); write "[::1]:9464".
bool IsLoopbackAddress(const std::string& address);

// Whether a client connecting to `address` reaches a server on this host:
// loopback, the wildcard (connecting to 0.0.0.0 reaches this host), or a
// name or address that resolves to one of this host's interface addresses.
bool IsThisHost(const std::string& address);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_NET_ROUTE_H_
