#include "core/model/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "common/json_excerpt.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

// Bytes per element of each dtype the format names.
const std::map<std::string, int64_t>& DtypeSizes() {
  static const auto* sizes = new std::map<std::string, int64_t>{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  return *sizes;
}

std::string DtypeList() {
  std::vector<std::string> names;
  for (const auto& [name, size] : DtypeSizes()) names.push_back(name);
  return absl::StrJoin(names, ", ");
}

// A JSON number that is a non-negative integer below 2^62.
bool ReadOffset(const nlohmann::ordered_json& value, int64_t* out) {
  if (!value.is_number_unsigned()) return false;
  const uint64_t v = value.get<uint64_t>();
  if (v >= (uint64_t{1} << 62)) return false;
  *out = static_cast<int64_t>(v);
  return true;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {  // inf, nan
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // zero
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ff;
    bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  // A zero anywhere first: the other dimensions may be huge (the header's
  // check bounds the product of a non-empty tensor by the file's size).
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

using OrderedJson = nlohmann::ordered_json;

// The header as JSON: an object, no key twice at any level (the JSON parser
// keeps the last; the format forbids them), no deeper than the format nests.
absl::StatusOr<OrderedJson> ParseHeaderJson(std::string_view header) {
  if (header.empty() || header.front() != '{') {
    return absl::InvalidArgumentError(
        "the header does not start with '{'; not a safetensors file");
  }
  if (JsonNestingDepth(header) > 3) {
    return absl::InvalidArgumentError(
        "the header nests deeper than a safetensors header does");
  }
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  using Event = OrderedJson::parse_event_t;
  const OrderedJson::parser_callback_t on_event = [&](int, Event event,
                                                      OrderedJson& parsed) {
    if (event == Event::object_start) {
      open_objects.emplace_back();
    } else if (event == Event::object_end && !open_objects.empty()) {
      open_objects.pop_back();
    } else if (event == Event::key && !open_objects.empty() &&
               parsed.is_string()) {
      const std::string key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second && duplicate.empty()) {
        duplicate = key;
      }
    }
    return true;
  };
  OrderedJson json = OrderedJson::parse(header.begin(), header.end(), on_event,
                                        /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError("the header is not a JSON object");
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the header has the key '", duplicate, "' twice"));
  }
  return json;
}

// __metadata__: null, or an object of strings.
absl::Status ReadMetadata(const OrderedJson& value,
                          std::map<std::string, std::string>* metadata) {
  if (value.is_null()) return absl::OkStatus();
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        "__metadata__ is not an object of strings");
  }
  for (const auto& [key, text] : value.items()) {
    if (!text.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("__metadata__.", key,
                       " is not a string (the format allows "
                       "string values only)"));
    }
    (*metadata)[key] = text.get<std::string>();
  }
  return absl::OkStatus();
}

// Reads `shape` into entry->shape and returns the element count, bounded by
// the buffer's size as it is multiplied (a hostile shape cannot overflow
// it): -1 when it exceeds the buffer.
absl::StatusOr<int64_t> ReadShape(const OrderedJson& shape, int64_t data_bytes,
                                  const std::string& where,
                                  SafetensorsEntry* entry) {
  if (!shape.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shape is not a list"));
  }
  int64_t numel = 1;
  bool zero = false, too_big = false;
  for (const OrderedJson& d : shape) {
    int64_t dim;
    if (!ReadOffset(d, &dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape ", JsonExcerpt(shape),
                       " holds something other than a non-negative integer"));
    }
    if (entry->shape.size() == kSafetensorsMaxDims) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": more than ", kSafetensorsMaxDims, " dimensions"));
    }
    entry->shape.push_back(dim);
    if (dim == 0) {
      zero = true;
    } else if (!too_big) {
      if (numel > data_bytes / dim) {
        too_big = true;
      } else {
        numel *= dim;
      }
    }
  }
  if (zero) return 0;
  return too_big ? -1 : numel;
}

// One tensor's entry: exactly dtype, shape and data_offsets, the offsets
// inside the buffer and spanning what the shape and dtype need.
absl::StatusOr<SafetensorsEntry> ReadEntry(const std::string& name,
                                           const OrderedJson& value,
                                           int64_t data_bytes) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  if (!value.is_object() || !value.contains("dtype") ||
      !value.contains("shape") || !value.contains("data_offsets") ||
      value.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": expected exactly dtype, shape and data_offsets"));
  }
  SafetensorsEntry entry;
  entry.name = name;
  const OrderedJson& dtype = value["dtype"];
  if (!dtype.is_string() || DtypeSizes().count(dtype.get<std::string>()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype ", JsonExcerpt(dtype),
                     " is not one of the format's: ", DtypeList()));
  }
  entry.dtype = dtype.get<std::string>();
  const OrderedJson& shape = value["shape"];
  absl::StatusOr<int64_t> numel = ReadShape(shape, data_bytes, where, &entry);
  if (!numel.ok()) return numel.status();
  const OrderedJson& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 ||
      !ReadOffset(offsets[0], &entry.begin) ||
      !ReadOffset(offsets[1], &entry.end) || entry.begin > entry.end) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets ", JsonExcerpt(offsets),
                     " is not [begin, end] with 0 <= begin <= end"));
  }
  if (entry.end > data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": data_offsets end at byte ", entry.end,
        " of a data buffer of ", data_bytes, " bytes (truncated file?)"));
  }
  const int64_t bytes = *numel < 0 ? -1 : *numel * DtypeSizes().at(entry.dtype);
  if (bytes != entry.end - entry.begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": shape ", JsonExcerpt(shape), " of ", entry.dtype, " needs ",
        bytes < 0 ? std::string("more than the file's") : std::to_string(bytes),
        " bytes but data_offsets span ", entry.end - entry.begin));
  }
  return entry;
}

// The tensors tile the data buffer: no hole, no overlap, nothing after.
absl::Status CheckTiling(const std::vector<SafetensorsEntry>& tensors,
                         int64_t data_bytes) {
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : tensors) by_offset.push_back(&e);
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
                     return std::make_pair(a->begin, a->end) <
                            std::make_pair(b->begin, b->end);
                   });
  int64_t covered = 0;
  for (const SafetensorsEntry* e : by_offset) {
    if (e->begin != covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", e->name, "' starts at byte ", e->begin, " of the data, ",
          e->begin > covered
              ? "leaving a hole after byte "
              : "overlapping the tensor before it, which ends at ",
          covered));
    }
    covered = e->end;
  }
  if (covered != data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the tensors cover ", covered, " bytes of a data buffer of ",
        data_bytes, "; the rest is not part of any tensor"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseSafetensorsHeader(
    std::string_view header, int64_t data_bytes,
    std::vector<SafetensorsEntry>* tensors,
    std::map<std::string, std::string>* metadata) {
  tensors->clear();
  metadata->clear();
  absl::StatusOr<OrderedJson> json = ParseHeaderJson(header);
  if (!json.ok()) return json.status();
  for (const auto& [name, value] : json->items()) {
    if (name == "__metadata__") {
      if (absl::Status s = ReadMetadata(value, metadata); !s.ok()) return s;
      continue;
    }
    absl::StatusOr<SafetensorsEntry> entry = ReadEntry(name, value, data_bytes);
    if (!entry.ok()) return entry.status();
    tensors->push_back(*std::move(entry));
  }
  return CheckTiling(*tensors, data_bytes);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  const std::string label = absl::StrCat("safetensors file ", path);
  absl::StatusOr<InputFile> opened = InputFile::Open(path);
  if (!opened.ok()) {
    return absl::Status(
        opened.status().code(),
        absl::StrCat("safetensors file ", opened.status().message()));
  }
  auto input = std::make_shared<const InputFile>(*std::move(opened));
  const auto size = static_cast<uint64_t>(input->size());
  if (size < 8) {
    return absl::DataLossError(absl::StrCat(label, ": truncated: ", size,
                                            " bytes, fewer than the 8 of the "
                                            "header's length"));
  }
  unsigned char length_bytes[8];
  if (absl::Status s = input->ReadAt(0, length_bytes, 8); !s.ok()) {
    return absl::DataLossError(absl::StrCat(label, ": ", s.message()));
  }
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i)
    header_length = header_length << 8 | length_bytes[i];
  if (header_length > static_cast<uint64_t>(kSafetensorsMaxHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": a header of ", header_length, " bytes (at most ",
        kSafetensorsMaxHeaderBytes, " are accepted); not a safetensors file?"));
  }
  if (header_length > size - 8) {
    return absl::DataLossError(absl::StrCat(
        label, ": truncated: the header says it is ", header_length,
        " bytes, the file has ", size - 8, " after the length"));
  }
  std::string header(header_length, '\0');
  if (absl::Status s =
          input->ReadAt(8, header.data(), static_cast<int64_t>(header_length));
      !s.ok()) {
    return absl::DataLossError(absl::StrCat(label, ": ", s.message()));
  }
  SafetensorsFile file;
  file.path_ = path;
  file.input_ = input;
  file.data_start_ = 8 + static_cast<int64_t>(header_length);
  if (absl::Status s = ParseSafetensorsHeader(
          header, static_cast<int64_t>(size) - file.data_start_, &file.tensors_,
          &file.metadata_);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": ", s.message()));
  }
  return file;
}

const SafetensorsEntry* SafetensorsFile::Find(std::string_view name) const {
  for (const SafetensorsEntry& e : tensors_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::Status SafetensorsFile::ReadAsFloat(const SafetensorsEntry& entry,
                                          float* out) const {
  const std::string label =
      absl::StrCat("safetensors file ", path_, ": tensor '", entry.name, "'");
  if (entry.dtype != "F32" && entry.dtype != "F16" && entry.dtype != "BF16") {
    return absl::InvalidArgumentError(
        absl::StrCat(label, " is ", entry.dtype,
                     "; only F32, F16 and BF16 weights are read"));
  }
  const int64_t n = entry.numel();
  const int64_t at = data_start_ + entry.begin;
  absl::Status read;
  if (entry.dtype == "F32") {
    read = input_->ReadAt(at, out, n * 4);
  } else {
    std::vector<uint16_t> half(static_cast<size_t>(n));
    read = input_->ReadAt(at, half.data(), n * 2);
    const bool bf16 = entry.dtype == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      out[i] = bf16 ? Bf16ToFloat(half[i]) : HalfToFloat(half[i]);
    }
  }
  if (!read.ok()) {
    return absl::DataLossError(
        absl::StrCat(label, ": ", read.message(), " (the file changed?)"));
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensors(
    const std::string& path, const std::vector<SafetensorsTensor>& tensors,
    const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    header[t.name] = {{"dtype", "F32"},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + 4 * numel}}};
    offset += 4 * numel;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >>
                                           (8 * i));
  }
  return WriteFileAtomically(
      path, [&](std::FILE* file, const std::string& temp) -> absl::Status {
        auto write = [&](const void* data, size_t bytes) {
          return WriteBytes(file, data, bytes, temp);
        };
        if (absl::Status s = write(length, 8); !s.ok()) return s;
        if (absl::Status s = write(text.data(), text.size()); !s.ok()) return s;
        std::vector<float> buffer;
        for (const SafetensorsTensor& t : tensors) {
          int64_t numel = 1;
          for (int64_t d : t.shape) numel *= d;
          buffer.assign(static_cast<size_t>(numel), 0.0f);
          if (absl::Status s = t.fill(buffer.data()); !s.ok()) return s;
          if (absl::Status s = write(buffer.data(), buffer.size() * 4);
              !s.ok()) {
            return s;
          }
        }
        return absl::OkStatus();
      });
}

}  // namespace shardtrain
