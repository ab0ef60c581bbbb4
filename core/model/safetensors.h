// The safetensors file format (huggingface/safetensors, docs "The format"),
// read and written by us, without LibTorch:
//
//   8 bytes   N, the header's length, little-endian uint64
//   N bytes   a JSON object, UTF-8, starting with '{', padded with spaces:
//             {"NAME": {"dtype": "F32", "shape": [768, 2304],
//                       "data_offsets": [BEGIN, END]}, ...,
//              "__metadata__": {"key": "value", ...}}
//   the rest  the tensors' bytes, row-major, little-endian; offsets are
//             relative to the start of this buffer
//
// A file is refused unless it is exactly that: the header fits in the file,
// every entry has a known dtype, a non-negative shape and offsets whose span
// is the shape's bytes, no name appears twice, and the tensors tile the data
// buffer with no hole and no overlap (the format's rule against polyglot
// files). Metadata values must be strings.
#ifndef SHARDTRAIN_CORE_MODEL_SAFETENSORS_H_
#define SHARDTRAIN_CORE_MODEL_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/input_file.h"

namespace shardtrain {

// The largest header a reader accepts. The format's reference reader allows
// 100 MB; GPT-2 XL's header is under 100 KB, and 16 MiB bounds what a
// hostile header costs the JSON parser.
inline constexpr int64_t kSafetensorsMaxHeaderBytes = 16 << 20;
// The most dimensions a tensor may have.
inline constexpr size_t kSafetensorsMaxDims = 16;

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16", ... as the format spells them
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets in the data buffer, [begin, end)
  int64_t end = 0;

  int64_t numel() const;
};

// An open, validated file. Tensors are read on demand.
class SafetensorsFile {
 public:
  // Reads and checks the header and the file's size against it; errors name
  // the file and what is wrong with it.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // In the header's order.
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }
  // nullptr when there is no tensor `name`.
  const SafetensorsEntry* Find(std::string_view name) const;

  // Reads `entry` into `out` (entry.numel() floats) as float32: F32 as is,
  // F16 and BF16 widened (exactly). Other dtypes are refused, naming them.
  absl::Status ReadAsFloat(const SafetensorsEntry& entry, float* out) const;

 private:
  std::string path_;
  std::shared_ptr<const InputFile> input_;
  int64_t data_start_ = 0;  // 8 + N
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Parses a header's JSON text (the N bytes) for a data buffer of
// `data_bytes`: the checks Open() makes, on bytes in memory.
absl::Status ParseSafetensorsHeader(
    std::string_view header, int64_t data_bytes,
    std::vector<SafetensorsEntry>* tensors,
    std::map<std::string, std::string>* metadata);

// One float32 tensor to write: `fill` writes its numel() floats into the
// buffer it is given.
struct SafetensorsTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::function<absl::Status(float* out)> fill;
};

// Writes `tensors` (float32, in this order) and `metadata` to `path`
// atomically; the header is padded with spaces so the data starts 8-byte
// aligned, as the reference writer does.
absl::Status WriteSafetensors(
    const std::string& path, const std::vector<SafetensorsTensor>& tensors,
    const std::map<std::string, std::string>& metadata);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_MODEL_SAFETENSORS_H_
