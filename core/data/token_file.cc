#include "core/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "core/data/gpt2_vocab.h"

namespace shardtrain {
namespace {

std::string ErrnoMessage(const std::string& path, const char* action) {
  return absl::StrCat(path, ": cannot ", action, ": ", std::strerror(errno));
}

// The token count the header declares, once magic, version and the file's
// size agree with it; `width` the bytes of each id.
absl::StatusOr<size_t> CheckHeader(
    const std::string& path,
    const std::array<int32_t, kTokenFileHeaderInts>& header, size_t file_bytes,
    int* width) {
  if (header[0] != kTokenFileMagic && header[0] != kTokenFile32Magic) {
    return absl::DataLossError(absl::StrCat(
        path, ": bad magic ", header[0], " (expected ", kTokenFileMagic, " or ",
        kTokenFile32Magic, "): not an llm.c token file"));
  }
  const bool wide = header[0] == kTokenFile32Magic;
  const int32_t version = wide ? kTokenFile32Version : kTokenFileVersion;
  if (header[1] != version) {
    return absl::DataLossError(absl::StrCat(
        path, ": unsupported version ", header[1], " for magic ", header[0],
        " (version ", version, wide ? ", uint32 ids" : ", uint16 GPT-2 ids",
        ", is supported)"));
  }
  *width = wide ? 4 : 2;
  if (header[2] < 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": negative token count ", header[2]));
  }
  const auto count = static_cast<size_t>(header[2]);
  const size_t expected_bytes =
      kTokenFileHeaderBytes + count * static_cast<size_t>(*width);
  if (file_bytes != expected_bytes) {
    return absl::DataLossError(absl::StrCat(
        path, ": header says ", count, " tokens (", expected_bytes,
        " bytes with the header) but the file has ", file_bytes, " bytes"));
  }
  return count;
}

absl::Status TruncatedHeader(const std::string& path, size_t file_bytes) {
  return absl::DataLossError(absl::StrCat(
      path, ": truncated header: file has ", file_bytes,
      " bytes, an llm.c token file header needs ", kTokenFileHeaderBytes));
}

}  // namespace

absl::StatusOr<TokenFile> TokenFile::Open(const std::string& path) {
  absl::StatusOr<InputFile> input = InputFile::Open(path);
  if (!input.ok()) return input.status();
  const auto file_bytes = static_cast<size_t>(input->size());
  if (file_bytes < kTokenFileHeaderBytes) {
    return TruncatedHeader(path, file_bytes);
  }
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED,
                         input->descriptor(), 0);
  if (mapping == MAP_FAILED) {
    return absl::InternalError(ErrnoMessage(path, "mmap"));
  }
  // From here the mapping is owned; TokenFile's destructor unmaps it.
  TokenFile file(path, mapping, file_bytes, 0);

  std::array<int32_t, kTokenFileHeaderInts> header;
  std::memcpy(header.data(), mapping, kTokenFileHeaderBytes);
  absl::StatusOr<size_t> count =
      CheckHeader(path, header, file_bytes, &file.width_);
  if (!count.ok()) return count.status();
  file.tokens_ = static_cast<const char*>(mapping) + kTokenFileHeaderBytes;
  file.size_ = *count;
  const uint32_t limit = file.width_ == 2
                             ? static_cast<uint32_t>(kGpt2VocabSize) - 1
                             : kMaxTokenId32;
  for (size_t i = 0; i < *count; ++i) {
    const uint32_t id = file[i];
    if (id > limit) {
      return absl::DataLossError(absl::StrCat(
          path, ": token id ", id, " at index ", i,
          file.width_ == 2 ? " is outside GPT-2's vocabulary (ids < "
                           : " is past the largest id a token file holds (",
          limit + 1, file.width_ == 2 ? ")" : " ids)"));
    }
    file.max_id_ = std::max(file.max_id_, id);
  }
  return file;
}

absl::StatusOr<int64_t> ReadTokenFileHeader(const std::string& path) {
  absl::StatusOr<InputFile> input = InputFile::Open(path);
  if (!input.ok()) return input.status();
  const auto file_bytes = static_cast<size_t>(input->size());
  if (file_bytes < kTokenFileHeaderBytes) {
    return TruncatedHeader(path, file_bytes);
  }
  std::array<int32_t, kTokenFileHeaderInts> header;
  if (absl::Status s = input->ReadAt(0, header.data(), kTokenFileHeaderBytes);
      !s.ok()) {
    return s;
  }
  int width = 0;
  absl::StatusOr<size_t> count = CheckHeader(path, header, file_bytes, &width);
  if (!count.ok()) return count.status();
  return static_cast<int64_t>(*count);
}

TokenFile::TokenFile(std::string path, void* mapping, size_t mapping_bytes,
                     size_t size)
    : path_(std::move(path)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      size_(size) {}

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_bytes_(std::exchange(other.mapping_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      width_(other.width_),
      max_id_(other.max_id_) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_bytes_ = std::exchange(other.mapping_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    size_ = std::exchange(other.size_, 0);
    width_ = other.width_;
    max_id_ = other.max_id_;
  }
  return *this;
}

TokenFile::~TokenFile() { Unmap(); }

void TokenFile::Unmap() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
  mapping_ = nullptr;
  mapping_bytes_ = 0;
  tokens_ = nullptr;
  size_ = 0;
}

namespace {

// The header and the ids, through a temporary file renamed into place.
template <typename Id>
absl::Status WriteIds(const std::string& path, absl::Span<const Id> tokens,
                      int32_t magic, int32_t version, uint32_t limit,
                      const char* what) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", tokens.size(),
        " tokens do not fit an llm.c header (at most ", INT32_MAX, ")"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": token id ", tokens[i], " at index ", i, " is ",
                       what, " (ids <= ", limit, ")"));
    }
  }
  std::array<int32_t, kTokenFileHeaderInts> header{};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());

  return WriteFileAtomically(
      path, [&](std::FILE* file, const std::string& temp) -> absl::Status {
        if (std::fwrite(header.data(), 1, kTokenFileHeaderBytes, file) !=
                kTokenFileHeaderBytes ||
            std::fwrite(tokens.data(), sizeof(Id), tokens.size(), file) !=
                tokens.size()) {
          return absl::InternalError(ErrnoMessage(temp, "write"));
        }
        return absl::OkStatus();
      });
}

}  // namespace

absl::Status WriteTokenFile(const std::string& path,
                            absl::Span<const uint16_t> tokens) {
  return WriteIds(path, tokens, kTokenFileMagic, kTokenFileVersion,
                  static_cast<uint32_t>(kGpt2VocabSize) - 1,
                  "outside GPT-2's vocabulary");
}

absl::Status WriteTokenFile32(const std::string& path,
                              absl::Span<const uint32_t> tokens) {
  return WriteIds(path, tokens, kTokenFile32Magic, kTokenFile32Version,
                  kMaxTokenId32, "past the largest id a token file holds");
}

}  // namespace shardtrain
