// How read commands print: `--output table` (aligned columns for people),
// `json` (the API's messages, proto field names, every field) or `yaml`.
#ifndef SHARDTRAIN_CLIENT_OUTPUT_FORMAT_H_
#define SHARDTRAIN_CLIENT_OUTPUT_FORMAT_H_

#include <string>
#include <vector>

#include "CLI/CLI.hpp"
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

// Left-aligned columns separated by two spaces, header first.
std::string FormatTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows);

// "3m12s"-style age of a unix-ms time relative to now; "-" for 0.
std::string FormatAge(int64_t unix_ms);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_OUTPUT_FORMAT_H_
