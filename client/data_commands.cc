#include "client/data_commands.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/exit_code.h"
#include "core/data/asset_paths.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/brown_corpus.h"
#include "core/data/dataset_preparer.h"
#include "core/data/gpt2_vocab.h"
#include "core/data/text_corpus.h"
#include "core/data/token_file.h"
#include "core/run/train_config.h"

namespace shardtrain::cli {
namespace {

struct PrepareOptions {
  std::string corpus;              // "brown", or empty when text is given
  std::vector<std::string> text;   // files or folders
  std::vector<std::string> jsonl;  // JSON Lines files
  std::string field = "text";      // the JSON Lines field holding the text
  std::string tokenizer;           // a tokenizer.json; empty: GPT-2's
  std::string out;
};

struct InspectOptions {
  std::string file;
  int count = 64;
  std::string tokenizer;  // a tokenizer.json; empty: GPT-2's
};

// GPT-2's built-in tokenizer, or the Hugging Face one at `path`.
absl::StatusOr<BpeTokenizer> LoadTokenizer(const std::string& path) {
  return path.empty() ? BpeTokenizer::LoadDefault()
                      : BpeTokenizer::LoadHuggingFace(path);
}

int RunPrepare(const PrepareOptions& options) {
  absl::StatusOr<BpeTokenizer> tokenizer = LoadTokenizer(options.tokenizer);
  if (!tokenizer.ok()) return ReportFailure(tokenizer.status());

  absl::StatusOr<Corpus> corpus;
  if (options.corpus == "brown") {
    absl::StatusOr<std::string> dir = BrownCorpusDir();
    if (!dir.ok()) return ReportFailure(dir.status());
    corpus = LoadBrownCorpus(*dir);
  } else if (!options.jsonl.empty()) {
    corpus = LoadJsonlCorpus(options.jsonl, options.field);
  } else {
    corpus = LoadTextCorpus(options.text);
  }
  if (!corpus.ok()) return ReportFailure(corpus.status());

  // meta.json names the tokenizer by its absolute path: export, inspect
  // and training find it from any directory.
  std::error_code ec;
  const std::string tokenizer_name =
      options.tokenizer.empty()
          ? "gpt2"
          : std::filesystem::absolute(options.tokenizer, ec)
                .lexically_normal()
                .string();
  absl::StatusOr<DatasetSummary> summary =
      PrepareDataset(*corpus, *tokenizer, options.out,
                     ec ? options.tokenizer : tokenizer_name);
  if (!summary.ok()) return ReportFailure(summary.status());

  std::cout << absl::StrFormat(
      "prepared %s: %d documents, split by %s, encoded in %.2f s\n",
      summary->source, corpus->documents.size(), summary->split_by,
      summary->encode_seconds);
  for (const SplitSummary* split : {&summary->train, &summary->val}) {
    std::cout << absl::StrFormat("  %-40s %6d documents %10d tokens\n",
                                 split->path, split->documents, split->tokens);
  }
  std::cout << "  " << options.out << "/meta.json\n";
  // Training checks this too, before step 1; said here, where it is fixed.
  const TrainConfig defaults;
  const int64_t eval_batch = defaults.batch_size * (defaults.seq_len + 1);
  if (summary->val.tokens < eval_batch) {
    std::cerr << absl::StrFormat(
        "warning: val.bin has %d tokens, fewer than one evaluation batch at "
        "the defaults (%d x %d); training refuses it unless --batch-size x "
        "(--seq-len + 1) x ranks fits. Add text for validation, or delete "
        "val.bin to train without evaluating.\n",
        summary->val.tokens, defaults.batch_size, defaults.seq_len + 1);
  }
  return kExitOk;
}

int RunInspect(const InspectOptions& options) {
  absl::StatusOr<TokenFile> file = TokenFile::Open(options.file);
  if (!file.ok()) return ReportFailure(file.status());
  // Without --tokenizer: the one meta.json beside the file names (data
  // prepare writes it), else GPT-2's.
  std::string tokenizer_path = options.tokenizer;
  std::string tokenizer_from =
      tokenizer_path.empty() ? "GPT-2's" : "--tokenizer";
  if (tokenizer_path.empty()) {
    const std::string dir =
        std::filesystem::path(options.file).parent_path().string();
    absl::StatusOr<std::string> named =
        DatasetTokenizer(dir.empty() ? "." : dir);
    if (named.ok() && *named != "gpt2") {
      tokenizer_path = *named;
      tokenizer_from = "meta.json";
    }
  }
  absl::StatusOr<BpeTokenizer> tokenizer = LoadTokenizer(tokenizer_path);
  if (!tokenizer.ok()) {
    return ReportFailure(
        tokenizer_from == "meta.json"
            ? absl::Status(tokenizer.status().code(),
                           absl::StrCat("the tokenizer meta.json names: ",
                                        tokenizer.status().message(),
                                        " (or give --tokenizer)"))
            : tokenizer.status());
  }

  const uint32_t eot = static_cast<uint32_t>(tokenizer->end_of_text());
  int64_t documents = 0;
  for (size_t i = 0; i < file->size(); ++i) documents += (*file)[i] == eot;
  std::vector<int> first;
  for (size_t i = 0; i < std::min<size_t>(file->size(), options.count); ++i) {
    first.push_back(static_cast<int>((*file)[i]));
  }
  absl::StatusOr<std::string> text = tokenizer->Decode(first);
  if (!text.ok()) return ReportFailure(text.status());
  const bool wide = file->width() == 4;

  absl::StatusOr<std::string> eot_text =
      tokenizer->Decode(std::vector<int>{static_cast<int>(eot)});
  std::cout << absl::StrFormat(
      "file       %s\n"
      "tokenizer  %s\n"
      "format     llm.c tokens (magic %d, version %d, %s)\n"
      "tokens     %d\n"
      "documents  %d (%s delimiters)\n"
      "first %d tokens:\n%s\n"
      "decoded:\n%s\n",
      file->path(),
      tokenizer_path.empty()
          ? std::string("GPT-2's")
          : absl::StrCat(tokenizer_path, " (", tokenizer_from, ")"),
      wide ? kTokenFile32Magic : kTokenFileMagic,
      wide ? kTokenFile32Version : kTokenFileVersion,
      wide ? "uint32" : "uint16", file->size(), documents,
      eot_text.ok() ? *eot_text : std::to_string(eot), first.size(),
      absl::StrJoin(first, " "), *text);
  return kExitOk;
}

}  // namespace

void AddDataCommands(CLI::App* app, int* exit_code) {
  CLI::App* data = app->add_subcommand(
      "data", "Prepare and inspect token datasets (local, no daemon needed)");
  data->require_subcommand(1);

  auto prepare_options = std::make_shared<PrepareOptions>();
  CLI::App* prepare = data->add_subcommand(
      "prepare",
      "Tokenize a corpus into DIR/train.bin, DIR/val.bin (llm.c format) and "
      "DIR/meta.json");
  CLI::Option_group* source =
      prepare->add_option_group("source", "What to prepare (exactly one)");
  source
      ->add_option("--corpus", prepare_options->corpus,
                   "A corpus installed by scripts/setup")
      ->check(CLI::IsMember({"brown"}));
  source->add_option(
      "--text", prepare_options->text,
      "Text files, or folders of .txt files; each file is one document");
  source->add_option("--jsonl", prepare_options->jsonl,
                     "JSON Lines files; each line's --field is one document");
  source->require_option(1);
  prepare
      ->add_option("--field", prepare_options->field,
                   "The JSON Lines field holding the text")
      ->capture_default_str();
  prepare->add_option(
      "--tokenizer", prepare_options->tokenizer,
      "A Hugging Face tokenizer.json (or its directory) instead of GPT-2's; "
      "documents are separated by its end-of-text token, and a vocabulary "
      "past GPT-2's is written as 32-bit token files");
  prepare
      ->add_option("--out", prepare_options->out,
                   "Output folder (created when missing)")
      ->required();
  prepare->callback([prepare_options, exit_code] {
    *exit_code = RunPrepare(*prepare_options);
  });

  auto inspect_options = std::make_shared<InspectOptions>();
  CLI::App* inspect = data->add_subcommand(
      "inspect", "Show an llm.c token file's header and first tokens");
  inspect->add_option("file", inspect_options->file, "The .bin file")
      ->required();
  inspect->add_option("--tokenizer", inspect_options->tokenizer,
                      "The tokenizer.json the file was prepared with");
  inspect
      ->add_option("--count", inspect_options->count,
                   "How many leading tokens to show and decode")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  inspect->callback([inspect_options, exit_code] {
    *exit_code = RunInspect(*inspect_options);
  });
}

}  // namespace shardtrain::cli
