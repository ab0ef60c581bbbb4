// Plain text files, or JSON Lines, as a corpus.
#ifndef SHARDTRAIN_CORE_DATA_TEXT_CORPUS_H_
#define SHARDTRAIN_CORE_DATA_TEXT_CORPUS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/data/corpus.h"

namespace shardtrain {

// Reads every path: a file is one document whatever its name; a folder
// contributes its *.txt files, recursively, in path order. Files holding only
// whitespace are skipped. NotFound for a path that does not exist or a folder
// without .txt files; InvalidArgument ("empty corpus") when no text is left.
absl::StatusOr<Corpus> LoadTextCorpus(absl::Span<const std::string> paths);

// JSON Lines files as a corpus: each line a JSON object whose string `field`
// is one document ("FILE:LINE" its name); blank lines and documents of only
// whitespace are skipped. InvalidArgument naming the file and line for a
// line that is not an object with that string field; NotFound for a missing
// file; "empty corpus" when no text is left.
absl::StatusOr<Corpus> LoadJsonlCorpus(absl::Span<const std::string> paths,
                                       const std::string& field);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_TEXT_CORPUS_H_
