#include "server/access_policy.h"

#include <arpa/inet.h>

#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {
namespace fs = std::filesystem;

bool IsLoopbackListen(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:") ||
      absl::StartsWith(listen, "unix-abstract:")) {
    return true;
  }
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost" || host == "::1") return true;
  // An address, not a name that merely starts like one
  // ("127.anything.example" resolves wherever its owner wants).
  in_addr v4{};
  return inet_pton(AF_INET, host.c_str(), &v4) == 1 &&
         (ntohl(v4.s_addr) >> 24) == 127;
}

absl::Status CheckListenAllowed(const std::string& listen, bool has_token,
                                bool insecure) {
  if (IsLoopbackListen(listen) || has_token || insecure) {
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
  if (listen.empty() || IsLoopbackListen(listen) || metrics_public) {
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
  absl::MutexLock lock(&mutex_);
  if (total_ >= max_total_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shardtraind already serves ", total_,
        " open streams (watch/logs), its limit; try again later, or raise "
        "shardtraind --max-streams"));
  }
  int& open = open_[peer];
  if (open >= max_per_connection_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection (", peer, ") already holds ", open,
        " open streams (watch/logs), the most one connection may; close "
        "one, or raise shardtraind --max-streams-per-client"));
  }
  ++open;
  ++total_;
  return std::make_unique<Slot>(this, peer);
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

void StreamLimiter::Release(const std::string& peer) {
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(peer);
  if (it == open_.end()) return;
  --total_;
  if (--it->second <= 0) open_.erase(it);
}

}  // namespace shardtrain
