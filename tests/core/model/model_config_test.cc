#include "core/model/model_config.h"

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ModelConfigTest, PresetsAreListedSmallestFirst) {
  EXPECT_THAT(
      ModelConfig::PresetNames(),
      ElementsAre("llama-tiny", "gpt2-tiny", "llama-mini", "gpt2-mini", "gpt2",
                  "smollm2-135m", "gpt2-medium", "gpt2-large", "llama3.2-1b",
                  "gpt2-xl", "llama3.1-8b", "llama3.1-70b"));
}

TEST(ModelConfigTest, EveryPresetValidatesAndGrows) {
  int64_t previous = 0;
  for (const std::string& name : ModelConfig::PresetNames()) {
    absl::StatusOr<ModelConfig> config = ModelConfig::FromPreset(name);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->name, name);
    EXPECT_TRUE(config->Validate().ok()) << name;
    if (!config->is_llama() || name.find("-tiny") != std::string::npos ||
        name.find("-mini") != std::string::npos) {
      // GPT-2's tokens (the built-in data).
      EXPECT_EQ(config->vocab_size, 50257) << name;
      EXPECT_EQ(config->padded_vocab_size, 50304) << name;
    }
    EXPECT_GT(config->NumParameters(), previous) << name;
    previous = config->NumParameters();
  }
}

TEST(ModelConfigTest, PublishedSizesHaveGpt2Dimensions) {
  struct Expected {
    const char* name;
    int64_t n_layer, n_head, n_embd;
  };
  for (const Expected& e :
       {Expected{"gpt2", 12, 12, 768}, Expected{"gpt2-medium", 24, 16, 1024},
        Expected{"gpt2-large", 36, 20, 1280},
        Expected{"gpt2-xl", 48, 25, 1600}}) {
    const ModelConfig config = *ModelConfig::FromPreset(e.name);
    EXPECT_EQ(config.n_layer, e.n_layer) << e.name;
    EXPECT_EQ(config.n_head, e.n_head) << e.name;
    EXPECT_EQ(config.n_embd, e.n_embd) << e.name;
    EXPECT_EQ(config.block_size, 1024) << e.name;
  }
}

TEST(ModelConfigTest, Gpt2Has124475904ParametersIncludingPaddedVocab) {
  EXPECT_EQ(ModelConfig::FromPreset("gpt2")->NumParameters(), 124'475'904);
}

// The Llama presets have the shapes of the published config.json files,
// hence their published parameter counts.
TEST(ModelConfigTest, LlamaPresetsHaveThePublishedParameterCounts) {
  struct Expected {
    const char* name;
    int64_t parameters;
    int64_t kv_heads, mlp;
    bool tied;
    double rope_theta, rope_factor;
  };
  for (const Expected& e :
       {Expected{"smollm2-135m", 134'515'008, 3, 1536, true, 100000, 0},
        Expected{"llama3.2-1b", 1'235'814'400, 8, 8192, true, 500000, 32},
        Expected{"llama3.1-8b", 8'030'261'248, 8, 14336, false, 500000, 8},
        Expected{"llama3.1-70b", 70'553'706'496, 8, 28672, false, 500000, 8}}) {
    const ModelConfig config = *ModelConfig::FromPreset(e.name);
    EXPECT_TRUE(config.is_llama()) << e.name;
    EXPECT_EQ(config.NumParameters(), e.parameters) << e.name;
    EXPECT_EQ(config.kv_heads(), e.kv_heads) << e.name;
    EXPECT_EQ(config.mlp_hidden(), e.mlp) << e.name;
    EXPECT_EQ(config.tied_head(), e.tied) << e.name;
    EXPECT_EQ(config.rope_theta, e.rope_theta) << e.name;
    EXPECT_EQ(config.rope_scaling.factor, e.rope_factor) << e.name;
    EXPECT_EQ(config.padded_vocab_size, config.vocab_size) << e.name;
  }
  const ModelConfig tiny = *ModelConfig::FromPreset("llama-tiny");
  EXPECT_EQ(tiny.kv_heads(), 2);
  EXPECT_EQ(tiny.n_head, 4);
}

// An untied head is a matrix product and its embedding a lookup: 6 FLOPs per
// parameter of the head, none for the embedding; tied, the one matrix
// counts once.
TEST(ModelConfigTest, LlamaFlopsCountTheHeadNotTheLookup) {
  const ModelConfig tied = *ParseModelSpec(
      "custom-llama:n_layer=2,n_head=4,n_embd=64,intermediate_size=96,"
      "vocab_size=1000");
  ModelConfig untied = tied;
  untied.tie_embeddings = false;
  const double matrices =
      static_cast<double>(2 * tied.BlockParameters() + tied.n_embd);
  const double attention = 12.0 * 2 * 4 * 16 * 128;
  EXPECT_DOUBLE_EQ(tied.FlopsPerToken(128),
                   6 * (matrices + 1024.0 * 64) + attention);
  EXPECT_DOUBLE_EQ(untied.FlopsPerToken(128),
                   6 * (matrices + 1024.0 * 64) + attention);
  EXPECT_EQ(untied.NumParameters(), tied.NumParameters() + 1024 * 64);
}

TEST(ParseModelSpecTest, CustomLlamaRoundTripsEveryField) {
  absl::StatusOr<ModelConfig> config = ParseModelSpec(
      "custom-llama: n_layer=3, n_head=6, n_kv_head=2, n_embd=96, "
      "intermediate_size=200, block_size=128, vocab_size=3000, "
      "rope_theta=500000.5, norm_eps=1e-6, tie_embeddings=0, "
      "attention_bias=1, rope_scaling_factor=8, rope_low_freq_factor=1.5, "
      "rope_high_freq_factor=4, rope_original_max_position_embeddings=64");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->n_kv_head, 2);
  EXPECT_EQ(config->padded_vocab_size, 3008);
  EXPECT_EQ(config->rope_theta, 500000.5);
  EXPECT_EQ(config->norm_eps, 1e-6);
  EXPECT_FALSE(config->tie_embeddings);
  EXPECT_TRUE(config->attention_bias);
  EXPECT_EQ(config->rope_scaling.low_freq_factor, 1.5);
  EXPECT_EQ(config->rope_scaling.original_max_position_embeddings, 64);
  absl::StatusOr<ModelConfig> again = ParseModelSpec(config->ToSpec());
  ASSERT_TRUE(again.ok()) << config->ToSpec() << ": " << again.status();
  EXPECT_TRUE(again->SameShape(*config)) << config->ToSpec();
  // One field changed is another model.
  ModelConfig other = *config;
  other.rope_theta = 10000;
  EXPECT_FALSE(other.SameShape(*config));
  // n_kv_head defaults to n_head (multi-head attention).
  EXPECT_EQ(ParseModelSpec("custom-llama:n_layer=1,n_head=4,n_embd=64,"
                           "intermediate_size=96")
                ->n_kv_head,
            4);
  EXPECT_EQ(ParseModelSpec("llama3.1-8b")->ToSpec(), "llama3.1-8b");
}

TEST(ParseModelSpecTest, LlamaErrorsNameTheField) {
  struct Case {
    const char* spec;
    const char* says;
  };
  for (const Case& c : {
           Case{"custom-llama:n_layer=2,n_head=4,n_embd=64",
                "needs field intermediate_size"},
           Case{"custom-llama:n_layer=2,n_head=4,n_kv_head=3,n_embd=64,"
                "intermediate_size=96",
                "n_kv_head = 3: must divide n_head = 4"},
           Case{"custom-llama:n_layer=2,n_head=4,n_embd=36,"
                "intermediate_size=96",
                "head size 9 must be even"},
           Case{"custom-llama:n_layer=2,n_head=4,n_embd=64,"
                "intermediate_size=96,tie_embeddings=yes",
                "tie_embeddings = \"yes\" must be 0 or 1"},
           Case{"custom-llama:n_layer=2,n_head=4,n_embd=64,"
                "intermediate_size=96,rope_theta=abc",
                "rope_theta = \"abc\" is not a number"},
           Case{"custom-llama:n_layer=2,n_head=4,n_embd=64,"
                "intermediate_size=96,rope_scaling_factor=0.5",
                "factor must be in [1, 1024]"},
           Case{"custom:n_layer=2,n_head=4,n_embd=64,n_kv_head=2",
                "unknown field \"n_kv_head\""},
       }) {
    absl::StatusOr<ModelConfig> config = ParseModelSpec(c.spec);
    ASSERT_FALSE(config.ok()) << c.spec;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.says))
        << c.spec;
  }
}

TEST(ModelConfigTest, UnknownPresetErrorListsAllowedNames) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromPreset("gpt3");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("gpt3"));
  for (const std::string& name : ModelConfig::PresetNames()) {
    EXPECT_THAT(config.status().message(), HasSubstr(name));
  }
  EXPECT_THAT(config.status().message(), HasSubstr("custom:"));
}

TEST(ModelConfigTest, FlopsPerTokenFollowsNanoGptEstimateMfu) {
  // nanoGPT: N = get_num_params() (all parameters minus wpe), then
  // 6*N + 12*L*H*Q*T. For gpt2 at T = 1024, worked out by hand:
  const double n = 124'475'904.0 - 1024.0 * 768.0;  // 123,689,472
  const double expected = 6.0 * n + 12.0 * 12 * 12 * 64 * 1024;
  EXPECT_DOUBLE_EQ(ModelConfig::FromPreset("gpt2")->FlopsPerToken(1024),
                   expected);
  EXPECT_DOUBLE_EQ(expected, 855'383'040.0);
}

TEST(ModelConfigTest, FlopsPerTokenGrowsLinearlyWithSequenceLength) {
  const ModelConfig config = *ModelConfig::FromPreset("gpt2-tiny");
  const double per_position = 12.0 * 2 * 4 * 32;
  EXPECT_DOUBLE_EQ(config.FlopsPerToken(128) - config.FlopsPerToken(64),
                   64 * per_position);
}

TEST(ParseModelSpecTest, AcceptsPresetNames) {
  for (const std::string& name : ModelConfig::PresetNames()) {
    absl::StatusOr<ModelConfig> config = ParseModelSpec(name);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_TRUE(config->SameShape(*ModelConfig::FromPreset(name)));
    EXPECT_EQ(config->name, name);
  }
}

TEST(ParseModelSpecTest, CustomFillsDefaultsAndPadsVocabTo64) {
  absl::StatusOr<ModelConfig> config =
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
  absl::StatusOr<ModelConfig> config = ParseModelSpec(
      "custom:n_layer=4,n_head=4,n_embd=256,block_size=512,vocab_size=50257,"
      "padded_vocab_size=50257");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->block_size, 512);
  EXPECT_EQ(config->padded_vocab_size, 50257);
}

TEST(ParseModelSpecTest, ToSpecRoundTrips) {
  const ModelConfig mini = *ModelConfig::FromPreset("gpt2-mini");
  EXPECT_EQ(mini.ToSpec(), "gpt2-mini");
  const ModelConfig custom =
      *ParseModelSpec("custom:n_layer=1,n_head=2,n_embd=8,block_size=16");
  absl::StatusOr<ModelConfig> again = ParseModelSpec(custom.ToSpec());
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
    absl::StatusOr<ModelConfig> config = ParseModelSpec(c.spec);
    ASSERT_FALSE(config.ok()) << c.spec;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(config.status().message(), HasSubstr(c.must_mention)) << c.spec;
  }
}

TEST(ModelConfigTest, ValidateRejectsAbsurdSizesBeforeAnythingIsAllocated) {
  ModelConfig config = *ModelConfig::FromPreset("gpt2");
  config.n_embd = int64_t{1} << 40;
  EXPECT_THAT(config.Validate().message(), HasSubstr("n_embd"));
}

}  // namespace
}  // namespace shardtrain
