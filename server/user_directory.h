// UserDirectory: who may call shardtraind, read from --auth-token-file.
//
// One line per token, like Kubernetes' static token file:
//
//   # token,user,role[,max_devices]
//   3f9a...e1,alice,user,6
//   77c0...9b,ops,admin
//
// `role` is `admin` (may cancel any job) or `user` (only their own);
// `max_devices` caps the devices the user's jobs hold at once (empty: the
// daemon's --default-quota). Blank lines and lines starting with `#` are
// skipped. A file holding one bare token (no comma) is the single-token form:
// one user named `admin` with the admin role. The file must be readable by
// its owner only (ReadFlagFile's secret check). Reload() re-reads it
// (shardtraind on SIGHUP); a file that fails to parse keeps the users
// already loaded. Thread-safe.
#ifndef SHARDTRAIN_SERVER_USER_DIRECTORY_H_
#define SHARDTRAIN_SERVER_USER_DIRECTORY_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace shardtrain {

// Who is calling. The anonymous caller (a daemon without a token file) has
// no name and may do everything, as a daemon without users always allowed.
struct Caller {
  std::string user;
  bool admin = true;

  // "alice", or "an anonymous caller".
  std::string Describe() const;
};

struct UserRecord {
  std::string token;
  std::string user;
  bool admin = false;
  int max_devices = -1;  // -1: the daemon's default quota
};

// The records in `text` (the file's contents), or InvalidArgument naming
// `path`, the line and what is wrong with it: a missing field, a role that
// is neither admin nor user, a user name outside [A-Za-z0-9._-]{1,64}, a
// negative or non-numeric quota, a token given twice, or no token at all.
absl::StatusOr<std::vector<UserRecord>> ParseTokenFile(const std::string& path,
                                                       absl::string_view text);

class UserDirectory {
 public:
  // No file: every call is allowed, as the anonymous caller.
  UserDirectory() = default;
  // Reads `path` (errors name the flag and the file).
  static absl::StatusOr<std::unique_ptr<UserDirectory>> Load(
      const std::string& path);

  UserDirectory(const UserDirectory&) = delete;
  UserDirectory& operator=(const UserDirectory&) = delete;

  // Re-reads the file; on an error the users already loaded stay. OK and
  // nothing done without a file.
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mutex_);

  // Whether calls must carry a token.
  bool enabled() const { return !path_.empty(); }
  // The user a token belongs to (compared in constant time per record).
  std::optional<Caller> Find(absl::string_view token) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // The user's cap on devices held at once: their own, else
  // `default_quota`; 0 means none.
  int QuotaOf(const std::string& user, int default_quota) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // How many users (distinct names) are loaded.
  size_t size() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  std::string path_;
  mutable absl::Mutex mutex_;
  std::vector<UserRecord> records_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_USER_DIRECTORY_H_
