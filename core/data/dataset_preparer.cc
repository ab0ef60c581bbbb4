#include "core/data/dataset_preparer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "core/data/gpt2_vocab.h"
#include "core/data/token_file.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

constexpr double kValidationFraction = 0.1;

void AppendTokens(const std::vector<int>& ids, std::vector<uint32_t>* out) {
  out->insert(out->end(), ids.begin(), ids.end());
}

// The document's ids; an error names the document.
absl::StatusOr<std::vector<int>> EncodeDocument(const BpeTokenizer& tokenizer,
                                                const Document& document) {
  absl::StatusOr<std::vector<int>> ids = tokenizer.Encode(document.text);
  if (!ids.ok()) {
    return absl::Status(
        ids.status().code(),
        absl::StrCat(document.name, ": ", ids.status().message()));
  }
  return ids;
}

// llm.c's 16-bit file while the vocabulary is GPT-2's size or less, its
// 32-bit one past it.
absl::Status WriteTokens(const std::string& path,
                         const std::vector<uint32_t>& tokens, bool wide) {
  if (wide) return WriteTokenFile32(path, tokens);
  const std::vector<uint16_t> narrow(tokens.begin(), tokens.end());
  return WriteTokenFile(path, narrow);
}

nlohmann::json SplitJson(const SplitSummary& split,
                         const std::vector<std::string>& names) {
  nlohmann::json json;
  json["file"] = std::filesystem::path(split.path).filename().string();
  json["documents"] = split.documents;
  json["tokens"] = split.tokens;
  if (!split.documents_per_group.empty()) {
    json["documents_per_group"] = split.documents_per_group;
  }
  json["document_names"] = names;
  return json;
}

}  // namespace

std::vector<bool> ChooseValidationDocuments(
    const std::vector<Document>& documents) {
  absl::flat_hash_map<std::string, std::vector<size_t>> groups;
  for (size_t i = 0; i < documents.size(); ++i) {
    groups[documents[i].group].push_back(i);
  }
  std::vector<bool> is_val(documents.size(), false);
  for (const auto& [group, members] : groups) {
    const size_t n = members.size();
    if (n < 2) continue;
    const auto n_val = std::max<size_t>(
        1, static_cast<size_t>(std::lround(n * kValidationFraction)));
    // The middle of each of n_val equal slices of the group.
    for (size_t k = 0; k < n_val; ++k) {
      is_val[members[(2 * k + 1) * n / (2 * n_val)]] = true;
    }
  }
  return is_val;
}

absl::StatusOr<DatasetSummary> PrepareDataset(
    const Corpus& corpus, const BpeTokenizer& tokenizer,
    const std::string& out_dir, const std::string& tokenizer_name) {
  if (corpus.documents.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty corpus: no documents in ", corpus.source));
  }
  const int eot = tokenizer.end_of_text();
  if (eot < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer ", tokenizer_name,
        " has no end-of-text token (<|endoftext|>, <|end_of_text|>, </s> or "
        "<eos>) to separate documents"));
  }
  const bool wide = tokenizer.vocab_size() > kGpt2VocabSize;
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec || !std::filesystem::is_directory(out_dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create output folder ", out_dir,
                     ec ? ": " + ec.message() : ""));
  }

  DatasetSummary summary;
  summary.source = corpus.source;
  summary.train.path = out_dir + "/train.bin";
  summary.val.path = out_dir + "/val.bin";
  std::vector<uint32_t> train_tokens, val_tokens;
  std::vector<std::string> train_names, val_names;

  const auto start = std::chrono::steady_clock::now();
  if (corpus.documents.size() == 1) {
    summary.split_by = "tokens";
    const Document& document = corpus.documents.front();
    absl::StatusOr<std::vector<int>> encoded =
        EncodeDocument(tokenizer, document);
    if (!encoded.ok()) return encoded.status();
    std::vector<int>& ids = *encoded;
    if (ids.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("empty corpus: no text in ", corpus.source));
    }
    ids.insert(ids.begin(), eot);
    // Keep at least one token of text on each side.
    const auto cut = std::clamp<size_t>(
        static_cast<size_t>(
            std::lround(ids.size() * (1 - kValidationFraction))),
        1, ids.size() - 1);
    train_tokens.assign(ids.begin(), ids.begin() + cut);
    val_tokens.push_back(static_cast<uint32_t>(eot));
    val_tokens.insert(val_tokens.end(), ids.begin() + cut, ids.end());
    for (SplitSummary* split : {&summary.train, &summary.val}) {
      split->documents = 1;
      if (!document.group.empty())
        split->documents_per_group[document.group] = 1;
    }
    train_names = val_names = {document.name};
  } else {
    summary.split_by = "documents";
    const std::vector<bool> is_val =
        ChooseValidationDocuments(corpus.documents);
    for (size_t i = 0; i < corpus.documents.size(); ++i) {
      const Document& document = corpus.documents[i];
      SplitSummary& split = is_val[i] ? summary.val : summary.train;
      std::vector<uint32_t>& tokens = is_val[i] ? val_tokens : train_tokens;
      tokens.push_back(static_cast<uint32_t>(eot));
      absl::StatusOr<std::vector<int>> ids =
          EncodeDocument(tokenizer, document);
      if (!ids.ok()) return ids.status();
      AppendTokens(*ids, &tokens);
      ++split.documents;
      if (!document.group.empty()) ++split.documents_per_group[document.group];
      (is_val[i] ? val_names : train_names).push_back(document.name);
    }
  }
  summary.encode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  summary.train.tokens = static_cast<int64_t>(train_tokens.size());
  summary.val.tokens = static_cast<int64_t>(val_tokens.size());

  if (absl::Status s = WriteTokens(summary.train.path, train_tokens, wide);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = WriteTokens(summary.val.path, val_tokens, wide);
      !s.ok()) {
    return s;
  }
  nlohmann::json meta;
  meta["source"] = summary.source;
  meta["format"] = {{"name", "llm.c"},
                    {"magic", wide ? kTokenFile32Magic : kTokenFileMagic},
                    {"version", wide ? kTokenFile32Version : kTokenFileVersion},
                    {"header_int32s", kTokenFileHeaderInts},
                    {"dtype", wide ? "uint32" : "uint16"}};
  meta["tokenizer"] = {{"name", tokenizer_name},
                       {"vocab_size", tokenizer.vocab_size()},
                       {"eot_token", eot},
                       {"eot_before_each_document", true}};
  meta["split_by"] = summary.split_by;
  meta["train"] = SplitJson(summary.train, train_names);
  meta["val"] = SplitJson(summary.val, val_names);
  if (absl::Status s =
          WriteFileAtomically(out_dir + "/meta.json", meta.dump(2) + "\n");
      !s.ok()) {
    return s;
  }
  return summary;
}

absl::StatusOr<std::string> DatasetTokenizer(const std::string& data_dir) {
  const std::string path = data_dir + "/meta.json";
  absl::StatusOr<std::string> text =
      ReadInputFile(path, int64_t{64} << 20, "a dataset's meta.json");
  if (!text.ok()) return text.status();
  // meta.json nests three levels (PrepareDataset writes it).
  if (absl::Status s = CheckJsonNesting(*text, 16, path); !s.ok()) {
    return absl::DataLossError(s.message());
  }
  const nlohmann::json meta =
      nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (meta.is_discarded() || !meta.is_object() || !meta.contains("tokenizer") ||
      !meta["tokenizer"].is_object() ||
      !meta["tokenizer"].value("name", nlohmann::json()).is_string()) {
    return absl::DataLossError(absl::StrCat(path, " names no tokenizer"));
  }
  return meta["tokenizer"]["name"].get<std::string>();
}

}  // namespace shardtrain
