// What a client may make shardtraind do, beyond the token: where it may
// listen without one, which files a job may read, and how many streams one
// client may hold open.
//
// - Listening: loopback ("127.0.0.1:P", "[::1]:P", "unix:...", or a name such
//   as "localhost:P" that resolves to loopback addresses only) is always
//   allowed; any other address needs a token (--auth-token-file) or an
//   explicit --insecure.
// - Paths: with --path-root DIR (repeatable), a job's `data` directory and
//   `trainer.init_from` file must resolve (symlinks and ".." followed) inside
//   one of the roots; the built-in dataset "brown" is not a path. Outputs are
//   always the coordinator's own state-dir/jobs/<id>/, never the client's
//   choice. Job names and labels are stored and displayed only: ids are
//   generated, so neither ever names a file or reaches a shell.
// - Streams: WatchJob and StreamLogs each hold a server thread for as long as
//   they run; one connection may hold at most --max-streams-per-client of
//   them, one peer (a local user, or a remote address) --max-streams-per-peer,
//   and the daemon --max-streams.
#ifndef SHARDTRAIN_SERVER_ACCESS_POLICY_H_
#define SHARDTRAIN_SERVER_ACCESS_POLICY_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardtrain {

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

// Who a gRPC peer ("ipv4:127.0.0.1:40512") is, for the per-peer stream
// limit. A loopback TCP connection is its local user ("uid 1000", from the
// kernel's socket table, /proc/net/tcp{,6}): every local user comes from
// 127.0.0.1, so an address alone would let one user lock out the others. A
// remote one is its address without the port ("ipv4:10.0.0.7"). Anything
// else (a Unix socket, whose peer gRPC does not identify) is the peer string.
// Every loopback form counts: 127.0.0.0/8, ::1 and IPv4-mapped IPv6, looked
// up in both tables; a loopback peer whose owner is not found is
// kUnknownLocalPeer, one peer shared by all such connections.
inline constexpr char kUnknownLocalPeer[] = "local user unknown";
std::string PeerIdentity(const std::string& peer);

// Long-lived streams (WatchJob, StreamLogs follow) each hold a server thread.
// Limits: per connection (the gRPC peer, address and port), per peer
// (PeerIdentity: nine connections of one process once took all 512 slots),
// and for the whole daemon, which bounds the threads however many
// connections or source addresses a client opens.
class StreamLimiter {
 public:
  // A held stream slot; releases it when destroyed.
  class Slot {
   public:
    Slot(StreamLimiter* limiter, std::string connection, std::string peer)
        : limiter_(limiter),
          connection_(std::move(connection)),
          peer_(std::move(peer)) {}
    ~Slot() { limiter_->Release(connection_, peer_); }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;

   private:
    StreamLimiter* const limiter_;
    const std::string connection_;
    const std::string peer_;
  };

  // `identify` maps a gRPC peer string to its PeerIdentity (tests pass
  // their own).
  StreamLimiter(
      int max_per_connection, int max_per_peer, int max_total,
      std::function<std::string(const std::string&)> identify = PeerIdentity)
      : max_per_connection_(max_per_connection),
        max_per_peer_(max_per_peer),
        max_total_(max_total),
        identify_(std::move(identify)) {}

  // A slot for `peer` (a gRPC peer string, "ipv4:127.0.0.1:5000": one
  // connection), or ResourceExhausted naming the limit that was reached.
  absl::StatusOr<std::unique_ptr<Slot>> Acquire(const std::string& peer);

  int open(const std::string& peer);
  int total();

 private:
  void Release(const std::string& connection, const std::string& peer);

  const int max_per_connection_;
  const int max_per_peer_;
  const int max_total_;
  const std::function<std::string(const std::string&)> identify_;
  absl::Mutex mutex_;
  std::map<std::string, int> open_ ABSL_GUARDED_BY(mutex_);  // per connection
  std::map<std::string, int> per_peer_ ABSL_GUARDED_BY(mutex_);
  int total_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_ACCESS_POLICY_H_
