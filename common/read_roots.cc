#include "common/read_roots.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace shardtrain {

bool IsWithinRoot(const std::string& resolved, const std::string& root) {
  return resolved == root ||
         absl::StartsWith(resolved, root == "/" ? root : root + "/");
}

std::vector<std::string> ReadRootsFromEnvironment() {
  const char* env = std::getenv(kReadRootsEnv);
  if (env == nullptr) return {};
  return absl::StrSplit(env, ':', absl::SkipEmpty());
}

absl::Status CheckOpenedFileWithinReadRoots(int fd, const std::string& path) {
  const std::vector<std::string> roots = ReadRootsFromEnvironment();
  if (roots.empty()) return absl::OkStatus();
  char target[4096];
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  if (n > 0) {
    target[n] = '\0';
    for (const std::string& root : roots) {
      if (IsWithinRoot(target, root)) return absl::OkStatus();
    }
  }
  return absl::PermissionDeniedError(
      absl::StrCat(path, " is ", n > 0 ? target : "a file of unknown location",
                   ", outside the directories jobs may read (",
                   absl::StrJoin(roots, ", "), "; shardtraind --path-root)"));
}

}  // namespace shardtrain
