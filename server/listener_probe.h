// ProbeListener: whether a server behind `address` still accepts
// connections, seen from outside as a client would. A listener whose accept
// loop has stopped (gRPC 1.51's ends for good on the first accept4 error,
// e.g. EMFILE during a descriptor flood) still completes TCP handshakes into
// its backlog, so a connect alone proves nothing: the probe waits until the
// server has taken the connection (it speaks, closes, or the kernel lists
// the connection as held by a process) without sending anything itself, so
// a TLS server logs no failed handshake.
#ifndef SHARDTRAIN_SERVER_LISTENER_PROBE_H_
#define SHARDTRAIN_SERVER_LISTENER_PROBE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace shardtrain {

// OK when the listener at `address` ("127.0.0.1:P", "[::1]:P", "host:P",
// "unix:/path", "unix-abstract:name"; the wildcard is probed on loopback)
// took a probe connection within `timeout`; Unavailable saying what did not
// happen otherwise (refused, never accepted, no descriptor to probe with).
absl::Status ProbeListener(const std::string& address, absl::Duration timeout);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_LISTENER_PROBE_H_
