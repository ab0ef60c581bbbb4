// Reading a small file a flag names (a token, a TLS certificate or key, a job
// spec): bounded, never blocking, and only a regular file. One place, so that
// a directory, a FIFO, /dev/zero or a world-readable secret is refused the
// same way for the coordinator and the CLI.
#ifndef SHARDTRAIN_COMMON_SMALL_FILE_H_
#define SHARDTRAIN_COMMON_SMALL_FILE_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace shardtrain {

struct SmallFileOptions {
  size_t max_bytes = 1 << 20;
  // A secret: refused when group or others may read or write it (as ssh
  // refuses a private key), naming the mode and the fix.
  bool secret = false;

  // A token or key: at most `max_bytes`, owner-only.
  static SmallFileOptions Secret(size_t max_bytes) {
    SmallFileOptions options;
    options.max_bytes = max_bytes;
    options.secret = true;
    return options;
  }
};

// The contents of `path`, or an error that starts with `flag` (the flag that
// named it) and says what is wrong: missing, not a regular file (a
// directory, a FIFO, a device), larger than max_bytes, or, for a secret,
// open to other users.
absl::StatusOr<std::string> ReadSmallFile(const std::string& flag,
                                          const std::string& path,
                                          SmallFileOptions options = {});

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_SMALL_FILE_H_
