// Any bytes as a safetensors file (a Hugging Face model's weights) and as its
// config.json: SafetensorsFile::Open() refuses with a message or returns
// tensors that tile the file's data exactly, each of which then reads;
// ParseHfModelConfig() and ParseHfLlamaConfig() refuse or return a config
// that validates.
#include <string_view>

#include "core/model/hf_gpt2.h"
#include "core/model/hf_llama.h"
#include "core/model/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) { return 0; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<shardtrain::ModelConfig> config =
      shardtrain::ParseHfModelConfig(text);
  if (config.ok()) {
    FUZZ_CHECK(config->Validate().ok(), "a parsed config is one we build");
  } else {
    FUZZ_CHECK(!config.status().message().empty(), "errors say why");
  }
  absl::StatusOr<shardtrain::ModelConfig> llama =
      shardtrain::ParseHfLlamaConfig(text);
  if (llama.ok()) {
    FUZZ_CHECK(llama->Validate().ok() && llama->is_llama(),
               "a parsed Llama config is one we build");
  } else {
    FUZZ_CHECK(!llama.status().message().empty(), "errors say why");
  }

  shardtrain::fuzz::MemFile file(data, size);
  absl::StatusOr<shardtrain::SafetensorsFile> st =
      shardtrain::SafetensorsFile::Open(file.path());
  if (!st.ok()) {
    FUZZ_CHECK(!st.status().message().empty(), "errors say why");
    return 0;
  }
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | data[i];
  int64_t covered = 0;
  for (const shardtrain::SafetensorsEntry& e : st->tensors()) {
    covered += e.end - e.begin;
    if (e.dtype == "F32" || e.dtype == "F16" || e.dtype == "BF16") {
      std::vector<float> out(static_cast<size_t>(e.numel()));
      FUZZ_CHECK(st->ReadAsFloat(e, out.data()).ok(), "a listed tensor reads");
    }
  }
  FUZZ_CHECK(covered == static_cast<int64_t>(size - 8 - header),
             "the tensors tile the data buffer");
  return 0;
}
