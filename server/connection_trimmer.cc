#include "server/connection_trimmer.h"

#include <dirent.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

// One row of /proc/net/tcp{,6}.
struct SocketRow {
  std::string local;  // "0100007F:C350" (address:port, the kernel's hex)
  std::string remote;
  std::string state;  // "01": established
  std::string uid;
  unsigned long inode = 0;
};

std::vector<SocketRow> ReadTable(const char* path) {
  std::vector<SocketRow> rows;
  std::ifstream table(path);
  std::string line;
  std::getline(table, line);  // the column titles
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    SocketRow row;
    std::string slot, queues, timer, retransmits, timeout, inode;
    fields >> slot >> row.local >> row.remote >> row.state >> queues >> timer >>
        retransmits >> row.uid >> timeout >> inode;
    if (!absl::SimpleAtoi(inode, &row.inode)) continue;
    rows.push_back(std::move(row));
  }
  return rows;
}

// The port of a kernel address ("0100007F:C350" -> 50000); -1 if unreadable.
int PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  return static_cast<int>(
      std::strtol(address.c_str() + colon + 1, nullptr, 16));
}

// Whether a kernel address is loopback: 127/8 (its first byte is the last
// pair of the little-endian hex word), ::1, or ::ffff:127/8.
bool IsLoopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  if (host.size() == 8) return absl::EndsWith(host, "7F");
  if (host == "00000000000000000000000001000000") return true;
  return absl::StartsWith(host, "0000000000000000FFFF0000") &&
         absl::EndsWith(host, "7F");
}

// This process's sockets: inode -> descriptor.
std::map<unsigned long, int> OwnSockets() {
  std::map<unsigned long, int> sockets;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return sockets;
  while (const dirent* entry = readdir(dir)) {
    int fd = 0;
    if (!absl::SimpleAtoi(entry->d_name, &fd)) continue;
    char target[64];
    const std::string link = absl::StrCat("/proc/self/fd/", fd);
    const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    unsigned long inode = 0;
    if (std::sscanf(target, "socket:[%lu]", &inode) == 1) sockets[inode] = fd;
  }
  closedir(dir);
  return sockets;
}

}  // namespace

TrimResult TrimConnectionsPerPeer(int port, int max_per_peer) {
  TrimResult result;
  const std::map<unsigned long, int> own = OwnSockets();
  std::vector<SocketRow> rows = ReadTable("/proc/net/tcp");
  std::vector<SocketRow> rows6 = ReadTable("/proc/net/tcp6");
  rows.insert(rows.end(), rows6.begin(), rows6.end());
  // A local client's socket, by its address: its owner.
  std::map<std::string, std::string> owner_of;
  for (const SocketRow& row : rows) {
    if (row.inode != 0) owner_of[row.local] = row.uid;
  }
  // peer -> this process's connections from it, (inode, descriptor).
  std::map<std::string, std::vector<std::pair<unsigned long, int>>> by_peer;
  for (const SocketRow& row : rows) {
    if (row.state != "01" || PortOf(row.local) != port) continue;
    const auto mine = own.find(row.inode);
    if (mine == own.end()) continue;
    ++result.connections;
    std::string peer;
    if (IsLoopback(row.remote)) {
      const auto owner = owner_of.find(row.remote);
      peer = owner != owner_of.end() ? absl::StrCat("uid ", owner->second)
                                     : "local user unknown";
    } else {
      peer = row.remote.substr(0, row.remote.rfind(':'));
    }
    by_peer[peer].push_back({row.inode, mine->second});
  }
  size_t most = 0;
  for (auto& [peer, connections] : by_peer) {
    if (connections.size() <= static_cast<size_t>(max_per_peer)) continue;
    // Inodes grow as sockets are made: the newest beyond the bound go.
    std::sort(connections.begin(), connections.end());
    for (size_t i = static_cast<size_t>(max_per_peer); i < connections.size();
         ++i) {
      // Still the same socket (a descriptor closed meanwhile may have been
      // reused for another).
      const auto [inode, fd] = connections[i];
      char target[64];
      const std::string link = absl::StrCat("/proc/self/fd/", fd);
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      if (std::string(target) != absl::StrCat("socket:[", inode, "]")) continue;
      if (::shutdown(fd, SHUT_RDWR) == 0) ++result.shut_down;
    }
    if (connections.size() > most) {
      most = connections.size();
      result.busiest = peer;
    }
  }
  return result;
}

std::string DescribeListener(int port) {
  std::vector<SocketRow> rows = ReadTable("/proc/net/tcp");
  std::vector<SocketRow> rows6 = ReadTable("/proc/net/tcp6");
  rows.insert(rows.end(), rows6.begin(), rows6.end());
  std::set<std::string> listening;  // "socket:[inode]"
  for (const SocketRow& row : rows) {
    if (row.state == "0A" && PortOf(row.local) == port && row.inode != 0) {
      listening.insert(absl::StrCat("socket:[", row.inode, "]"));
    }
  }
  if (listening.empty()) return "";
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return "";
  std::string found;
  while (const dirent* process = readdir(proc)) {
    int pid = 0;
    if (!absl::SimpleAtoi(process->d_name, &pid)) continue;
    const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
    DIR* fds = opendir(fd_dir.c_str());
    if (fds == nullptr) continue;  // gone, or another user's
    bool holds = false;
    while (const dirent* fd = readdir(fds)) {
      char target[64];
      const std::string link = absl::StrCat(fd_dir, "/", fd->d_name);
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      if (listening.count(target)) {
        holds = true;
        break;
      }
    }
    closedir(fds);
    if (!holds) continue;
    std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"));
    std::string cmdline((std::istreambuf_iterator<char>(in)),
                        std::istreambuf_iterator<char>());
    while (!cmdline.empty() && cmdline.back() == '\0') cmdline.pop_back();
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.size() > 200) cmdline = cmdline.substr(0, 200) + "...";
    found = absl::StrCat("pid ", pid, " (", cmdline, ")");
    break;
  }
  closedir(proc);
  return found;
}

}  // namespace shardtrain
