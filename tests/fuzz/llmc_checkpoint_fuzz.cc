// Any bytes as an llm.c model checkpoint: ReadLlmcConfig() refuses with a
// message or returns a config whose layout is exactly the file's size; such
// a file then loads into a model of that config. Header counts that would
// ask for huge tensors are refused before anything is allocated.
#include <torch/torch.h>

#include <string>

#include "tests/fuzz/fuzz_target.h"
#include "worker/engine/model/gpt2.h"
#include "worker/engine/model/llmc_checkpoint.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardtrain::fuzz::MemFile file(data, size);
  absl::StatusOr<shardtrain::ModelConfig> config =
      shardtrain::ReadLlmcConfig(file.path());
  if (!config.ok()) {
    FUZZ_CHECK(!config.status().message().empty(), "errors say why");
    return 0;
  }
  FUZZ_CHECK(static_cast<int64_t>(size) ==
                 shardtrain::kLlmcHeaderBytes + 4 * config->NumParameters(),
             "a readable config describes exactly the file");
  absl::StatusOr<shardtrain::Gpt2> model = shardtrain::CreateGpt2(*config, 1);
  FUZZ_CHECK(model.ok(), "a readable config builds a model");
  const absl::Status loaded =
      shardtrain::LoadLlmcCheckpoint(file.path(), *model);
  FUZZ_CHECK(loaded.ok(), "a readable checkpoint loads");
  return 0;
}
