// PretokenRegex: a tokenizer's pre-tokenization regex (GPT-2's, or the
// Split pattern a tokenizer.json chooses) compiled with PCRE2 (JIT when the
// CPU has it) and matched within bounds, so that a pattern that backtracks
// catastrophically is refused in a fraction of a second instead of running
// for hours: PCRE2's match, depth and heap limits, a bounded JIT stack, and
// a time bound per text (MatchTimer). Thread-safe; matching state is per
// thread.
#ifndef SHARDTRAIN_CORE_DATA_PRETOKEN_REGEX_H_
#define SHARDTRAIN_CORE_DATA_PRETOKEN_REGEX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct pcre2_real_code_8;

namespace shardtrain {

// The time one text's regex matching has taken, against its bound (a base
// plus a share per MiB of the text). It runs only inside the matching, so
// the merges between matches do not count.
class MatchTimer {
 public:
  explicit MatchTimer(size_t text_bytes);

  void Start();
  void Stop();
  // Between Start and Stop: whether the bound is passed.
  bool Expired() const;

  size_t text_bytes() const { return text_bytes_; }
  double limit_seconds() const { return limit_ns_ * 1e-9; }

 private:
  size_t text_bytes_;
  int64_t limit_ns_;
  int64_t spent_ns_ = 0;
  int64_t started_ns_ = 0;
};

class PretokenRegex {
 public:
  // InvalidArgument naming the offset in `pattern` where it does not
  // compile.
  static absl::StatusOr<PretokenRegex> Compile(const std::string& pattern);

  PretokenRegex(PretokenRegex&&) noexcept;
  PretokenRegex& operator=(PretokenRegex&&) noexcept;
  ~PretokenRegex();

  // The next match in `text` at or after `start`: true and its byte range
  // in [*begin, *end); false when nothing more matches. InvalidArgument
  // naming the pattern (cut to 60 bytes) and the bound it exceeded.
  // `timer` times the whole text being encoded.
  absl::StatusOr<bool> Find(absl::string_view text, size_t start,
                            MatchTimer* timer, size_t* begin,
                            size_t* end) const;
  // Whether the pattern matches the empty text (and so would never move on).
  bool MatchesEmpty() const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct CodeDeleter {
    void operator()(pcre2_real_code_8* code) const;
  };
  PretokenRegex(std::string pattern,
                std::unique_ptr<pcre2_real_code_8, CodeDeleter> code);

  std::string pattern_;
  std::unique_ptr<pcre2_real_code_8, CodeDeleter> code_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_PRETOKEN_REGEX_H_
