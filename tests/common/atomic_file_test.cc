// WriteFileAtomically: a reader sees the old file or the whole new one.
#include "common/atomic_file.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "common/free_port.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

TEST(AtomicFileTest, ReplacesTheFileAndLeavesNoTemporary) {
  test::TempDir dir;
  const std::string path = dir / "state.json";
  test::WriteFile(path, "old");
  ASSERT_TRUE(WriteFileAtomically(path, std::string(100000, 'x')).ok());
  EXPECT_EQ(test::ReadFile(path), std::string(100000, 'x'));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()),
                          fs::directory_iterator()),
            1);
}

TEST(AtomicFileTest, AFailedWriteKeepsTheOldFileAndRemovesTheTemporary) {
  test::TempDir dir;
  const std::string path = dir / "model.bin";
  test::WriteFile(path, "old");
  const absl::Status failed = WriteFileAtomically(
      path, [](std::FILE* file, const std::string&) -> absl::Status {
        std::fputs("half", file);
        return absl::DataLossError("the model went away");
      });
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(test::ReadFile(path), "old");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()),
                          fs::directory_iterator()),
            1);
  const absl::Status no_dir =
      WriteFileAtomically(dir / "missing/file", "contents");
  EXPECT_EQ(no_dir.code(), absl::StatusCode::kInternal);
  EXPECT_NE(no_dir.message().find("cannot create"), std::string::npos);
}

// A 44 GiB sparse input once made an export allocate a buffer this machine
// could not hold: std::bad_alloc, abort, and its temporary left behind.
TEST(AtomicFileTest, AWriterOutOfMemoryIsAnErrorAndLeavesNoTemporary) {
  test::TempDir dir;
  const std::string path = dir / "model.bin";
  const absl::Status failed = WriteFileAtomically(
      path, [](std::FILE* file, const std::string&) -> absl::Status {
        std::fputs("half", file);
        throw std::bad_alloc();
      });
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(failed.message().find("out of memory"), std::string::npos);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()),
                          fs::directory_iterator()),
            0);
}

// An export killed half-way (Ctrl-C, or SIGTERM from a scheduler) leaves
// neither a torn target nor its multi-gigabyte temporary file, and the
// process still ends by the signal.
TEST(AtomicFileTest, AnInterruptRemovesTheTemporaryFileOfAWriteInProgress) {
  for (const int signal_number : {SIGTERM, SIGINT}) {
    test::TempDir dir;
    const std::string path = dir / "model.safetensors";
    const std::string temp_prefix = "model.safetensors.tmp.";
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      RemoveTemporaryFilesOnInterrupt();
      (void)WriteFileAtomically(
          path, [](std::FILE* file, const std::string&) -> absl::Status {
            std::fputs("the first gigabyte", file);
            std::fflush(file);
            for (;;) ::pause();  // the rest never comes
          });
      ::_exit(0);
    }
    // Await the temporary file, then interrupt the writer.
    bool started = false;
    for (int i = 0; i < 2000 && !started; ++i) {
      for (const auto& entry : fs::directory_iterator(dir.path())) {
        if (entry.path().filename().string().rfind(temp_prefix, 0) == 0 &&
            entry.file_size() > 0)
          started = true;
      }
      if (!started) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(started) << "the writer never began";
    ASSERT_EQ(::kill(child, signal_number), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == signal_number)
        << "status " << status;
    EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()),
                            fs::directory_iterator()),
              0)
        << "signal " << signal_number << " left a file behind";
  }
}

TEST(FreePortTest, GivesALoopbackPortInRange) {
  absl::StatusOr<int> port = PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_GT(*port, 0);
  EXPECT_LT(*port, 65536);
}

}  // namespace
}  // namespace shardtrain
