// Any text as a shardtrain-train YAML config: applied over the defaults it
// is either refused with a message or gives a config whose Validate()
// answers (either way) without crashing; an accepted, valid config applies
// the same way twice.
#include <string>

#include "core/run/train_config.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) { return 0; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  shardtrain::TrainConfig config;
  config.out = "/tmp/fuzz-out";
  const absl::Status applied = shardtrain::ApplyYamlTrainConfig(text, &config);
  if (!applied.ok()) {
    FUZZ_CHECK(!applied.message().empty(), "errors say why");
    return 0;
  }
  const absl::Status valid = config.Validate();
  if (!valid.ok()) {
    FUZZ_CHECK(!valid.message().empty(), "errors say why");
    return 0;
  }
  shardtrain::TrainConfig again;
  again.out = "/tmp/fuzz-out";
  FUZZ_CHECK(shardtrain::ApplyYamlTrainConfig(text, &again).ok(),
             "applying is deterministic");
  FUZZ_CHECK(again.Validate().ok(), "validating is deterministic");
  return 0;
}
