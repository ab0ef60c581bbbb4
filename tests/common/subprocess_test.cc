// SpawnSubprocess: what a child gets and what it does not inherit.
#include "common/subprocess.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

// Waits for `pid` and returns its exit code (-1 if a signal killed it).
int WaitExit(int pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadAll(int fd) {
  std::string out;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof buffer)) > 0) out.append(buffer, n);
  close(fd);
  return out;
}

TEST(SubprocessTest, LogFileGetsStdoutStderrAndTheEnvironmentOverrides) {
  test::TempDir dir;
  SubprocessOptions options;
  options.argv = {"/bin/sh", "-c", "echo out $SHARDTRAIN_X; echo err >&2"};
  options.env = {{"SHARDTRAIN_X", "42"}};
  options.output = SubprocessOptions::Output::kLogFile;
  options.log_path = dir / "log";
  absl::StatusOr<Subprocess> child = SpawnSubprocess(options);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(WaitExit(child->pid), 0);
  EXPECT_EQ(test::ReadFile(dir / "log"), "out 42\nerr\n");
}

TEST(SubprocessTest, PipesCarryOutputAndNoOtherDescriptorIsInherited) {
  // A descriptor this process holds without close-on-exec (as a leaked
  // socket or database would be) must not reach the child.
  const int opened = open("/dev/null", O_RDONLY);
  ASSERT_GE(opened, 0);
  const int leaked = dup2(opened, 57);  // clear of the child's own
  close(opened);
  ASSERT_EQ(leaked, 57);
  SubprocessOptions options;
  options.argv = {"/bin/sh", "-c", "ls /proc/self/fd; echo done >&2"};
  options.output = SubprocessOptions::Output::kPipes;
  absl::StatusOr<Subprocess> child = SpawnSubprocess(options);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::string out = ReadAll(child->stdout_fd);
  const std::string err = ReadAll(child->stderr_fd);
  EXPECT_EQ(WaitExit(child->pid), 0);
  close(leaked);
  EXPECT_EQ(err, "done\n");
  // ls lists 0, 1, 2 and the descriptor it opened to read the folder.
  EXPECT_THAT(out, HasSubstr("0\n1\n2\n"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("57"))) << out;
}

TEST(SubprocessTest, LeadsItsOwnProcessGroupUnlessToldToJoinOne) {
  SubprocessOptions options;
  options.argv = {"/bin/sleep", "5"};
  absl::StatusOr<Subprocess> leader = SpawnSubprocess(options);
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ(getpgid(leader->pid), leader->pid);
  options.process_group = leader->pid;
  absl::StatusOr<Subprocess> member = SpawnSubprocess(options);
  ASSERT_TRUE(member.ok()) << member.status();
  EXPECT_EQ(getpgid(member->pid), leader->pid);
  kill(-leader->pid, SIGKILL);  // one signal stops the group
  EXPECT_EQ(WaitExit(leader->pid), -1);
  EXPECT_EQ(WaitExit(member->pid), -1);
}

// `shardtrain daemon` starts shardtraind this way: its own session, so it
// outlives the shell, and no death signal tied to the thread that spawned it.
TEST(SubprocessTest, ADetachedChildLeadsItsOwnSessionAndOutlivesItsSpawner) {
  test::TempDir dir;
  SubprocessOptions options;
  options.argv = {"/bin/sh", "-c", "sleep 1; echo alive"};
  options.detached = true;
  options.output = SubprocessOptions::Output::kLogFile;
  options.log_path = dir / "log";
  int pid = -1;
  std::thread spawner([&] {
    absl::StatusOr<Subprocess> child = SpawnSubprocess(options);
    ASSERT_TRUE(child.ok()) << child.status();
    pid = child->pid;
  });
  spawner.join();  // the spawning thread is gone: no SIGKILL follows
  ASSERT_GT(pid, 0);
  EXPECT_EQ(getsid(pid), pid);
  EXPECT_EQ(WaitExit(pid), 0);
  EXPECT_EQ(test::ReadFile(dir / "log"), "alive\n");
}

TEST(SubprocessTest, AProgramThatCannotRunIsAnErrorNamingIt) {
  SubprocessOptions options;
  options.argv = {"/nonexistent/shardtrain-worker"};
  absl::StatusOr<Subprocess> child = SpawnSubprocess(options);
  EXPECT_EQ(child.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(child.status().message(),
              HasSubstr("cannot run /nonexistent/shardtrain-worker"));
  EXPECT_THAT(child.status().message(), HasSubstr("No such file"));
  EXPECT_EQ(SpawnSubprocess(SubprocessOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SubprocessTest, DescribesExitsAsPeopleReadThem) {
  EXPECT_EQ(DescribeExit(3, 0), "exit code 3");
  EXPECT_EQ(DescribeExit(0, SIGKILL), "signal KILL");
  EXPECT_EQ(DescribeExit(0, SIGSEGV), "signal SEGV");
}

TEST(RunCommandTest, CollectsOutputEnvironmentAndExitCode) {
  absl::StatusOr<CommandResult> result =
      RunCommand({"sh", "-c", "echo out $SHARDTRAIN_X; echo err >&2; exit 3"},
                 {{"SHARDTRAIN_X", "7"}}, 10);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->out, "out 7\n");
  EXPECT_EQ(result->err, "err\n");
  EXPECT_EQ(result->exit_code, 3);
  EXPECT_FALSE(result->ok());
}

TEST(RunCommandTest, KillsACommandPastItsTimeout) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<CommandResult> result = RunCommand({"sleep", "30"}, {}, 0.3);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("sleep 30"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(RunCommandTest, AMissingProgramIsAnErrorNamingIt) {
  absl::StatusOr<CommandResult> result =
      RunCommand({"shardtrain-no-such-program"}, {}, 5);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("shardtrain-no-such-program"));
}

}  // namespace
}  // namespace shardtrain
