#include "server/log_files.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_split.h"

namespace shardtrain {
namespace {

constexpr int64_t kTailWindowBytes = 1 << 20;
constexpr int64_t kReadChunkBytes = 1 << 20;

int64_t FileSize(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return -1;
  return static_cast<int64_t>(in.tellg());
}

std::string ReadRange(const std::string& path, int64_t offset, int64_t size) {
  std::ifstream in(path, std::ios::binary);
  if (!in || size <= 0) return "";
  in.seekg(offset);
  std::string data(static_cast<size_t>(size), '\0');
  in.read(data.data(), size);
  data.resize(static_cast<size_t>(in.gcount()));
  return data;
}

}  // namespace

std::vector<std::string> ReadLastLines(const std::string& path, int n) {
  const int64_t size = FileSize(path);
  if (size <= 0 || n <= 0) return {};
  const int64_t start = std::max<int64_t>(0, size - kTailWindowBytes);
  std::string data = ReadRange(path, start, size - start);
  if (!data.empty() && data.back() == '\n') data.pop_back();
  std::vector<std::string> lines = absl::StrSplit(data, '\n');
  if (start > 0 && !lines.empty()) lines.erase(lines.begin());  // cut line
  if (static_cast<int>(lines.size()) > n) {
    lines.erase(lines.begin(), lines.end() - n);
  }
  return lines;
}

LogFollower::LogFollower(std::string path, int tail)
    : path_(std::move(path)), tail_(tail) {}

std::vector<std::string> LogFollower::Poll() {
  const int64_t size = FileSize(path_);
  if (size < 0) return {};
  if (!started_) {
    started_ = true;
    if (tail_ > 0) {
      // Start after the tail; the tail itself is returned now.
      std::vector<std::string> lines = ReadLastLines(path_, tail_);
      offset_ = size;
      const std::string last = ReadRange(path_, size - 1, 1);
      if (last != "\n" && !lines.empty()) {
        partial_ = lines.back();
        lines.pop_back();
      }
      return lines;
    }
  }
  if (size < offset_) offset_ = 0;  // truncated: start over
  std::vector<std::string> lines;
  while (offset_ < size) {
    const int64_t chunk = std::min(kReadChunkBytes, size - offset_);
    const std::string data = ReadRange(path_, offset_, chunk);
    if (data.empty()) break;
    offset_ += static_cast<int64_t>(data.size());
    size_t begin = 0;
    for (size_t nl = data.find('\n'); nl != std::string::npos;
         nl = data.find('\n', begin)) {
      partial_.append(data, begin, nl - begin);
      lines.push_back(std::move(partial_));
      partial_.clear();
      begin = nl + 1;
    }
    partial_.append(data, begin, std::string::npos);
  }
  return lines;
}

std::string LogFollower::TakePartial() {
  std::string partial = std::move(partial_);
  partial_.clear();
  return partial;
}

}  // namespace shardtrain
