#include "core/data/batch_sampler.h"

#include <numeric>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

// Uniform integer in [0, bound) from a 64-bit generator, by rejection, so the
// permutation is identical on every platform (std::uniform_int_distribution
// is implementation-defined).
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x;
  do {
    x = rng();
  } while (x >= limit);
  return x % bound;
}

}  // namespace

absl::StatusOr<BatchSampler> BatchSampler::Create(
    const BatchSamplerOptions& options) {
  if (options.seq_len <= 0 || options.local_batch <= 0 ||
      options.world_size <= 0 || options.grad_accum <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch sampler needs positive seq_len, batch, world size and "
        "grad_accum; got seq_len=",
        options.seq_len, " batch=", options.local_batch, " world_size=",
        options.world_size, " grad_accum=", options.grad_accum));
  }
  BatchSampler sampler(options);
  if (sampler.steps_per_epoch_ == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data has ", options.num_tokens, " tokens = ", sampler.num_windows_,
        " windows of seq_len ", options.seq_len, ", fewer than the ",
        sampler.windows_per_step(),
        " one step needs (world_size x batch_size x grad_accum)"));
  }
  return sampler;
}

BatchSampler::BatchSampler(const BatchSamplerOptions& options)
    : options_(options) {
  num_windows_ = options.num_tokens > options.seq_len
                     ? (options.num_tokens - 1) / options.seq_len
                     : 0;
  steps_per_epoch_ = num_windows_ / windows_per_step();
}

int64_t BatchSampler::windows_per_step() const {
  return options_.world_size * options_.local_batch * options_.grad_accum;
}

const std::vector<int64_t>& BatchSampler::OrderFor(int64_t epoch) {
  if (epoch == cached_epoch_) return cached_order_;
  cached_order_.resize(num_windows_);
  std::iota(cached_order_.begin(), cached_order_.end(), int64_t{0});
  if (options_.shuffle) {
    std::seed_seq seq{static_cast<uint32_t>(options_.seed),
                      static_cast<uint32_t>(options_.seed >> 32),
                      static_cast<uint32_t>(epoch)};
    std::mt19937_64 rng(seq);
    for (int64_t i = num_windows_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(UniformBelow(rng, i + 1));
      std::swap(cached_order_[i], cached_order_[j]);
    }
  }
  cached_epoch_ = epoch;
  return cached_order_;
}

std::vector<int64_t> BatchSampler::WindowStarts(int64_t step, int64_t micro,
                                                int64_t rank) {
  const std::vector<int64_t>& order = OrderFor(EpochOf(step));
  const int64_t step_in_epoch = step % steps_per_epoch_;
  int64_t first = step_in_epoch * windows_per_step() +
                  (micro * options_.world_size + rank) * options_.local_batch;
  std::vector<int64_t> starts(options_.local_batch);
  for (int64_t i = 0; i < options_.local_batch; ++i) {
    starts[i] = order[first + i] * options_.seq_len;
  }
  return starts;
}

}  // namespace shardtrain
