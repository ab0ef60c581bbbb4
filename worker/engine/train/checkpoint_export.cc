#include "worker/engine/train/checkpoint_export.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "worker/engine/model/gpt2_config.h"
#include "worker/engine/model/llmc_layout.h"
#include "worker/engine/train/checkpoint_store.h"

namespace shardtrain {

absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
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

absl::Status ExportCheckpointAsLlmc(CheckpointReader& reader,
                                    const std::string& path) {
  const nlohmann::json& training = reader.metadata().training;
  if (!training.contains("model") || !training["model"].is_string()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", reader.dir(),
                                            " does not record its model"));
  }
  absl::StatusOr<Gpt2Config> config =
      ParseModelSpec(training["model"].get<std::string>());
  if (!config.ok()) return config.status();
  // Every tensor is checked before anything is written.
  const std::vector<std::string> names = LlmcParameterNames(*config);
  const std::vector<std::vector<int64_t>> shapes = LlmcParameterShapes(*config);
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
  const LlmcHeader header = MakeLlmcHeader(*config);
  return WriteFileAtomically(
      path, [&](std::FILE* file, const std::string& temp) -> absl::Status {
        auto write = [&](const void* data, size_t bytes) -> absl::Status {
          if (std::fwrite(data, 1, bytes, file) != bytes) {
            return absl::ResourceExhaustedError(absl::StrCat(
                "cannot write ", temp, ": ", std::strerror(errno)));
          }
          return absl::OkStatus();
        };
        if (absl::Status s = write(header.data(), kLlmcHeaderBytes); !s.ok()) {
          return s;
        }
        std::vector<float> buffer;
        for (size_t i = 0; i < names.size(); ++i) {
          buffer.resize(static_cast<size_t>(sizes[i]));
          if (absl::Status s =
                  reader.Read("model." + names[i], 0, sizes[i], buffer.data());
              !s.ok()) {
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

}  // namespace shardtrain
