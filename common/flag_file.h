// ReadFlagFile: reading a small file one of the process's own flags names (a
// token, a TLS certificate or key, a job spec given to the CLI): bounded,
// never blocking, and only a regular file. One place, so that a directory, a
// FIFO, /dev/zero or a world-readable secret is refused the same way for the
// coordinator and the CLI. What a job names (its data, models, checkpoints)
// is read through InputFile (input_file.h), confined beneath --path-root.
#ifndef SHARDTRAIN_COMMON_FLAG_FILE_H_
#define SHARDTRAIN_COMMON_FLAG_FILE_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace shardtrain {

struct FlagFileOptions {
  size_t max_bytes = 1 << 20;
  // A secret: refused when group or others may read or write it (as ssh
  // refuses a private key), naming the mode and the fix.
  bool secret = false;

  // A token or key: at most `max_bytes`, owner-only.
  static FlagFileOptions Secret(size_t max_bytes) {
    FlagFileOptions options;
    options.max_bytes = max_bytes;
    options.secret = true;
    return options;
  }
};

// The contents of `path`, or an error that starts with `flag` (the flag that
// named it) and says what is wrong: missing, not a regular file (a
// directory, a FIFO, a device), larger than max_bytes, or, for a secret,
// open to other users.
absl::StatusOr<std::string> ReadFlagFile(const std::string& flag,
                                         const std::string& path,
                                         FlagFileOptions options = {});

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_FLAG_FILE_H_
