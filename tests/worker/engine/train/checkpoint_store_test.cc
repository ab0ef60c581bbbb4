#include "core/checkpoint/checkpoint_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "tests/test_util.h"
#include "worker/engine/support/tensor_file.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

std::string TempDir(const std::string& name) { return test::ScratchDir(name); }

TEST(CheckpointStoreTest, LatestIsOnlyEverACommittedCheckpoint) {
  CheckpointStore store(TempDir("ckpt"));
  EXPECT_TRUE(absl::IsNotFound(store.Latest().status()));

  auto staging = store.Begin(10);
  ASSERT_TRUE(staging.ok());
  std::ofstream(*staging + "/model.pt") << "x";
  EXPECT_TRUE(absl::IsNotFound(store.Latest().status()));  // not yet committed
  ASSERT_TRUE(store.Commit(10).ok());
  ASSERT_TRUE(store.Latest().ok());
  EXPECT_EQ(fs::path(*store.Latest()).filename(), "step_00000010");
  EXPECT_TRUE(fs::exists(*store.Latest() + "/model.pt"));

  // A crash while writing step 20 leaves step 10 as the latest.
  ASSERT_TRUE(store.Begin(20).ok());
  EXPECT_EQ(fs::path(*store.Latest()).filename(), "step_00000010");
}

TEST(CheckpointStoreTest, KeepsOnlyTheNewestCheckpoints) {
  CheckpointStore store(TempDir("prune"), /*keep=*/2);
  for (int64_t step : {1, 2, 3, 4}) {
    ASSERT_TRUE(store.Begin(step).ok());
    ASSERT_TRUE(store.Commit(step).ok());
  }
  EXPECT_FALSE(fs::exists(store.root() + "/step_00000001"));
  EXPECT_FALSE(fs::exists(store.root() + "/step_00000002"));
  EXPECT_TRUE(fs::exists(store.root() + "/step_00000003"));
  EXPECT_EQ(fs::path(*store.Latest()).filename(), "step_00000004");
}

TEST(CheckpointStoreTest, CandidatesAreLatestThenOlderNewestFirst) {
  CheckpointStore store(TempDir("candidates"), /*keep=*/3);
  EXPECT_TRUE(store.Candidates().empty());
  for (int64_t step : {10, 20, 30}) {
    ASSERT_TRUE(store.Begin(step).ok());
    ASSERT_TRUE(store.Commit(step).ok());
  }
  ASSERT_TRUE(store.Begin(40).ok());  // never committed: not a candidate
  const std::string root = store.root();
  EXPECT_EQ(store.Candidates(),
            (std::vector<std::string>{root + "/step_00000030",
                                      root + "/step_00000020",
                                      root + "/step_00000010"}));
  // `latest` rolled back to 20: 30 is not preferred over it.
  std::ofstream(root + "/latest") << "step_00000020\n";
  EXPECT_EQ(store.Candidates(),
            (std::vector<std::string>{root + "/step_00000020",
                                      root + "/step_00000010"}));
  // An unreadable pointer: every complete checkpoint, newest first.
  fs::remove(root + "/latest");
  EXPECT_EQ(store.Candidates().front(), root + "/step_00000030");
  EXPECT_EQ(store.Candidates().size(), 3u);
}

TEST(TensorFileTest, RoundTripsNamedTensors) {
  const std::string path = TempDir("tensors") + "/t.pt";
  torch::Tensor a = torch::randn({3, 4});
  torch::Tensor b = torch::arange(5);
  ASSERT_TRUE(
      SaveTensorFile(path, {{"h.0.attn.c_attn.weight", a}, {"b", b}}).ok());
  auto loaded = LoadTensorFile(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 2u);
  EXPECT_EQ((*loaded)[0].first, "h.0.attn.c_attn.weight");
  EXPECT_TRUE(torch::equal((*loaded)[0].second, a));
  EXPECT_TRUE(torch::equal((*loaded)[1].second, b));
}

// 256 bytes overwritten in place (the size unchanged): refused by the
// checksum, naming the file, instead of resuming damaged weights.
TEST(TensorFileTest, ABitFlippedFileIsRefusedByItsChecksum) {
  const std::string path = TempDir("damaged") + "/t.pt";
  ASSERT_TRUE(SaveTensorFile(path, {{"w", torch::randn({64, 64})}}).ok());
  const auto size = fs::file_size(path);
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(size / 2));
    const std::string junk(256, '\x7f');
    file.write(junk.data(), junk.size());
  }
  ASSERT_EQ(fs::file_size(path), size);

  auto loaded = LoadTensorFile(path);

  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(loaded.status().message()),
              testing::HasSubstr("does not match its checksum"));
}

TEST(TensorFileTest, GarbageAndMissingFilesAreErrors) {
  const std::string dir = TempDir("garbage");
  std::ofstream(dir + "/bad.pt") << "not a tensor file";
  EXPECT_FALSE(LoadTensorFile(dir + "/bad.pt").ok());
  EXPECT_TRUE(absl::IsNotFound(LoadTensorFile(dir + "/none.pt").status()));
}

}  // namespace
}  // namespace shardtrain
