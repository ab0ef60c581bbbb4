#include "core/model/llmc_layout.h"

#include "absl/strings/str_cat.h"
#include "common/input_file.h"

namespace shardtrain {
namespace {

int64_t ExpectedFileSize(const ModelConfig& config) {
  return kLlmcHeaderBytes +
         static_cast<int64_t>(sizeof(float)) * config.NumParameters();
}

}  // namespace

absl::StatusOr<ModelConfig> ReadLlmcConfig(const std::string& path) {
  absl::StatusOr<InputFile> file = InputFile::Open(path);
  if (!file.ok()) {
    return absl::Status(
        file.status().code(),
        absl::StrCat("llm.c checkpoint ", file.status().message()));
  }
  return ReadLlmcConfig(*file);
}

absl::StatusOr<ModelConfig> ReadLlmcConfig(const InputFile& file) {
  const std::string& path = file.path();
  const int64_t size = file.size();
  if (size < kLlmcHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("llm.c checkpoint ", path, ": truncated: ", size,
                     " bytes, the header alone is ", kLlmcHeaderBytes));
  }
  LlmcHeader header{};
  if (absl::Status s = file.ReadAt(0, header.data(), kLlmcHeaderBytes);
      !s.ok()) {
    return absl::DataLossError(absl::StrCat("llm.c checkpoint ", s.message()));
  }
  if (header[0] != kLlmcModelMagic) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llm.c checkpoint ", path, ": bad magic number ", header[0],
        " (expected ", kLlmcModelMagic, "); not an llm.c GPT-2 model file"));
  }
  if (header[1] == kLlmcModelVersionBf16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llm.c checkpoint ", path, ": version ", kLlmcModelVersionBf16,
        " (bf16 weights) is not supported; only version ",
        kLlmcModelVersionFp32,
        " (fp32) is, e.g. gpt2_124M.bin rather than gpt2_124M_bf16.bin"));
  }
  if (header[1] != kLlmcModelVersionFp32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llm.c checkpoint ", path, ": unsupported version ", header[1],
        "; only version ", kLlmcModelVersionFp32, " (fp32) is supported"));
  }
  ModelConfig config;
  config.block_size = header[2];
  config.vocab_size = header[3];
  config.n_layer = header[4];
  config.n_head = header[5];
  config.n_embd = header[6];
  config.padded_vocab_size = header[7];
  config.name = "custom";
  for (const std::string& name : ModelConfig::PresetNames()) {
    if (ModelConfig::FromPreset(name)->SameShape(config)) config.name = name;
  }
  if (absl::Status s = config.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llm.c checkpoint ", path, ": invalid header: ", s.message()));
  }
  const int64_t expected = ExpectedFileSize(config);
  if (size != expected) {
    return absl::DataLossError(absl::StrCat(
        "llm.c checkpoint ", path, ": ",
        size < expected ? "truncated: " : "too long: ", size,
        " bytes, but model ", config.ToSpec(), " (", config.NumParameters(),
        " fp32 parameters) needs ", expected));
  }
  return config;
}

LlmcHeader MakeLlmcHeader(const ModelConfig& c) {
  LlmcHeader header{};
  header[0] = kLlmcModelMagic;
  header[1] = kLlmcModelVersionFp32;
  header[2] = static_cast<int32_t>(c.block_size);
  header[3] = static_cast<int32_t>(c.vocab_size);
  header[4] = static_cast<int32_t>(c.n_layer);
  header[5] = static_cast<int32_t>(c.n_head);
  header[6] = static_cast<int32_t>(c.n_embd);
  header[7] = static_cast<int32_t>(c.padded_vocab_size);
  return header;
}

std::vector<std::string> LlmcParameterNames(const ModelConfig& config) {
  std::vector<std::string> names = {"wte.weight", "wpe.weight"};
  for (const char* member :
       {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
        "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
        "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
        "mlp.c_proj.bias"}) {
    for (int64_t layer = 0; layer < config.n_layer; ++layer) {
      names.push_back(absl::StrCat("h.", layer, ".", member));
    }
  }
  names.push_back("ln_f.weight");
  names.push_back("ln_f.bias");
  return names;
}

std::vector<std::vector<int64_t>> LlmcParameterShapes(
    const ModelConfig& config) {
  const int64_t c = config.n_embd;
  std::vector<std::vector<int64_t>> shapes = {{config.padded_vocab_size, c},
                                              {config.block_size, c}};
  const std::vector<std::vector<int64_t>> per_layer = {
      {c}, {c}, {3 * c, c}, {3 * c}, {c, c},     {c},
      {c}, {c}, {4 * c, c}, {4 * c}, {c, 4 * c}, {c}};
  for (const std::vector<int64_t>& shape : per_layer) {
    for (int64_t layer = 0; layer < config.n_layer; ++layer) {
      shapes.push_back(shape);
    }
  }
  shapes.push_back({c});
  shapes.push_back({c});
  return shapes;
}

}  // namespace shardtrain
