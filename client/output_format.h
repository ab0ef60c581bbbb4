// How read commands print: `--output table` (aligned columns for people),
// `json` (the API's messages, proto field names, every field) or `yaml`.
#ifndef SHARDTRAIN_CLIENT_OUTPUT_FORMAT_H_
#define SHARDTRAIN_CLIENT_OUTPUT_FORMAT_H_

#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace shardtrain::cli {

// Adds -o/--output {table,json,yaml} bound to `format` (default table).
void AddOutputFlag(CLI::App* app, std::string* format);

// The message as JSON (proto field names, enums by name, zero values kept).
std::string MessageToJson(const google::protobuf::Message& message);
// The same document as block-style YAML.
std::string JsonToYaml(const std::string& json);
// Prints `message` in `format` ("json" or "yaml") on stdout.
void PrintMessage(const google::protobuf::Message& message,
                  const std::string& format);

// `text` safe to print on a terminal: every control character (C0 but tab,
// DEL, and C1 in UTF-8) shown as an escape ("\x1b", "\u009b"), so that
// bytes from a job's log, an error text or a checkpoint's names cannot move
// the cursor, retitle the window or forge a line. Newlines are kept only when
// `keep_newlines`. Every string the CLI prints that it did not write itself
// passes through here (tables do it for their cells).
std::string TerminalSafe(absl::string_view text, bool keep_newlines = false);

// Left-aligned columns separated by two spaces, header first; cells pass
// through TerminalSafe.
std::string FormatTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows);

// "3m12s"-style age of a unix-ms time relative to now; "-" for 0.
std::string FormatAge(int64_t unix_ms);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_OUTPUT_FORMAT_H_
