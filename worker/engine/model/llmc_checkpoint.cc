#include "worker/engine/model/llmc_checkpoint.h"

#include <c10/util/Exception.h>
#include <torch/types.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "core/model/model_config.h"
#include "worker/engine/model/gpt2.h"

namespace shardtrain {
namespace {

// llm.c writes the header and the weights in host byte order, which is
// little-endian on every platform it (and we) run on.
using Header = LlmcHeader;

std::string ErrnoText() { return std::strerror(errno); }

// The model's weights in the file's order (llmc_layout.h): the members its
// modules read, which FSDP points at consolidated weights for an export.
std::vector<torch::Tensor> ParametersInFileOrder(Gpt2& model) {
  const std::map<std::string, torch::Tensor*> members = model->MemberTensors();
  std::vector<torch::Tensor> out;
  for (const std::string& name : LlmcParameterNames(model->config())) {
    const auto it = members.find(name);
    TORCH_CHECK(it != members.end(), "llm.c layout: the model has no ", name);
    out.push_back(*it->second);
  }
  return out;
}

absl::Status WriteFile(Gpt2& model, std::FILE* file, const std::string& path) {
  const Header header = MakeLlmcHeader(model->config());
  if (absl::Status s = WriteBytes(file, header.data(), kLlmcHeaderBytes, path);
      !s.ok()) {
    return s;
  }
  torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> params = ParametersInFileOrder(model);
  int64_t numel = 0;
  for (const torch::Tensor& p : params) numel += p.numel();
  if (numel != model->config().NumParameters()) {
    // E.g. a sharded model whose weights are not gathered.
    return absl::InternalError(absl::StrCat(
        "writing llm.c checkpoint ", path, ": the model holds ", numel,
        " of its ", model->config().NumParameters(), " weights"));
  }
  for (const torch::Tensor& p : params) {
    // A no-op for the usual CPU fp32 parameter.
    const torch::Tensor cpu = p.to(torch::kCPU, torch::kFloat).contiguous();
    if (absl::Status s = WriteBytes(file, cpu.data_ptr<float>(),
                                    cpu.numel() * sizeof(float), path);
        !s.ok()) {
      return s;
    }
  }
  if (std::fflush(file) != 0 || ::fsync(::fileno(file)) != 0) {
    return absl::InternalError(
        absl::StrCat("flushing llm.c checkpoint ", path, ": ", ErrnoText()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveLlmcCheckpoint(Gpt2& model, const std::string& path) {
  return WriteFileAtomically(
      path, [&](std::FILE* file, const std::string& temp) -> absl::Status {
        try {
          return WriteFile(model, file, temp);
        } catch (const c10::Error& e) {
          return absl::InternalError(absl::StrCat("writing llm.c checkpoint ",
                                                  path, ": ",
                                                  e.what_without_backtrace()));
        }
      });
}

absl::Status Gpt2Impl::ExportWeights(const std::string& path) {
  Gpt2 self(std::static_pointer_cast<Gpt2Impl>(shared_from_this()));
  return SaveLlmcCheckpoint(self, path);
}

absl::Status LoadLlmcCheckpoint(const std::string& path, Gpt2& model) {
  absl::StatusOr<InputFile> file = InputFile::Open(path);
  if (!file.ok()) {
    return absl::Status(
        file.status().code(),
        absl::StrCat("llm.c checkpoint ", file.status().message()));
  }
  absl::StatusOr<ModelConfig> config = ReadLlmcConfig(*file);
  if (!config.ok()) return config.status();
  if (!config->SameShape(model->config())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "llm.c checkpoint ", path, " holds model ", config->ToSpec(),
        ", which does not match model ", model->config().ToSpec()));
  }
  int64_t offset = kLlmcHeaderBytes;
  try {
    torch::NoGradGuard no_grad;
    for (torch::Tensor& p : ParametersInFileOrder(model)) {
      // Straight into the parameter when it is CPU fp32, else via a staging
      // tensor that copy_() moves to the parameter's device and dtype.
      const bool direct =
          p.is_cpu() && p.scalar_type() == torch::kFloat && p.is_contiguous();
      torch::Tensor dest =
          direct ? p : torch::empty(p.sizes(), torch::dtype(torch::kFloat));
      const int64_t bytes = dest.numel() * static_cast<int64_t>(sizeof(float));
      if (absl::Status s = file->ReadAt(offset, dest.data_ptr<float>(), bytes);
          !s.ok()) {
        return absl::DataLossError(
            absl::StrCat("llm.c checkpoint ", s.message(),
                         " (did the file change while loading?)"));
      }
      offset += bytes;
      if (!direct) p.copy_(dest);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("loading llm.c checkpoint ", path,
                                            ": ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::Status LoadWeights(const WeightReader& read, Gpt2& model) {
  try {
    torch::NoGradGuard no_grad;
    size_t index = 0;
    for (torch::Tensor& p : ParametersInFileOrder(model)) {
      const bool direct =
          p.is_cpu() && p.scalar_type() == torch::kFloat && p.is_contiguous();
      torch::Tensor dest =
          direct ? p : torch::empty(p.sizes(), torch::dtype(torch::kFloat));
      if (absl::Status s = read(index++, dest.data_ptr<float>()); !s.ok()) {
        return s;
      }
      if (!direct) p.copy_(dest);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("loading weights: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
