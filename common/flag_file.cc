#include "common/flag_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardtrain {

absl::StatusOr<std::string> ReadFlagFile(const std::string& flag,
                                         const std::string& path,
                                         FlagFileOptions options) {
  const int fd =
      ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const std::string message = absl::StrCat(flag, ": cannot read '", path,
                                             "': ", std::strerror(errno));
    return errno == ENOENT ? absl::NotFoundError(message)
                           : absl::PermissionDeniedError(message);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat(flag, ": cannot stat '", path,
                                            "': ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' is ",
                     S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                                            : "not a regular file",
                     "; expected a file"));
  }
  if (static_cast<size_t>(st.st_size) > options.max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' has ", st.st_size,
                     " bytes; at most ", options.max_bytes, " expected"));
  }
  if (options.secret && (st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: '%s' is open to other users (mode %04o); a secret must be "
        "readable by its owner only: chmod 600 '%s'",
        flag, path, st.st_mode & 07777, path));
  }
  std::string contents(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < contents.size()) {
    const ssize_t n = ::read(fd, contents.data() + got, contents.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(absl::StrCat(flag, ": cannot read '", path,
                                              "': ", std::strerror(errno)));
    }
    if (n == 0) break;  // shrank while read
    got += static_cast<size_t>(n);
  }
  contents.resize(got);
  return contents;
}

}  // namespace shardtrain
