// Any bytes -> GPT-2 BPE tokens -> decode gives the same bytes back (byte
// level BPE covers every byte), with and without special tokens allowed.
#include <optional>
#include <string>
#include <vector>

#include "core/data/bpe_tokenizer.h"
#include "tests/fuzz/fuzz_target.h"

namespace {
std::optional<shardtrain::BpeTokenizer>* tokenizer;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  absl::StatusOr<shardtrain::BpeTokenizer> loaded =
      shardtrain::BpeTokenizer::LoadDefault();
  if (!loaded.ok()) {
    std::fprintf(stderr, "bpe_tokenizer_fuzz: %s (run scripts/setup)\n",
                 std::string(loaded.status().message()).c_str());
    std::exit(1);
  }
  tokenizer = new std::optional<shardtrain::BpeTokenizer>(std::move(*loaded));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const shardtrain::SpecialTokens special :
       {shardtrain::SpecialTokens::kAsText,
        shardtrain::SpecialTokens::kRecognize}) {
    // GPT-2's regex stays inside the matching bounds on any bytes.
    const absl::StatusOr<std::vector<int>> encoded =
        (**tokenizer).Encode(text, special);
    FUZZ_CHECK(encoded.ok(), "GPT-2's regex encodes any bytes");
    const std::vector<int>& ids = *encoded;
    for (int id : ids) {
      FUZZ_CHECK(id >= 0 && id < (**tokenizer).vocab_size(),
                 "token id inside the vocabulary");
    }
    FUZZ_CHECK(ids.size() <= text.size(), "at most one token per byte");
    absl::StatusOr<std::string> decoded = (**tokenizer).Decode(ids);
    FUZZ_CHECK(decoded.ok(), "encoded ids decode");
    FUZZ_CHECK(*decoded == text, "decode(encode(bytes)) == bytes");
  }
  return 0;
}
