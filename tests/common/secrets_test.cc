#include "common/secrets.h"

#include <gtest/gtest.h>

#include <string>

namespace shardtrain {
namespace {

TEST(SecretsTest, EqualOnlyWhenEveryByteAndTheLengthAgree) {
  EXPECT_TRUE(SecretsEqual("tok-alice", "tok-alice"));
  EXPECT_TRUE(SecretsEqual("", ""));
  EXPECT_FALSE(SecretsEqual("tok-alice", "tok-alicf"));
  EXPECT_FALSE(SecretsEqual("xok-alice", "tok-alice"));
  // A prefix is not the secret, either way round.
  EXPECT_FALSE(SecretsEqual("tok-ali", "tok-alice"));
  EXPECT_FALSE(SecretsEqual("tok-alice", "tok-ali"));
  EXPECT_FALSE(SecretsEqual("", "x"));
  // Bytes past ASCII and embedded NULs compare as bytes.
  EXPECT_TRUE(
      SecretsEqual(std::string("a\0\xff", 3), std::string("a\0\xff", 3)));
  EXPECT_FALSE(
      SecretsEqual(std::string("a\0\xff", 3), std::string("a\0\xfe", 3)));
}

}  // namespace
}  // namespace shardtrain
