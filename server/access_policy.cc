#include "server/access_policy.h"

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
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
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

std::string StreamLimiter::ClientOf(const std::string& peer) {
  if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) {
    const size_t colon = peer.rfind(':');
    if (colon > 5) return peer.substr(0, colon);
  }
  return peer;
}

absl::StatusOr<std::unique_ptr<StreamLimiter::Slot>> StreamLimiter::Acquire(
    const std::string& peer) {
  const std::string client = ClientOf(peer);
  absl::MutexLock lock(&mutex_);
  int& open = open_[client];
  if (open >= max_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        client, " already holds ", open,
        " open streams (watch/logs), the most one client may; close one, or "
        "raise shardtraind --max-streams-per-client"));
  }
  ++open;
  return std::make_unique<Slot>(this, client);
}

int StreamLimiter::open(const std::string& client) {
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(client);
  return it == open_.end() ? 0 : it->second;
}

void StreamLimiter::Release(const std::string& client) {
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(client);
  if (it == open_.end()) return;
  if (--it->second <= 0) open_.erase(it);
}

}  // namespace shardtrain
