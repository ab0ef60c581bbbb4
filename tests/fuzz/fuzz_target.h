// What every fuzz target shares: the libFuzzer entry points, and a check
// that aborts (a finding) when a property a parser promises does not hold.
// Built two ways (tests/fuzz/CMakeLists.txt): with libFuzzer under clang
// (scripts/fuzz), and with replay_main.cc as a plain program that runs the
// kept corpus in ctest.
#ifndef SHARDTRAIN_TESTS_FUZZ_FUZZ_TARGET_H_
#define SHARDTRAIN_TESTS_FUZZ_FUZZ_TARGET_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv);

// Aborts with `what` when `condition` is false: libFuzzer keeps the input.
#define FUZZ_CHECK(condition, what)                                     \
  do {                                                                  \
    if (!(condition)) {                                                 \
      std::fprintf(stderr, "fuzz property violated: %s (%s)\n", (what), \
                   #condition);                                         \
      std::abort();                                                     \
    }                                                                   \
  } while (false)

namespace shardtrain::fuzz {

// `data` as a file only this process sees (a memfd), named by a path that
// open() and mmap() accept; closed when destroyed.
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("fuzz-input", 0);
    size_t written = 0;
    while (fd_ >= 0 && written < size) {
      const ssize_t n = write(fd_, data + written, size - written);
      if (n <= 0) break;
      written += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() {
    if (fd_ >= 0) close(fd_);
  }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace shardtrain::fuzz

#endif  // SHARDTRAIN_TESTS_FUZZ_FUZZ_TARGET_H_
