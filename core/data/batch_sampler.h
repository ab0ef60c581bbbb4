// Deterministic order of training windows over a token stream.
//
// A window is seq_len + 1 consecutive tokens (inputs and shifted targets)
// starting at a multiple of seq_len. Each epoch visits a fresh permutation of
// all windows, a pure function of (seed, epoch). One optimizer step consumes
// world_size * local_batch * grad_accum consecutive windows of that order;
// micro-step m of rank r reads the local_batch windows starting at position
// (m * world_size + r) * local_batch of the step's block. Hence a single device
// with batch W*B sees exactly the samples that W ranks with batch B see
// together, and 4 micro-steps of batch B see what one step of batch 4B sees.
// Torch-free.
#ifndef SHARDTRAIN_CORE_DATA_BATCH_SAMPLER_H_
#define SHARDTRAIN_CORE_DATA_BATCH_SAMPLER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace shardtrain {

struct BatchSamplerOptions {
  int64_t num_tokens = 0;  // tokens in the stream
  int64_t seq_len = 0;
  int64_t local_batch = 0;  // windows per rank per micro-step
  int64_t world_size = 1;
  int64_t grad_accum = 1;
  uint64_t seed = 0;
  bool shuffle = true;  // false: windows in file order, every epoch
};

class BatchSampler {
 public:
  // Fails when the stream cannot fill one optimizer step.
  static absl::StatusOr<BatchSampler> Create(
      const BatchSamplerOptions& options);

  int64_t num_windows() const { return num_windows_; }
  int64_t windows_per_step() const;
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t EpochOf(int64_t step) const { return step / steps_per_epoch_; }

  // Token offsets of the windows that `rank` reads on micro-step `micro` of
  // the 0-based global `step` (counted across epochs).
  std::vector<int64_t> WindowStarts(int64_t step, int64_t micro, int64_t rank);

 private:
  explicit BatchSampler(const BatchSamplerOptions& options);
  const std::vector<int64_t>& OrderFor(int64_t epoch);

  BatchSamplerOptions options_;
  int64_t num_windows_ = 0;
  int64_t steps_per_epoch_ = 0;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_order_;  // window indices of cached_epoch_
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_BATCH_SAMPLER_H_
