#include "server/metrics_http_server.h"

#include <arpa/inet.h>
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
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace shardtrain {
namespace {

// Deadlines are on the monotonic clock: a wall-clock step must not close (or
// keep) every connection at once.
using Clock = std::chrono::steady_clock;

// After the response, how long the server reads (and drops) what the client
// still sends before it closes. Closing with unread input would send a reset,
// which can destroy the response before the client has read it.
constexpr absl::Duration kLingerTimeout = absl::Seconds(1);
// Connections accepted per poll round, so that a flood of new connections
// cannot starve the ones already open.
constexpr int kAcceptsPerRound = 64;
// How long the listener rests after accept() fails for want of descriptors
// or memory (it stays readable, and polling it meanwhile would spin).
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);

constexpr absl::string_view kMetricsPath = "/metrics";
constexpr absl::string_view kMetricsContentType =
    "text/plain; version=0.0.4; charset=utf-8";
constexpr absl::string_view kErrorContentType = "text/plain; charset=utf-8";

Clock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<Clock::duration>(
      absl::ToChronoNanoseconds(d));
}

std::string ErrnoMessage(absl::string_view what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

struct ListenAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
};

// The socket address of a listen string (see MetricsHttpServer::Start).
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

// Where the request head (request line and headers) ends in `data`, just
// past its blank line; npos while it has not ended. Bare LF line ends are
// accepted too (RFC 9112 §2.2). `from` is where the previous search stopped.
size_t HeadEnd(absl::string_view data, size_t from) {
  from = from >= 2 ? from - 2 : 0;
  for (size_t i = data.find('\n', from); i != absl::string_view::npos;
       i = data.find('\n', i + 1)) {
    if (i + 1 < data.size() && data[i + 1] == '\n') return i + 2;
    if (i + 2 < data.size() && data[i + 1] == '\r' && data[i + 2] == '\n') {
      return i + 3;
    }
  }
  return absl::string_view::npos;
}

std::string HttpResponse(absl::string_view status,
                         absl::string_view content_type, absl::string_view body,
                         bool send_body = true,
                         absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n",
                      extra_headers, "Connection: close\r\n\r\n",
                      send_body ? body : "");
}

std::string ErrorResponse(absl::string_view status,
                          absl::string_view extra_headers = "") {
  return HttpResponse(status, kErrorContentType, absl::StrCat(status, "\n"),
                      /*send_body=*/true, extra_headers);
}

struct Connection {
  enum class State {
    kReadingRequest,  // "half-open": its request head is incomplete
    kWriting,         // the response is being sent
    kDraining,        // the response is out; waiting for the client to close
    kClosed,          // to be removed from the table
  };

  int fd = -1;
  std::string peer;
  State state = State::kReadingRequest;
  // Of the current state: then the connection is answered 408 (while the
  // request is read) or closed.
  Clock::time_point deadline;
  Clock::time_point accepted;
  std::string request;
  std::string response;
  size_t written = 0;
};

void Close(Connection& c) {
  close(c.fd);
  c.fd = -1;
  c.state = Connection::State::kClosed;
}

// Closes and removes the oldest connection in `state` accepted before
// `before`; false when there is none.
bool CloseOldest(std::list<Connection>& connections, Connection::State state,
                 Clock::time_point before = Clock::time_point::max()) {
  for (auto it = connections.begin(); it != connections.end(); ++it) {
    if (it->state == state && it->accepted <= before) {
      Close(*it);
      connections.erase(it);
      return true;
    }
  }
  return false;
}

// Sends what the socket takes now; once the whole response is out, ends the
// stream and drains (see kLingerTimeout).
void Write(Connection& c, Clock::time_point now) {
  while (c.written < c.response.size()) {
    const ssize_t n = send(c.fd, c.response.data() + c.written,
                           c.response.size() - c.written, MSG_NOSIGNAL);
    if (n > 0) {
      c.written += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      Close(c);
      return;
    }
  }
  shutdown(c.fd, SHUT_WR);
  c.state = Connection::State::kDraining;
  c.deadline = now + ToClock(kLingerTimeout);
  std::string().swap(c.response);
}

void StartResponse(Connection& c, std::string response, Clock::time_point now,
                   absl::Duration write_timeout) {
  std::string().swap(c.request);
  c.response = std::move(response);
  c.written = 0;
  c.state = Connection::State::kWriting;
  c.deadline = now + ToClock(write_timeout);
  Write(c, now);
}

// Reads and drops the client's input until it closes; the deadline closes
// one that never does.
void Drain(Connection& c) {
  char buffer[4096];
  for (;;) {
    const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    Close(c);
    return;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen) {
  return Start(listen, Options());
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
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
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(
      options, *listen_fd, wake_fd, BoundPort(*listen_fd)));
}

MetricsHttpServer::MetricsHttpServer(Options options, int listen_fd,
                                     int wake_fd, int port)
    : options_(options),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      port_(port),
      thread_([this] { Run(); }) {}

MetricsHttpServer::~MetricsHttpServer() {
  const uint64_t stop = 1;
  (void)!write(wake_fd_, &stop, sizeof(stop));
  thread_.join();
  close(listen_fd_);
  close(wake_fd_);
}

void MetricsHttpServer::RegisterCollectable(
    const std::weak_ptr<prometheus::Collectable>& collectable) {
  absl::MutexLock lock(&mutex_);
  collectables_.push_back(collectable);
}

std::string MetricsHttpServer::Collect() {
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

std::string MetricsHttpServer::Respond(absl::string_view head) {
  absl::string_view line = head.substr(0, head.find('\n'));
  if (absl::EndsWith(line, "\r")) line.remove_suffix(1);
  // method SP request-target SP HTTP-version
  const size_t first = line.find(' ');
  const size_t second = first == absl::string_view::npos
                            ? absl::string_view::npos
                            : line.find(' ', first + 1);
  if (second == absl::string_view::npos ||
      !absl::StartsWith(line.substr(second + 1), "HTTP/1.")) {
    return ErrorResponse("400 Bad Request");
  }
  const absl::string_view method = line.substr(0, first);
  absl::string_view target = line.substr(first + 1, second - first - 1);
  target = target.substr(0, target.find('?'));
  if (target != kMetricsPath) return ErrorResponse("404 Not Found");
  if (method != "GET" && method != "HEAD") {
    return ErrorResponse("405 Method Not Allowed", "Allow: GET, HEAD\r\n");
  }
  return HttpResponse("200 OK", kMetricsContentType, Collect(),
                      /*send_body=*/method == "GET");
}

namespace {

// The server thread's connections and what it does with them: accept, read a
// request head, answer it, drain, expire deadlines. Lives on that thread.
class ConnectionLoop {
 public:
  using Options = MetricsHttpServer::Options;
  using Responder = std::function<std::string(absl::string_view head)>;

  ConnectionLoop(const Options& options, int listen_fd, int wake_fd,
                 Responder respond)
      : options_(options),
        listen_fd_(listen_fd),
        wake_fd_(wake_fd),
        respond_(std::move(respond)) {}
  ~ConnectionLoop() {
    for (Connection& c : connections_) close(c.fd);
  }

  // Serves until wake_fd is written.
  void Run() {
    while (Round()) {
    }
  }

 private:
  using State = Connection::State;

  // One poll and what it found; false once asked to stop.
  bool Round();
  // Reads what has arrived of `c`'s request head; answers it once complete
  // (or too long), closes a connection its client ended first.
  void ReadRequest(Connection& c, Clock::time_point now);
  // Takes the connections waiting on the listening socket.
  void AcceptNew(Clock::time_point now);
  // Closes `peer`'s oldest connection whose request head has still not
  // arrived; one whose request has arrived is answered instead.
  void EvictHalfOpen(const std::string& peer, Clock::time_point now);
  // Answers a request still unread at its deadline with 408; closes other
  // connections past theirs.
  void Expire(Clock::time_point now);

  const Options& options_;
  const int listen_fd_;
  const int wake_fd_;
  const Responder respond_;
  // In accept order, so the first match is the oldest.
  std::list<Connection> connections_;
  Clock::time_point accept_paused_until_;
  std::vector<pollfd> polled_;
  std::vector<Connection*> polled_connections_;
  char buffer_[16 * 1024];
};

void ConnectionLoop::ReadRequest(Connection& c, Clock::time_point now) {
  for (;;) {
    // One byte past the bound tells "too long" from "exactly at it".
    const size_t room = options_.max_header_bytes + 1 - c.request.size();
    const ssize_t n = recv(c.fd, buffer_, std::min(sizeof(buffer_), room), 0);
    if (n > 0) {
      const size_t searched = c.request.size();
      c.request.append(buffer_, static_cast<size_t>(n));
      const size_t end = HeadEnd(c.request, searched);
      if (end != absl::string_view::npos && end <= options_.max_header_bytes) {
        StartResponse(c, respond_(absl::string_view(c.request).substr(0, end)),
                      now, options_.write_timeout);
        return;
      }
      if (c.request.size() > options_.max_header_bytes) {
        StartResponse(c, ErrorResponse("431 Request Header Fields Too Large"),
                      now, options_.write_timeout);
        return;
      }
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      Close(c);  // the client gave up (or failed) before a whole request
      return;
    }
  }
}

void ConnectionLoop::AcceptNew(Clock::time_point now) {
  for (int i = 0; i < kAcceptsPerRound; ++i) {
    sockaddr_storage peer{};
    socklen_t length = sizeof(peer);
    const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer),
                           &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // Out of descriptors (or memory): an idle client's is the one to
      // give up; with none, rest until some are freed.
      if (!CloseOldest(connections_, State::kReadingRequest)) {
        accept_paused_until_ = now + ToClock(kAcceptPause);
      }
      return;
    }
    Connection c;
    c.fd = fd;
    c.peer = PeerAddress(peer);
    c.accepted = now;
    c.deadline = now + ToClock(options_.header_timeout);
    if (connections_.size() >= static_cast<size_t>(options_.max_connections) &&
        !CloseOldest(connections_, State::kReadingRequest,
                     now - ToClock(options_.eviction_grace)) &&
        !CloseOldest(connections_, State::kDraining)) {
      close(fd);  // every connection is being answered: they go first
      continue;
    }
    connections_.push_back(std::move(c));
    // A client that sent its request with the connection (as a scraper
    // does) is answered now, before any newer connection can count
    // against it.
    Connection& added = connections_.back();
    ReadRequest(added, now);
    if (added.state == State::kClosed) {
      connections_.pop_back();
      continue;
    }
    if (added.state != State::kReadingRequest) continue;
    const std::string peer_address = added.peer;
    const auto half_open = std::count_if(
        connections_.begin(), connections_.end(), [&](const Connection& o) {
          return o.state == State::kReadingRequest && o.peer == peer_address;
        });
    if (half_open > options_.max_half_open_per_peer) {
      EvictHalfOpen(peer_address, now);
    }
  }
}

void ConnectionLoop::EvictHalfOpen(const std::string& peer,
                                   Clock::time_point now) {
  // Within the grace a connection is not judged: with only young ones, the
  // peer holds more for a moment (max_connections still bounds them all).
  const Clock::time_point judged_before =
      now - ToClock(options_.eviction_grace);
  for (auto it = connections_.begin(); it != connections_.end(); ++it) {
    if (it->state != State::kReadingRequest || it->peer != peer ||
        it->accepted > judged_before) {
      continue;
    }
    // Its request may have arrived since the last poll (a scraper accepted
    // between its connect and its send): read before judging it idle.
    ReadRequest(*it, now);
    if (it->state == State::kReadingRequest) Close(*it);
    if (it->state == State::kClosed) {
      connections_.erase(it);
      return;
    }
  }
}

void ConnectionLoop::Expire(Clock::time_point now) {
  for (Connection& c : connections_) {
    if (c.state == State::kClosed || now < c.deadline) continue;
    if (c.state == State::kReadingRequest) {
      StartResponse(c, ErrorResponse("408 Request Timeout"), now,
                    options_.write_timeout);
    } else {
      Close(c);
    }
  }
  connections_.remove_if(
      [](const Connection& c) { return c.state == State::kClosed; });
}

bool ConnectionLoop::Round() {
  Clock::time_point now = Clock::now();
  polled_.clear();
  polled_connections_.clear();
  polled_.push_back({wake_fd_, POLLIN, 0});
  const bool accepting = now >= accept_paused_until_;
  if (accepting) polled_.push_back({listen_fd_, POLLIN, 0});
  Clock::time_point next_deadline =
      accepting ? Clock::time_point::max() : accept_paused_until_;
  for (Connection& c : connections_) {
    polled_.push_back(
        {c.fd,
         static_cast<short>(c.state == State::kWriting ? POLLOUT : POLLIN), 0});
    polled_connections_.push_back(&c);
    next_deadline = std::min(next_deadline, c.deadline);
  }
  int timeout_ms = -1;
  if (next_deadline != Clock::time_point::max()) {
    timeout_ms = static_cast<int>(std::clamp<int64_t>(
        std::chrono::ceil<std::chrono::milliseconds>(next_deadline - now)
            .count(),
        0, 60 * 1000));
  }
  if (poll(polled_.data(), polled_.size(), timeout_ms) < 0 && errno != EINTR) {
    // ENOMEM: nothing to do but try again a little later.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return true;
  }
  if (polled_[0].revents != 0) return false;  // the destructor's stop
  now = Clock::now();

  const size_t first_connection = accepting ? 2 : 1;
  for (size_t i = 0; i < polled_connections_.size(); ++i) {
    if (polled_[first_connection + i].revents == 0) continue;
    Connection& c = *polled_connections_[i];
    switch (c.state) {
      case State::kReadingRequest:
        ReadRequest(c, now);
        break;
      case State::kWriting:
        Write(c, now);
        break;
      case State::kDraining:
        Drain(c);
        break;
      case State::kClosed:
        break;
    }
  }
  Expire(now);
  if (accepting && (polled_[1].revents & POLLIN) != 0) AcceptNew(now);
  return true;
}

}  // namespace

void MetricsHttpServer::Run() {
  ConnectionLoop loop(options_, listen_fd_, wake_fd_,
                      [this](absl::string_view head) { return Respond(head); });
  loop.Run();
}

}  // namespace shardtrain
