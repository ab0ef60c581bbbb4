// Any bytes as a checkpoint's checkpoint.json and as its store's `latest`
// pointer (both named by --resume, --init-from and `checkpoint
// inspect/export`): ParseCheckpointMetadata() refuses with a message or
// returns tensors whose chunks tile them exactly inside files it lists;
// CheckpointStore::Latest() refuses or names a step directory of the store,
// never a path outside it.
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/checkpoint_store.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

std::string run_dir;  // a run with checkpoints/step_00000007 in it

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  namespace fs = std::filesystem;
  run_dir = (fs::temp_directory_path() /
             ("checkpoint_fuzz_" + std::to_string(::getpid())))
                .string();
  fs::create_directories(run_dir + "/checkpoints/step_00000007");
  std::atexit([] { std::filesystem::remove_all(run_dir); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<shardtrain::CheckpointMetadata> metadata =
      shardtrain::ParseCheckpointMetadata(text, "fuzz");
  if (!metadata.ok()) {
    FUZZ_CHECK(!metadata.status().message().empty(), "errors say why");
  } else {
    for (const shardtrain::TensorEntry& tensor : metadata->tensors) {
      int64_t next = 0;
      for (const shardtrain::TensorChunk& chunk : tensor.chunks) {
        FUZZ_CHECK(chunk.offset == next, "chunks tile the tensor in order");
        next += chunk.numel;
        const shardtrain::DataFile* file = metadata->FindFile(chunk.file);
        FUZZ_CHECK(file != nullptr, "a chunk's file is listed");
        FUZZ_CHECK(chunk.byte_offset >= 0 &&
                       chunk.byte_offset + 4 * chunk.numel <= file->bytes,
                   "a chunk lies inside its file");
      }
      FUZZ_CHECK(next == tensor.numel(), "chunks cover the tensor");
    }
    FUZZ_CHECK(metadata->TotalBytes() >= 0, "sizes do not overflow");
  }

  { std::ofstream(run_dir + "/checkpoints/latest", std::ios::binary) << text; }
  const shardtrain::CheckpointStore store(run_dir);
  absl::StatusOr<std::string> latest = store.Latest();
  if (latest.ok()) {
    FUZZ_CHECK(*latest == run_dir + "/checkpoints/step_00000007",
               "latest names a step directory of the store");
  } else {
    FUZZ_CHECK(!latest.status().message().empty(), "errors say why");
  }
  return 0;
}
