#include "worker/engine/train/tensor_file.h"

#include <torch/serialize.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"

namespace shardtrain {

absl::Status SaveTensorFile(const std::string& path,
                            const NamedTensors& tensors) {
  try {
    c10::Dict<std::string, at::Tensor> dict;
    for (const auto& [name, tensor] : tensors) {
      dict.insert(name, tensor.detach().to(torch::kCPU));
    }
    const std::vector<char> bytes = torch::pickle_save(dict);
    return WriteFileAtomically(path,
                               std::string_view(bytes.data(), bytes.size()));
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("saving ", path, ": ", e.what_without_backtrace()));
  }
}

absl::StatusOr<NamedTensors> LoadTensorFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
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
