// Helpers shared by the tests: scratch folders, whole-file I/O
// and running a command with captured output.
#ifndef SHARDTRAIN_TESTS_TEST_UTIL_H_
#define SHARDTRAIN_TESTS_TEST_UTIL_H_

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace shardtrain::test {

// Whether this build made the CLI (bin/shardtrain). The engine scope (the
// CUDA flavour) builds only what links LibTorch: there a test's steps that
// drive the CLI skip, as the host build runs them (tests/CMakeLists.txt
// shardtrain_needs_cli defines SHARDTRAIN_HAS_CLI for such tests).
#if defined(SHARDTRAIN_HAS_CLI) && !SHARDTRAIN_HAS_CLI
inline constexpr bool kHasCli = false;
#else
inline constexpr bool kHasCli = true;
#endif

// A fresh folder under $TMPDIR (or /tmp), removed with its contents when this
// object is destroyed.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr ? tmp : "/tmp") + "/shardtrain_test_XXXXXX";
    path_ = ::mkdtemp(pattern.data()) != nullptr ? pattern : "";
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }

  const std::string& path() const { return path_; }
  std::string operator/(std::string_view name) const {
    return path_ + "/" + std::string(name);
  }

 private:
  std::string path_;
};

// The folders ScratchDir made in this process, removed when it exits.
struct ScratchDirs {
  pid_t owner = ::getpid();
  std::vector<std::string> paths;
};
inline ScratchDirs& ScratchDirsOfThisProcess() {
  static auto* dirs = new ScratchDirs;
  return *dirs;
}
inline void RemoveScratchDirs() {
  ScratchDirs& dirs = ScratchDirsOfThisProcess();
  // A forked child that exits must not remove its parent's folders.
  if (::getpid() != dirs.owner) return;
  std::error_code ec;
  for (const std::string& path : dirs.paths) {
    std::filesystem::remove_all(path, ec);
  }
}

// An empty folder $TMPDIR/shardtrain_<name>_<pid> (or under /tmp) that lives
// until the test program exits: for a fixture that shares one folder across
// its tests, or a test that hands the path to other processes. Removed with
// its contents at exit, so a suite run leaves nothing behind.
inline std::string ScratchDir(std::string_view name) {
  static const bool registered = (std::atexit(RemoveScratchDirs), true);
  (void)registered;
  const char* tmp = std::getenv("TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") +
                           "/shardtrain_" + std::string(name) + "_" +
                           std::to_string(::getpid());
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  std::filesystem::create_directories(path, ec);
  ScratchDirsOfThisProcess().paths.push_back(path);
  return path;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

inline void WriteFile(const std::string& path, std::string_view contents) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(contents.data(), static_cast<std::streamsize>(contents.size()));
}

struct CommandResult {
  int exit_code = -1;  // -1 when the command did not exit normally
  std::string out;
  std::string err;
};

// Runs `command` with /bin/sh, `input` on its stdin.
inline CommandResult RunCommand(const std::string& command,
                                std::string_view input = "") {
  TempDir io;
  WriteFile(io / "in", input);
  const int status = std::system((command + " <" + (io / "in") + " >" +
                                  (io / "out") + " 2>" + (io / "err"))
                                     .c_str());
  CommandResult result;
  if (status != -1 && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  result.out = ReadFile(io / "out");
  result.err = ReadFile(io / "err");
  return result;
}

inline bool NodeAvailable() {
  return std::system("command -v node >/dev/null 2>&1") == 0;
}

}  // namespace shardtrain::test

#endif  // SHARDTRAIN_TESTS_TEST_UTIL_H_
