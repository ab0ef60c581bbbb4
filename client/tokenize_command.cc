#include "client/tokenize_command.h"

#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/exit_code.h"
#include "core/data/bpe_tokenizer.h"

namespace shardtrain::cli {
namespace {

int RunTokenize(bool decode, const std::string& tokenizer_path) {
  absl::StatusOr<BpeTokenizer> tokenizer =
      tokenizer_path.empty() ? BpeTokenizer::LoadDefault()
                             : BpeTokenizer::LoadHuggingFace(tokenizer_path);
  if (!tokenizer.ok()) return ReportFailure(tokenizer.status());
  const std::string input{std::istreambuf_iterator<char>(std::cin),
                          std::istreambuf_iterator<char>()};
  if (!decode) {
    const absl::StatusOr<std::vector<int>> ids =
        tokenizer->Encode(input, SpecialTokens::kRecognize);
    if (!ids.ok()) return ReportFailure(ids.status());
    std::cout << absl::StrJoin(*ids, " ") << "\n";
    return kExitOk;
  }

  std::vector<int> ids;
  for (absl::string_view word :
       absl::StrSplit(input, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty())) {
    int id;
    if (!absl::SimpleAtoi(word, &id)) {
      return ReportFailure(
          absl::StrCat("tokenize --decode: \"", word,
                       "\" is not a token id (expected integers separated "
                       "by whitespace)"));
    }
    ids.push_back(id);
  }
  absl::StatusOr<std::string> text = tokenizer->Decode(ids);
  if (!text.ok()) {
    return ReportFailure(
        absl::StrCat("tokenize --decode: ", text.status().message()));
  }
  std::cout << *text << std::flush;
  return kExitOk;
}

}  // namespace

void AddTokenizeCommand(CLI::App* app, int* exit_code) {
  auto decode = std::make_shared<bool>(false);
  auto tokenizer = std::make_shared<std::string>();
  CLI::App* tokenize = app->add_subcommand(
      "tokenize",
      "Byte-level BPE: text on stdin -> token ids on stdout, separated by "
      "spaces; GPT-2's by default (\"<|endoftext|>\" -> 50256)");
  tokenize->add_flag("--decode", *decode,
                     "Read token ids on stdin and write their text");
  tokenize->add_option(
      "--tokenizer", *tokenizer,
      "A Hugging Face tokenizer.json, or a directory holding one (Llama 3, "
      "Qwen, SmolLM ...: byte-level BPE); its added tokens are matched in "
      "the text");
  tokenize->callback([decode, tokenizer, exit_code] {
    *exit_code = RunTokenize(*decode, *tokenizer);
  });
}

}  // namespace shardtrain::cli
