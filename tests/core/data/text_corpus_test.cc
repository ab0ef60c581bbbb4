// Plain text corpora and how PrepareDataset splits them.
#include "core/data/text_corpus.h"

#include <filesystem>
#include <string>
#include <vector>

#include "core/data/bpe_tokenizer.h"
#include "core/data/dataset_preparer.h"
#include "core/data/token_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> Names(const Corpus& corpus) {
  std::vector<std::string> names;
  for (const Document& d : corpus.documents) names.push_back(d.name);
  return names;
}

TEST(LoadTextCorpusTest, FileIsOneDocumentWhateverItsName) {
  test::TempDir dir;
  test::WriteFile(dir / "story.md", "Once upon a time.");
  absl::StatusOr<Corpus> corpus = LoadTextCorpus({dir / "story.md"});
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  ASSERT_EQ(corpus->documents.size(), 1u);
  EXPECT_EQ(corpus->documents[0].text, "Once upon a time.");
  EXPECT_EQ(corpus->source, dir / "story.md");
}

TEST(LoadTextCorpusTest, FolderGivesItsTxtFilesRecursivelyInPathOrder) {
  test::TempDir dir;
  std::filesystem::create_directories(dir / "sub");
  test::WriteFile(dir / "b.txt", "bee");
  test::WriteFile(dir / "a.txt", "ay");
  test::WriteFile(dir / "sub/c.txt", "sea");
  test::WriteFile(dir / "notes.md", "skipped");
  test::WriteFile(dir / "blank.txt", " \n\t\n");

  absl::StatusOr<Corpus> corpus = LoadTextCorpus({dir.path()});
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_THAT(Names(*corpus),
              ElementsAre(dir / "a.txt", dir / "b.txt", dir / "sub/c.txt"));
}

TEST(LoadTextCorpusTest, SameFileTwiceIsOneDocument) {
  test::TempDir dir;
  test::WriteFile(dir / "a.txt", "ay");
  absl::StatusOr<Corpus> corpus = LoadTextCorpus({dir / "a.txt", dir.path()});
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ(corpus->documents.size(), 1u);
}

TEST(LoadTextCorpusTest, MissingPathIsNotFoundNamingIt) {
  absl::StatusOr<Corpus> corpus = LoadTextCorpus({"/nonexistent/x.txt"});
  ASSERT_FALSE(corpus.ok());
  EXPECT_EQ(corpus.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(corpus.status().message(), HasSubstr("/nonexistent/x.txt"));
}

TEST(LoadTextCorpusTest, FolderWithoutTxtFilesIsNotFound) {
  test::TempDir dir;
  test::WriteFile(dir / "notes.md", "text");
  absl::StatusOr<Corpus> corpus = LoadTextCorpus({dir.path()});
  ASSERT_FALSE(corpus.ok());
  EXPECT_THAT(corpus.status().message(), HasSubstr("no .txt files"));
}

TEST(LoadTextCorpusTest, OnlyBlankFilesIsAnEmptyCorpus) {
  test::TempDir dir;
  test::WriteFile(dir / "empty.txt", "");
  test::WriteFile(dir / "blank.txt", "\n\n");
  absl::StatusOr<Corpus> corpus = LoadTextCorpus({dir.path()});
  ASSERT_FALSE(corpus.ok());
  EXPECT_EQ(corpus.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(corpus.status().message(), HasSubstr("empty corpus"));
}

TEST(LoadJsonlCorpusTest, LineNestedTooDeepIsRefusedNamingIt) {
  test::TempDir dir;
  test::WriteFile(dir / "docs.jsonl",
                  "{\"text\": \"fine\"}\n{\"text\": \"x\", \"meta\": " +
                      std::string(100'000, '[') + std::string(100'000, ']') +
                      "}\n");
  absl::StatusOr<Corpus> corpus = LoadJsonlCorpus({dir / "docs.jsonl"}, "text");
  ASSERT_FALSE(corpus.ok());
  EXPECT_EQ(corpus.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(corpus.status().message(),
              HasSubstr(dir / "docs.jsonl:2 nests 100001 levels deep"));
}

TEST(ChooseValidationDocumentsTest, TakesATenthOfEachGroupEvenlySpread) {
  std::vector<Document> documents;
  for (int i = 0; i < 44; ++i) documents.push_back({"a", "news", "x"});
  for (int i = 0; i < 6; ++i) documents.push_back({"m", "scifi", "x"});
  documents.push_back({"lone", "solo", "x"});

  const std::vector<bool> is_val = ChooseValidationDocuments(documents);
  std::vector<int> val;
  for (size_t i = 0; i < is_val.size(); ++i) {
    if (is_val[i]) val.push_back(static_cast<int>(i));
  }
  // 4 of 44 news, 1 of 6 scifi (at least one), the lone document in train.
  EXPECT_THAT(val, ElementsAre(5, 16, 27, 38, 47));
}

TEST(ChooseValidationDocumentsTest, TwoDocumentsPutOneInEachSplit) {
  const std::vector<bool> is_val =
      ChooseValidationDocuments({{"a", "", "x"}, {"b", "", "y"}});
  EXPECT_THAT(is_val, ElementsAre(false, true));
}

class PrepareTextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<BpeTokenizer> tokenizer = BpeTokenizer::LoadDefault();
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::make_unique<BpeTokenizer>(std::move(*tokenizer));
  }

  std::vector<uint16_t> Tokens(const std::string& path) {
    absl::StatusOr<TokenFile> file = TokenFile::Open(path);
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) return {};
    const std::vector<uint32_t> ids = file->ToVector();
    return {ids.begin(), ids.end()};
  }

  std::unique_ptr<BpeTokenizer> tokenizer_;
  test::TempDir dir_;
};

TEST_F(PrepareTextTest, SingleDocumentIsCutNinetyTenByTokens) {
  std::string text;
  for (int i = 0; i < 100; ++i)
    text += "Sentence number " + std::to_string(i) + ". ";
  const Corpus corpus{"story", {{"story.txt", "", text}}};

  absl::StatusOr<DatasetSummary> summary =
      PrepareDataset(corpus, *tokenizer_, dir_ / "out");
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->split_by, "tokens");

  absl::StatusOr<std::vector<int>> encoded = tokenizer_->Encode(text);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  std::vector<int> all = *encoded;
  all.insert(all.begin(), kGpt2EndOfText);
  const std::vector<uint16_t> train = Tokens(dir_ / "out/train.bin");
  const std::vector<uint16_t> val = Tokens(dir_ / "out/val.bin");
  ASSERT_FALSE(val.empty());
  EXPECT_EQ(val[0], kGpt2EndOfText);
  std::vector<int> joined(train.begin(), train.end());
  joined.insert(joined.end(), val.begin() + 1, val.end());
  EXPECT_EQ(joined, all);
  EXPECT_NEAR(static_cast<double>(train.size()) / all.size(), 0.9, 0.01);
}

TEST_F(PrepareTextTest, DocumentsGoWholeToOneSplit) {
  Corpus corpus{"files", {}};
  for (int i = 0; i < 20; ++i) {
    corpus.documents.push_back(
        {"doc" + std::to_string(i), "", "Document " + std::to_string(i)});
  }
  absl::StatusOr<DatasetSummary> summary =
      PrepareDataset(corpus, *tokenizer_, dir_ / "out");
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->split_by, "documents");
  EXPECT_EQ(summary->train.documents, 18);
  EXPECT_EQ(summary->val.documents, 2);

  const std::vector<uint16_t> val = Tokens(dir_ / "out/val.bin");
  std::vector<int> expected;
  for (int i : {5, 15}) {
    expected.push_back(kGpt2EndOfText);
    absl::StatusOr<std::vector<int>> ids =
        tokenizer_->Encode("Document " + std::to_string(i));
    ASSERT_TRUE(ids.ok()) << ids.status();
    expected.insert(expected.end(), ids->begin(), ids->end());
  }
  EXPECT_EQ(std::vector<int>(val.begin(), val.end()), expected);
  const auto meta =
      nlohmann::json::parse(test::ReadFile(dir_ / "out/meta.json"));
  EXPECT_EQ(meta["val"]["document_names"], nlohmann::json({"doc5", "doc15"}));
}

TEST_F(PrepareTextTest, EmptyCorpusIsRejected) {
  absl::StatusOr<DatasetSummary> summary =
      PrepareDataset(Corpus{"nothing", {}}, *tokenizer_, dir_ / "out");
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(summary.status().message(), HasSubstr("empty corpus"));
}

TEST_F(PrepareTextTest, OutputPathThatIsAFileIsAnError) {
  test::WriteFile(dir_ / "taken", "x");
  absl::StatusOr<DatasetSummary> summary = PrepareDataset(
      Corpus{"one", {{"a", "", "text"}}}, *tokenizer_, dir_ / "taken");
  ASSERT_FALSE(summary.ok());
  EXPECT_THAT(summary.status().message(), HasSubstr(dir_ / "taken"));
}

}  // namespace
}  // namespace shardtrain
