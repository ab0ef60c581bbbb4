#include "core/data/brown_corpus.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace shardtrain {
namespace {

// A sample file is "c", a genre letter and two digits.
bool IsSampleName(const std::string& name) {
  return name.size() == 4 && name[0] == 'c' && absl::ascii_islower(name[1]) &&
         absl::ascii_isdigit(name[2]) && absl::ascii_isdigit(name[3]);
}

// Tokens written without a space before them.
bool AttachesToPrevious(absl::string_view word) {
  static constexpr absl::string_view kClosers[] = {
      ",", ".",  ";",   ":",   "!",   "?",  ")",   "]",
      "}", "'s", "n't", "'re", "'ve", "'m", "'ll", "'d"};
  return std::find(std::begin(kClosers), std::end(kClosers), word) !=
         std::end(kClosers);
}

// Tokens written without a space after them.
bool AttachesToNext(absl::string_view word) {
  return word == "(" || word == "[" || word == "{";
}

// Builds one paragraph from its words, deciding where spaces go.
class ParagraphWriter {
 public:
  void Add(absl::string_view word) {
    bool glue_before = AttachesToPrevious(word);
    bool glue_after = AttachesToNext(word);
    if (word == "``") {
      word = "\"";
      glue_after = true;
    } else if (word == "''") {
      word = "\"";
      glue_before = true;
    } else if (word == "'") {
      // Brown writes both single quotes as '; they alternate within a
      // paragraph.
      glue_before = single_quote_open_;
      glue_after = !single_quote_open_;
      single_quote_open_ = !single_quote_open_;
    }
    if (!text_.empty() && !glue_before && !glue_next_) text_ += ' ';
    absl::StrAppend(&text_, word);
    glue_next_ = glue_after;
  }

  bool empty() const { return text_.empty(); }
  std::string Take() {
    glue_next_ = false;
    single_quote_open_ = false;
    return std::move(text_);
  }

 private:
  std::string text_;
  bool glue_next_ = false;
  bool single_quote_open_ = false;
};

}  // namespace

std::string BrownGenreName(char letter) {
  // NLTK's category names (cats.txt), by the letters of CONTENTS.
  switch (letter) {
    case 'a':
      return "news";
    case 'b':
      return "editorial";
    case 'c':
      return "reviews";
    case 'd':
      return "religion";
    case 'e':
      return "hobbies";
    case 'f':
      return "lore";
    case 'g':
      return "belles_lettres";
    case 'h':
      return "government";
    case 'j':
      return "learned";
    case 'k':
      return "fiction";
    case 'l':
      return "mystery";
    case 'm':
      return "science_fiction";
    case 'n':
      return "adventure";
    case 'p':
      return "romance";
    case 'r':
      return "humor";
    default:
      return std::string(1, letter);
  }
}

std::string BrownSampleToText(absl::string_view tagged) {
  std::vector<std::string> paragraphs;
  ParagraphWriter paragraph;
  auto end_paragraph = [&] {
    if (!paragraph.empty()) paragraphs.push_back(paragraph.Take());
  };
  for (absl::string_view line : absl::StrSplit(tagged, '\n')) {
    const bool indented = !line.empty() && line[0] == '\t';
    if (absl::StripAsciiWhitespace(line).empty() || indented) end_paragraph();
    for (absl::string_view token :
         absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty())) {
      const size_t slash = token.rfind('/');
      // "word/tag"; a token without a tag (none in Brown) is kept whole.
      const absl::string_view word =
          slash == absl::string_view::npos || slash == 0
              ? token
              : token.substr(0, slash);
      paragraph.Add(word);
    }
  }
  end_paragraph();
  return absl::StrJoin(paragraphs, "\n");
}

absl::StatusOr<Corpus> LoadBrownCorpus(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file(ec) && IsSampleName(name)) names.push_back(name);
  }
  if (ec) {
    return absl::NotFoundError(absl::StrCat("cannot read Brown Corpus folder ",
                                            dir, ": ", ec.message()));
  }
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "empty corpus: no Brown Corpus samples (files ca01 ... cr09) in ",
        dir));
  }
  std::sort(names.begin(), names.end());

  Corpus corpus;
  corpus.source = "brown";
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(dir, "/", name);
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::DataLossError(absl::StrCat("cannot read ", path));
    const std::string tagged{std::istreambuf_iterator<char>(in),
                             std::istreambuf_iterator<char>()};
    std::string text = BrownSampleToText(tagged);
    if (text.empty()) {
      return absl::DataLossError(absl::StrCat(path, ": sample has no words"));
    }
    corpus.documents.push_back(
        Document{name, BrownGenreName(name[1]), std::move(text)});
  }
  return corpus;
}

}  // namespace shardtrain
