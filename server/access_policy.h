// What a client may make shardtraind do, beyond the token: where it may
// listen without one, which files a job may read, and how many streams one
// client may hold open.
//
// - Listening: loopback ("127.0.0.1:P", "localhost:P", "[::1]:P", "unix:...")
//   is always allowed; any other address needs a token (--auth-token-file)
//   or an explicit --insecure.
// - Paths: with --path-root DIR (repeatable), a job's `data` directory and
//   `trainer.init_from` file must resolve (symlinks and ".." followed) inside
//   one of the roots; the built-in dataset "brown" is not a path. Outputs are
//   always the coordinator's own state-dir/jobs/<id>/, never the client's
//   choice. Job names and labels are stored and displayed only: ids are
//   generated, so neither ever names a file or reaches a shell.
// - Streams: WatchJob and StreamLogs each hold a server thread for as long as
//   they run; one client (peer address without its port) may hold at most
//   --max-streams-per-client of them.
#ifndef SHARDTRAIN_SERVER_ACCESS_POLICY_H_
#define SHARDTRAIN_SERVER_ACCESS_POLICY_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardtrain {

// Whether a --listen address reaches this host only.
bool IsLoopbackListen(const std::string& listen);

// OK when `listen` is loopback, or a token is configured, or the operator
// said --insecure; else FailedPrecondition naming the flags.
// --metrics-listen beyond loopback only with --metrics-public: /metrics has
// no token. FailedPrecondition naming the flag otherwise.
absl::Status CheckMetricsListenAllowed(const std::string& listen,
                                       bool metrics_public);

absl::Status CheckListenAllowed(const std::string& listen, bool has_token,
                                bool insecure);

// The directories jobs may read from. No roots: every path is allowed (the
// loopback default: clients are local users).
class PathRoots {
 public:
  // Each root must exist; kept in canonical form. InvalidArgument names the
  // flag and the root otherwise.
  static absl::StatusOr<PathRoots> Create(
      const std::vector<std::string>& roots);
  PathRoots() = default;

  bool confined() const { return !roots_.empty(); }
  const std::vector<std::string>& roots() const { return roots_; }

  // OK when `path` (as resolved: symlinks and ".." followed) lies inside a
  // root; InvalidArgument naming `field` and the roots otherwise.
  absl::Status Check(const std::string& field, const std::string& path) const;

 private:
  std::vector<std::string> roots_;
};

// Long-lived streams (WatchJob, StreamLogs follow) each hold a server thread.
// Limits: per connection (the gRPC peer, address and port: local users all
// come from 127.0.0.1, so an address-wide limit let one process lock every
// other user out) and for the whole daemon, which bounds the threads however
// many connections or source addresses a client opens.
class StreamLimiter {
 public:
  // A held stream slot; releases it when destroyed.
  class Slot {
   public:
    Slot(StreamLimiter* limiter, std::string connection)
        : limiter_(limiter), connection_(std::move(connection)) {}
    ~Slot() { limiter_->Release(connection_); }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;

   private:
    StreamLimiter* const limiter_;
    const std::string connection_;
  };

  StreamLimiter(int max_per_connection, int max_total)
      : max_per_connection_(max_per_connection), max_total_(max_total) {}

  // A slot for `peer` (a gRPC peer string, "ipv4:127.0.0.1:5000": one
  // connection), or ResourceExhausted naming the limit that was reached.
  absl::StatusOr<std::unique_ptr<Slot>> Acquire(const std::string& peer);

  int open(const std::string& peer);
  int total();

 private:
  void Release(const std::string& peer);

  const int max_per_connection_;
  const int max_total_;
  absl::Mutex mutex_;
  std::map<std::string, int> open_ ABSL_GUARDED_BY(mutex_);
  int total_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_ACCESS_POLICY_H_
