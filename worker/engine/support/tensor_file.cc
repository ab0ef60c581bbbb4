#include "worker/engine/support/tensor_file.h"

#include <torch/serialize.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/input_file.h"

namespace shardtrain {

namespace {

// Tensor files hold one rank's small state (its optimizer step, a strategy's
// extras); anything larger is not one of ours.
constexpr int64_t kMaxTensorFileBytes = int64_t{4} << 30;

// The sidecar "<crc32 hex> <size>\n" beside each tensor file: a checkpoint
// damaged in place (same size, bytes overwritten) is refused by name rather
// than resumed into a diverging run.
std::string ChecksumPath(const std::string& path) { return path + ".crc32"; }

std::string ChecksumLine(std::string_view bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  size_t done = 0;
  while (done < bytes.size()) {
    const size_t chunk = std::min<size_t>(bytes.size() - done, 1u << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + done),
                static_cast<uInt>(chunk));
    done += chunk;
  }
  return absl::StrFormat("%08x %d\n", static_cast<uint32_t>(crc), bytes.size());
}

}  // namespace

absl::Status SaveTensorFile(const std::string& path,
                            const NamedTensors& tensors) {
  try {
    c10::Dict<std::string, at::Tensor> dict;
    for (const auto& [name, tensor] : tensors) {
      dict.insert(name, tensor.detach().to(torch::kCPU));
    }
    const std::vector<char> bytes = torch::pickle_save(dict);
    const std::string_view view(bytes.data(), bytes.size());
    // The checksum first: a crash between the two leaves a mismatch, which
    // reads as damaged, never an unchecked file that looks whole.
    if (absl::Status s =
            WriteFileAtomically(ChecksumPath(path), ChecksumLine(view));
        !s.ok()) {
      return s;
    }
    return WriteFileAtomically(path, view);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("saving ", path, ": ", e.what_without_backtrace()));
  }
}

absl::StatusOr<NamedTensors> LoadTensorFile(const std::string& path) {
  absl::StatusOr<InputFile> file = InputFile::Open(path);
  if (!file.ok()) return file.status();
  if (file->size() > kMaxTensorFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", file->size(), " bytes; a tensor file may have at most ",
        kMaxTensorFileBytes));
  }
  std::vector<char> bytes(static_cast<size_t>(file->size()));
  if (absl::Status s = file->ReadAt(0, bytes.data(), file->size()); !s.ok()) {
    return s;
  }
  // Files written before checksums existed have no sidecar and are read
  // as they are.
  absl::StatusOr<std::string> sidecar =
      ReadInputFile(ChecksumPath(path), 4096, "checksum");
  if (!sidecar.ok() && !absl::IsNotFound(sidecar.status())) {
    return sidecar.status();
  }
  if (sidecar.ok()) {
    const std::string& expected = *sidecar;
    if (expected !=
        ChecksumLine(std::string_view(bytes.data(), bytes.size()))) {
      return absl::DataLossError(absl::StrCat(
          path, " does not match its checksum (", ChecksumPath(path),
          "): the file was damaged or changed after it was written"));
    }
  }
  try {
    const c10::IValue value = torch::pickle_load(bytes);
    if (!value.isGenericDict()) {
      return absl::DataLossError(
          absl::StrCat(path, " does not hold a dict of tensors"));
    }
    NamedTensors tensors;
    for (const auto& entry : value.toGenericDict()) {
      tensors.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
    }
    return tensors;
  } catch (const c10::Error& e) {
    return absl::DataLossError(absl::StrCat(
        path, " is not a readable tensor file: ", e.what_without_backtrace()));
  }
}

}  // namespace shardtrain
