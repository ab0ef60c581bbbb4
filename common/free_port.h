// A TCP port on the loopback interface that was free a moment ago (bound to
// port 0, read back, released): for rendezvous stores and test servers.
// Another process can take it before it is used; callers that bind it
// themselves should retry on EADDRINUSE.
#ifndef SHARDTRAIN_COMMON_FREE_PORT_H_
#define SHARDTRAIN_COMMON_FREE_PORT_H_

#include "absl/status/statusor.h"

namespace shardtrain {

absl::StatusOr<int> PickFreePort();

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_FREE_PORT_H_
