// A TCP port on the loopback interface that was free a moment ago (bound to
// port 0, read back, released): for rendezvous stores and test servers.
// Another process can take it before it is used; callers that bind it
// themselves should retry on EADDRINUSE.
#ifndef SHARDTRAIN_COMMON_FREE_PORT_H_
#define SHARDTRAIN_COMMON_FREE_PORT_H_

#include <functional>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"

namespace shardtrain {

absl::StatusOr<int> PickFreePort();

// Free ports that were not handed out lately: a start that retries after
// its port was taken (another process bound it between the pick and rank
// 0's bind) never gets that port, or any of the last `remember` ports this
// picker gave, again; the kernel may well offer the same free port twice.
// Thread-safe.
class FreshPortPicker {
 public:
  // `pick`: where free ports come from (PickFreePort; tests give their own).
  explicit FreshPortPicker(
      size_t remember = 64,
      std::function<absl::StatusOr<int>()> pick = PickFreePort);

  // A free port none of the last `remember` calls returned. Unavailable
  // when 64 picks in a row were all recent ones.
  absl::StatusOr<int> Pick();

 private:
  const size_t remember_;
  const std::function<absl::StatusOr<int>()> pick_;
  std::mutex mutex_;
  std::vector<int> recent_;  // oldest first, at most remember_
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_FREE_PORT_H_
