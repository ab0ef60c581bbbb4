// MetricsEndpoint: shardtraind's /metrics, served over HTTP/1.1 by
// libmicrohttpd. It answers `GET /metrics` with the Prometheus text exposition
// of the registered collectables, and nothing else (404 for other paths, 405
// for other methods), one request per connection.
//
// HTTP is libmicrohttpd's (run from this class's one thread over its epoll
// set, no thread per connection), so an idle connection costs a descriptor,
// never a thread, and a scrape is answered while any number of idle or
// half-sent connections are open. What libmicrohttpd bounds by inactivity or
// refuses outright, this class bounds by age and makes room for, from
// libmicrohttpd's connection and accept-policy hooks:
//   - a connection must complete its request headers within header_timeout
//     of its accept, however slowly it trickles (then it gets a 408 and is
//     closed), in at most max_header_bytes (431);
//   - at most max_half_open_per_peer connections from one address may have
//     incomplete headers, and at most max_connections may be open. A new
//     connection beyond either bound is admitted by closing an idle one (its
//     head incomplete and nothing it sent waiting in its socket: one whose
//     request has arrived is never closed for room): the oldest idle one
//     past eviction_grace, else the newest idle one within it, from the new
//     one's address for the per-address bound and from the address with the
//     most half-open connections for the total. (libmicrohttpd's own
//     per-address limit would refuse the new one instead, which locks a
//     scraper out behind its own address's idlers; refusing it while every
//     connection is young let a flood of fresh connections starve the
//     scraper.) So a flood displaces its own latest arrivals: within the
//     grace, a scraper's connection is closed for room only when it is the
//     newest idle one of the most crowded address as another connection
//     arrives, i.e. when it shares a flooding address and the flood's next
//     connection is accepted between the scraper's connect and its request;
//   - beyond max_connections with no idle connection left, the oldest
//     answered one is closed, and when every connection is being answered
//     the new one is refused. So the server holds at most max_connections
//     (and those shut in its current round), each with a memory pool of
//     2 * max_header_bytes + 4 KiB: about 10 MiB at the defaults;
//   - a client that has not read its whole response within write_timeout is
//     closed.
// The collection and serialization run on the server thread; a scrape costs
// what the registry's Collect() costs (milliseconds).
#ifndef SHARDTRAIN_SERVER_METRICS_ENDPOINT_H_
#define SHARDTRAIN_SERVER_METRICS_ENDPOINT_H_

#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"

struct MHD_Daemon;

namespace shardtrain {

class MetricsConnections;

class MetricsEndpoint {
 public:
  static constexpr absl::Duration kHeaderTimeout = absl::Seconds(1);
  static constexpr absl::Duration kWriteTimeout = absl::Seconds(5);
  static constexpr size_t kMaxHeaderBytes = 8 * 1024;
  static constexpr int kMaxHalfOpenPerPeer = 16;
  static constexpr int kMaxConnections = 512;
  static constexpr absl::Duration kEvictionGrace = absl::Milliseconds(250);

  struct Options {
    // From accept until the blank line that ends the request headers.
    absl::Duration header_timeout = kHeaderTimeout;
    // For the whole response, from the end of its request.
    absl::Duration write_timeout = kWriteTimeout;
    size_t max_header_bytes = kMaxHeaderBytes;
    int max_half_open_per_peer = kMaxHalfOpenPerPeer;
    int max_connections = kMaxConnections;
    // A connection this young is not yet judged by its age: a scraper
    // sends its request right after it connects, but may be accepted a
    // moment before the request arrives, amid a burst of idle connections
    // from its own address. Past it, a request not yet sent marks the
    // connection idle, and idle ones go oldest first; within it, they go
    // only when no older idle one is left, newest first.
    absl::Duration eviction_grace = kEvictionGrace;
  };

  // Binds `listen` ("host:port", as --metrics-listen takes it: an IPv4
  // address, "[IPv6]", a name such as localhost, or an empty host for every
  // IPv4 address; a bare "port" means the same; port 0 picks a free one) and
  // starts serving. An error says why the address could not be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& listen, Options options);
  // The same with the default bounds. (Not a default argument: GCC cannot
  // use a nested struct's member initializers inside its enclosing class.)
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& listen);

  // Stops the server thread and closes every connection.
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // Adds `collectable` to what /metrics serves, from the next scrape on. The
  // server holds it weakly: one that has expired is skipped.
  void RegisterCollectable(
      const std::weak_ptr<prometheus::Collectable>& collectable);

  // The port actually bound.
  int port() const { return port_; }

 private:
  MetricsEndpoint(int wake_fd, int port);
  void Run();
  // The exposition of every live collectable.
  std::string Collect();

  const int wake_fd_;  // an eventfd; written once to stop Run()
  const int port_;
  Options options_;
  // The bounds above, over the daemon's connections; used on the server
  // thread only (and by the daemon's stop, after it has ended).
  std::unique_ptr<MetricsConnections> connections_;
  MHD_Daemon* daemon_ = nullptr;

  absl::Mutex mutex_;
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables_
      ABSL_GUARDED_BY(mutex_);

  // Started last, once the daemon exists.
  std::thread thread_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_METRICS_ENDPOINT_H_
