// The Brown Corpus as text, and prepared into train.bin/val.bin/meta.json.
// The whole corpus is prepared once per test process (SetUpTestSuite).
#include "core/data/brown_corpus.h"

#include <algorithm>
#include <iostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "core/data/asset_paths.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/builtin_dataset.h"
#include "core/data/dataset_preparer.h"
#include "core/data/token_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

TEST(BrownSampleToTextTest, DropsTagsAfterTheLastSlash) {
  EXPECT_EQ(BrownSampleToText("\tAdd/vb 1-1/2/cd cups/nns and/cc/x ./."),
            "Add 1-1/2 cups and/cc.");
}

TEST(BrownSampleToTextTest, AttachesPunctuationToThePreviousWord) {
  EXPECT_EQ(BrownSampleToText("\tYes/rb ,/, he/pps said/vbd ;/. no/rb :/: "
                              "why/wrb ?/. Go/vb !/. Done/vbn ./."),
            "Yes, he said; no: why? Go! Done.");
}

TEST(BrownSampleToTextTest, TurnsDoubleQuoteMarksIntoHuggingQuotes) {
  EXPECT_EQ(BrownSampleToText("\tIt/pps produced/vbd ``/`` no/at evidence/nn "
                              "''/'' ,/, he/pps said/vbd ./."),
            "It produced \"no evidence\", he said.");
}

TEST(BrownSampleToTextTest, HugsBracketsAndAlternatingSingleQuotes) {
  EXPECT_EQ(BrownSampleToText("\tpitch/nn 3/cd (/( pretty/ql high/jj )/) "
                              "and/cc '/' pro/jj '/' letters/nns ./."),
            "pitch 3 (pretty high) and 'pro' letters.");
}

TEST(BrownSampleToTextTest, KeepsContractionsAndPossessivesWhole) {
  EXPECT_EQ(BrownSampleToText("\tAtlanta's/np$ mayor/nn didn't/dod* "
                              "know/vb 'em/ppo ./."),
            "Atlanta's mayor didn't know 'em.");
}

TEST(BrownSampleToTextTest, JoinsSentencesAndPutsParagraphsOnLines) {
  const std::string tagged =
      "\n\n\tFirst/od sentence/nn ./.\nSecond/od one/cd ./.\n\n\n"
      "\tNew/jj paragraph/nn ./.\n\n";
  EXPECT_EQ(BrownSampleToText(tagged),
            "First sentence. Second one.\nNew paragraph.");
}

TEST(BrownGenreNameTest, NamesTheFifteenGenresLikeNltk) {
  EXPECT_EQ(BrownGenreName('a'), "news");
  EXPECT_EQ(BrownGenreName('m'), "science_fiction");
  EXPECT_EQ(BrownGenreName('r'), "humor");
}

TEST(LoadBrownCorpusTest, FolderWithoutSamplesIsAnEmptyCorpusError) {
  test::TempDir dir;
  test::WriteFile(dir / "README", "not a sample");
  absl::StatusOr<Corpus> corpus = LoadBrownCorpus(dir.path());
  ASSERT_FALSE(corpus.ok());
  EXPECT_THAT(corpus.status().message(), HasSubstr("empty corpus"));
  EXPECT_THAT(corpus.status().message(), HasSubstr(dir.path()));
}

class PreparedBrownTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<BpeTokenizer> tokenizer = BpeTokenizer::LoadDefault();
    absl::StatusOr<std::string> brown_dir = BrownCorpusDir();
    if (!tokenizer.ok() || !brown_dir.ok()) {
      error_ = new std::string(
          (tokenizer.ok() ? brown_dir.status() : tokenizer.status())
              .ToString());
      return;
    }
    absl::StatusOr<Corpus> corpus = LoadBrownCorpus(*brown_dir);
    if (!corpus.ok()) {
      error_ = new std::string(corpus.status().ToString());
      return;
    }
    out_ = new test::TempDir;
    absl::StatusOr<DatasetSummary> summary =
        PrepareDataset(*corpus, *tokenizer, out_->path());
    if (!summary.ok()) {
      error_ = new std::string(summary.status().ToString());
      return;
    }
    tokenizer_ = new BpeTokenizer(std::move(*tokenizer));
    corpus_ = new Corpus(std::move(*corpus));
    summary_ = new DatasetSummary(std::move(*summary));
    std::cout << "Brown: train " << summary_->train.documents << " documents, "
              << summary_->train.tokens << " tokens; val "
              << summary_->val.documents << " documents, "
              << summary_->val.tokens << " tokens; encoded in "
              << summary_->encode_seconds << " s\n";
  }
  static void TearDownTestSuite() {
    delete summary_;
    delete corpus_;
    delete tokenizer_;
    delete out_;
    summary_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(summary_, nullptr) << (error_ ? *error_ : "");
  }

  static const Document& Sample(const std::string& name) {
    return *std::find_if(corpus_->documents.begin(), corpus_->documents.end(),
                         [&](const Document& d) { return d.name == name; });
  }

  static std::string* error_;
  static test::TempDir* out_;
  static BpeTokenizer* tokenizer_;
  static Corpus* corpus_;
  static DatasetSummary* summary_;
};

std::string* PreparedBrownTest::error_ = nullptr;
test::TempDir* PreparedBrownTest::out_ = nullptr;
BpeTokenizer* PreparedBrownTest::tokenizer_ = nullptr;
Corpus* PreparedBrownTest::corpus_ = nullptr;
DatasetSummary* PreparedBrownTest::summary_ = nullptr;

TEST_F(PreparedBrownTest, EverySampleIsOneDocumentInOneOfFifteenGenres) {
  EXPECT_EQ(corpus_->documents.size(), 500u);
  std::set<std::string> genres;
  for (const Document& d : corpus_->documents) genres.insert(d.group);
  EXPECT_EQ(genres.size(), 15u);
  EXPECT_EQ(summary_->train.documents + summary_->val.documents, 500);
}

TEST_F(PreparedBrownTest, TextHasNoTagsAndReadableQuotes) {
  for (const Document& d : corpus_->documents) {
    for (const char* leftover : {"/at ", "/nn", "/vb", "/in ", "/jj", "/np",
                                 ",/,", "./.", "``", " ,", " ."}) {
      ASSERT_THAT(d.text, Not(HasSubstr(leftover)))
          << d.name << " still holds \"" << leftover << "\"";
    }
    // '' survives only inside words, as inches: 4' 10''.
    for (size_t at = d.text.find("''"); at != std::string::npos;
         at = d.text.find("''", at + 2)) {
      ASSERT_TRUE(at > 0 && absl::ascii_isdigit(d.text[at - 1]))
          << d.name << " holds a quote mark '' at " << at;
    }
  }
  EXPECT_THAT(Sample("ca01").text,
              StartsWith("The Fulton County Grand Jury said Friday an "
                         "investigation of Atlanta's recent primary election "
                         "produced \"no evidence\" that any irregularities "
                         "took place.\nThe jury further said"));
}

TEST_F(PreparedBrownTest, EveryGenreIsInBothSplits) {
  EXPECT_EQ(summary_->train.documents_per_group.size(), 15u);
  EXPECT_EQ(summary_->val.documents_per_group.size(), 15u);
}

TEST_F(PreparedBrownTest, SplitIsAboutNinetyTenByDocumentsAndTokens) {
  const double val_documents = summary_->val.documents / 500.0;
  const double val_tokens =
      static_cast<double>(summary_->val.tokens) /
      static_cast<double>(summary_->train.tokens + summary_->val.tokens);
  EXPECT_NEAR(val_documents, 0.10, 0.02);
  EXPECT_NEAR(val_tokens, 0.10, 0.03);
}

TEST_F(PreparedBrownTest, TokenFilesHoldEachDocumentAfterEndOfText) {
  absl::StatusOr<TokenFile> train = TokenFile::Open(summary_->train.path);
  ASSERT_TRUE(train.ok()) << train.status();
  absl::StatusOr<TokenFile> val = TokenFile::Open(summary_->val.path);
  ASSERT_TRUE(val.ok()) << val.status();
  EXPECT_EQ(static_cast<int64_t>(train->size()), summary_->train.tokens);
  EXPECT_EQ(static_cast<int64_t>(val->size()), summary_->val.tokens);
  const std::vector<uint32_t> tokens = train->ToVector();
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), kGpt2EndOfText),
            summary_->train.documents);

  // The first train document is ca01, whole.
  const auto second = std::find(tokens.begin() + 1, tokens.end(),
                                static_cast<uint32_t>(kGpt2EndOfText));
  absl::StatusOr<std::string> first_document =
      tokenizer_->Decode(std::vector<int>(tokens.begin(), second));
  ASSERT_TRUE(first_document.ok());
  EXPECT_EQ(*first_document, "<|endoftext|>" + Sample("ca01").text);
}

TEST_F(PreparedBrownTest, MetaJsonDescribesSourceSplitsAndVocabulary) {
  const auto meta =
      nlohmann::json::parse(test::ReadFile(out_->path() + "/meta.json"));
  EXPECT_EQ(meta["source"], "brown");
  EXPECT_EQ(meta["split_by"], "documents");
  EXPECT_EQ(meta["tokenizer"]["vocab_size"], 50257);
  EXPECT_EQ(meta["tokenizer"]["eot_token"], 50256);
  EXPECT_EQ(meta["train"]["file"], "train.bin");
  EXPECT_EQ(meta["train"]["tokens"], summary_->train.tokens);
  EXPECT_EQ(meta["val"]["documents"], summary_->val.documents);
  EXPECT_EQ(meta["val"]["document_names"].size(),
            static_cast<size_t>(summary_->val.documents));
  EXPECT_EQ(meta["val"]["documents_per_group"].size(), 15u);
}

TEST_F(PreparedBrownTest, PreparingAgainGivesIdenticalBytes) {
  test::TempDir again;
  ASSERT_TRUE(PrepareDataset(*corpus_, *tokenizer_, again.path()).ok());
  for (const char* file : {"train.bin", "val.bin", "meta.json"}) {
    // Compare contents, not the folder names that meta.json does not hold.
    EXPECT_TRUE(test::ReadFile(again / file) ==
                test::ReadFile(out_->path() + "/" + file))
        << file << " differs between two runs";
  }
}

// Every rank of every job on `data: brown` asks for it at once: one prepares,
// the others wait and find it there; nothing half-written is left.
TEST(PrepareBuiltinDatasetTest, ConcurrentCallersGetOneCompleteDataset) {
  test::TempDir state;
  const std::string dir = state / "data/brown";
  std::vector<absl::Status> results(3);
  std::vector<std::thread> callers;
  for (absl::Status& result : results) {
    callers.emplace_back(
        [&result, &dir] { result = PrepareBuiltinDataset("brown", dir); });
  }
  for (std::thread& caller : callers) caller.join();
  for (const absl::Status& result : results) {
    EXPECT_TRUE(result.ok()) << result;
  }
  absl::StatusOr<int64_t> tokens = ReadTokenFileHeader(dir + "/train.bin");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_GT(*tokens, 100000);
  EXPECT_TRUE(std::filesystem::exists(dir + "/val.bin"));
  EXPECT_FALSE(std::filesystem::exists(dir + ".staging"));
  EXPECT_EQ(PrepareBuiltinDataset("wikitext", dir).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardtrain
