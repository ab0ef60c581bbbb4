// llm.c's token files: a header of 256 little-endian int32 (magic, version,
// token count, the rest zero) followed by that many token ids:
//   magic 20240520, version 1: uint16 GPT-2 ids (ids < 50,257); FineWeb and
//                  TinyStories shards prepared by llm.c use it too;
//   magic 20240801, version 7: uint32 ids, for vocabularies past 65,536
//                  (llm.c's Llama 3 shards; ids < 2^24 here).
#ifndef SHARDTRAIN_CORE_DATA_TOKEN_FILE_H_
#define SHARDTRAIN_CORE_DATA_TOKEN_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardtrain {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr int32_t kTokenFile32Magic = 20240801;
inline constexpr int32_t kTokenFile32Version = 7;
// The ids a 32-bit file may hold.
inline constexpr uint32_t kMaxTokenId32 = (uint32_t{1} << 24) - 1;
inline constexpr size_t kTokenFileHeaderInts = 256;
inline constexpr size_t kTokenFileHeaderBytes =
    kTokenFileHeaderInts * sizeof(int32_t);

// A read-only, memory-mapped token file. Movable, not copyable; unmaps when
// destroyed, so data() is valid only while this object lives.
class TokenFile {
 public:
  // Maps `path` and validates it: header present, magic and version right,
  // file size equal to header + count * width bytes, every id < 50,257
  // (16-bit) or <= kMaxTokenId32 (32-bit). Each failure is a message naming
  // the file.
  static absl::StatusOr<TokenFile> Open(const std::string& path);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  const std::string& path() const { return path_; }
  // Number of tokens.
  size_t size() const { return size_; }
  // Bytes per id: 2 or 4.
  int width() const { return width_; }
  // `i` < size().
  uint32_t operator[](size_t i) const {
    return width_ == 2 ? static_cast<const uint16_t*>(tokens_)[i]
                       : static_cast<const uint32_t*>(tokens_)[i];
  }
  // The largest id in the file (0 when empty).
  uint32_t max_id() const { return max_id_; }
  // Every id, copied.
  std::vector<uint32_t> ToVector() const {
    std::vector<uint32_t> ids(size_);
    for (size_t i = 0; i < size_; ++i) ids[i] = (*this)[i];
    return ids;
  }

 private:
  TokenFile(std::string path, void* mapping, size_t mapping_bytes, size_t size);
  void Unmap();

  std::string path_;
  void* mapping_ = nullptr;  // the whole file, header included
  size_t mapping_bytes_ = 0;
  const void* tokens_ = nullptr;
  size_t size_ = 0;
  int width_ = 2;
  uint32_t max_id_ = 0;
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
// The same as a 32-bit file (magic 20240801, version 7). InvalidArgument for
// an id > kMaxTokenId32.
absl::Status WriteTokenFile32(const std::string& path,
                              absl::Span<const uint32_t> tokens);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_TOKEN_FILE_H_
