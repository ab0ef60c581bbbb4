#include "core/data/batch_sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace shardtrain {
namespace {

BatchSampler MakeSampler(int64_t batch, int64_t world, int64_t accum,
                         uint64_t seed = 7,
                         int64_t num_tokens = 64 * 1000 + 1) {
  BatchSamplerOptions options;
  options.num_tokens = num_tokens;
  options.seq_len = 64;
  options.local_batch = batch;
  options.world_size = world;
  options.grad_accum = accum;
  options.seed = seed;
  return *BatchSampler::Create(options);
}

TEST(BatchSamplerTest, SingleWithBatchWBSeesWhatWRanksWithBatchBSee) {
  BatchSampler single = MakeSampler(/*batch=*/6, /*world=*/1, /*accum=*/1);
  BatchSampler distributed = MakeSampler(/*batch=*/2, /*world=*/3, /*accum=*/1);
  for (int64_t step : {0, 1, 17, 40, 83}) {  // 83 is in epoch 1
    std::vector<int64_t> together;
    for (int64_t rank = 0; rank < 3; ++rank) {
      auto part = distributed.WindowStarts(step, 0, rank);
      together.insert(together.end(), part.begin(), part.end());
    }
    EXPECT_EQ(single.WindowStarts(step, 0, 0), together) << "step " << step;
  }
}

TEST(BatchSamplerTest, AccumulationMicroStepsCoverTheLargeBatch) {
  BatchSampler large = MakeSampler(/*batch=*/8, 1, /*accum=*/1);
  BatchSampler micro = MakeSampler(/*batch=*/2, 1, /*accum=*/4);
  for (int64_t step : {0, 5, 150}) {
    std::vector<int64_t> together;
    for (int64_t m = 0; m < 4; ++m) {
      auto part = micro.WindowStarts(step, m, 0);
      together.insert(together.end(), part.begin(), part.end());
    }
    EXPECT_EQ(large.WindowStarts(step, 0, 0), together) << "step " << step;
  }
}

TEST(BatchSamplerTest, EachEpochVisitsEveryWindowOnceInANewOrder) {
  BatchSampler sampler = MakeSampler(/*batch=*/10, 1, 1);
  ASSERT_EQ(sampler.num_windows(), 1000);
  ASSERT_EQ(sampler.steps_per_epoch(), 100);
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t step = 0; step < 200; ++step) {
    auto starts = sampler.WindowStarts(step, 0, 0);
    (step < 100 ? epoch0 : epoch1)
        .insert((step < 100 ? epoch0 : epoch1).end(), starts.begin(),
                starts.end());
  }
  std::set<int64_t> unique0(epoch0.begin(), epoch0.end());
  EXPECT_EQ(unique0.size(), 1000u);
  EXPECT_EQ(*unique0.rbegin(), 999 * 64);
  EXPECT_NE(epoch0, epoch1);
  std::sort(epoch1.begin(), epoch1.end());
  EXPECT_EQ(std::vector<int64_t>(unique0.begin(), unique0.end()), epoch1);
}

TEST(BatchSamplerTest, OrderIsAFunctionOfTheSeed) {
  BatchSampler a = MakeSampler(4, 1, 1, /*seed=*/1);
  BatchSampler b = MakeSampler(4, 1, 1, /*seed=*/1);
  BatchSampler c = MakeSampler(4, 1, 1, /*seed=*/2);
  EXPECT_EQ(a.WindowStarts(3, 0, 0), b.WindowStarts(3, 0, 0));
  EXPECT_NE(a.WindowStarts(3, 0, 0), c.WindowStarts(3, 0, 0));
}

TEST(BatchSamplerTest, WithoutShuffleWindowsComeInFileOrder) {
  BatchSamplerOptions options;
  options.num_tokens = 1001;
  options.seq_len = 10;
  options.local_batch = 3;
  options.shuffle = false;
  BatchSampler sampler = *BatchSampler::Create(options);
  EXPECT_EQ(sampler.WindowStarts(1, 0, 0), (std::vector<int64_t>{30, 40, 50}));
}

TEST(BatchSamplerTest, WindowsNeverReadPastTheEnd) {
  // 1 + 64 * 5 tokens: exactly 5 windows of 65 tokens.
  BatchSampler sampler = MakeSampler(5, 1, 1, 3, /*num_tokens=*/64 * 5 + 1);
  for (int64_t start : sampler.WindowStarts(0, 0, 0)) {
    EXPECT_LE(start + 64 + 1, 64 * 5 + 1);
  }
}

TEST(BatchSamplerTest, RejectsDataSmallerThanOneStep) {
  BatchSamplerOptions options;
  options.num_tokens = 100;
  options.seq_len = 64;
  options.local_batch = 2;
  auto sampler = BatchSampler::Create(options);
  ASSERT_FALSE(sampler.ok());
  EXPECT_NE(sampler.status().message().find("fewer than the 2"),
            std::string::npos)
      << sampler.status();
}

TEST(BatchSamplerTest, RejectsNonPositiveSizes) {
  BatchSamplerOptions options;
  options.num_tokens = 10000;
  options.seq_len = 64;
  options.local_batch = -1;
  EXPECT_FALSE(BatchSampler::Create(options).ok());
}

}  // namespace
}  // namespace shardtrain
