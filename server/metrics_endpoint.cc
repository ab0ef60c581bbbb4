#include "server/metrics_endpoint.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace shardtrain {
namespace {

// Deadlines are on the monotonic clock: a wall-clock step must not close (or
// keep) every connection at once.
using SteadyClock = std::chrono::steady_clock;

constexpr absl::string_view kMetricsPath = "/metrics";
constexpr char kMetricsContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";
constexpr char kErrorContentType[] = "text/plain; charset=utf-8";

SteadyClock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<SteadyClock::duration>(
      absl::ToChronoNanoseconds(d));
}

std::string ErrnoMessage(absl::string_view what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

struct ListenAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
};

// The socket address of a listen string (see MetricsEndpoint::Start).
absl::StatusOr<ListenAddress> ParseListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
  const std::string port_text =
      colon == std::string::npos ? listen : listen.substr(colon + 1);
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(),
                   [](char c) { return absl::ascii_isdigit(c); }) ||
      std::stoi(port_text) > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", port_text, "' is not a port (0-65535)"));
  }
  const uint16_t port = htons(static_cast<uint16_t>(std::stoi(port_text)));

  ListenAddress address;
  if (host.empty()) {
    auto* v4 = reinterpret_cast<sockaddr_in*>(&address.storage);
    v4->sin_family = AF_INET;
    v4->sin_addr.s_addr = htonl(INADDR_ANY);
    v4->sin_port = port;
    address.length = sizeof(sockaddr_in);
    return address;
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  hints.ai_family = AF_UNSPEC;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    hints.ai_family = AF_INET6;
    hints.ai_flags |= AI_NUMERICHOST;
  }
  addrinfo* found = nullptr;
  if (const int error = getaddrinfo(host.c_str(), nullptr, &hints, &found);
      error != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", host, "': ", gai_strerror(error)));
  }
  // A name with both families ("localhost") binds its IPv4 address, as
  // civetweb did.
  const addrinfo* chosen = nullptr;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    if (chosen == nullptr ||
        (a->ai_family == AF_INET && chosen->ai_family != AF_INET)) {
      chosen = a;
    }
  }
  if (chosen == nullptr) {
    freeaddrinfo(found);
    return absl::InvalidArgumentError(
        absl::StrCat("'", host, "' has no IPv4 or IPv6 address"));
  }
  std::memcpy(&address.storage, chosen->ai_addr, chosen->ai_addrlen);
  address.length = chosen->ai_addrlen;
  freeaddrinfo(found);
  if (address.storage.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&address.storage)->sin_port = port;
  } else {
    reinterpret_cast<sockaddr_in6*>(&address.storage)->sin6_port = port;
  }
  return address;
}

// A non-blocking listening socket on `address`, closed on exec (the daemon
// starts worker processes, which must not inherit it).
absl::StatusOr<int> Listen(const ListenAddress& address) {
  const int family = address.storage.ss_family;
  const int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(ErrnoMessage("socket"));
  const int one = 1;
  // A restarted daemon rebinds its port while old connections sit in
  // TIME_WAIT.
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // "[::]:port" means IPv6 only, as it did with civetweb.
  if (family == AF_INET6) {
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
  }
  if (bind(fd, reinterpret_cast<const sockaddr*>(&address.storage),
           address.length) != 0) {
    const std::string message = ErrnoMessage("bind");
    close(fd);
    return absl::UnavailableError(message);
  }
  if (listen(fd, SOMAXCONN) != 0) {
    const std::string message = ErrnoMessage("listen");
    close(fd);
    return absl::UnavailableError(message);
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    return 0;
  }
  return ntohs(bound.ss_family == AF_INET
                   ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                   : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
}

// The peer's address without its port: the key of the per-peer bound.
std::string PeerAddress(const sockaddr_storage& peer) {
  char text[INET6_ADDRSTRLEN] = "";
  if (peer.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&peer)->sin_addr,
              text, sizeof(text));
  } else if (peer.ss_family == AF_INET6) {
    inet_ntop(AF_INET6,
              &reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

std::string PeerAddress(const sockaddr* peer) {
  sockaddr_storage storage{};
  if (peer != nullptr) {
    std::memcpy(&storage, peer,
                peer->sa_family == AF_INET6 ? sizeof(sockaddr_in6)
                                            : sizeof(sockaddr_in));
  }
  return PeerAddress(storage);
}

// What the server sends to a request head still incomplete at its deadline,
// written beside the daemon (which has nothing to send on that connection).
constexpr absl::string_view kRequestTimeout =
    "HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; "
    "charset=utf-8\r\nContent-Length: 20\r\nConnection: close\r\n\r\n"
    "408 Request Timeout\n";

}  // namespace

// The daemon's connections in accept order, and the bounds of the header:
// libmicrohttpd tells it of each accept (Admit, then Started), of each
// request head (Answered) and of each close (Closed); Expire enforces the
// deadlines between the daemon's rounds. A connection is closed by shutting
// its socket down: the daemon reads the end of stream and closes it in its
// next round. Everything runs on the server thread.
class MetricsConnections {
 public:
  using Options = MetricsEndpoint::Options;

  MetricsConnections(const Options& options,
                     std::function<std::string()> collect)
      : options_(options), collect_(std::move(collect)) {}

  // The accept policy: makes room for a connection from `peer` beyond
  // either bound (see the header: an idle one goes, oldest judged first,
  // then youngest in the grace; beyond the total, then the oldest answered
  // one); false refuses it.
  bool Admit(const sockaddr* peer, SteadyClock::time_point now);
  void Started(MHD_Connection* connection, void** context,
               SteadyClock::time_point now);
  void Closed(void* context);
  // The access handler: the request head has arrived.
  MHD_Result Answer(MHD_Connection* connection, absl::string_view url,
                    absl::string_view method, SteadyClock::time_point now);
  // Answers 408 to heads still incomplete at their deadline and closes
  // answers still unread at theirs.
  void Expire(SteadyClock::time_point now);
  // The earliest deadline, or max() with none.
  SteadyClock::time_point NextDeadline() const;

 private:
  struct Connection {
    enum class State {
      kReadingRequest,  // "half-open": its request head is incomplete
      kAnswered,        // its response is queued or out
      kClosing,         // shut down here; the daemon has yet to close it
    };
    int fd = -1;
    std::string peer;
    State state = State::kReadingRequest;
    SteadyClock::time_point accepted;
    SteadyClock::time_point deadline;
  };
  using State = Connection::State;
  // Half-open connections by peer address.
  using HalfOpenCounts = std::unordered_map<std::string, int>;

  void Shut(Connection& c);
  // Closes one idle connection from `peer` (from any address, if empty) to
  // make room: the oldest judged idle (accepted before `judged_before`),
  // else the youngest of the address with the most half-open connections
  // in `*half_open` (kept counting); false when every half-open candidate
  // has its request waiting.
  bool CloseIdle(absl::string_view peer, SteadyClock::time_point judged_before,
                 HalfOpenCounts* half_open);
  // Closes the oldest answered connection; false when there is none.
  bool CloseOldestAnswered();

  const Options& options_;
  const std::function<std::string()> collect_;
  std::list<Connection> connections_;
};

namespace {

// Bytes are waiting in `fd`'s socket that the daemon has yet to read: a
// request that arrived since its last round (a scraper accepted between its
// connect and its send), so the connection is not idle.
bool RequestWaiting(int fd) {
  char byte;
  return recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
}

}  // namespace

void MetricsConnections::Shut(Connection& c) {
  shutdown(c.fd, SHUT_RDWR);
  c.state = State::kClosing;
}

bool MetricsConnections::CloseIdle(absl::string_view peer,
                                   SteadyClock::time_point judged_before,
                                   HalfOpenCounts* half_open) {
  std::vector<Connection*> half_open_here;  // oldest first
  for (Connection& c : connections_) {
    if (c.state == State::kReadingRequest && (peer.empty() || c.peer == peer)) {
      half_open_here.push_back(&c);
    }
  }
  auto close = [half_open, this](Connection* c) {
    --(*half_open)[c->peer];
    Shut(*c);
    return true;
  };
  // Past the grace, the oldest has had longest to send its request.
  for (Connection* c : half_open_here) {
    if (c->accepted > judged_before) break;
    if (!RequestWaiting(c->fd)) return close(c);
  }
  // Within it, age says nothing yet: the newest of the most crowded address
  // goes, so a flood displaces its own latest arrivals rather than a
  // connection that came before them (a scraper accepted just before its
  // request arrived) or one from a quieter address.
  std::vector<Connection*> young(half_open_here.rbegin(),
                                 half_open_here.rend());
  std::stable_sort(young.begin(), young.end(),
                   [half_open](const Connection* a, const Connection* b) {
                     return half_open->at(a->peer) > half_open->at(b->peer);
                   });
  for (Connection* c : young) {
    if (c->accepted > judged_before && !RequestWaiting(c->fd)) {
      return close(c);
    }
  }
  return false;
}

bool MetricsConnections::CloseOldestAnswered() {
  for (Connection& c : connections_) {
    if (c.state == State::kAnswered) {
      Shut(c);
      return true;
    }
  }
  return false;
}

bool MetricsConnections::Admit(const sockaddr* peer,
                               SteadyClock::time_point now) {
  const SteadyClock::time_point judged_before =
      now - ToClock(options_.eviction_grace);
  const std::string address = PeerAddress(peer);
  HalfOpenCounts half_open;
  int open = 0;
  for (const Connection& c : connections_) {
    if (c.state == State::kClosing) continue;
    ++open;
    if (c.state == State::kReadingRequest) ++half_open[c.peer];
  }
  // The new connection counts as half-open from its address.
  if (++half_open[address] > options_.max_half_open_per_peer &&
      CloseIdle(address, judged_before, &half_open)) {
    --open;
  }
  if (open < options_.max_connections) return true;
  // An answered connection goes only when no half-open one is idle: closing
  // it may lose a response its client has yet to read.
  return CloseIdle("", judged_before, &half_open) || CloseOldestAnswered();
}

void MetricsConnections::Started(MHD_Connection* connection, void** context,
                                 SteadyClock::time_point now) {
  Connection c;
  const MHD_ConnectionInfo* fd =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  const MHD_ConnectionInfo* peer =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  c.fd = fd != nullptr ? fd->connect_fd : -1;
  c.peer = PeerAddress(peer != nullptr ? peer->client_addr : nullptr);
  c.accepted = now;
  c.deadline = now + ToClock(options_.header_timeout);
  connections_.push_back(std::move(c));
  *context = &connections_.back();
}

void MetricsConnections::Closed(void* context) {
  connections_.remove_if(
      [context](const Connection& c) { return &c == context; });
}

namespace {

MHD_Result Respond(MHD_Connection* connection, unsigned int status,
                   const char* content_type, const std::string& body,
                   const char* allow = nullptr) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
  if (allow != nullptr) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, allow);
  }
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return queued;
}

MHD_Result RespondError(MHD_Connection* connection, unsigned int status,
                        const char* allow = nullptr) {
  return Respond(
      connection, status, kErrorContentType,
      absl::StrCat(status, " ", MHD_get_reason_phrase_for(status), "\n"),
      allow);
}

}  // namespace

MHD_Result MetricsConnections::Answer(MHD_Connection* connection,
                                      absl::string_view url,
                                      absl::string_view method,
                                      SteadyClock::time_point now) {
  const MHD_ConnectionInfo* context =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  if (context != nullptr && context->socket_context != nullptr) {
    Connection& c = *static_cast<Connection*>(context->socket_context);
    if (c.state == State::kReadingRequest) {
      c.state = State::kAnswered;
      c.deadline = now + ToClock(options_.write_timeout);
    }
  }
  // A head that fits the daemon's memory pool (a little above the bound)
  // but not the bound.
  const MHD_ConnectionInfo* head = MHD_get_connection_info(
      connection, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
  if (head != nullptr && head->header_size > options_.max_header_bytes) {
    return RespondError(connection, MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE);
  }
  if (url != kMetricsPath) return RespondError(connection, MHD_HTTP_NOT_FOUND);
  if (method != MHD_HTTP_METHOD_GET && method != MHD_HTTP_METHOD_HEAD) {
    return RespondError(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "GET, HEAD");
  }
  return Respond(connection, MHD_HTTP_OK, kMetricsContentType, collect_());
}

void MetricsConnections::Expire(SteadyClock::time_point now) {
  for (Connection& c : connections_) {
    if (c.state == State::kClosing || now < c.deadline) continue;
    if (c.state == State::kReadingRequest) {
      // The daemon has read what arrived and has nothing to send yet.
      (void)!send(c.fd, kRequestTimeout.data(), kRequestTimeout.size(),
                  MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    Shut(c);
  }
}

SteadyClock::time_point MetricsConnections::NextDeadline() const {
  SteadyClock::time_point next = SteadyClock::time_point::max();
  for (const Connection& c : connections_) {
    if (c.state != State::kClosing) next = std::min(next, c.deadline);
  }
  return next;
}

namespace {

MHD_Result OnAccept(void* cls, const sockaddr* peer, socklen_t) {
  return static_cast<MetricsConnections*>(cls)->Admit(peer, SteadyClock::now())
             ? MHD_YES
             : MHD_NO;
}

void OnConnection(void* cls, MHD_Connection* connection, void** context,
                  MHD_ConnectionNotificationCode code) {
  auto* connections = static_cast<MetricsConnections*>(cls);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    connections->Started(connection, context, SteadyClock::now());
  } else {
    connections->Closed(*context);
  }
}

MHD_Result OnRequest(void* cls, MHD_Connection* connection, const char* url,
                     const char* method, const char*, const char*,
                     size_t* upload_size, void** request) {
  // Called again with the body of a request that has one: its answer (a
  // 405) went with the first call, and the daemon discards the rest.
  if (*request != nullptr) {
    *upload_size = 0;
    return MHD_YES;
  }
  *request = cls;
  return static_cast<MetricsConnections*>(cls)->Answer(connection, url, method,
                                                       SteadyClock::now());
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& listen) {
  return Start(listen, Options());
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& listen, Options options) {
  absl::StatusOr<ListenAddress> address = ParseListen(listen);
  if (!address.ok()) return address.status();
  absl::StatusOr<int> listen_fd = Listen(*address);
  if (!listen_fd.ok()) return listen_fd.status();
  const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd < 0) {
    const std::string message = ErrnoMessage("eventfd");
    close(*listen_fd);
    return absl::InternalError(message);
  }
  std::unique_ptr<MetricsEndpoint> server(
      new MetricsEndpoint(wake_fd, BoundPort(*listen_fd)));
  server->options_ = options;
  MetricsEndpoint* self = server.get();
  server->connections_ = std::make_unique<MetricsConnections>(
      server->options_, [self] { return self->Collect(); });
  MetricsConnections* connections = server->connections_.get();
  // The daemon's own bounds are backstops: the deadlines and caps above are
  // enforced by MetricsConnections, so its inactivity timeout is off and
  // its connection limit leaves room for connections being shut down. Its
  // memory pool holds a head of max_header_bytes and the response's
  // headers; beyond that it answers 431 itself.
  const unsigned int pool_bytes =
      static_cast<unsigned int>(2 * options.max_header_bytes + 4096);
  const unsigned int daemon_limit =
      static_cast<unsigned int>(2 * options.max_connections + 64);
  server->daemon_ = MHD_start_daemon(
      MHD_USE_EPOLL, 0, &OnAccept, connections, &OnRequest, connections,
      MHD_OPTION_LISTEN_SOCKET, static_cast<MHD_socket>(*listen_fd),
      MHD_OPTION_NOTIFY_CONNECTION, &OnConnection, connections,
      MHD_OPTION_CONNECTION_TIMEOUT, 0u, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
      static_cast<size_t>(pool_bytes), MHD_OPTION_CONNECTION_LIMIT,
      daemon_limit, MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    close(*listen_fd);
    return absl::InternalError(
        absl::StrCat("libmicrohttpd could not serve on ", listen));
  }
  server->thread_ = std::thread([self] { self->Run(); });
  return server;
}

MetricsEndpoint::MetricsEndpoint(int wake_fd, int port)
    : wake_fd_(wake_fd), port_(port) {}

MetricsEndpoint::~MetricsEndpoint() {
  const uint64_t stop = 1;
  (void)!write(wake_fd_, &stop, sizeof(stop));
  if (thread_.joinable()) thread_.join();
  // Closes every connection and the listening socket.
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
  close(wake_fd_);
}

void MetricsEndpoint::RegisterCollectable(
    const std::weak_ptr<prometheus::Collectable>& collectable) {
  absl::MutexLock lock(&mutex_);
  collectables_.push_back(collectable);
}

std::string MetricsEndpoint::Collect() {
  std::vector<std::shared_ptr<prometheus::Collectable>> live;
  {
    absl::MutexLock lock(&mutex_);
    for (const auto& weak : collectables_) {
      if (auto collectable = weak.lock())
        live.push_back(std::move(collectable));
    }
  }
  std::vector<prometheus::MetricFamily> families;
  for (const auto& collectable : live) {
    std::vector<prometheus::MetricFamily> some = collectable->Collect();
    families.insert(families.end(), std::make_move_iterator(some.begin()),
                    std::make_move_iterator(some.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

void MetricsEndpoint::Run() {
  const MHD_DaemonInfo* info =
      MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_EPOLL_FD);
  pollfd polled[2] = {{wake_fd_, POLLIN, 0},
                      {info != nullptr ? info->epoll_fd : -1, POLLIN, 0}};
  for (;;) {
    SteadyClock::time_point now = SteadyClock::now();
    SteadyClock::time_point next = connections_->NextDeadline();
    MHD_UNSIGNED_LONG_LONG daemon_ms = 0;
    if (MHD_get_timeout(daemon_, &daemon_ms) == MHD_YES) {
      next = std::min(next, now + std::chrono::milliseconds(daemon_ms));
    }
    int timeout_ms = 1000;
    if (next != SteadyClock::time_point::max()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::ceil<std::chrono::milliseconds>(next - now).count(), 0,
          1000));
    }
    if (poll(polled, 2, timeout_ms) < 0 && errno != EINTR) {
      // ENOMEM: nothing to do but try again a little later.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (polled[0].revents != 0) return;  // the destructor's stop
    MHD_run(daemon_);
    connections_->Expire(SteadyClock::now());
  }
}

}  // namespace shardtrain
