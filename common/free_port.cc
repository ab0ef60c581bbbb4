#include "common/free_port.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardtrain {

absl::StatusOr<int> PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const absl::Status status = absl::InternalError(
        absl::StrCat("bind 127.0.0.1:0: ", strerror(errno)));
    close(fd);
    return status;
  }
  close(fd);
  return static_cast<int>(ntohs(address.sin_port));
}

FreshPortPicker::FreshPortPicker(size_t remember,
                                 std::function<absl::StatusOr<int>()> pick)
    : remember_(std::max<size_t>(1, remember)), pick_(std::move(pick)) {}

absl::StatusOr<int> FreshPortPicker::Pick() {
  std::lock_guard<std::mutex> lock(mutex_);
  constexpr int kTries = 64;
  for (int i = 0; i < kTries; ++i) {
    absl::StatusOr<int> port = pick_();
    if (!port.ok()) return port.status();
    if (std::find(recent_.begin(), recent_.end(), *port) != recent_.end()) {
      continue;
    }
    recent_.push_back(*port);
    if (recent_.size() > remember_) recent_.erase(recent_.begin());
    return *port;
  }
  return absl::UnavailableError(absl::StrCat("no free port outside the last ",
                                             recent_.size(), " handed out in ",
                                             kTries, " picks"));
}

}  // namespace shardtrain
