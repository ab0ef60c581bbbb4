// Every file a job or a command names (token data, an --init-from model, a
// checkpoint's files, a Hugging Face directory's files, a spec) is opened here
// and nowhere else, so that one place decides what may be read and how much.
//
// An InputFile is
//   - confined: when the process has read roots (kReadRootsEnv, shardtraind
//     --path-root), the file is opened beneath a root with openat2's
//     RESOLVE_BENEATH, so no symlink at any component leads outside, and the
//     opened file's real location is checked again;
//   - never blocking: opened O_NONBLOCK, so a FIFO cannot stall its reader;
//   - a regular file: a FIFO, a device (/dev/zero), a directory or a socket is
//     refused, naming which;
//   - bounded: its size is taken once at open, whole-file reads are refused
//     above a caller's limit before any allocation, and reads past the size
//     seen at open fail instead of growing.
// Error texts name the path and the cause, never the file's bytes.
#ifndef SHARDTRAIN_COMMON_INPUT_FILE_H_
#define SHARDTRAIN_COMMON_INPUT_FILE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardtrain {

class InputFile {
 public:
  // Opens `path` as above. NotFound when it does not exist; PermissionDenied
  // when it lies (or leads) outside the read roots or cannot be opened;
  // InvalidArgument when it is not a regular file.
  static absl::StatusOr<InputFile> Open(const std::string& path);
  // The same, for a file of the process's own rather than one a job names
  // (a cache under the user's home, the daemon's endpoint file): every
  // guarantee above but the read roots.
  static absl::StatusOr<InputFile> OpenOwn(const std::string& path);

  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();

  const std::string& path() const { return path_; }
  // The size at open; every read stays within it.
  int64_t size() const { return size_; }
  // The open descriptor, for a reader that maps the file (token data); it
  // stays owned by this object.
  int descriptor() const { return fd_; }

  // Exactly `bytes` bytes from `offset`. OutOfRange when the range is not
  // inside size(); DataLoss when the file is shorter than it was at open.
  absl::Status ReadAt(int64_t offset, void* out, int64_t bytes) const;

  // The whole file; InvalidArgument, before anything is allocated, when it
  // is larger than `max_bytes` (`what` names the file's role in the error:
  // "checkpoint metadata", "config.json").
  absl::StatusOr<std::string> ReadAll(int64_t max_bytes,
                                      const std::string& what) const;

 private:
  static absl::StatusOr<InputFile> OpenWithin(
      const std::string& path, const std::vector<std::string>& roots);
  InputFile(int fd, std::string path, int64_t size)
      : fd_(fd), path_(std::move(path)), size_(size) {}

  int fd_ = -1;
  std::string path_;
  int64_t size_ = 0;
};

// InputFile::Open(path) then ReadAll(max_bytes, what).
absl::StatusOr<std::string> ReadInputFile(const std::string& path,
                                          int64_t max_bytes,
                                          const std::string& what);

// InputFile::OpenOwn(path) then ReadAll(max_bytes, what).
absl::StatusOr<std::string> ReadOwnFile(const std::string& path,
                                        int64_t max_bytes,
                                        const std::string& what);

// The deepest nesting of JSON brackets outside strings: checked before a
// parse, so a hostile file (300,000 levels) cannot recurse a parser, or the
// destruction of what it built, off the stack.
int JsonNestingDepth(std::string_view text);
// InvalidArgument naming `what` when `text` nests deeper than `max_depth`.
absl::Status CheckJsonNesting(std::string_view text, int max_depth,
                              const std::string& what);

// What a stat mode is, for errors: "a FIFO", "a directory", "a character
// device", "a socket", "a block device", "a regular file".
const char* FileKindName(unsigned mode);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_INPUT_FILE_H_
