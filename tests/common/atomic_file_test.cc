// WriteFileAtomically: a reader sees the old file or the whole new one.
#include "common/atomic_file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

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

TEST(FreePortTest, GivesALoopbackPortInRange) {
  absl::StatusOr<int> port = PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_GT(*port, 0);
  EXPECT_LT(*port, 65536);
}

}  // namespace
}  // namespace shardtrain
