// The directories a process may read job inputs from (shardtraind
// --path-root). The coordinator resolves every input file against them before
// a launch; its ranks check again, on the file they actually opened, so a
// symlink turned between the two checks cannot lead outside either.
#ifndef SHARDTRAIN_COMMON_READ_ROOTS_H_
#define SHARDTRAIN_COMMON_READ_ROOTS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardtrain {

// The environment variable that hands the roots to ranks: canonical
// directories separated by ':'. Unset or empty: reading is not restricted.
inline constexpr char kReadRootsEnv[] = "SHARDTRAIN_PATH_ROOTS";

// The roots kReadRootsEnv names; empty when reading is not restricted.
std::vector<std::string> ReadRootsFromEnvironment();

// Whether `resolved` (a canonical path) is `root` or lies below it.
bool IsWithinRoot(const std::string& resolved, const std::string& root);

// For a file this process opened as `fd` from `path`: OK when no roots are
// set (kReadRootsEnv) or the file's real location (/proc/self/fd) lies
// inside one; PermissionDenied naming both paths otherwise.
absl::Status CheckOpenedFileWithinReadRoots(int fd, const std::string& path);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_READ_ROOTS_H_
