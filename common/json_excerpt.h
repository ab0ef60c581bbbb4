// A JSON value as a short, bounded text for error messages.
//
// nlohmann::json::dump() recurses once per level and writes the whole value,
// so quoting a field of a file we were handed in an error can overflow the
// stack (a value nested 100,000 deep) or copy megabytes into a message. An
// error names what it refuses with JsonExcerpt instead.
#ifndef SHARDTRAIN_COMMON_JSON_EXCERPT_H_
#define SHARDTRAIN_COMMON_JSON_EXCERPT_H_

#include <cstddef>
#include <string>

#include "nlohmann/json.hpp"

namespace shardtrain {

// `value` as compact JSON (what dump() writes) when that is short and
// shallow; otherwise a prefix of it: containers below the second level are
// written {...} or [...], and the text is cut after `max_chars` characters
// (at a UTF-8 character boundary) and ends in "...". Recurses at most three
// levels and reads about `max_chars` characters' worth of the value, however
// large or deep it is.
std::string JsonExcerpt(const nlohmann::json& value, size_t max_chars = 80);
std::string JsonExcerpt(const nlohmann::ordered_json& value,
                        size_t max_chars = 80);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_JSON_EXCERPT_H_
