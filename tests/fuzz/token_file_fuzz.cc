// Any bytes as an llm.c token file: Open() either refuses with a message
// naming the file or gives tokens that keep its promises (count matching
// the size, every id inside GPT-2's vocabulary). Truncated files, wrong
// magic, huge header counts: no crash, no allocation (the file is mapped).
// ReadTokenFileHeader (what the coordinator reads) agrees with Open on every
// input: it accepts whatever Open accepts, with the same count, and refuses
// every header Open refuses.
#include <string>

#include "core/data/gpt2_vocab.h"
#include "core/data/token_file.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) { return 0; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardtrain::fuzz::MemFile file(data, size);
  absl::StatusOr<shardtrain::TokenFile> tokens =
      shardtrain::TokenFile::Open(file.path());
  absl::StatusOr<int64_t> header = shardtrain::ReadTokenFileHeader(file.path());
  if (tokens.ok()) {
    FUZZ_CHECK(header.ok() && *header == static_cast<int64_t>(tokens->size()),
               "the header reader agrees with Open");
  } else if (!header.ok()) {
    FUZZ_CHECK(std::string(header.status().message()).find(file.path()) !=
                   std::string::npos,
               "header errors name the file");
  }
  if (!tokens.ok()) {
    FUZZ_CHECK(!tokens.status().message().empty(), "errors say why");
    FUZZ_CHECK(std::string(tokens.status().message()).find(file.path()) !=
                   std::string::npos,
               "errors name the file");
    return 0;
  }
  FUZZ_CHECK(shardtrain::kTokenFileHeaderBytes +
                     tokens->size() * static_cast<size_t>(tokens->width()) ==
                 size,
             "the count matches the file size");
  const uint32_t limit = tokens->width() == 2
                             ? static_cast<uint32_t>(shardtrain::kGpt2VocabSize)
                             : shardtrain::kMaxTokenId32 + 1;
  for (uint32_t id : tokens->ToVector()) {
    FUZZ_CHECK(id < limit, "ids inside the vocabulary");
  }
  return 0;
}
