// TrimConnectionsPerPeer: a bound on the connections one client holds open
// to the daemon's gRPC port. gRPC 1.51 accepts every connection it can and
// offers no hook at accept, so one peer could hold every descriptor; the
// coordinator's self-check (once a second) counts this process's
// connections on the port per peer — a local user by the uid owning the
// client's socket (every local user connects from 127.0.0.1), a remote one
// by its address — and shuts down (shutdown(2), so gRPC closes its own
// descriptor) the newest of a peer's connections beyond the bound.
#ifndef SHARDTRAIN_SERVER_CONNECTION_TRIMMER_H_
#define SHARDTRAIN_SERVER_CONNECTION_TRIMMER_H_

#include <string>

namespace shardtrain {

struct TrimResult {
  int connections = 0;  // this process's connections on the port
  int shut_down = 0;    // beyond the bound, shut down now
  std::string busiest;  // the peer holding the most, when any was cut
};

// Linux only (the kernel's socket tables); elsewhere nothing is counted.
TrimResult TrimConnectionsPerPeer(int port, int max_per_peer);

// Who listens on TCP `port` (any address), for an error that names the
// process in the way: "pid 4242 (shardtraind --listen 127.0.0.1:50551
// --state-dir /srv/st)", its command line cut to 200 characters; "" when
// no listener is found or its process is not this user's to look at.
std::string DescribeListener(int port);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_CONNECTION_TRIMMER_H_
