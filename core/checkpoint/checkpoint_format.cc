#include "core/checkpoint/checkpoint_format.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "common/json_excerpt.h"
#include "zlib.h"

namespace shardtrain {
namespace {

constexpr int64_t kFloatBytes = sizeof(float);

// The most bytes of JSON a checkpoint's metadata or a rank's index may have:
// GPT-2 XL written by 1,024 ranks, optimizer state included, needs ~40 MiB.
constexpr int64_t kMaxIndexBytes = int64_t{256} << 20;
// How deep they may nest: the format nests five levels (tensors, their
// chunks), `training` a few; deeper text is refused before it is parsed.
constexpr int kMaxIndexNesting = 64;

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  return ReadInputFile(path, kMaxIndexBytes, "checkpoint metadata");
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The most elements one tensor may have (a checkpoint naming more is not
// one of ours): 2^40, 4 TiB of float32.
constexpr int64_t kMaxTensorElements = int64_t{1} << 40;
constexpr int64_t kMaxBlockBytes = int64_t{64} << 20;

// An integer field; anything else (a float, a string) throws, and the caller
// reports the file as malformed.
int64_t IntAt(const nlohmann::json& json, const char* key) {
  const nlohmann::json& value = json.at(key);
  if (!value.is_number_integer()) {
    throw std::invalid_argument(absl::StrCat("'", key, "' is not an integer"));
  }
  return value.get<int64_t>();
}

// An array of integers in [lo, hi]; a float, a string or a value out of range
// throws (converting 3.7e66 to an integer is undefined behaviour, found by
// checkpoint_fuzz), and the caller reports the file as malformed.
std::vector<int64_t> IntsAt(const nlohmann::json& json, const char* key,
                            int64_t lo = INT64_MIN, int64_t hi = INT64_MAX) {
  const nlohmann::json& values = json.at(key);
  if (!values.is_array()) {
    throw std::invalid_argument(absl::StrCat("'", key, "' is not an array"));
  }
  std::vector<int64_t> out;
  out.reserve(values.size());
  for (const nlohmann::json& v : values) {
    const bool in_range = v.is_number_unsigned()
                              ? v.get<uint64_t>() <= static_cast<uint64_t>(hi)
                              : v.is_number_integer() &&
                                    v.get<int64_t>() >= lo &&
                                    v.get<int64_t>() <= hi;
    if (!in_range) {
      throw std::invalid_argument(
          absl::StrCat("'", key, "' holds something other than integers in [",
                       lo, ", ", hi, "]"));
    }
    out.push_back(v.is_number_unsigned()
                      ? static_cast<int64_t>(v.get<uint64_t>())
                      : v.get<int64_t>());
  }
  return out;
}

std::vector<uint32_t> Crc32sAt(const nlohmann::json& json, const char* key) {
  const std::vector<int64_t> values = IntsAt(json, key, 0, UINT32_MAX);
  return std::vector<uint32_t>(values.begin(), values.end());
}

// Chunks sorted by offset must tile [0, numel) exactly.
absl::Status CheckCoverage(const TensorEntry& tensor,
                           const std::string& where) {
  int64_t next = 0;
  for (const TensorChunk& chunk : tensor.chunks) {
    if (chunk.offset != next) {
      return absl::DataLossError(
          absl::StrCat(where, ": tensor ", tensor.name, " has ",
                       chunk.offset > next ? "no chunk for" : "two chunks for",
                       " elements from ", std::min(chunk.offset, next)));
    }
    next += chunk.numel;
  }
  if (next != tensor.numel()) {
    return absl::DataLossError(
        absl::StrCat(where, ": tensor ", tensor.name, " has chunks for ", next,
                     " of its ", tensor.numel(), " elements"));
  }
  return absl::OkStatus();
}

// The per-strategy formats of earlier versions, by the file that marks them.
std::string OldFormatOf(const std::string& dir) {
  std::error_code ec;
  if (std::filesystem::exists(dir + "/fsdp_index.json", ec)) {
    return "the FSDP shard format (fsdp_index.json, one shard file per rank)";
  }
  if (std::filesystem::exists(dir + "/model.pt", ec)) {
    return "the single-device/DDP format (model.pt and optimizer.pt)";
  }
  return "";
}

// CRC-32 of a byte stream, block by block.
class BlockCrc {
 public:
  explicit BlockCrc(int64_t block_bytes) : block_bytes_(block_bytes) {}
  void Add(const char* data, int64_t size) {
    while (size > 0) {
      const int64_t n = std::min(size, block_bytes_ - in_block_);
      crc_ = crc32(crc_, reinterpret_cast<const Bytef*>(data),
                   static_cast<uInt>(n));
      in_block_ += n;
      data += n;
      size -= n;
      if (in_block_ == block_bytes_) Flush();
    }
  }
  std::vector<uint32_t> Finish() {
    if (in_block_ > 0) Flush();
    return std::move(crcs_);
  }

 private:
  void Flush() {
    crcs_.push_back(static_cast<uint32_t>(crc_));
    crc_ = crc32(0L, Z_NULL, 0);
    in_block_ = 0;
  }
  const int64_t block_bytes_;
  uLong crc_ = crc32(0L, Z_NULL, 0);
  int64_t in_block_ = 0;
  std::vector<uint32_t> crcs_;
};

nlohmann::json DataFileJson(const DataFile& file) {
  return {{"name", file.name},
          {"bytes", file.bytes},
          {"block_bytes", file.block_bytes},
          {"crc32", file.crc32}};
}

nlohmann::json ChunkJson(const TensorChunk& chunk) {
  return {{"file", chunk.file},
          {"offset", chunk.offset},
          {"numel", chunk.numel},
          {"byte_offset", chunk.byte_offset}};
}

}  // namespace

int64_t TensorEntry::numel() const { return Product(shape); }

const TensorEntry* CheckpointMetadata::Find(const std::string& name) const {
  auto it = std::lower_bound(
      tensors.begin(), tensors.end(), name,
      [](const TensorEntry& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

int64_t CheckpointMetadata::TotalBytes() const {
  int64_t bytes = 0;
  for (const TensorEntry& t : tensors) bytes += t.numel() * kFloatBytes;
  return bytes;
}

const DataFile* CheckpointMetadata::FindFile(const std::string& name) const {
  for (const DataFile& file : files) {
    if (file.name == name) return &file;
  }
  return nullptr;
}

std::map<std::string, int64_t> CheckpointMetadata::BytesPerFile() const {
  std::map<std::string, int64_t> bytes;
  for (const DataFile& file : files) bytes[file.name] = 0;
  for (const TensorEntry& t : tensors) {
    for (const TensorChunk& c : t.chunks)
      bytes[c.file] += c.numel * kFloatBytes;
  }
  return bytes;
}

std::string RankDataFile(int64_t rank) {
  return absl::StrFormat("rank-%05d.bin", rank);
}

std::string RankIndexFile(int64_t rank) {
  return absl::StrFormat("rank-%05d.json", rank);
}

absl::Status WriteRankChunks(const std::string& dir, int64_t rank,
                             const std::vector<ChunkToWrite>& chunks) {
  const std::string file = RankDataFile(rank);
  nlohmann::json index_chunks = nlohmann::json::array();
  int64_t byte_offset = 0;
  for (const ChunkToWrite& c : chunks) {
    if (c.offset < 0 || c.numel < 0 || c.offset + c.numel > Product(c.shape)) {
      return absl::InternalError(
          absl::StrCat("checkpoint: rank ", rank, " has a chunk of ", c.name,
                       " ", ShapeText(c.shape), " at [", c.offset, ", ",
                       c.offset + c.numel, ") outside the tensor"));
    }
    index_chunks.push_back({{"name", c.name},
                            {"shape", c.shape},
                            {"offset", c.offset},
                            {"numel", c.numel},
                            {"byte_offset", byte_offset}});
    byte_offset += c.numel * kFloatBytes;
  }
  BlockCrc crc(kCheckpointBlockBytes);
  absl::Status written = WriteFileAtomically(
      absl::StrCat(dir, "/", file),
      [&](std::FILE* out, const std::string& temp) -> absl::Status {
        for (const ChunkToWrite& c : chunks) {
          const size_t n = static_cast<size_t>(c.numel);
          if (n > 0 && std::fwrite(c.data, sizeof(float), n, out) != n) {
            return absl::ResourceExhaustedError(absl::StrCat(
                "checkpoint: cannot write ", temp, ": ", std::strerror(errno)));
          }
          crc.Add(reinterpret_cast<const char*>(c.data), c.numel * kFloatBytes);
        }
        return absl::OkStatus();
      });
  if (!written.ok()) return written;
  const DataFile data{file, byte_offset, kCheckpointBlockBytes, crc.Finish()};
  const nlohmann::json index = {
      {"rank", rank}, {"file", DataFileJson(data)}, {"chunks", index_chunks}};
  return WriteFileAtomically(absl::StrCat(dir, "/", RankIndexFile(rank)),
                             index.dump() + "\n");
}

absl::Status WriteCheckpointMetadata(const std::string& dir, int64_t world_size,
                                     const nlohmann::json& training) {
  std::map<std::string, TensorEntry> tensors;
  nlohmann::json files = nlohmann::json::array();
  for (int64_t r = 0; r < world_size; ++r) {
    const std::string path = absl::StrCat(dir, "/", RankIndexFile(r));
    absl::StatusOr<std::string> text = ReadWholeFile(path);
    if (!text.ok()) return text.status();
    if (absl::Status s = CheckJsonNesting(*text, kMaxIndexNesting, path);
        !s.ok()) {
      return absl::DataLossError(s.message());
    }
    const nlohmann::json index =
        nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.contains("chunks") ||
        !index["chunks"].is_array()) {
      return absl::DataLossError(absl::StrCat(path, " is unreadable"));
    }
    const std::string file = RankDataFile(r);
    try {
      files.push_back(index.at("file"));
      for (const nlohmann::json& c : index["chunks"]) {
        const std::string name = c.at("name").get<std::string>();
        const std::vector<int64_t> shape = IntsAt(c, "shape");
        TensorEntry& entry = tensors[name];
        if (entry.name.empty()) {
          entry.name = name;
          entry.shape = shape;
        } else if (entry.shape != shape) {
          return absl::DataLossError(
              absl::StrCat("checkpoint: ranks disagree on the shape of ", name,
                           ": ", ShapeText(entry.shape), " and ",
                           ShapeText(shape), " (rank ", r, ")"));
        }
        entry.chunks.push_back({file, IntAt(c, "offset"), IntAt(c, "numel"),
                                IntAt(c, "byte_offset")});
      }
    } catch (const std::exception& e) {
      return absl::DataLossError(absl::StrCat(path, ": ", e.what()));
    }
  }
  nlohmann::json entries = nlohmann::json::array();
  for (auto& [name, entry] : tensors) {  // by name
    std::sort(entry.chunks.begin(), entry.chunks.end(),
              [](const TensorChunk& a, const TensorChunk& b) {
                return std::pair(a.offset, a.numel) <
                       std::pair(b.offset, b.numel);
              });
    if (absl::Status s = CheckCoverage(entry, dir); !s.ok()) return s;
    nlohmann::json chunks = nlohmann::json::array();
    for (const TensorChunk& c : entry.chunks) chunks.push_back(ChunkJson(c));
    entries.push_back({{"name", name},
                       {"dtype", entry.dtype},
                       {"shape", entry.shape},
                       {"chunks", chunks}});
  }
  const nlohmann::json metadata = {
      {"format", kCheckpointFormat},
      {"version", kCheckpointVersion},
      {"training", training.is_object() ? training : nlohmann::json::object()},
      {"files", files},
      {"tensors", entries}};
  return WriteFileAtomically(absl::StrCat(dir, "/", kCheckpointMetadataFile),
                             metadata.dump(1) + "\n");
}

absl::StatusOr<CheckpointMetadata> ParseCheckpointMetadata(
    const std::string& text, const std::string& where) {
  if (absl::Status s = CheckJsonNesting(text, kMaxIndexNesting, where);
      !s.ok()) {
    return absl::DataLossError(s.message());
  }
  const nlohmann::json json =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::DataLossError(absl::StrCat(where, " is not valid JSON"));
  }
  if (!json.contains("format") || !json["format"].is_string() ||
      json["format"].get<std::string>() != kCheckpointFormat) {
    return absl::DataLossError(
        absl::StrCat(where, " is not a ", kCheckpointFormat, " file"));
  }
  if (!json.contains("version") || !json["version"].is_number_integer() ||
      json["version"].get<int64_t>() != kCheckpointVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, " has format version ",
        json.contains("version") ? JsonExcerpt(json["version"]) : "(none)",
        "; this shardtrain reads version ", kCheckpointVersion));
  }
  CheckpointMetadata metadata;
  try {
    metadata.training = json.at("training");
    if (!metadata.training.is_object()) {
      return absl::DataLossError(
          absl::StrCat(where, ": 'training' is not an object"));
    }
    for (const nlohmann::json& f : json.at("files")) {
      DataFile file{f.at("name").get<std::string>(), IntAt(f, "bytes"),
                    IntAt(f, "block_bytes"), Crc32sAt(f, "crc32")};
      const int64_t blocks = file.block_bytes > 0 &&
                                     file.block_bytes <= kMaxBlockBytes &&
                                     file.bytes >= 0
                                 ? file.bytes / file.block_bytes +
                                       (file.bytes % file.block_bytes != 0)
                                 : -1;
      if (file.bytes < 0 || blocks != static_cast<int64_t>(file.crc32.size()) ||
          file.name.empty() || file.name.find('/') != std::string::npos ||
          file.name == "..") {
        return absl::DataLossError(absl::StrCat(where, ": data file entry '",
                                                file.name, "' is malformed"));
      }
      metadata.files.push_back(std::move(file));
    }
    for (const nlohmann::json& t : json.at("tensors")) {
      TensorEntry entry;
      entry.name = t.at("name").get<std::string>();
      entry.dtype = t.at("dtype").get<std::string>();
      entry.shape = IntsAt(t, "shape");
      if (entry.dtype != "float32") {
        return absl::DataLossError(absl::StrCat(where, ": tensor ", entry.name,
                                                " has dtype ", entry.dtype,
                                                "; only float32 is read"));
      }
      int64_t elements = 1;
      for (int64_t d : entry.shape) {
        if (d < 0 || (d > 0 && elements > kMaxTensorElements / d)) {
          return absl::DataLossError(absl::StrCat(
              where, ": tensor ", entry.name, " has an impossible shape"));
        }
        elements *= d;
      }
      for (const nlohmann::json& c : t.at("chunks")) {
        TensorChunk chunk{c.at("file").get<std::string>(), IntAt(c, "offset"),
                          IntAt(c, "numel"), IntAt(c, "byte_offset")};
        const DataFile* file = metadata.FindFile(chunk.file);
        // Within the tensor and within the file, without overflowing.
        if (file == nullptr || chunk.numel < 0 || chunk.offset < 0 ||
            chunk.offset > elements || chunk.numel > elements - chunk.offset ||
            chunk.byte_offset < 0 || chunk.byte_offset > file->bytes ||
            chunk.numel > (file->bytes - chunk.byte_offset) / kFloatBytes) {
          return absl::DataLossError(absl::StrCat(
              where, ": tensor ", entry.name, " has a malformed chunk"));
        }
        entry.chunks.push_back(std::move(chunk));
      }
      std::sort(entry.chunks.begin(), entry.chunks.end(),
                [](const TensorChunk& a, const TensorChunk& b) {
                  return std::pair(a.offset, a.numel) <
                         std::pair(b.offset, b.numel);
                });
      if (absl::Status s = CheckCoverage(entry, where); !s.ok()) return s;
      metadata.tensors.push_back(std::move(entry));
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(where, ": ", e.what()));
  }
  std::sort(metadata.tensors.begin(), metadata.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) {
              return a.name < b.name;
            });
  for (size_t i = 1; i < metadata.tensors.size(); ++i) {
    if (metadata.tensors[i].name == metadata.tensors[i - 1].name) {
      return absl::DataLossError(absl::StrCat(
          where, ": tensor ", metadata.tensors[i].name, " is listed twice"));
    }
  }
  return metadata;
}

CheckpointReader::CheckpointReader(std::string dir, CheckpointMetadata metadata,
                                   std::map<std::string, InputFile> files)
    : dir_(std::move(dir)),
      metadata_(std::move(metadata)),
      files_(std::move(files)) {}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kCheckpointMetadataFile);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    const std::string old = OldFormatOf(dir);
    if (!old.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", dir, " is in ", old,
          " of shardtrain 0.x, which this version does not read; start from "
          "that run's exported model.bin with --init-from (the optimizer "
          "state and data position are not carried over)"));
    }
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", dir, " has no ", kCheckpointMetadataFile));
  }
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<CheckpointMetadata> metadata =
      ParseCheckpointMetadata(*text, path);
  if (!metadata.ok()) return metadata.status();
  // A data file of another length than written: torn or truncated.
  std::map<std::string, InputFile> files;
  for (const DataFile& file : metadata->files) {
    absl::StatusOr<InputFile> data =
        InputFile::Open(absl::StrCat(dir, "/", file.name));
    if (absl::IsNotFound(data.status())) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", dir, ": ", file.name, " is missing"));
    }
    if (!data.ok()) return data.status();
    if (data->size() != file.bytes) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", dir, ": ", file.name, " has ",
                       data->size(), " bytes but was written with ", file.bytes,
                       data->size() < file.bytes ? " (truncated)" : ""));
    }
    files.emplace(file.name, *std::move(data));
  }
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(dir, *std::move(metadata), std::move(files)));
}

absl::Status CheckpointReader::Read(const std::string& name, int64_t offset,
                                    int64_t numel, float* out) {
  const TensorEntry* tensor = metadata_.Find(name);
  if (tensor == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", dir_, " has no tensor ", name));
  }
  if (offset < 0 || numel < 0 || offset + numel > tensor->numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", dir_, ": elements [", offset, ", ", offset + numel,
        ") are outside ", name, " ", ShapeText(tensor->shape)));
  }
  const int64_t end = offset + numel;
  for (const TensorChunk& chunk : tensor->chunks) {
    const int64_t lo = std::max(offset, chunk.offset);
    const int64_t hi = std::min(end, chunk.offset + chunk.numel);
    if (lo >= hi) continue;
    const DataFile* file = metadata_.FindFile(chunk.file);
    if (absl::Status s = ReadChecked(
            *file, chunk.byte_offset + (lo - chunk.offset) * kFloatBytes,
            (hi - lo) * kFloatBytes,
            reinterpret_cast<char*>(out + (lo - offset)));
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(s.message(), " (reading ", name, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadChecked(const DataFile& file, int64_t offset,
                                           int64_t size, char* out) {
  if (size <= 0) return absl::OkStatus();
  if (offset < 0 || offset > file.bytes || size > file.bytes - offset) {
    return absl::DataLossError(absl::StrCat("checkpoint ", dir_, ": bytes ",
                                            offset, "+", size, " are outside ",
                                            file.name));
  }
  const InputFile& input = files_.at(file.name);
  auto pread_all = [&](char* dst, int64_t bytes, int64_t at) -> absl::Status {
    absl::Status s = input.ReadAt(at, dst, bytes);
    if (s.ok()) return s;
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir_, ": ", s.message()));
  };
  // Blocks touched for the first time are read whole and checked; the
  // requested bytes are copied out of them.
  std::vector<bool>& checked = checked_[file.name];
  checked.resize(file.crc32.size(), false);
  std::vector<char> block;
  const int64_t end = offset + size;
  for (int64_t b = offset / file.block_bytes; b * file.block_bytes < end; ++b) {
    const int64_t block_begin = b * file.block_bytes;
    const int64_t block_end =
        std::min(block_begin + file.block_bytes, file.bytes);
    const int64_t lo = std::max(offset, block_begin);
    const int64_t hi = std::min(end, block_end);
    if (checked[b]) {
      if (absl::Status s = pread_all(out + (lo - offset), hi - lo, lo);
          !s.ok()) {
        return s;
      }
      continue;
    }
    block.resize(static_cast<size_t>(block_end - block_begin));
    if (absl::Status s =
            pread_all(block.data(), block_end - block_begin, block_begin);
        !s.ok()) {
      return s;
    }
    const uint32_t crc = static_cast<uint32_t>(crc32(
        crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(block.data()),
        static_cast<uInt>(block.size())));
    if (crc != file.crc32[b]) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", dir_, ": ", file.name, " bytes ",
                       block_begin, "-", block_end,
                       " fail their CRC-32 check (the file changed after it "
                       "was written)"));
    }
    checked[b] = true;
    std::memcpy(out + (lo - offset), block.data() + (lo - block_begin),
                static_cast<size_t>(hi - lo));
  }
  return absl::OkStatus();
}

int64_t TrainingInt(const nlohmann::json& training, const std::string& key,
                    int64_t fallback) {
  if (!training.is_object() || !training.contains(key) ||
      !training[key].is_number_integer()) {
    return fallback;
  }
  return training[key].get<int64_t>();
}

std::string WrittenByMesh(const nlohmann::json& written_by) {
  const std::string mesh = TrainingString(written_by, "mesh", "");
  return mesh.empty() ? TrainingString(written_by, "strategy") : mesh;
}

std::string TrainingString(const nlohmann::json& training,
                           const std::string& key,
                           const std::string& fallback) {
  if (!training.is_object() || !training.contains(key) ||
      !training[key].is_string()) {
    return fallback;
  }
  return training[key].get<std::string>();
}

}  // namespace shardtrain
