// llm.c's token file: a header of 256 little-endian int32 (magic 20240520,
// version 1, token count, the rest zero) followed by that many uint16 GPT-2
// token ids. FineWeb and TinyStories shards prepared by llm.c use it too.
#ifndef SHARDTRAIN_CORE_DATA_TOKEN_FILE_H_
#define SHARDTRAIN_CORE_DATA_TOKEN_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardtrain {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr size_t kTokenFileHeaderInts = 256;
inline constexpr size_t kTokenFileHeaderBytes =
    kTokenFileHeaderInts * sizeof(int32_t);

// A read-only, memory-mapped token file. Movable, not copyable; unmaps when
// destroyed, so data() is valid only while this object lives.
class TokenFile {
 public:
  // Maps `path` and validates it: header present, magic and version right,
  // file size equal to header + count * 2 bytes, every id < kGpt2VocabSize.
  // Each failure is a message naming the file.
  static absl::StatusOr<TokenFile> Open(const std::string& path);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  const std::string& path() const { return path_; }
  // Number of tokens.
  size_t size() const { return size_; }
  const uint16_t* data() const { return tokens_; }
  absl::Span<const uint16_t> tokens() const { return {tokens_, size_}; }
  // `i` < size().
  uint16_t operator[](size_t i) const { return tokens_[i]; }

 private:
  TokenFile(std::string path, void* mapping, size_t mapping_bytes, size_t size);
  void Unmap();

  std::string path_;
  void* mapping_ = nullptr;  // the whole file, header included
  size_t mapping_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  size_t size_ = 0;
};

// The token count of the token file at `path`, from its header alone (one
// bounded read, no mapping): magic, version and the file's size checked, the
// ids not. For the coordinator, which must never read job data itself.
// Neither this nor TokenFile::Open blocks on a FIFO or opens anything but a
// regular file.
absl::StatusOr<int64_t> ReadTokenFileHeader(const std::string& path);

// Writes `tokens` to `path` in the format above, through a temporary file in
// the same folder renamed into place, so readers never see a partial file.
// InvalidArgument for an id >= kGpt2VocabSize or more than INT32_MAX tokens.
absl::Status WriteTokenFile(const std::string& path,
                            absl::Span<const uint16_t> tokens);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_TOKEN_FILE_H_
