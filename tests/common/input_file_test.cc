#include "common/input_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/read_roots.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

// The bytes of a file outside the read roots; no error may show them.
constexpr char kSecret[] = "SECRET-0123456789";

class InputFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() /
            ("input_file_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    fs::create_directories(base_ / "root" / "sub");
    fs::create_directories(base_ / "outside");
    root_ = fs::canonical(base_ / "root").string();
    Write(base_ / "outside" / "secret", kSecret);
    ::unsetenv(kReadRootsEnv);
  }
  void TearDown() override {
    ::unsetenv(kReadRootsEnv);
    fs::remove_all(base_);
  }
  static void Write(const fs::path& path, const std::string& text) {
    std::ofstream(path, std::ios::binary) << text;
  }
  void ConfineToRoot() { ::setenv(kReadRootsEnv, root_.c_str(), 1); }

  fs::path base_;
  std::string root_;
};

TEST_F(InputFileTest, ARegularFileReadsWhole) {
  Write(base_ / "root" / "a.txt", "hello");
  absl::StatusOr<std::string> text =
      ReadInputFile((base_ / "root" / "a.txt").string(), 100, "a test file");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "hello");
}

TEST_F(InputFileTest, AMissingFileIsNotFound) {
  absl::StatusOr<InputFile> file =
      InputFile::Open((base_ / "root" / "missing").string());
  EXPECT_TRUE(absl::IsNotFound(file.status())) << file.status();
}

TEST_F(InputFileTest, AFifoIsRefusedByNameWithoutBlocking) {
  const fs::path fifo = base_ / "root" / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No writer ever opens it: a blocking open would hang the test.
  absl::StatusOr<InputFile> file = InputFile::Open(fifo.string());
  ASSERT_TRUE(absl::IsInvalidArgument(file.status())) << file.status();
  EXPECT_NE(file.status().message().find("a FIFO"), std::string::npos)
      << file.status();
}

TEST_F(InputFileTest, ADeviceOrADirectoryIsRefusedByName) {
  absl::StatusOr<InputFile> zero = InputFile::Open("/dev/zero");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("a character device"),
            std::string::npos)
      << zero.status();
  absl::StatusOr<InputFile> dir = InputFile::Open(root_);
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("a directory"), std::string::npos)
      << dir.status();
}

TEST_F(InputFileTest, ASymlinkToDevZeroIsRefusedBeforeAnyRead) {
  fs::create_symlink("/dev/zero", base_ / "root" / "latest");
  absl::StatusOr<std::string> text = ReadInputFile(
      (base_ / "root" / "latest").string(), 1 << 20, "the latest pointer");
  ASSERT_TRUE(absl::IsInvalidArgument(text.status())) << text.status();
  EXPECT_NE(text.status().message().find("character device"),
            std::string::npos);
}

TEST_F(InputFileTest, AWholeFileReadAboveTheLimitIsRefusedBeforeAllocating) {
  // 44 GiB, sparse: allocating it would abort the process.
  const fs::path big = base_ / "root" / "checkpoint.json";
  Write(big, "");
  fs::resize_file(big, uint64_t{44} << 30);
  absl::StatusOr<std::string> text =
      ReadInputFile(big.string(), 1 << 20, "checkpoint metadata");
  ASSERT_TRUE(absl::IsInvalidArgument(text.status())) << text.status();
  EXPECT_NE(text.status().message().find("checkpoint metadata of 47244640256"),
            std::string::npos)
      << text.status();
}

TEST_F(InputFileTest, ReadsStayWithinTheSizeSeenAtOpen) {
  const fs::path path = base_ / "root" / "grows";
  Write(path, "0123456789");
  absl::StatusOr<InputFile> file = InputFile::Open(path.string());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 10);
  Write(path, "0123456789ABCDEFGHIJ");  // grows after open
  char out[20];
  EXPECT_TRUE(absl::IsOutOfRange(file->ReadAt(5, out, 10)));
  ASSERT_TRUE(file->ReadAt(2, out, 8).ok());
  EXPECT_EQ(std::string(out, 8), "23456789");
  fs::resize_file(path, 4);  // shrinks after open
  const absl::Status shrunk = file->ReadAt(0, out, 10);
  EXPECT_TRUE(absl::IsDataLoss(shrunk)) << shrunk;
}

TEST_F(InputFileTest, UnderReadRootsAFileInsideReads) {
  Write(base_ / "root" / "sub" / "model.json", "{}");
  fs::create_symlink(base_ / "root" / "sub" / "model.json",
                     base_ / "root" / "absolute-link-inside");
  ConfineToRoot();
  EXPECT_TRUE(InputFile::Open(root_ + "/sub/model.json").ok());
  // An absolute symlink whose target stays inside is a file inside.
  absl::StatusOr<InputFile> linked =
      InputFile::Open(root_ + "/absolute-link-inside");
  EXPECT_TRUE(linked.ok()) << linked.status();
}

TEST_F(InputFileTest, UnderReadRootsASymlinkLeadingOutsideIsRefused) {
  fs::create_symlink(base_ / "outside" / "secret",
                     base_ / "root" / "sub" / "model.safetensors");
  fs::create_symlink("../../outside/secret",
                     base_ / "root" / "sub" / "relative-link");
  fs::create_symlink(base_ / "outside", base_ / "root" / "dir-link");
  ConfineToRoot();
  for (const std::string& path :
       {root_ + "/sub/model.safetensors", root_ + "/sub/relative-link",
        root_ + "/dir-link/secret", root_ + "/sub/../../outside/secret"}) {
    absl::StatusOr<std::string> text =
        ReadInputFile(path, 1 << 20, "a test file");
    ASSERT_TRUE(absl::IsPermissionDenied(text.status()))
        << path << ": " << text.status();
    EXPECT_NE(text.status().message().find("outside"), std::string::npos);
    EXPECT_EQ(text.status().message().find("SECRET"), std::string::npos)
        << "the error shows the outside file's bytes: " << text.status();
    EXPECT_EQ(text.status().message().find(
                  " " + std::to_string(sizeof(kSecret) - 1) + " bytes"),
              std::string::npos)
        << "the error shows the outside file's size: " << text.status();
  }
}

}  // namespace
}  // namespace shardtrain
