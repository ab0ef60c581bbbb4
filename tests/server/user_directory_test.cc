// The token file's users, roles and quotas, and its reload.
#include "server/user_directory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>

#include "tests/test_util.h"

namespace shardtrain {
namespace {

using test::TempDir;
using test::WriteFile;
using ::testing::HasSubstr;

TEST(UserDirectoryTest, LinesNameUsersRolesAndQuotas) {
  absl::StatusOr<std::vector<UserRecord>> users = ParseTokenFile(
      "t",
      "# token,user,role[,max_devices]\n\n tok-a , alice, user, 6\n"
      "tok-o,ops,admin\ntok-a2,alice,user,6\n");
  ASSERT_TRUE(users.ok()) << users.status();
  ASSERT_EQ(users->size(), 3u);
  EXPECT_EQ((*users)[0].token, "tok-a");
  EXPECT_EQ((*users)[0].user, "alice");
  EXPECT_FALSE((*users)[0].admin);
  EXPECT_EQ((*users)[0].max_devices, 6);
  EXPECT_TRUE((*users)[1].admin);
  EXPECT_EQ((*users)[1].max_devices, -1);
}

TEST(UserDirectoryTest, ASingleBareTokenIsOneAdmin) {
  absl::StatusOr<std::vector<UserRecord>> users =
      ParseTokenFile("t", "  s3cret-token \n");
  ASSERT_TRUE(users.ok()) << users.status();
  ASSERT_EQ(users->size(), 1u);
  EXPECT_EQ((*users)[0].token, "s3cret-token");
  EXPECT_EQ((*users)[0].user, "admin");
  EXPECT_TRUE((*users)[0].admin);
}

TEST(UserDirectoryTest, MistakesAreNamedWithTheirLine) {
  struct Case {
    const char* text;
    const char* error;
  };
  for (const Case& c : std::vector<Case>{
           {"a,alice\n", "line 1: expected token,user,role[,max_devices]"},
           {"a,alice,root\n", "line 1: role 'root': must be admin or user"},
           {"a,al ice,user\n", "user 'al ice': a name of 1 to 64"},
           {"a,alice,user,-1\n", "max_devices '-1': must be a whole number"},
           {"a,alice,user,x\n", "max_devices 'x'"},
           {"a,alice,user\na,bob,user\n",
            "line 2: the token of bob is given to another user"},
           {"a,alice,user\nb,alice,admin\n",
            "line 2: alice appears above with another role"},
           {"a,alice,user\nbare\n", "line 2: a bare token beside other lines"},
           {",alice,user\n", "the token is empty"},
           {"# only a comment\n\n", "is empty (no token in it)"},
       }) {
    absl::StatusOr<std::vector<UserRecord>> users =
        ParseTokenFile("/etc/tokens", c.text);
    ASSERT_FALSE(users.ok()) << c.text;
    EXPECT_THAT(users.status().message(), HasSubstr(c.error)) << c.text;
    EXPECT_THAT(users.status().message(),
                HasSubstr("--auth-token-file: '/etc/tokens'"));
  }
}

TEST(UserDirectoryTest, FindsTheCallerAndTheirQuota) {
  TempDir dir;
  const std::string path = dir / "tokens";
  WriteFile(path, "tok-a,alice,user,6\ntok-o,ops,admin\n");
  chmod(path.c_str(), 0600);
  absl::StatusOr<std::unique_ptr<UserDirectory>> users =
      UserDirectory::Load(path);
  ASSERT_TRUE(users.ok()) << users.status();
  EXPECT_TRUE((*users)->enabled());
  std::optional<Caller> alice = (*users)->Find("tok-a");
  ASSERT_TRUE(alice.has_value());
  EXPECT_EQ(alice->user, "alice");
  EXPECT_FALSE(alice->admin);
  EXPECT_TRUE((*users)->Find("tok-o")->admin);
  EXPECT_FALSE((*users)->Find("tok-").has_value());
  EXPECT_FALSE((*users)->Find("tok-ab").has_value());
  EXPECT_FALSE((*users)->Find("").has_value());
  EXPECT_EQ((*users)->QuotaOf("alice", 2), 6);
  EXPECT_EQ((*users)->QuotaOf("ops", 2), 2);
  EXPECT_EQ((*users)->QuotaOf("nobody", 0), 0);
}

TEST(UserDirectoryTest, AReloadThatFailsKeepsTheUsersLoaded) {
  TempDir dir;
  const std::string path = dir / "tokens";
  WriteFile(path, "tok-a,alice,user\n");
  chmod(path.c_str(), 0600);
  absl::StatusOr<std::unique_ptr<UserDirectory>> users =
      UserDirectory::Load(path);
  ASSERT_TRUE(users.ok()) << users.status();

  WriteFile(path, "tok-a,alice,user\ntok-b,bob,user,2\n");
  chmod(path.c_str(), 0600);
  ASSERT_TRUE((*users)->Reload().ok());
  EXPECT_EQ((*users)->Find("tok-b")->user, "bob");
  EXPECT_EQ((*users)->size(), 2u);

  WriteFile(path, "tok-a,alice,superuser\n");
  chmod(path.c_str(), 0600);
  absl::Status bad = (*users)->Reload();
  EXPECT_THAT(bad.message(), HasSubstr("role 'superuser'"));
  EXPECT_EQ((*users)->Find("tok-b")->user, "bob");

  // Readable by others: refused as the single-token file always was.
  WriteFile(path, "tok-a,alice,user\n");
  chmod(path.c_str(), 0644);
  bad = (*users)->Reload();
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(bad.message(), HasSubstr("--auth-token-file"));
  EXPECT_TRUE((*users)->Find("tok-b").has_value());
}

TEST(UserDirectoryTest, WithoutAFileEveryoneIsTheAnonymousAdmin) {
  UserDirectory open;
  EXPECT_FALSE(open.enabled());
  EXPECT_TRUE(open.Reload().ok());
  EXPECT_EQ(Caller{}.Describe(), "an anonymous caller");
  EXPECT_TRUE(Caller{}.admin);
}

}  // namespace
}  // namespace shardtrain
