// What the CLI prints that it did not write itself (a job's log lines, error
// texts from the daemon, names read from a checkpoint) cannot drive the
// terminal.
#include "client/output_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace shardtrain::cli {
namespace {

TEST(TerminalSafeTest, ControlCharactersAreShownAsEscapes) {
  // A window-title OSC, a screen clear, a bell, a carriage return that would
  // overwrite the line, and DEL.
  EXPECT_EQ(TerminalSafe("\x1b]0;owned\x07ok\x1b[2J\rfake\x7f"),
            "\\x1b]0;owned\\x07ok\\x1b[2J\\x0dfake\\x7f");
  // C1 controls in UTF-8 (U+009B is a one-byte CSI on some terminals).
  EXPECT_EQ(TerminalSafe("a\xc2\x9b"
                         "31mb"),
            "a\\u009b31mb");
}

TEST(TerminalSafeTest, TextTabsAndUnicodeAreKept) {
  EXPECT_EQ(TerminalSafe("step 1\tloss 5.2 — Ünïcode ✓"),
            "step 1\tloss 5.2 — Ünïcode ✓");
  EXPECT_EQ(TerminalSafe("\xc2\xa0nbsp"), "\xc2\xa0nbsp");  // U+00A0
}

TEST(TerminalSafeTest, NewlinesAreKeptOnlyWhenAsked) {
  EXPECT_EQ(TerminalSafe("forged\nline"), "forged\\x0aline");
  EXPECT_EQ(TerminalSafe("two\nlines", /*keep_newlines=*/true), "two\nlines");
}

TEST(TerminalSafeTest, TableCellsAreSafeAndAlignedByWhatIsShown) {
  const std::string table =
      FormatTable({"NAME", "STATE"}, {{"a\x1b[31m", "RUNNING"}, {"bb", "X"}});
  EXPECT_EQ(table.find('\x1b'), std::string::npos) << table;
  EXPECT_THAT(table, ::testing::HasSubstr("a\\x1b[31m  RUNNING\n"));
}

}  // namespace
}  // namespace shardtrain::cli
