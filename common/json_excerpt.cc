#include "common/json_excerpt.h"

#include <algorithm>
#include <string_view>

namespace shardtrain {
namespace {

// Containers this deep (the value itself is depth 0) are elided.
constexpr int kElidedDepth = 2;

// Appends a JSON string literal of `text`, or of as much of it as takes
// `out` past `max_chars` (where JsonExcerpt cuts it). A cut inside a UTF-8
// character is written as U+FFFD rather than thrown.
void AppendString(std::string_view text, size_t max_chars, std::string* out) {
  const size_t budget = max_chars - std::min(max_chars, out->size());
  const nlohmann::json literal(std::string(text.substr(0, budget + 1)));
  *out += literal.dump(-1, ' ', /*ensure_ascii=*/false,
                       nlohmann::json::error_handler_t::replace);
}

// Appends `value` at `depth`, stopping early once `out` is longer than
// `max_chars`.
template <typename Json>
void AppendExcerpt(const Json& value, int depth, size_t max_chars,
                   std::string* out) {
  if (value.is_string()) {
    AppendString(value.template get_ref<const std::string&>(), max_chars, out);
    return;
  }
  if (!value.is_structured()) {  // a number, true, false or null
    *out += value.dump();
    return;
  }
  const bool object = value.is_object();
  if (value.empty()) {
    *out += object ? "{}" : "[]";
    return;
  }
  if (depth >= kElidedDepth) {
    *out += object ? "{...}" : "[...]";
    return;
  }
  *out += object ? '{' : '[';
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (out->size() > max_chars) return;  // cut by the caller
    if (it != value.begin()) *out += ',';
    if (object) {
      AppendString(it.key(), max_chars, out);
      *out += ':';
    }
    AppendExcerpt(*it, depth + 1, max_chars, out);
  }
  *out += object ? '}' : ']';
}

template <typename Json>
std::string Excerpt(const Json& value, size_t max_chars) {
  std::string out;
  AppendExcerpt(value, 0, max_chars, &out);
  if (out.size() <= max_chars) return out;
  size_t cut = max_chars;
  while (cut > 0 && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  out.resize(cut);
  return out + "...";
}

}  // namespace

std::string JsonExcerpt(const nlohmann::json& value, size_t max_chars) {
  return Excerpt(value, max_chars);
}

std::string JsonExcerpt(const nlohmann::ordered_json& value, size_t max_chars) {
  return Excerpt(value, max_chars);
}

}  // namespace shardtrain
