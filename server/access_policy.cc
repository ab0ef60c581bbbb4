#include "server/access_policy.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/net_route.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

// The uid owning the open TCP socket whose local end is `local`
// ("0100007F:9C40", the kernel's notation) in the table at `path`, or ""
// when none does.
std::string SocketOwner(const char* path, const std::string& local) {
  std::ifstream table(path);
  std::string line;
  std::getline(table, line);  // the column titles
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string slot, local_address, remote, state, queues, timer, retransmits,
        uid, timeout, inode;
    fields >> slot >> local_address >> remote >> state >> queues >> timer >>
        retransmits >> uid >> timeout >> inode;
    // A socket no process holds (TIME_WAIT) is listed as uid 0, inode 0.
    if (local_address == local && inode != "0") return uid;
  }
  return "";
}

}  // namespace

std::string PeerIdentity(const std::string& peer) {
  const std::string decoded =
      absl::StrReplaceAll(peer, {{"%5B", "["}, {"%5D", "]"}});
  absl::string_view text = decoded;
  const bool v6 = absl::ConsumePrefix(&text, "ipv6:");
  if (!v6 && !absl::ConsumePrefix(&text, "ipv4:")) return peer;
  const size_t colon = text.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(text.substr(colon + 1), &port)) {
    return peer;
  }
  std::string address(text.substr(0, colon));
  if (v6 && address.size() >= 2 && address.front() == '[') {
    address = address.substr(1, address.size() - 2);
  }
  // The loopback client's socket, as each table would list it: gRPC names a
  // client that connected to 127.0.0.1 through an IPv6 socket
  // (::ffff:127.0.0.1, listed in tcp6) as "ipv4:127.0.0.1", and one that
  // connected through an IPv4 socket may be named in the mapped form.
  std::vector<std::pair<const char*, std::string>> entries;
  if (!v6) {
    in_addr a{};
    if (inet_pton(AF_INET, address.c_str(), &a) != 1) return peer;
    if ((ntohl(a.s_addr) >> 24) != 127) return absl::StrCat("ipv4:", address);
    entries.push_back(
        {"/proc/net/tcp", absl::StrFormat("%08X:%04X", a.s_addr, port)});
    entries.push_back(
        {"/proc/net/tcp6",
         absl::StrFormat("0000000000000000FFFF0000%08X:%04X", a.s_addr, port)});
  } else {
    in6_addr a{};
    if (inet_pton(AF_INET6, address.c_str(), &a) != 1) return peer;
    const bool mapped_loopback =
        IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
    if (!IN6_IS_ADDR_LOOPBACK(&a) && !mapped_loopback) {
      return absl::StrCat("ipv6:", address);
    }
    uint32_t words[4];
    std::memcpy(words, a.s6_addr, sizeof(words));
    entries.push_back({"/proc/net/tcp6",
                       absl::StrFormat("%08X%08X%08X%08X:%04X", words[0],
                                       words[1], words[2], words[3], port)});
    if (mapped_loopback) {
      entries.push_back(
          {"/proc/net/tcp", absl::StrFormat("%08X:%04X", words[3], port)});
    }
  }
  for (const auto& [table, local] : entries) {
    const std::string owner = SocketOwner(table, local);
    if (!owner.empty()) return absl::StrCat("uid ", owner);
  }
  // Gone already, or in another network namespace: still a local client,
  // capped with every other one whose owner is unknown, never on its own
  // (one cap per connection would let a client take every slot).
  return kUnknownLocalPeer;
}

absl::Status CheckListenAllowed(const std::string& listen, bool has_token,
                                bool insecure) {
  if (IsLoopbackAddress(listen) || has_token || insecure) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "--listen: ", listen,
      " is reachable from other hosts, and anyone who reaches it could run "
      "jobs as this user; give --auth-token-file (and --tls-cert/--tls-key), "
      "or --insecure to accept that"));
}

absl::Status CheckMetricsListenAllowed(const std::string& listen,
                                       bool metrics_public) {
  if (listen.empty() || IsLoopbackAddress(listen) || metrics_public) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "--metrics-listen: ", listen,
      " is reachable from other hosts, and /metrics shows every job's name, "
      "labels and progress without a token; add --metrics-public to accept "
      "that (as a Prometheus in another container needs)"));
}

absl::StatusOr<PathRoots> PathRoots::Create(
    const std::vector<std::string>& roots) {
  PathRoots result;
  for (const std::string& root : roots) {
    std::error_code ec;
    const fs::path canonical = fs::canonical(root, ec);
    if (ec || !fs::is_directory(canonical, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--path-root: '", root, "' is not an existing directory"));
    }
    result.roots_.push_back(canonical.string());
  }
  return result;
}

absl::Status PathRoots::Check(const std::string& field,
                              const std::string& path) const {
  if (roots_.empty()) return absl::OkStatus();
  std::error_code ec;
  // Symlinks and ".." resolved as far as the path exists.
  const fs::path resolved = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (!ec) {
    const std::string text = resolved.string();
    for (const std::string& root : roots_) {
      if (text == root ||
          absl::StartsWith(text, root == "/" ? root : root + "/")) {
        return absl::OkStatus();
      }
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": '", path, "' is outside the directories jobs may read (",
      absl::StrJoin(roots_, ", "), "; shardtraind --path-root)"));
}

absl::StatusOr<std::unique_ptr<StreamLimiter::Slot>> StreamLimiter::Acquire(
    const std::string& peer) {
  const std::string who = identify_(peer);
  absl::MutexLock lock(&mutex_);
  if (total_ >= max_total_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shardtraind already serves ", total_,
        " open streams (watch/logs), its limit; try again later, or raise "
        "shardtraind --max-streams"));
  }
  auto open = open_.find(peer);
  if (open != open_.end() && open->second >= max_per_connection_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection (", peer, ") already holds ", open->second,
        " open streams (watch/logs), the most one connection may; close "
        "one, or raise shardtraind --max-streams-per-client"));
  }
  auto held = per_peer_.find(who);
  if (held != per_peer_.end() && held->second >= max_per_peer_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this client (", who, ") already holds ", held->second,
        " open streams (watch/logs) over all its connections, the most one "
        "client may; close some, or raise shardtraind --max-streams-per-peer"));
  }
  ++open_[peer];
  ++per_peer_[who];
  ++total_;
  return std::make_unique<Slot>(this, peer, who);
}

int StreamLimiter::open(const std::string& peer) {
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(peer);
  return it == open_.end() ? 0 : it->second;
}

int StreamLimiter::total() {
  absl::MutexLock lock(&mutex_);
  return total_;
}

void StreamLimiter::Release(const std::string& connection,
                            const std::string& peer) {
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(connection);
  if (it == open_.end()) return;
  --total_;
  if (--it->second <= 0) open_.erase(it);
  auto held = per_peer_.find(peer);
  if (held != per_peer_.end() && --held->second <= 0) per_peer_.erase(held);
}

}  // namespace shardtrain
