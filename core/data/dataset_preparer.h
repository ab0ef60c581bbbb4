// Turns a Corpus into an llm.c-style dataset folder:
//   train.bin, val.bin  token files (see token_file.h), every document
//                       preceded by the end-of-text token as llm.c does;
//   meta.json           source, split rule, documents and tokens per split,
//                       vocabulary.
// The split is a pure function of the corpus, so preparing twice gives
// identical bytes.
#ifndef SHARDTRAIN_CORE_DATA_DATASET_PREPARER_H_
#define SHARDTRAIN_CORE_DATA_DATASET_PREPARER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/corpus.h"

namespace shardtrain {

struct SplitSummary {
  std::string path;  // out_dir/train.bin or out_dir/val.bin
  int64_t documents = 0;
  int64_t tokens = 0;
  std::map<std::string, int64_t> documents_per_group;  // Brown genres
};

struct DatasetSummary {
  std::string source;
  // "documents": whole documents go to one split; "tokens": a single document
  // cut at 90% of its tokens.
  std::string split_by;
  SplitSummary train;
  SplitSummary val;
  double encode_seconds = 0;
};

// Which documents go to val: about 10% of each group (at least one when the
// group has two or more documents), spread evenly through the group's order.
// A group of one document stays in train.
std::vector<bool> ChooseValidationDocuments(
    const std::vector<Document>& documents);

// Tokenizes `corpus` and writes the dataset into `out_dir` (created when
// missing), each document preceded by the tokenizer's end-of-text token:
// 16-bit token files for a vocabulary of GPT-2's size or less, 32-bit ones
// past it. Two or more documents are split by ChooseValidationDocuments; a
// single one by tokens, 90/10, val starting with its own end-of-text. With
// GPT-2's built-in tokenizer the literal text "<|endoftext|>" in a document
// is text, not a delimiter (a Hugging Face tokenizer matches its added
// tokens). `tokenizer_name` goes to meta.json. InvalidArgument for an empty
// corpus or a tokenizer without an end-of-text token.
absl::StatusOr<DatasetSummary> PrepareDataset(
    const Corpus& corpus, const BpeTokenizer& tokenizer,
    const std::string& out_dir, const std::string& tokenizer_name = "gpt2");

// The tokenizer the dataset in `data_dir` was prepared with, as its
// meta.json names it: "gpt2", or the tokenizer.json (or its directory) that
// data prepare --tokenizer was given. Errors name the file.
absl::StatusOr<std::string> DatasetTokenizer(const std::string& data_dir);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_DATASET_PREPARER_H_
