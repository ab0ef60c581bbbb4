#include "server/user_directory.h"

#include <set>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flag_file.h"
#include "common/secrets.h"

namespace shardtrain {
namespace {

constexpr size_t kMaxTokenFileBytes = 1 << 20;
constexpr size_t kMaxUserName = 64;

bool ValidUserName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxUserName) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' &&
        c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string Caller::Describe() const {
  return user.empty() ? "an anonymous caller" : user;
}

absl::StatusOr<std::vector<UserRecord>> ParseTokenFile(const std::string& path,
                                                       absl::string_view text) {
  std::vector<UserRecord> records;
  std::set<std::string> tokens;
  int line_number = 0;
  bool bare = false;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line.front() == '#') continue;
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth-token-file: '", path, "' line ", line_number, ": ", what));
    };
    if (line.find(',') == absl::string_view::npos) {
      // The single-token form: the whole file is one token.
      if (!records.empty() || bare) {
        return bad(
            "a bare token beside other lines; give every line as "
            "token,user,role[,max_devices]");
      }
      if (absl::c_any_of(line, [](char c) {
            return absl::ascii_isspace(static_cast<unsigned char>(c));
          })) {
        return bad("a token may not contain whitespace");
      }
      records.push_back({std::string(line), "admin", true, -1});
      bare = true;
      continue;
    }
    if (bare) {
      return bad(
          "a token,user,role line after a bare token; give every line as "
          "token,user,role[,max_devices]");
    }
    std::vector<std::string> fields = absl::StrSplit(line, ',');
    for (std::string& f : fields) absl::StripAsciiWhitespace(&f);
    if (fields.size() < 3 || fields.size() > 4) {
      return bad(absl::StrCat("expected token,user,role[,max_devices]; got ",
                              fields.size(), " fields"));
    }
    UserRecord record;
    record.token = fields[0];
    record.user = fields[1];
    if (record.token.empty()) return bad("the token is empty");
    if (!ValidUserName(record.user)) {
      return bad(absl::StrCat("user '", record.user.substr(0, kMaxUserName),
                              "': a name of 1 to 64 letters, digits, '.', "
                              "'_' or '-'"));
    }
    if (fields[2] == "admin") {
      record.admin = true;
    } else if (fields[2] != "user") {
      return bad(absl::StrCat("role '", fields[2].substr(0, 32),
                              "': must be admin or user"));
    }
    if (fields.size() == 4 && !fields[3].empty()) {
      if (!absl::SimpleAtoi(fields[3], &record.max_devices) ||
          record.max_devices < 0) {
        return bad(absl::StrCat("max_devices '", fields[3].substr(0, 32),
                                "': must be a whole number >= 0 (0: none)"));
      }
    }
    if (!tokens.insert(record.token).second) {
      return bad(absl::StrCat("the token of ", record.user,
                              " is given to another user above; every token "
                              "must name one user"));
    }
    for (const UserRecord& other : records) {
      if (other.user == record.user &&
          (other.admin != record.admin ||
           other.max_devices != record.max_devices)) {
        return bad(absl::StrCat(record.user,
                                " appears above with another role or "
                                "max_devices; give each of a user's tokens "
                                "the same"));
      }
    }
    records.push_back(std::move(record));
  }
  if (records.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-token-file: '", path, "' is empty (no token in it)"));
  }
  return records;
}

absl::StatusOr<std::unique_ptr<UserDirectory>> UserDirectory::Load(
    const std::string& path) {
  auto directory = std::make_unique<UserDirectory>();
  directory->path_ = path;
  if (absl::Status s = directory->Reload(); !s.ok()) return s;
  return directory;
}

absl::Status UserDirectory::Reload() {
  if (path_.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> text = ReadFlagFile(
      "--auth-token-file", path_, FlagFileOptions::Secret(kMaxTokenFileBytes));
  if (!text.ok()) return text.status();
  absl::StatusOr<std::vector<UserRecord>> records =
      ParseTokenFile(path_, *text);
  if (!records.ok()) return records.status();
  absl::MutexLock lock(&mutex_);
  records_ = std::move(*records);
  return absl::OkStatus();
}

std::optional<Caller> UserDirectory::Find(absl::string_view token) const {
  absl::MutexLock lock(&mutex_);
  std::optional<Caller> found;
  // Every record is compared, so the time taken says nothing of which one
  // (or whether one) matched.
  for (const UserRecord& record : records_) {
    if (SecretsEqual(token, record.token) && !found.has_value()) {
      found = Caller{record.user, record.admin};
    }
  }
  return found;
}

int UserDirectory::QuotaOf(const std::string& user, int default_quota) const {
  absl::MutexLock lock(&mutex_);
  for (const UserRecord& record : records_) {
    if (record.user == user && record.max_devices >= 0) {
      return record.max_devices;
    }
  }
  return default_quota;
}

size_t UserDirectory::size() const {
  absl::MutexLock lock(&mutex_);
  std::set<std::string> names;
  for (const UserRecord& record : records_) names.insert(record.user);
  return names.size();
}

}  // namespace shardtrain
