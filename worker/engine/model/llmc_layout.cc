#include "worker/engine/model/llmc_layout.h"

#include "absl/strings/str_cat.h"

namespace shardtrain {

LlmcHeader MakeLlmcHeader(const Gpt2Config& c) {
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

std::vector<std::string> LlmcParameterNames(const Gpt2Config& config) {
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
    const Gpt2Config& config) {
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
