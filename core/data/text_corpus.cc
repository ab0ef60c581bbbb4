#include "core/data/text_corpus.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/input_file.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

// One text file is tokenized in memory; a larger corpus is many files.
constexpr int64_t kMaxDocumentBytes = int64_t{1} << 30;
// How deep a JSON Lines record may nest: datasets' records carry a text and
// a little metadata; a deeper line is refused before it is parsed.
constexpr int kMaxRecordNesting = 64;

// The files `path` stands for, in a deterministic order.
absl::StatusOr<std::vector<std::string>> ExpandPath(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) {
    return absl::NotFoundError(
        absl::StrCat("no such file or directory: ", path));
  }
  if (!fs::is_directory(status)) return std::vector<std::string>{path};

  std::vector<std::string> files;
  for (auto it = fs::recursive_directory_iterator(
           path, fs::directory_options::follow_directory_symlink, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->path().extension() == ".txt" && it->is_regular_file(ec)) {
      files.push_back(it->path().string());
    }
  }
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat("cannot read folder ", path, ": ", ec.message()));
  }
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat("no .txt files in ", path));
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

absl::StatusOr<Corpus> LoadTextCorpus(absl::Span<const std::string> paths) {
  Corpus corpus;
  corpus.source = absl::StrJoin(paths, " ");
  absl::flat_hash_set<std::string> seen;
  for (const std::string& path : paths) {
    absl::StatusOr<std::vector<std::string>> files = ExpandPath(path);
    if (!files.ok()) return files.status();
    for (const std::string& file : *files) {
      std::error_code ec;
      const fs::path canonical = fs::weakly_canonical(file, ec);
      if (!seen.insert(ec ? file : canonical.string()).second) continue;
      absl::StatusOr<std::string> read =
          ReadInputFile(file, kMaxDocumentBytes, "a text document");
      if (!read.ok()) return read.status();
      std::string text = *std::move(read);
      if (absl::StripAsciiWhitespace(text).empty()) continue;
      corpus.documents.push_back(Document{file, "", std::move(text)});
    }
  }
  if (corpus.documents.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty corpus: no text in ", corpus.source));
  }
  return corpus;
}

absl::StatusOr<Corpus> LoadJsonlCorpus(absl::Span<const std::string> paths,
                                       const std::string& field) {
  Corpus corpus;
  corpus.source = absl::StrJoin(paths, " ");
  for (const std::string& file : paths) {
    absl::StatusOr<std::string> read =
        ReadInputFile(file, kMaxDocumentBytes, "a JSON Lines file");
    if (!read.ok()) return read.status();
    int64_t line_number = 0;
    for (absl::string_view line : absl::StrSplit(*read, '\n')) {
      ++line_number;
      if (absl::StripAsciiWhitespace(line).empty()) continue;
      const std::string where = absl::StrCat(file, ":", line_number);
      if (absl::Status s =
              CheckJsonNesting(std::string_view(line.data(), line.size()),
                               kMaxRecordNesting, where);
          !s.ok()) {
        return s;
      }
      const nlohmann::json json =
          nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (json.is_discarded() || !json.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": not a JSON object (JSON Lines: one object per line)"));
      }
      if (!json.contains(field) || !json[field].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": no string field \"", field,
                         "\" (--field names the one holding the text)"));
      }
      std::string text = json[field].get<std::string>();
      if (absl::StripAsciiWhitespace(text).empty()) continue;
      corpus.documents.push_back(Document{where, "", std::move(text)});
    }
  }
  if (corpus.documents.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty corpus: no text in ", corpus.source));
  }
  return corpus;
}

}  // namespace shardtrain
