#include "common/json_excerpt.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

using ::testing::EndsWith;
using ::testing::StartsWith;

TEST(JsonExcerptTest, ShortShallowValueIsItsJson) {
  for (const char* text :
       {R"(128)", R"(1e-05)", R"(null)", R"("llama")", R"([1,2])",
        R"({"type":"linear","factor":2.0})", R"([[1,2],{"a":[]}])"}) {
    const nlohmann::json value = nlohmann::json::parse(text);
    EXPECT_EQ(JsonExcerpt(value), value.dump()) << text;
  }
  EXPECT_EQ(JsonExcerpt(nlohmann::ordered_json::parse(R"({"b":1,"a":2})")),
            R"({"b":1,"a":2})");
}

TEST(JsonExcerptTest, ContainersBelowTheSecondLevelAreElided) {
  EXPECT_EQ(JsonExcerpt(nlohmann::json::parse(R"([[[1]],{"a":{"b":2}}])")),
            R"([[[...]],{"a":{...}}])");
}

// A value nested 100,000 deep, which dump() would recurse through.
TEST(JsonExcerptTest, DeepValueGivesAShortPrefix) {
  const nlohmann::json deep = nlohmann::json::parse(std::string(100'000, '[') +
                                                    std::string(100'000, ']'));
  EXPECT_EQ(JsonExcerpt(deep), "[[[...]]]");
}

TEST(JsonExcerptTest, LargeValueIsCutAtMaxChars) {
  const nlohmann::json wide = std::vector<int>(1'000'000, 7);
  const std::string excerpt = JsonExcerpt(wide, 40);
  EXPECT_EQ(excerpt.size(), 43u);
  EXPECT_THAT(excerpt, StartsWith("[7,7,7"));
  EXPECT_THAT(excerpt, EndsWith("..."));

  const nlohmann::json text = std::string(1 << 20, 'x');
  EXPECT_EQ(JsonExcerpt(text, 10), "\"xxxxxxxxx...");
}

TEST(JsonExcerptTest, CutNeverSplitsAUtf8Character) {
  // "é" is two bytes; the cut falls inside the fifth one.
  std::string accents;
  for (int i = 0; i < 100; ++i) accents += "\xc3\xa9";
  const std::string excerpt = JsonExcerpt(nlohmann::json(accents), 10);
  EXPECT_EQ(excerpt, "\"" + accents.substr(0, 8) + "...");
}

}  // namespace
}  // namespace shardtrain
