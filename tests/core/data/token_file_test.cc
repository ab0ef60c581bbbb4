// llm.c token files: what WriteTokenFile writes, TokenFile maps back, and
// every corruption Open must refuse with a message naming the file.
#include "core/data/token_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/read_roots.h"
#include "core/data/gpt2_vocab.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

// The bytes of a token file with the given header fields and tokens.
std::string TokenFileBytes(int32_t magic, int32_t version, int32_t count,
                           const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(kTokenFileHeaderInts, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header.data()),
                    kTokenFileHeaderBytes);
  bytes.append(reinterpret_cast<const char*>(tokens.data()),
               tokens.size() * sizeof(uint16_t));
  return bytes;
}

TEST(TokenFileTest, ReadsBackWhatWasWritten) {
  test::TempDir dir;
  const std::vector<uint16_t> tokens = {kGpt2EndOfText, 15496, 995, 0, 50255};
  ASSERT_TRUE(WriteTokenFile(dir / "t.bin", tokens).ok());

  absl::StatusOr<TokenFile> file = TokenFile::Open(dir / "t.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->size(), tokens.size());
  std::vector<uint16_t> read;
  for (size_t i = 0; i < file->size(); ++i) read.push_back((*file)[i]);
  EXPECT_EQ(read, tokens);
  EXPECT_EQ((*file)[1], 15496u);
  EXPECT_EQ(file->width(), 2);
  EXPECT_EQ(file->max_id(), 50256u);
  EXPECT_EQ(file->path(), dir / "t.bin");
}

// llm.c's 32-bit file (its Llama 3 shards' layout): magic 20240801,
// version 7, uint32 ids, for vocabularies past 65,536.
TEST(TokenFileTest, ThirtyTwoBitFilesHoldLargeVocabularies) {
  test::TempDir dir;
  const std::vector<uint32_t> tokens = {128001, 9906, 1917, 0, 151643};
  ASSERT_TRUE(WriteTokenFile32(dir / "t.bin", tokens).ok());
  const std::string bytes = test::ReadFile(dir / "t.bin");
  ASSERT_EQ(bytes.size(), kTokenFileHeaderBytes + 4 * tokens.size());
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240801);
  EXPECT_EQ(header[1], 7);
  EXPECT_EQ(header[2], 5);
  absl::StatusOr<TokenFile> file = TokenFile::Open(dir / "t.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->width(), 4);
  std::vector<uint32_t> read;
  for (size_t i = 0; i < file->size(); ++i) read.push_back((*file)[i]);
  EXPECT_EQ(read, tokens);
  EXPECT_EQ(file->max_id(), 151643u);
  EXPECT_EQ(ReadTokenFileHeader(dir / "t.bin").value(), 5);
  // Past 2^24 ids, and the 16-bit version number under the 32-bit magic,
  // are refused.
  EXPECT_FALSE(WriteTokenFile32(dir / "u.bin", {1u << 24}).ok());
  std::string wrong_version = bytes;
  const int32_t one = 1;
  std::memcpy(wrong_version.data() + 4, &one, 4);
  test::WriteFile(dir / "v.bin", wrong_version);
  absl::StatusOr<TokenFile> refused = TokenFile::Open(dir / "v.bin");
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(),
              HasSubstr("unsupported version 1 for magic 20240801"));
}

TEST(TokenFileTest, WritesLlmcLayoutByteForByte) {
  test::TempDir dir;
  ASSERT_TRUE(WriteTokenFile(dir / "t.bin", {1, 2, 3}).ok());
  EXPECT_EQ(test::ReadFile(dir / "t.bin"),
            TokenFileBytes(20240520, 1, 3, {1, 2, 3}));
}

TEST(TokenFileTest, EmptyFileHoldsNoTokens) {
  test::TempDir dir;
  ASSERT_TRUE(WriteTokenFile(dir / "t.bin", {}).ok());
  absl::StatusOr<TokenFile> file = TokenFile::Open(dir / "t.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 0u);
}

TEST(TokenFileTest, MovedFromFileKeepsTheMappingAlive) {
  test::TempDir dir;
  ASSERT_TRUE(WriteTokenFile(dir / "t.bin", {7, 8}).ok());
  absl::StatusOr<TokenFile> opened = TokenFile::Open(dir / "t.bin");
  ASSERT_TRUE(opened.ok());

  TokenFile file = std::move(*opened);
  TokenFile other = std::move(file);
  EXPECT_EQ(other.size(), 2u);
  EXPECT_EQ(other[1], 8u);
}

TEST(TokenFileTest, WriteLeavesNoTemporaryFileBehind) {
  test::TempDir dir;
  ASSERT_TRUE(WriteTokenFile(dir / "t.bin", {1}).ok());
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
}

TEST(TokenFileTest, WriteRejectsIdsOutsideTheVocabulary) {
  test::TempDir dir;
  const absl::Status status = WriteTokenFile(dir / "t.bin", {1, 50257});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("50257"));
  EXPECT_FALSE(std::filesystem::exists(dir / "t.bin"));
}

struct CorruptionCase {
  std::string name;
  std::string bytes;
  std::string expected_message;
};

class TokenFileCorruptionTest
    : public ::testing::TestWithParam<CorruptionCase> {};

TEST_P(TokenFileCorruptionTest, OpenFailsNamingTheFileAndTheProblem) {
  test::TempDir dir;
  const std::string path = dir / "bad.bin";
  test::WriteFile(path, GetParam().bytes);

  absl::StatusOr<TokenFile> file = TokenFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
  EXPECT_THAT(file.status().message(), HasSubstr(GetParam().expected_message));
}

INSTANTIATE_TEST_SUITE_P(
    Corruptions, TokenFileCorruptionTest,
    ::testing::Values(
        CorruptionCase{"WrongMagic", TokenFileBytes(20240326, 1, 1, {5}),
                       "bad magic 20240326"},
        CorruptionCase{"WrongVersion", TokenFileBytes(20240520, 2, 1, {5}),
                       "unsupported version 2"},
        CorruptionCase{"MoreTokensThanHeaderSays",
                       TokenFileBytes(20240520, 1, 1, {5, 6}),
                       "header says 1 tokens"},
        CorruptionCase{"FewerTokensThanHeaderSays",
                       TokenFileBytes(20240520, 1, 3, {5, 6}),
                       "header says 3 tokens"},
        CorruptionCase{"OddTrailingByte",
                       TokenFileBytes(20240520, 1, 1, {5}) + "x",
                       "but the file has 1027 bytes"},
        CorruptionCase{"NegativeCount", TokenFileBytes(20240520, 1, -4, {}),
                       "negative token count"},
        CorruptionCase{"IdOutsideVocabulary",
                       TokenFileBytes(20240520, 1, 3, {5, 50257, 6}),
                       "token id 50257 at index 1"},
        CorruptionCase{"TruncatedHeader",
                       TokenFileBytes(20240520, 1, 0, {}).substr(0, 100),
                       "truncated header: file has 100 bytes"},
        CorruptionCase{"EmptyFile", "", "truncated header: file has 0 bytes"}),
    [](const ::testing::TestParamInfo<CorruptionCase>& param_info) {
      return param_info.param.name;
    });

TEST(TokenFileHeaderTest, GivesTheCountFromTheHeaderAlone) {
  test::TempDir dir;
  ASSERT_TRUE(WriteTokenFile(dir / "t.bin", {1, 2, 3}).ok());

  absl::StatusOr<int64_t> count = ReadTokenFileHeader(dir / "t.bin");

  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, 3);
}

TEST(TokenFileHeaderTest, RefusesAFileWhoseSizeDisagreesWithTheHeader) {
  test::TempDir dir;
  ASSERT_TRUE(WriteTokenFile(dir / "t.bin", {1, 2, 3}).ok());
  ASSERT_EQ(truncate((dir / "t.bin").c_str(), kTokenFileHeaderBytes + 2), 0);

  absl::StatusOr<int64_t> count = ReadTokenFileHeader(dir / "t.bin");

  EXPECT_EQ(count.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(count.status().message(), HasSubstr("header says 3 tokens"));
}

// A FIFO would block open() until a writer came: neither reader waits.
TEST(TokenFileHeaderTest, AFifoIsRefusedWithoutBlocking) {
  test::TempDir dir;
  const std::string fifo = dir / "train.bin";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);

  absl::StatusOr<int64_t> count = ReadTokenFileHeader(fifo);
  absl::StatusOr<TokenFile> file = TokenFile::Open(fifo);

  EXPECT_EQ(count.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(count.status().message(),
              HasSubstr("is a FIFO, not a regular file"));
  EXPECT_THAT(file.status().message(),
              HasSubstr("is a FIFO, not a regular file"));
}

// With read roots set (as shardtraind --path-root hands them to ranks), a
// token file reached through a symlink out of them is refused on the file
// actually opened.
TEST(TokenFileHeaderTest, AFileOutsideTheReadRootsIsRefused) {
  test::TempDir inside, outside;
  ASSERT_TRUE(WriteTokenFile(outside / "secret.bin", {7}).ok());
  ASSERT_TRUE(WriteTokenFile(inside / "val.bin", {8}).ok());
  ASSERT_EQ(
      symlink((outside / "secret.bin").c_str(), (inside / "train.bin").c_str()),
      0);
  char* real = realpath(inside.path().c_str(), nullptr);
  ASSERT_NE(real, nullptr);
  setenv(kReadRootsEnv, real, 1);
  free(real);

  absl::StatusOr<TokenFile> escaped = TokenFile::Open(inside / "train.bin");
  absl::StatusOr<TokenFile> kept = TokenFile::Open(inside / "val.bin");
  unsetenv(kReadRootsEnv);

  EXPECT_EQ(escaped.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(escaped.status().message(),
              HasSubstr("outside the directories jobs may read"));
  EXPECT_TRUE(kept.ok()) << kept.status();
}

TEST(TokenFileTest, MissingFileIsNotFound) {
  absl::StatusOr<TokenFile> file = TokenFile::Open("/nonexistent/t.bin");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("/nonexistent/t.bin"));
}

}  // namespace
}  // namespace shardtrain
