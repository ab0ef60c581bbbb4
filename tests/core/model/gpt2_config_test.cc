#include "core/model/gpt2_config.h"

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Gpt2ConfigTest, PresetsAreListedSmallestFirst) {
  EXPECT_THAT(Gpt2Config::PresetNames(),
              ElementsAre("gpt2-tiny", "gpt2-mini", "gpt2", "gpt2-medium",
                          "gpt2-large", "gpt2-xl"));
}

TEST(Gpt2ConfigTest, EveryPresetValidatesAndGrows) {
  int64_t previous = 0;
  for (const std::string& name : Gpt2Config::PresetNames()) {
    absl::StatusOr<Gpt2Config> config = Gpt2Config::FromPreset(name);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->name, name);
    EXPECT_TRUE(config->Validate().ok()) << name;
    EXPECT_EQ(config->vocab_size, 50257) << name;
    EXPECT_EQ(config->padded_vocab_size, 50304) << name;
    EXPECT_GT(config->NumParameters(), previous) << name;
    previous = config->NumParameters();
  }
}

TEST(Gpt2ConfigTest, PublishedSizesHaveGpt2Dimensions) {
  struct Expected {
    const char* name;
    int64_t n_layer, n_head, n_embd;
  };
  for (const Expected& e :
       {Expected{"gpt2", 12, 12, 768}, Expected{"gpt2-medium", 24, 16, 1024},
        Expected{"gpt2-large", 36, 20, 1280},
        Expected{"gpt2-xl", 48, 25, 1600}}) {
    const Gpt2Config config = *Gpt2Config::FromPreset(e.name);
    EXPECT_EQ(config.n_layer, e.n_layer) << e.name;
    EXPECT_EQ(config.n_head, e.n_head) << e.name;
    EXPECT_EQ(config.n_embd, e.n_embd) << e.name;
    EXPECT_EQ(config.block_size, 1024) << e.name;
  }
}

TEST(Gpt2ConfigTest, Gpt2Has124475904ParametersIncludingPaddedVocab) {
  EXPECT_EQ(Gpt2Config::FromPreset("gpt2")->NumParameters(), 124'475'904);
}

TEST(Gpt2ConfigTest, UnknownPresetErrorListsAllowedNames) {
  absl::StatusOr<Gpt2Config> config = Gpt2Config::FromPreset("gpt3");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("gpt3"));
  for (const std::string& name : Gpt2Config::PresetNames()) {
    EXPECT_THAT(config.status().message(), HasSubstr(name));
  }
  EXPECT_THAT(config.status().message(), HasSubstr("custom:"));
}

TEST(Gpt2ConfigTest, FlopsPerTokenFollowsNanoGptEstimateMfu) {
  // nanoGPT: N = get_num_params() (all parameters minus wpe), then
  // 6*N + 12*L*H*Q*T. For gpt2 at T = 1024, worked out by hand:
  const double n = 124'475'904.0 - 1024.0 * 768.0;  // 123,689,472
  const double expected = 6.0 * n + 12.0 * 12 * 12 * 64 * 1024;
  EXPECT_DOUBLE_EQ(Gpt2Config::FromPreset("gpt2")->FlopsPerToken(1024),
                   expected);
  EXPECT_DOUBLE_EQ(expected, 855'383'040.0);
}

TEST(Gpt2ConfigTest, FlopsPerTokenGrowsLinearlyWithSequenceLength) {
  const Gpt2Config config = *Gpt2Config::FromPreset("gpt2-tiny");
  const double per_position = 12.0 * 2 * 4 * 32;
  EXPECT_DOUBLE_EQ(config.FlopsPerToken(128) - config.FlopsPerToken(64),
                   64 * per_position);
}

TEST(ParseModelSpecTest, AcceptsPresetNames) {
  for (const std::string& name : Gpt2Config::PresetNames()) {
    absl::StatusOr<Gpt2Config> config = ParseModelSpec(name);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_TRUE(config->SameShape(*Gpt2Config::FromPreset(name)));
    EXPECT_EQ(config->name, name);
  }
}

TEST(ParseModelSpecTest, CustomFillsDefaultsAndPadsVocabTo64) {
  absl::StatusOr<Gpt2Config> config =
      ParseModelSpec("custom:n_layer=3, n_head=2 ,n_embd=64,vocab_size=1000");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->name, "custom");
  EXPECT_EQ(config->n_layer, 3);
  EXPECT_EQ(config->n_head, 2);
  EXPECT_EQ(config->n_embd, 64);
  EXPECT_EQ(config->block_size, 1024);
  EXPECT_EQ(config->vocab_size, 1000);
  EXPECT_EQ(config->padded_vocab_size, 1024);
}

TEST(ParseModelSpecTest, CustomAcceptsEveryField) {
  absl::StatusOr<Gpt2Config> config = ParseModelSpec(
      "custom:n_layer=4,n_head=4,n_embd=256,block_size=512,vocab_size=50257,"
      "padded_vocab_size=50257");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->block_size, 512);
  EXPECT_EQ(config->padded_vocab_size, 50257);
}

TEST(ParseModelSpecTest, ToSpecRoundTrips) {
  const Gpt2Config mini = *Gpt2Config::FromPreset("gpt2-mini");
  EXPECT_EQ(mini.ToSpec(), "gpt2-mini");
  const Gpt2Config custom =
      *ParseModelSpec("custom:n_layer=1,n_head=2,n_embd=8,block_size=16");
  absl::StatusOr<Gpt2Config> again = ParseModelSpec(custom.ToSpec());
  ASSERT_TRUE(again.ok()) << again.status() << " for " << custom.ToSpec();
  EXPECT_TRUE(again->SameShape(custom));
}

TEST(ParseModelSpecTest, ErrorsNameTheFieldAndTheAllowedValues) {
  struct Case {
    const char* spec;
    const char* must_mention;
  };
  for (const Case& c : {
           Case{"gpt5", "gpt2-tiny"},
           Case{"custom:n_layer=2,n_head=2", "n_embd"},
           Case{"custom:n_layer=2,n_head=2,n_embd=64,depth=3", "depth"},
           Case{"custom:n_layer=2,n_head=2,n_embd=64,depth=3", "block_size"},
           Case{"custom:n_layer=two,n_head=2,n_embd=64", "n_layer"},
           Case{"custom:n_layer=0,n_head=2,n_embd=64", "n_layer"},
           Case{"custom:n_layer=2,n_head=3,n_embd=64", "multiple of n_head"},
           Case{"custom:n_layer=2,n_head=2,n_embd=64,n_head=2", "twice"},
           Case{"custom:n_layer=2,n_head=2,n_embd", "<field>=<int>"},
           Case{"custom:n_layer=2,n_head=2,n_embd=64,vocab_size=100,"
                "padded_vocab_size=99",
                "padded_vocab_size"},
           Case{"custom:n_layer=2,n_head=2,n_embd=64,block_size=-5",
                "block_size"},
       }) {
    absl::StatusOr<Gpt2Config> config = ParseModelSpec(c.spec);
    ASSERT_FALSE(config.ok()) << c.spec;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(config.status().message(), HasSubstr(c.must_mention)) << c.spec;
  }
}

TEST(Gpt2ConfigTest, ValidateRejectsAbsurdSizesBeforeAnythingIsAllocated) {
  Gpt2Config config = *Gpt2Config::FromPreset("gpt2");
  config.n_embd = int64_t{1} << 40;
  EXPECT_THAT(config.Validate().message(), HasSubstr("n_embd"));
}

}  // namespace
}  // namespace shardtrain
