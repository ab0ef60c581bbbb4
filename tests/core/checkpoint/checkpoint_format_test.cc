// The checkpoint format on its own: ranks' chunks merged into one metadata
// file, ranges read across chunk boundaries, and every way a checkpoint can
// be broken refused with its name. Torch-free, like the format.
#include "core/checkpoint/checkpoint_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <vector>

#include "common/read_roots.h"
#include "core/checkpoint/checkpoint_export.h"
#include "core/checkpoint/checkpoint_store.h"
#include "core/model/llmc_layout.h"
#include "core/model/model_config.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A [4, 5] tensor "a" (values 0..19) cut at element 7 and 13 over three
// ranks, and a [3] tensor "b" written whole by rank 1.
void WriteThreeRanks(const std::string& dir) {
  std::vector<float> a(20);
  std::iota(a.begin(), a.end(), 0.0f);
  const std::vector<float> b = {-1, -2, -3};
  ASSERT_TRUE(WriteRankChunks(dir, 0, {{"a", {4, 5}, 0, 7, a.data()}}).ok());
  ASSERT_TRUE(WriteRankChunks(dir, 1,
                              {{"a", {4, 5}, 7, 6, a.data() + 7},
                               {"b", {3}, 0, 3, b.data()}})
                  .ok());
  ASSERT_TRUE(
      WriteRankChunks(dir, 2, {{"a", {4, 5}, 13, 7, a.data() + 13}}).ok());
}

TEST(CheckpointFormatTest, RanksChunksMergeIntoOneMetadataAndReadAnyRange) {
  test::TempDir dir;
  WriteThreeRanks(dir.path());
  ASSERT_TRUE(WriteCheckpointMetadata(dir.path(), 3, {{"step", 7}}).ok());

  auto reader = CheckpointReader::Open(dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  const CheckpointMetadata& metadata = (*reader)->metadata();
  EXPECT_EQ(metadata.training["step"], 7);
  ASSERT_EQ(metadata.files.size(), 3u);
  EXPECT_EQ(metadata.files[2].name, "rank-00002.bin");
  EXPECT_EQ(metadata.files[1].bytes, (6 + 3) * 4);
  EXPECT_EQ(metadata.files[1].crc32.size(), 1u);
  ASSERT_EQ(metadata.tensors.size(), 2u);
  EXPECT_EQ(metadata.Find("a")->chunks.size(), 3u);
  EXPECT_EQ(metadata.TotalBytes(), (20 + 3) * 4);
  EXPECT_EQ(metadata.BytesPerFile().at("rank-00001.bin"), (6 + 3) * 4);

  // A range across all three chunks, as a rank of another world size asks.
  std::vector<float> got(10);
  ASSERT_TRUE((*reader)->Read("a", 5, 10, got.data()).ok());
  EXPECT_THAT(got, ElementsAre(5, 6, 7, 8, 9, 10, 11, 12, 13, 14));
  std::vector<float> b(3);
  ASSERT_TRUE((*reader)->Read("b", 0, 3, b.data()).ok());
  EXPECT_THAT(b, ElementsAre(-1, -2, -3));

  EXPECT_EQ((*reader)->Read("c", 0, 1, got.data()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ((*reader)->Read("a", 15, 6, got.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointFormatTest, AGapOrAnOverlapBetweenRanksIsRefusedAtMerge) {
  test::TempDir gap;
  std::vector<float> a(20, 1.0f);
  ASSERT_TRUE(
      WriteRankChunks(gap.path(), 0, {{"a", {20}, 0, 7, a.data()}}).ok());
  ASSERT_TRUE(
      WriteRankChunks(gap.path(), 1, {{"a", {20}, 8, 12, a.data()}}).ok());
  const absl::Status missing = WriteCheckpointMetadata(gap.path(), 2, {});
  EXPECT_THAT(missing.message(), HasSubstr("no chunk for elements from 7"));
  EXPECT_FALSE(std::filesystem::exists(gap / "checkpoint.json"));

  test::TempDir overlap;
  ASSERT_TRUE(
      WriteRankChunks(overlap.path(), 0, {{"a", {20}, 0, 10, a.data()}}).ok());
  ASSERT_TRUE(
      WriteRankChunks(overlap.path(), 1, {{"a", {20}, 9, 11, a.data()}}).ok());
  EXPECT_THAT(WriteCheckpointMetadata(overlap.path(), 2, {}).message(),
              HasSubstr("two chunks for elements from 9"));

  test::TempDir shapes;
  ASSERT_TRUE(
      WriteRankChunks(shapes.path(), 0, {{"a", {20}, 0, 10, a.data()}}).ok());
  ASSERT_TRUE(
      WriteRankChunks(shapes.path(), 1, {{"a", {4, 5}, 10, 10, a.data()}})
          .ok());
  EXPECT_THAT(WriteCheckpointMetadata(shapes.path(), 2, {}).message(),
              HasSubstr("ranks disagree on the shape of a"));

  // A rank that wrote nothing (it died): the merge says which index is gone.
  test::TempDir lost;
  ASSERT_TRUE(
      WriteRankChunks(lost.path(), 0, {{"a", {20}, 0, 20, a.data()}}).ok());
  EXPECT_THAT(WriteCheckpointMetadata(lost.path(), 2, {}).message(),
              HasSubstr("rank-00001.json"));
}

TEST(CheckpointFormatTest, BrokenCheckpointsAreRefusedNamingTheProblem) {
  test::TempDir dir;
  WriteThreeRanks(dir.path());
  ASSERT_TRUE(WriteCheckpointMetadata(dir.path(), 3, {}).ok());

  // Bytes overwritten after the write: the block's CRC-32 says so when a
  // read touches it; the other files still read.
  {
    std::fstream file(dir / "rank-00001.bin",
                      std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(8);
    file.write("\x7f\x7f\x7f\x7f", 4);
  }
  auto changed = CheckpointReader::Open(dir.path());
  ASSERT_TRUE(changed.ok()) << changed.status();
  std::vector<float> got(7);
  EXPECT_TRUE((*changed)->Read("a", 0, 7, got.data()).ok());
  const absl::Status flipped = (*changed)->Read("b", 0, 1, got.data());
  EXPECT_EQ(flipped.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(flipped.message(), HasSubstr("rank-00001.bin bytes 0-36 fail "
                                           "their CRC-32 check"));

  // A truncated data file.
  std::filesystem::resize_file(dir / "rank-00002.bin", 8);
  auto truncated = CheckpointReader::Open(dir.path());
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(truncated.status().message(),
              HasSubstr("rank-00002.bin has 8 bytes but was written with 28 "
                        "(truncated)"));

  // Metadata that is not JSON, or names a file outside the checkpoint.
  test::WriteFile(dir / "checkpoint.json", "{\"format\": ");
  EXPECT_THAT(CheckpointReader::Open(dir.path()).status().message(),
              HasSubstr("not valid JSON"));
  test::WriteFile(
      dir / "checkpoint.json",
      R"({"format":"shardtrain-checkpoint","version":2,"training":{},)"
      R"("files":[{"name":"../x","bytes":4,"block_bytes":1048576,)"
      R"("crc32":[0]}],"tensors":[]})");
  EXPECT_THAT(CheckpointReader::Open(dir.path()).status().message(),
              HasSubstr("data file entry '../x' is malformed"));
  test::WriteFile(
      dir / "checkpoint.json",
      R"({"format":"shardtrain-checkpoint","version":2,"training":{},)"
      R"("files":[{"name":"x","bytes":4,"block_bytes":1048576,"crc32":[0]}],)"
      R"("tensors":[{"name":"a","dtype":"float32","shape":[2],)"
      R"("chunks":[{"file":"x","offset":0,"numel":2,"byte_offset":0}]}]})");
  EXPECT_THAT(CheckpointReader::Open(dir.path()).status().message(),
              HasSubstr("malformed chunk"));
  test::WriteFile(dir / "checkpoint.json",
                  R"({"format":"shardtrain-checkpoint","version":3})");
  EXPECT_THAT(CheckpointReader::Open(dir.path()).status().message(),
              HasSubstr("format version 3; this shardtrain reads version 2"));
  // Nested 100,000 deep: refused before it is parsed (an error quoted the
  // version whole, recursing once per level).
  test::WriteFile(dir / "checkpoint.json",
                  R"({"format":"shardtrain-checkpoint","version":)" +
                      std::string(100'000, '[') + std::string(100'000, ']') +
                      "}");
  const absl::Status deep = CheckpointReader::Open(dir.path()).status();
  EXPECT_EQ(deep.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(deep.message(),
              HasSubstr("checkpoint.json nests 100001 levels deep"));

  // The per-strategy formats of earlier versions, by name.
  test::TempDir old;
  test::WriteFile(old / "model.pt", "x");
  const absl::Status refused = CheckpointReader::Open(old.path()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("single-device/DDP format"));
  EXPECT_THAT(refused.message(), HasSubstr("--init-from"));
}

TEST(CheckpointExportTest, WritesTheModelInLlmcOrderWithoutRanks) {
  // gpt2-tiny's weights, each tensor filled with its index in llm.c's order
  // and cut in two at an odd element, as two ranks would write them.
  absl::StatusOr<ModelConfig> config = ParseModelSpec("gpt2-tiny");
  ASSERT_TRUE(config.ok());
  test::TempDir dir;
  const std::vector<std::string> names = LlmcParameterNames(*config);
  const std::vector<std::vector<int64_t>> shapes = LlmcParameterShapes(*config);
  std::vector<std::vector<float>> values;
  std::vector<int64_t> sizes;
  int64_t total = 0;
  std::vector<ChunkToWrite> rank0, rank1;
  for (size_t i = 0; i < names.size(); ++i) {
    int64_t size = 1;
    for (int64_t d : shapes[i]) size *= d;
    sizes.push_back(size);
    values.emplace_back(size, static_cast<float>(i));
    total += size;
  }
  ASSERT_EQ(total, config->NumParameters());
  for (size_t i = 0; i < names.size(); ++i) {
    const int64_t half = sizes[i] / 2 + 1;
    rank0.push_back(
        {"model." + names[i], shapes[i], 0, half, values[i].data()});
    rank1.push_back({"model." + names[i], shapes[i], half, sizes[i] - half,
                     values[i].data() + half});
  }
  ASSERT_TRUE(WriteRankChunks(dir.path(), 0, rank0).ok());
  ASSERT_TRUE(WriteRankChunks(dir.path(), 1, rank1).ok());
  ASSERT_TRUE(
      WriteCheckpointMetadata(dir.path(), 2, {{"model", config->ToSpec()}})
          .ok());
  auto reader = CheckpointReader::Open(dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status();

  const std::string out = dir / "model.bin";
  ASSERT_TRUE(ExportCheckpointAsLlmc(**reader, out).ok());

  std::ifstream in(out, std::ios::binary);
  LlmcHeader header{};
  in.read(reinterpret_cast<char*>(header.data()), kLlmcHeaderBytes);
  EXPECT_EQ(header, MakeLlmcHeader(*config));
  EXPECT_EQ(std::filesystem::file_size(out),
            static_cast<uintmax_t>(kLlmcHeaderBytes + 4 * total));
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<float> got(sizes[i]);
    in.read(reinterpret_cast<char*>(got.data()), sizes[i] * 4);
    ASSERT_EQ(got, values[i]) << names[i];
  }

  // Another model's checkpoint: a tensor shaped otherwise, or missing.
  test::TempDir flat;
  ASSERT_TRUE(
      WriteRankChunks(
          flat.path(), 0,
          {{"model.wte.weight", {sizes[0]}, 0, sizes[0], values[0].data()}})
          .ok());
  ASSERT_TRUE(
      WriteCheckpointMetadata(flat.path(), 1, {{"model", config->ToSpec()}})
          .ok());
  auto misshapen = CheckpointReader::Open(flat.path());
  ASSERT_TRUE(misshapen.ok());
  EXPECT_THAT(
      ExportCheckpointAsLlmc(**misshapen, dir / "x.bin").message(),
      HasSubstr("holds model.wte.weight as [6438912], not [50304, 128]"));
  test::TempDir other;
  ASSERT_TRUE(WriteRankChunks(other.path(), 0,
                              {{"model.wte.weight", shapes[0], 0, sizes[0],
                                values[0].data()}})
                  .ok());
  ASSERT_TRUE(
      WriteCheckpointMetadata(other.path(), 1, {{"model", config->ToSpec()}})
          .ok());
  auto partial = CheckpointReader::Open(other.path());
  ASSERT_TRUE(partial.ok());
  EXPECT_THAT(ExportCheckpointAsLlmc(**partial, dir / "x.bin").message(),
              HasSubstr("has no tensor model.wpe.weight"));
}

TEST(CheckpointExportTest, ARunDirectoryResolvesToItsNewestCheckpoint) {
  test::TempDir run;
  std::filesystem::create_directories(run / "checkpoints/step_00000004");
  std::filesystem::create_directories(run / "checkpoints/step_00000008");
  test::WriteFile(run / "checkpoints/latest", "step_00000008\n");
  EXPECT_EQ(*ResolveCheckpointDir(run.path()),
            run / "checkpoints/step_00000008");
  EXPECT_EQ(*ResolveCheckpointDir(run / "checkpoints"),
            run / "checkpoints/step_00000008");
  // As a shell completes it.
  EXPECT_EQ(*ResolveCheckpointDir(run / "checkpoints/"),
            run / "checkpoints/step_00000008");
  EXPECT_EQ(ResolveCheckpointDir(run / "nope").status().code(),
            absl::StatusCode::kNotFound);
}

// A checkpoint directory is named by a job (--resume, --init-from) or a
// command (checkpoint inspect/export): every file in it is read as a file the
// caller named, confined and bounded.
class HostileCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    namespace fs = std::filesystem;
    root_ = fs::canonical(tmp_.path()).string() + "/root";
    fs::create_directories(root_ + "/ckpt");
    fs::create_directories(tmp_ / "outside");
    WriteThreeRanks(root_ + "/ckpt");
    ASSERT_TRUE(WriteCheckpointMetadata(root_ + "/ckpt", 3, {}).ok());
  }
  void TearDown() override { ::unsetenv(kReadRootsEnv); }
  std::string Ckpt(const std::string& name) const {
    return root_ + "/ckpt/" + name;
  }
  // Moves a checkpoint file outside the root and leaves a symlink to it.
  void MoveOutside(const std::string& name) {
    namespace fs = std::filesystem;
    const std::string outside = tmp_ / ("outside/" + name);
    fs::rename(Ckpt(name), outside);
    fs::create_symlink(outside, Ckpt(name));
  }

  test::TempDir tmp_;
  std::string root_;
};

TEST_F(HostileCheckpointTest, AFileLinkedOutsideThePathRootIsRefused) {
  MoveOutside("rank-00001.bin");
  ASSERT_TRUE(CheckpointReader::Open(Ckpt("")).ok())
      << "without --path-root a symlink is followed";
  ::setenv(kReadRootsEnv, root_.c_str(), 1);
  auto reader = CheckpointReader::Open(Ckpt(""));
  ASSERT_EQ(reader.status().code(), absl::StatusCode::kPermissionDenied)
      << reader.status();
  EXPECT_THAT(reader.status().message(),
              HasSubstr("outside the directories jobs may read"));
  const auto size = std::filesystem::file_size(tmp_ / "outside/rank-00001.bin");
  EXPECT_THAT(std::string(reader.status().message()),
              ::testing::Not(HasSubstr(std::to_string(size) + " bytes")));

  MoveOutside("checkpoint.json");
  reader = CheckpointReader::Open(Ckpt(""));
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kPermissionDenied)
      << reader.status();
}

TEST_F(HostileCheckpointTest, MetadataThatIsADeviceOrAFifoIsRefusedAtOnce) {
  std::filesystem::remove(Ckpt("checkpoint.json"));
  std::filesystem::create_symlink("/dev/zero", Ckpt("checkpoint.json"));
  auto reader = CheckpointReader::Open(Ckpt(""));
  EXPECT_THAT(reader.status().message(), HasSubstr("a character device"));
  std::filesystem::remove(Ckpt("checkpoint.json"));
  ASSERT_EQ(::mkfifo(Ckpt("checkpoint.json").c_str(), 0600), 0);
  reader = CheckpointReader::Open(Ckpt(""));  // would block on a plain open
  EXPECT_THAT(reader.status().message(), HasSubstr("a FIFO"));
}

TEST_F(HostileCheckpointTest, OversizedMetadataIsRefusedBeforeItIsRead) {
  // 44 GiB, sparse: read whole it was std::bad_alloc and exit 134.
  std::filesystem::resize_file(Ckpt("checkpoint.json"), uint64_t{44} << 30);
  auto reader = CheckpointReader::Open(Ckpt(""));
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reader.status().message(),
              HasSubstr("checkpoint metadata of 47244640256 bytes; at most"));
}

TEST_F(HostileCheckpointTest, ALatestPointerIsAStepNameInTheStoreOrRefused) {
  namespace fs = std::filesystem;
  const std::string run = tmp_ / "run";
  fs::create_directories(run + "/checkpoints/step_00000002");
  const std::string latest = run + "/checkpoints/latest";
  const CheckpointStore store(run);
  fs::create_symlink("/dev/zero", latest);
  EXPECT_THAT(store.Latest().status().message(),
              HasSubstr("a character device"));
  fs::remove(latest);
  ASSERT_EQ(::mkfifo(latest.c_str(), 0600), 0);
  EXPECT_THAT(store.Latest().status().message(), HasSubstr("a FIFO"));
  fs::remove(latest);
  test::WriteFile(latest, "../../outside\n");
  absl::StatusOr<std::string> escaped = store.Latest();
  EXPECT_THAT(escaped.status().message(),
              HasSubstr("does not name a step directory"));
  EXPECT_THAT(std::string(escaped.status().message()),
              ::testing::Not(HasSubstr("outside")));
  // Resolving a run still finds its complete checkpoints.
  EXPECT_EQ(*ResolveCheckpointDir(run), run + "/checkpoints/step_00000002");
  test::WriteFile(latest, "step_00000002\n");
  EXPECT_EQ(*store.Latest(), run + "/checkpoints/step_00000002");
}

}  // namespace
}  // namespace shardtrain
