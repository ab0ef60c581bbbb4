#include "common/input_file.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/read_roots.h"

namespace shardtrain {
namespace {

constexpr int kOpenFlags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;

absl::Status OpenError(const std::string& path, int error) {
  if (error == ENOENT || error == ENOTDIR) {
    return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  }
  return absl::PermissionDeniedError(
      absl::StrCat(path, ": cannot open: ", std::strerror(error)));
}

// Opens the canonical `real` beneath `root` so that no component can lead
// outside it, even if the tree changes after `real` was resolved. Where the
// kernel lacks openat2 (or a seccomp filter hides it), a plain open, whose
// result the caller checks through /proc/self/fd.
int OpenBeneath(const std::string& root, const std::string& real) {
  const int root_fd = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (root_fd < 0) return -1;
  std::string relative = real.substr(root.size());
  while (!relative.empty() && relative.front() == '/') relative.erase(0, 1);
  if (relative.empty()) relative = ".";
  open_how how{};
  how.flags = kOpenFlags;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  int fd = static_cast<int>(
      ::syscall(SYS_openat2, root_fd, relative.c_str(), &how, sizeof(how)));
  const int error = errno;
  ::close(root_fd);
  if (fd < 0 && (error == ENOSYS || error == EPERM)) {
    fd = ::open(real.c_str(), kOpenFlags);
  } else {
    errno = error;
  }
  return fd;
}

}  // namespace

const char* FileKindName(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    default:
      return "not a regular file";
  }
}

absl::StatusOr<InputFile> InputFile::Open(const std::string& path) {
  return OpenWithin(path, ReadRootsFromEnvironment());
}

absl::StatusOr<InputFile> InputFile::OpenOwn(const std::string& path) {
  return OpenWithin(path, {});
}

absl::StatusOr<InputFile> InputFile::OpenWithin(
    const std::string& path, const std::vector<std::string>& roots) {
  int fd = -1;
  if (roots.empty()) {
    fd = ::open(path.c_str(), kOpenFlags);
    if (fd < 0) return OpenError(path, errno);
  } else {
    char real[PATH_MAX];
    if (::realpath(path.c_str(), real) == nullptr) {
      return OpenError(path, errno);
    }
    const std::string* root = nullptr;
    for (const std::string& r : roots) {
      if (IsWithinRoot(real, r)) root = &r;
    }
    if (root == nullptr) {
      return absl::PermissionDeniedError(absl::StrCat(
          path, " is ", real, ", outside the directories jobs may read (",
          absl::StrJoin(roots, ", "), "; shardtraind --path-root)"));
    }
    fd = OpenBeneath(*root, real);
    if (fd < 0 && (errno == EXDEV || errno == ELOOP)) {
      return absl::PermissionDeniedError(absl::StrCat(
          path, ": a symbolic link leads outside ", *root,
          " (the directories jobs may read; shardtraind --path-root)"));
    }
    if (fd < 0) return OpenError(path, errno);
  }
  InputFile file(fd, path, 0);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": cannot stat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is ", FileKindName(st.st_mode), ", not a regular file"));
  }
  if (!roots.empty()) {
    if (absl::Status s = CheckOpenedFileWithinReadRoots(fd, path); !s.ok()) {
      return s;
    }
  }
  file.size_ = static_cast<int64_t>(st.st_size);
  return file;
}

InputFile::InputFile(InputFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      size_(other.size_) {}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    size_ = other.size_;
  }
  return *this;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status InputFile::ReadAt(int64_t offset, void* out, int64_t bytes) const {
  if (offset < 0 || bytes < 0 || offset > size_ || bytes > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": bytes ", offset, "+",
                                              bytes, " are outside the file's ",
                                              size_, " bytes"));
  }
  auto* dst = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, dst, static_cast<size_t>(bytes), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(
          absl::StrCat(path_, ": cannot read at byte ", offset, ": ",
                       n == 0 ? "the file is shorter than when it was opened"
                              : std::strerror(errno)));
    }
    dst += n;
    offset += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> InputFile::ReadAll(int64_t max_bytes,
                                               const std::string& what) const {
  if (size_ > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", what, " of ",
                                                   size_, " bytes; at most ",
                                                   max_bytes, " are accepted"));
  }
  std::string contents(static_cast<size_t>(size_), '\0');
  if (absl::Status s = ReadAt(0, contents.data(), size_); !s.ok()) return s;
  return contents;
}

absl::StatusOr<std::string> ReadInputFile(const std::string& path,
                                          int64_t max_bytes,
                                          const std::string& what) {
  absl::StatusOr<InputFile> file = InputFile::Open(path);
  if (!file.ok()) return file.status();
  return file->ReadAll(max_bytes, what);
}

absl::StatusOr<std::string> ReadOwnFile(const std::string& path,
                                        int64_t max_bytes,
                                        const std::string& what) {
  absl::StatusOr<InputFile> file = InputFile::OpenOwn(path);
  if (!file.ok()) return file.status();
  return file->ReadAll(max_bytes, what);
}

int JsonNestingDepth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

absl::Status CheckJsonNesting(std::string_view text, int max_depth,
                              const std::string& what) {
  const int depth = JsonNestingDepth(text);
  if (depth <= max_depth) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " nests ", depth,
                                                 " levels deep; at most ",
                                                 max_depth, " are accepted"));
}

}  // namespace shardtrain
