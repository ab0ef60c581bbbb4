// Any bytes as a SubmitJob request's JobSpec (binary protobuf, or the JSON
// a spec file holds when the first byte is odd) through everything
// SubmitJob checks before storing (ValidateSubmission): refused with a
// message naming a field, or accepted; an accepted spec converts to a
// TrainConfig and back to a spec that is accepted again.
#include <google/protobuf/util/json_util.h>

#include <filesystem>
#include <string>

#include "proto/job_config.h"
#include "server/job_manager.h"
#include "tests/fuzz/fuzz_target.h"

namespace {
shardtrain::JobManagerOptions* options;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  options = new shardtrain::JobManagerOptions;
  options->state_dir = "/tmp/shardtrain-fuzz-state";
  for (int i = 0; i < 4; ++i) {
    options->devices.push_back({i, shardtrain::v1::CPU, "cpu slot", 0});
  }
  // One existing dataset, as the real locator would find it.
  options->resolve_data =
      [](const std::string& data) -> absl::StatusOr<std::string> {
    if (data == "brown") return std::string("/tmp/shardtrain-fuzz-state/brown");
    return absl::InvalidArgumentError("data: '" + data + "' has no train.bin");
  };
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  shardtrain::v1::JobSpec spec;
  if (data[0] % 2 == 0) {
    if (!spec.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  } else {
    const std::string json(reinterpret_cast<const char*>(data + 1), size - 1);
    if (!google::protobuf::util::JsonStringToMessage(json, &spec).ok()) {
      return 0;
    }
  }
  absl::StatusOr<shardtrain::v1::JobSpec> accepted =
      shardtrain::ValidateSubmission(*options, spec);
  if (!accepted.ok()) {
    FUZZ_CHECK(accepted.status().code() != absl::StatusCode::kOk &&
                   !accepted.status().message().empty(),
               "refusals say why");
    return 0;
  }
  absl::StatusOr<shardtrain::TrainConfig> config =
      shardtrain::TrainConfigFromJobSpec(*accepted, "/tmp/fuzz-out");
  FUZZ_CHECK(config.ok(), "an accepted spec converts");
  const shardtrain::v1::JobSpec back =
      shardtrain::JobSpecFromTrainConfig(*config, accepted->world_size());
  absl::StatusOr<shardtrain::TrainConfig> again =
      shardtrain::TrainConfigFromJobSpec(back, "/tmp/fuzz-out");
  FUZZ_CHECK(again.ok(), "the round trip is accepted again");
  return 0;
}
