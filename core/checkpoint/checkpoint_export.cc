#include "core/checkpoint/checkpoint_export.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "core/checkpoint/checkpoint_store.h"
#include "core/model/hf_gpt2.h"
#include "core/model/hf_llama.h"
#include "core/model/hf_settings.h"
#include "core/model/llmc_layout.h"
#include "core/model/model_config.h"

namespace shardtrain {

absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // "run/checkpoints/" (a shell's completion) and a bare "checkpoints" name
  // the same folder as "run/checkpoints": compare whole, normal paths.
  fs::path normal = fs::absolute(given, ec).lexically_normal();
  if (!normal.has_filename() && normal.has_parent_path()) {
    normal = normal.parent_path();
  }
  const std::string path = ec ? given : normal.string();
  if (fs::exists(fs::path(path) / kCheckpointMetadataFile, ec)) return path;
  // A run's --out, or its checkpoints/ folder.
  std::string out;
  if (fs::is_directory(fs::path(path) / "checkpoints", ec)) {
    out = path;
  } else if (fs::exists(fs::path(path) / "latest", ec)) {
    out = fs::path(path).parent_path().string();
  }
  if (!out.empty()) {
    const std::vector<std::string> candidates =
        CheckpointStore(out).Candidates();
    if (!candidates.empty()) return candidates.front();
    return absl::NotFoundError(
        absl::StrCat(path, " holds no complete checkpoint"));
  }
  if (!fs::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such directory"));
  }
  // Not ours: let the reader say what it is (an old format, or nothing).
  return path;
}

namespace {

// The checkpoint's model tensors, each checked before anything is read.
absl::StatusOr<ModelWeights> CheckpointWeights(CheckpointReader& reader) {
  const nlohmann::json& training = reader.metadata().training;
  if (!training.contains("model") || !training["model"].is_string()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", reader.dir(),
                                            " does not record its model"));
  }
  absl::StatusOr<ModelConfig> config =
      ParseModelSpec(training["model"].get<std::string>());
  if (!config.ok()) return config.status();
  const std::vector<std::string> names = ModelParameterNames(*config);
  const std::vector<std::vector<int64_t>> shapes =
      ModelParameterShapes(*config);
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < names.size(); ++i) {
    const TensorEntry* tensor = reader.metadata().Find("model." + names[i]);
    if (tensor == nullptr) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", reader.dir(), " has no tensor model.", names[i]));
    }
    if (tensor->shape != shapes[i]) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", reader.dir(), " holds model.", names[i],
                       " as [", absl::StrJoin(tensor->shape, ", "), "], not [",
                       absl::StrJoin(shapes[i], ", "), "] as model ",
                       config->ToSpec(), " has it"));
    }
    sizes.push_back(tensor->numel());
  }
  ModelWeights weights;
  weights.config = *config;
  weights.names = names;
  if (training.contains("data") && training["data"].is_string()) {
    weights.data = training["data"].get<std::string>();
  }
  weights.description = absl::StrCat("checkpoint ", reader.dir(), " (step ",
                                     training.value("step", int64_t{0}), ")");
  weights.read = [&reader, names, sizes](size_t index, float* out) {
    return reader.Read("model." + names[index], 0, sizes[index], out);
  };
  return weights;
}

// An llm.c model file's tensors, at their offsets.
absl::StatusOr<ModelWeights> LlmcWeights(const std::string& path) {
  absl::StatusOr<InputFile> opened = InputFile::Open(path);
  if (!opened.ok()) {
    return absl::Status(
        opened.status().code(),
        absl::StrCat("llm.c model ", opened.status().message()));
  }
  auto file = std::make_shared<InputFile>(*std::move(opened));
  absl::StatusOr<ModelConfig> config = ReadLlmcConfig(*file);
  if (!config.ok()) return config.status();
  std::vector<int64_t> offsets, sizes;
  int64_t offset = kLlmcHeaderBytes;
  for (const std::vector<int64_t>& shape : LlmcParameterShapes(*config)) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    offsets.push_back(offset);
    sizes.push_back(numel);
    offset += 4 * numel;
  }
  ModelWeights weights;
  weights.config = *config;
  weights.names = LlmcParameterNames(*config);
  weights.description = absl::StrCat("llm.c model ", path);
  weights.source = file;
  weights.read = [file = file.get(), path, offsets, sizes](size_t index,
                                                           float* out) {
    absl::Status s = file->ReadAt(offsets[index], out, sizes[index] * 4);
    if (s.ok()) return s;
    return absl::DataLossError(
        absl::StrCat("llm.c model ", path, ": cannot read tensor ", index, ": ",
                     s.message(), " (the file changed?)"));
  };
  return weights;
}

// A Hugging Face directory, read by its model_type's reader.
template <typename Reader>
absl::StatusOr<ModelWeights> HfWeightsOf(const std::string& path) {
  absl::StatusOr<std::unique_ptr<Reader>> opened = Reader::Open(path);
  if (!opened.ok()) return opened.status();
  std::shared_ptr<Reader> reader = std::move(*opened);
  ModelWeights weights;
  weights.config = reader->config();
  weights.names = ModelParameterNames(weights.config);
  weights.description = absl::StrCat("Hugging Face model ", path);
  weights.read = [r = reader.get()](size_t index, float* out) {
    return r->Read(index, out);
  };
  weights.source = reader;
  return weights;
}

absl::StatusOr<ModelWeights> HfModelWeights(const std::string& path) {
  const std::string config_path =
      (std::filesystem::path(path) / kHfConfigFile).string();
  absl::StatusOr<std::string> text =
      ReadInputFile(config_path, int64_t{1} << 20, "a model config");
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("Hugging Face model ", path, ": ",
                                     text.status().message()));
  }
  if (absl::Status s =
          CheckJsonNesting(*text, kMaxHfJsonNesting, kHfConfigFile);
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hugging Face model ", path, ": ", s.message()));
  }
  const std::string type = HfModelType(*text);
  if (type == "llama" || type == "qwen2") {
    return HfWeightsOf<HfLlamaReader>(path);
  }
  if (type == "gpt2") return HfWeightsOf<HfGpt2Reader>(path);
  return absl::InvalidArgumentError(
      absl::StrCat("Hugging Face model ", path, ": ", kHfConfigFile,
                   ": model_type is \"", type,
                   "\"; models load as \"gpt2\" (GPT2LMHeadModel), \"llama\" "
                   "(LlamaForCausalLM) or \"qwen2\" (Qwen2ForCausalLM)"));
}

}  // namespace

absl::StatusOr<ModelWeights> OpenModelWeights(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return LlmcWeights(path);
  if (!fs::exists(path, ec)) {
    return absl::NotFoundError(
        absl::StrCat(path, ": no such file or directory"));
  }
  if (!fs::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        " is neither a file nor a directory (a model is an llm.c file, "
        "a Hugging Face directory, a checkpoint or a finished run's "
        "output)"));
  }
  // A checkpoint, or a run's output (or its checkpoints/ folder) that holds
  // checkpoints: the latest. Else a Hugging Face directory (which a
  // finished Llama run's output is: config.json beside its
  // model.safetensors), or a finished GPT-2 run's model.bin.
  const fs::path dir_path(path);
  const bool checkpoints = fs::exists(dir_path / kCheckpointMetadataFile, ec) ||
                           fs::is_directory(dir_path / "checkpoints", ec) ||
                           fs::exists(dir_path / "latest", ec);
  if (!checkpoints) {
    if (IsHfModelDir(path)) return HfModelWeights(path);
    const fs::path model_bin = dir_path / "model.bin";
    if (fs::is_regular_file(model_bin, ec)) {
      return LlmcWeights(model_bin.string());
    }
  }
  absl::StatusOr<std::string> dir = ResolveCheckpointDir(path);
  if (!dir.ok()) return dir.status();
  absl::StatusOr<std::unique_ptr<CheckpointReader>> opened =
      CheckpointReader::Open(*dir);
  if (!opened.ok()) {
    if (!fs::exists(fs::path(*dir) / kCheckpointMetadataFile, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path,
          " holds no model: neither config.json (a Hugging Face model, "
          "or a finished Llama run's), a finished GPT-2 run's model.bin "
          "nor a checkpoint"));
    }
    return opened.status();
  }
  std::shared_ptr<CheckpointReader> reader = std::move(*opened);
  absl::StatusOr<ModelWeights> weights = CheckpointWeights(*reader);
  if (!weights.ok()) return weights.status();
  weights->source = reader;
  return weights;
}

std::vector<std::string> ModelParameterNames(const ModelConfig& config) {
  return config.is_llama() ? LlamaParameterNames(config)
                           : LlmcParameterNames(config);
}

std::vector<std::vector<int64_t>> ModelParameterShapes(
    const ModelConfig& config) {
  return config.is_llama() ? LlamaParameterShapes(config)
                           : LlmcParameterShapes(config);
}

absl::Status WriteLlmcModel(const ModelWeights& weights,
                            const std::string& path) {
  if (weights.config.is_llama()) {
    return absl::InvalidArgumentError(
        absl::StrCat(weights.description, " holds a Llama-family model (",
                     weights.config.ToSpec(),
                     "); llm.c's format holds GPT-2 only: export it --to hf"));
  }
  const std::vector<std::vector<int64_t>> shapes =
      LlmcParameterShapes(weights.config);
  const LlmcHeader header = MakeLlmcHeader(weights.config);
  return WriteFileAtomically(
      path, [&](std::FILE* file, const std::string& temp) -> absl::Status {
        auto write = [&](const void* data, size_t bytes) {
          return WriteBytes(file, data, bytes, temp);
        };
        if (absl::Status s = write(header.data(), kLlmcHeaderBytes); !s.ok()) {
          return s;
        }
        std::vector<float> buffer;
        for (size_t i = 0; i < shapes.size(); ++i) {
          int64_t numel = 1;
          for (int64_t d : shapes[i]) numel *= d;
          buffer.resize(static_cast<size_t>(numel));
          if (absl::Status s = weights.read(i, buffer.data()); !s.ok()) {
            return s;
          }
          if (absl::Status s = write(buffer.data(), buffer.size() * 4);
              !s.ok()) {
            return s;
          }
        }
        return absl::OkStatus();
      });
}

absl::Status ExportCheckpointAsLlmc(CheckpointReader& reader,
                                    const std::string& path) {
  absl::StatusOr<ModelWeights> weights = CheckpointWeights(reader);
  if (!weights.ok()) return weights.status();
  return WriteLlmcModel(*weights, path);
}

}  // namespace shardtrain
