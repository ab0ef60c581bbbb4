// The checkpoint format every strategy and world size reads and writes
// (docs/checkpoints.md has the layout, for readers in other languages).
//
//   step_00000100/checkpoint.json     the metadata: what was trained, and
//                                     for every tensor its global shape and
//                                     where each of its pieces lies
//   step_00000100/rank-00003.bin      the bytes rank 3 wrote: its pieces,
//                                     raw little-endian float32, one after
//                                     the other
//   step_00000100/rank-00003.json     rank 3's own index (merged into
//                                     checkpoint.json)
//
// Every data file carries a CRC-32 per MiB block; a reader checks each block
// the first time it reads from it, so a file changed after it was written
// (a bit flip, an overwrite) is refused, not trained on.
//
// A tensor is named globally ("model.h.0.attn.c_attn.weight",
// "optim.exp_avg.h.0.attn.c_attn.weight") and cut into chunks: contiguous
// ranges of its row-major flattened elements. Each rank writes the ranges it
// owns, in parallel (its FSDP shard; an even share of a replicated DDP
// tensor); every element of every tensor is in exactly one chunk. A reader at
// any world size asks for the ranges it needs and gets them from whichever
// chunks hold them (a save plan and a load plan, as in
// torch.distributed.checkpoint).
//
// Torch-free: the trainer copies tensors through it, and the CLI inspects and
// exports checkpoints with it, without ranks.
#ifndef SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_FORMAT_H_
#define SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_FORMAT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/input_file.h"
#include "nlohmann/json.hpp"

namespace shardtrain {

inline constexpr char kCheckpointFormat[] = "shardtrain-checkpoint";
inline constexpr int kCheckpointVersion = 2;
inline constexpr char kCheckpointMetadataFile[] = "checkpoint.json";

// Elements [offset, offset + numel) of a tensor's flattened elements, stored
// in `file` from `byte_offset` on.
struct TensorChunk {
  std::string file;  // relative to the checkpoint directory
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t byte_offset = 0;
};

struct TensorEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype = "float32";    // the only one written
  std::vector<TensorChunk> chunks;  // by offset; cover the tensor once

  int64_t numel() const;
};

// One rank's data file: its length and the CRC-32 (zlib's) of each
// block_bytes block, the last one possibly shorter.
struct DataFile {
  std::string name;
  int64_t bytes = 0;
  int64_t block_bytes = 0;
  std::vector<uint32_t> crc32;
};

struct CheckpointMetadata {
  // What the trainer records about the run (step, samples consumed, who
  // wrote it, the settings a resume must agree with); opaque here.
  nlohmann::json training;
  std::vector<DataFile> files;       // rank order
  std::vector<TensorEntry> tensors;  // by name

  const TensorEntry* Find(const std::string& name) const;
  const DataFile* FindFile(const std::string& name) const;
  int64_t TotalBytes() const;
  // Bytes in each data file, by file name.
  std::map<std::string, int64_t> BytesPerFile() const;
};

inline constexpr int64_t kCheckpointBlockBytes = int64_t{1} << 20;

// A piece of one rank's state to save: elements [offset, offset + numel) of
// tensor `name` (global shape `shape`), read from `data` (host memory).
struct ChunkToWrite {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t numel = 0;
  const float* data = nullptr;
};

std::string RankDataFile(int64_t rank);   // "rank-00003.bin"
std::string RankIndexFile(int64_t rank);  // "rank-00003.json"

// Writes rank `rank`'s chunks into `dir`: its data file, then its index.
absl::Status WriteRankChunks(const std::string& dir, int64_t rank,
                             const std::vector<ChunkToWrite>& chunks);

// Once every rank has written: merges the `world_size` rank indexes with
// `training` into checkpoint.json. Fails (writing nothing) when an index is
// missing, a tensor's chunks overlap or leave a gap, or two ranks disagree
// on a tensor's shape.
absl::Status WriteCheckpointMetadata(const std::string& dir, int64_t world_size,
                                     const nlohmann::json& training);

// Reads a checkpoint's tensors. Opening reads and checks checkpoint.json
// (and that every data file is as long as its chunks say); a directory in
// the per-strategy format of earlier versions is refused by name.
class CheckpointReader {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(
      const std::string& dir);
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const CheckpointMetadata& metadata() const { return metadata_; }
  const std::string& dir() const { return dir_; }

  // Copies elements [offset, offset + numel) of tensor `name` into `out`.
  // NotFound names a tensor the checkpoint does not have; InvalidArgument a
  // range outside it.
  absl::Status Read(const std::string& name, int64_t offset, int64_t numel,
                    float* out);

 private:
  CheckpointReader(std::string dir, CheckpointMetadata metadata,
                   std::map<std::string, InputFile> files);
  // Reads bytes [offset, offset + size) of `file` into `out`, checking the
  // CRC of every block it touches that was not checked before.
  absl::Status ReadChecked(const DataFile& file, int64_t offset, int64_t size,
                           char* out);

  std::string dir_;
  CheckpointMetadata metadata_;
  std::map<std::string, InputFile> files_;  // opened and sized at Open
  std::map<std::string, std::vector<bool>> checked_;  // file -> block
};

// A field of CheckpointMetadata::training (or of an object in it), or
// `fallback` when it is missing or of another type.
int64_t TrainingInt(const nlohmann::json& training, const std::string& key,
                    int64_t fallback = -1);
std::string TrainingString(const nlohmann::json& training,
                           const std::string& key,
                           const std::string& fallback = "?");

// The mesh a checkpoint's `written_by` record names (MeshName:
// "pp2xfsdp2"); a checkpoint from before meshes were recorded gives its
// strategy.
std::string WrittenByMesh(const nlohmann::json& written_by);

// Parses and checks a checkpoint.json's text (`where` names it in errors).
absl::StatusOr<CheckpointMetadata> ParseCheckpointMetadata(
    const std::string& text, const std::string& where);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_FORMAT_H_
