// /metrics under idle and hostile clients: shardtraind's server
// (MetricsEndpoint: libmicrohttpd with its age-based bounds) beside each
// candidate library alone, configured as close to the same bounds as it
// allows — libmicrohttpd (1 s inactivity timeout, 16 connections per
// address, 512 in all, a 16 KiB memory pool) and libevent's evhttp (1 s
// read/write timeouts, 8 KiB of headers; 2.1 has no connection caps).
// Each serves the same exposition; the cases are what Prometheus meets on a
// shared host. Prints a Markdown table (bench/RESULTS.md §13).
//
//   metrics_http_bench
#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/thread.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/metrics_endpoint.h"

namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
      .count();
}

// A connection to 127.0.0.1:`port` from `source` (another loopback address
// stands for another host); -1 when refused.
int Connect(int port, const char* source) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source, &from.sin_addr);
  bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void SendAll(int fd, const std::string& data) {
  (void)!send(fd, data.data(), data.size(), MSG_NOSIGNAL);
}

// True once the peer ended the stream (or reset it) within `ms`.
bool Ended(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, ms) <= 0) return false;
  char buffer[4096];
  return read(fd, buffer, sizeof(buffer)) <= 0 || Ended(fd, 0);
}

// A whole 200 response from `source` within 2 s: its milliseconds, or -1.
double Scrape(int port, const char* source = "127.0.0.1") {
  const Clock::time_point start = Clock::now();
  const int fd = Connect(port, source);
  if (fd < 0) return -1;
  SendAll(fd, "GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n");
  std::string response;
  char buffer[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 2000) <= 0) break;
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n <= 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  const bool ok = response.rfind("HTTP/1.1 200", 0) == 0 &&
                  response.find("bench_answer") != std::string::npos;
  return ok ? MsSince(start) : -1;
}

class Held {
 public:
  ~Held() { Clear(); }
  void Open(int port, int count, const char* source,
            const std::string& prefix = "") {
    for (int i = 0; i < count; ++i) {
      const int fd = Connect(port, source);
      if (fd < 0) continue;
      SendAll(fd, prefix);
      fds_.push_back(fd);
    }
  }
  int StillOpen() {
    int open = 0;
    for (int fd : fds_) open += Ended(fd, 0) ? 0 : 1;
    return open;
  }
  void Clear() {
    for (int fd : fds_) close(fd);
    fds_.clear();
  }

 private:
  std::vector<int> fds_;
};

struct Server {
  std::string name;
  int port = 0;
  std::function<void()> stop;
};

Server StartOurs(std::shared_ptr<prometheus::Registry> registry) {
  auto server = shardtrain::MetricsEndpoint::Start("127.0.0.1:0");
  std::shared_ptr<shardtrain::MetricsEndpoint> held(std::move(*server));
  held->RegisterCollectable(registry);
  return {"shardtraind (libmicrohttpd + bounds)", held->port(),
          [held, registry]() mutable { held.reset(); }};
}

MHD_Result MhdAnswer(void* cls, MHD_Connection* connection, const char*,
                     const char*, const char*, const char*, size_t*, void**) {
  const std::string& body = *static_cast<const std::string*>(cls);
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_PERSISTENT);
  MHD_add_response_header(response, "Connection", "close");
  const MHD_Result queued = MHD_queue_response(connection, 200, response);
  MHD_destroy_response(response);
  return queued;
}

Server StartMhd(const std::string* body) {
  MHD_Daemon* daemon = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL, 0, nullptr, nullptr,
      &MhdAnswer, const_cast<std::string*>(body), MHD_OPTION_CONNECTION_TIMEOUT,
      1u, MHD_OPTION_PER_IP_CONNECTION_LIMIT, 16u, MHD_OPTION_CONNECTION_LIMIT,
      512u, MHD_OPTION_CONNECTION_MEMORY_LIMIT, static_cast<size_t>(16384),
      MHD_OPTION_END);
  const int port = MHD_get_daemon_info(daemon, MHD_DAEMON_INFO_BIND_PORT)->port;
  return {"libmicrohttpd alone", port, [daemon] { MHD_stop_daemon(daemon); }};
}

void EvAnswer(evhttp_request* request, void* cls) {
  const std::string& body = *static_cast<const std::string*>(cls);
  evbuffer* out = evbuffer_new();
  evbuffer_add(out, body.data(), body.size());
  evhttp_add_header(evhttp_request_get_output_headers(request), "Connection",
                    "close");
  evhttp_send_reply(request, 200, "OK", out);
  evbuffer_free(out);
}

Server StartEvhttp(const std::string* body) {
  event_base* base = event_base_new();
  evhttp* http = evhttp_new(base);
  const timeval second{1, 0};
  evhttp_set_timeout_tv(http, &second);
  evhttp_set_max_headers_size(http, 8192);
  evhttp_set_cb(http, "/metrics", &EvAnswer, const_cast<std::string*>(body));
  evhttp_bound_socket* bound =
      evhttp_bind_socket_with_handle(http, "127.0.0.1", 0);
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  getsockname(evhttp_bound_socket_get_fd(bound),
              reinterpret_cast<sockaddr*>(&address), &length);
  auto thread = std::make_shared<std::thread>(
      [base] { event_base_loop(base, EVLOOP_NO_EXIT_ON_EMPTY); });
  return {"evhttp alone", ntohs(address.sin_port), [base, http, thread] {
            event_base_loopbreak(base);
            thread->join();
            evhttp_free(http);
            event_base_free(base);
          }};
}

struct Row {
  double idle_median = 0, busy_other_max = 0, busy_same_max = 0;
  int same_failed = 0;
  double trickle_closed_s = 0;
  int held_of_600 = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Row Measure(const Server& server) {
  Row row;
  std::vector<double> idle;
  for (int i = 0; i < 50; ++i) idle.push_back(Scrape(server.port));
  row.idle_median = Median(idle);
  {  // 64 idle and 8 half-sent connections from another host.
    Held held;
    held.Open(server.port, 64, "127.0.0.2");
    held.Open(server.port, 8, "127.0.0.2", "GET /metr");
    for (int i = 0; i < 20; ++i) {
      const double ms = Scrape(server.port);
      row.busy_other_max = ms < 0 ? -1 : std::max(row.busy_other_max, ms);
      if (ms < 0) break;
    }
  }
  {  // The same from the scraper's own address, 300 ms before it scrapes.
    Held held;
    held.Open(server.port, 64, "127.0.0.1");
    held.Open(server.port, 8, "127.0.0.1", "GET /metr");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (int i = 0; i < 20; ++i) {
      const double ms = Scrape(server.port);
      if (ms < 0) ++row.same_failed;
      row.busy_same_max = std::max(row.busy_same_max, ms);
    }
  }
  {  // A header line every 100 ms.
    const int fd = Connect(server.port, "127.0.0.3");
    SendAll(fd, "GET /metrics HTTP/1.1\r\n");
    const Clock::time_point start = Clock::now();
    bool ended = false;
    while (!ended && MsSince(start) < 10000) {
      SendAll(fd, "X-A: b\r\n");
      ended = Ended(fd, 100);
    }
    row.trickle_closed_s = ended ? MsSince(start) / 1000 : -1;
    close(fd);
  }
  {  // 600 idle connections from 30 addresses, 20 each: how many the
     // server holds 150 ms after the last connect (its caps at work).
    Held held;
    for (int a = 0; a < 30; ++a) {
      held.Open(server.port, 20, ("127.0.1." + std::to_string(a + 1)).c_str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    row.held_of_600 = held.StillOpen();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  return row;
}

}  // namespace

int main() {
  rlimit files{8192, 8192};
  setrlimit(RLIMIT_NOFILE, &files);
  evthread_use_pthreads();
  auto registry = std::make_shared<prometheus::Registry>();
  auto& family = prometheus::BuildGauge()
                     .Name("bench_answer")
                     .Help("A gauge per job, as a busy daemon has")
                     .Register(*registry);
  for (int i = 0; i < 40; ++i) {
    family.Add({{"job", std::to_string(i)}, {"mesh", "pp2xfsdp2"}}).Set(i);
  }
  const std::string body =
      prometheus::TextSerializer().Serialize(registry->Collect());
  std::printf(
      "| server | scrape, idle (median ms) | 64 idle + 8 half-sent from "
      "another address (worst ms) | the same from the scraper's address "
      "(worst ms; failed of 20) | a head trickled a line per 100 ms closed "
      "after (s) | of 600 idle connections from 30 addresses, held 150 ms "
      "after the last connect |\n"
      "| --- | --- | --- | --- | --- | --- |\n");
  for (const auto& start : std::vector<std::function<Server()>>{
           [&] { return StartOurs(registry); }, [&] { return StartMhd(&body); },
           [&] { return StartEvhttp(&body); }}) {
    Server server = start();
    const Row r = Measure(server);
    server.stop();
    auto ms = [](double v) {
      char text[32];
      std::snprintf(text, sizeof(text), v < 0 ? "failed" : "%.1f", v);
      return std::string(text);
    };
    std::printf("| %s | %s | %s | %s; %d | %s | %d |\n", server.name.c_str(),
                ms(r.idle_median).c_str(), ms(r.busy_other_max).c_str(),
                ms(r.busy_same_max).c_str(), r.same_failed,
                r.trickle_closed_s < 0
                    ? "not within 10"
                    : (std::to_string(r.trickle_closed_s).substr(0, 4)).c_str(),
                r.held_of_600);
    std::fflush(stdout);
  }
}
