#include "client/output_format.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace shardtrain::cli {
namespace {

void BlockStyle(YAML::Node node) {
  node.SetStyle(YAML::EmitterStyle::Block);
  if (node.IsMap()) {
    for (auto it = node.begin(); it != node.end(); ++it) BlockStyle(it->second);
  } else if (node.IsSequence()) {
    for (auto it = node.begin(); it != node.end(); ++it) BlockStyle(*it);
  }
}

// Protobuf's JSON writes 64-bit integers as strings (for JavaScript's sake);
// jq, pandas and a person expect numbers. Rewrites them where `message`'s
// descriptor says a field is one, at any depth (repeated, maps, nested).
void Int64sAsNumbers(const google::protobuf::Descriptor* type,
                     nlohmann::ordered_json& object) {
  using google::protobuf::FieldDescriptor;
  if (!object.is_object()) return;
  auto convert = [](const FieldDescriptor* field,
                    nlohmann::ordered_json& value) {
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT64:
        if (value.is_string()) value = std::stoll(value.get<std::string>());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        if (value.is_string()) value = std::stoull(value.get<std::string>());
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        // Well-known types (Timestamp, Duration) have JSON forms of their own.
        if (field->message_type()->file()->package() != "google.protobuf") {
          Int64sAsNumbers(field->message_type(), value);
        }
        break;
      default:
        break;
    }
  };
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor* field = type->field(i);
    auto it = object.find(field->name());
    if (it == object.end()) continue;
    if (field->is_map()) {
      const FieldDescriptor* value_field = field->message_type()->map_value();
      for (auto item : it->items()) convert(value_field, item.value());
    } else if (field->is_repeated()) {
      for (nlohmann::ordered_json& element : *it) convert(field, element);
    } else {
      convert(field, *it);
    }
  }
}

}  // namespace

void AddOutputFlag(CLI::App* app, std::string* format) {
  app->add_option("-o,--output", *format, "table | json | yaml")
      ->check(CLI::IsMember({"table", "json", "yaml"}))
      ->capture_default_str();
}

std::string MessageToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  nlohmann::ordered_json parsed =
      nlohmann::ordered_json::parse(json, nullptr, false);
  if (parsed.is_discarded()) return json;
  Int64sAsNumbers(message.GetDescriptor(), parsed);
  return parsed.dump(2) + "\n";
}

std::string JsonToYaml(const std::string& json) {
  YAML::Node node = YAML::Load(json);
  BlockStyle(node);
  YAML::Emitter out;
  out << node;
  return std::string(out.c_str()) + "\n";
}

void PrintMessage(const google::protobuf::Message& message,
                  const std::string& format) {
  const std::string json = MessageToJson(message);
  std::cout << (format == "yaml" ? JsonToYaml(json) : json);
  std::cout.flush();
}

std::string TerminalSafe(absl::string_view text, bool keep_newlines) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c < 0x20 && c != '\t' && !(keep_newlines && c == '\n')) || c == 0x7f) {
      absl::StrAppendFormat(&out, "\\x%02x", c);
    } else if (c == 0xc2 && i + 1 < text.size() &&
               static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(text[i + 1]) <= 0x9f) {
      absl::StrAppendFormat(&out, "\\u%04x",
                            static_cast<unsigned char>(text[++i]));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string FormatTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& raw_rows) {
  std::vector<std::vector<std::string>> rows = raw_rows;
  for (auto& row : rows) {
    for (std::string& cell : row) cell = TerminalSafe(cell);
  }
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string text;
    for (size_t c = 0; c < cells.size(); ++c) {
      text += cells[c];
      if (c + 1 < cells.size())
        text += std::string(width[c] - cells[c].size() + 2, ' ');
    }
    out += text + "\n";
  };
  line(header);
  for (const auto& row : rows) line(row);
  return out;
}

std::string FormatAge(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  const absl::Duration age = absl::Trunc(
      absl::Now() - absl::FromUnixMillis(unix_ms), absl::Seconds(1));
  // absl writes a zero duration as a bare "0": every age carries its unit.
  if (age < absl::Seconds(1)) return "0s";
  return absl::FormatDuration(age);
}

}  // namespace shardtrain::cli
