#include "core/checkpoint/checkpoint_store.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/input_file.h"

namespace shardtrain {
namespace fs = std::filesystem;

CheckpointStore::CheckpointStore(std::string out_dir, int keep)
    : root_(std::move(out_dir) + "/checkpoints"), keep_(keep) {}

std::string CheckpointStore::StagingDir(int64_t step) const {
  return absl::StrFormat("%s/.step_%08d.partial", root_, step);
}

std::string CheckpointStore::FinalDir(int64_t step) const {
  return absl::StrFormat("%s/step_%08d", root_, step);
}

absl::StatusOr<std::string> CheckpointStore::Begin(int64_t step) {
  std::error_code ec;
  const std::string staging = StagingDir(step);
  fs::remove_all(staging, ec);
  fs::create_directories(staging, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create checkpoint dir ",
                                            staging, ": ", ec.message()));
  }
  return staging;
}

absl::Status CheckpointStore::Commit(int64_t step) {
  std::error_code ec;
  const std::string final_dir = FinalDir(step);
  fs::remove_all(final_dir, ec);
  fs::rename(StagingDir(step), final_dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot publish checkpoint ",
                                            final_dir, ": ", ec.message()));
  }
  if (absl::Status s = WriteFileAtomically(
          root_ + "/latest", fs::path(final_dir).filename().string() + "\n");
      !s.ok()) {
    return s;
  }
  // Prune the oldest complete checkpoints beyond `keep_`.
  std::vector<std::string> complete;
  for (const auto& entry : fs::directory_iterator(root_, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind("step_", 0) == 0) {
      complete.push_back(name);
    }
  }
  std::sort(complete.begin(), complete.end());
  for (size_t i = 0; i + keep_ < complete.size(); ++i) {
    fs::remove_all(fs::path(root_) / complete[i], ec);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckpointStore::Latest() const {
  const std::string path = root_ + "/latest";
  absl::StatusOr<InputFile> file = InputFile::Open(path);
  if (absl::IsNotFound(file.status())) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoint in ", root_, " (nothing to resume)"));
  }
  if (!file.ok()) return file.status();
  absl::StatusOr<std::string> text = file->ReadAll(4096, "the latest pointer");
  if (!text.ok()) return text.status();
  const std::string name(absl::StripAsciiWhitespace(*text));
  if (name.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoint in ", root_, " (nothing to resume)"));
  }
  // A step directory's name and nothing else, so that `latest` cannot lead
  // out of the store (and its text is not echoed when it is something else).
  if (!absl::StartsWith(name, "step_") ||
      !std::all_of(name.begin() + 5, name.end(),
                   [](char c) { return c >= '0' && c <= '9'; }) ||
      name.size() == 5) {
    return absl::DataLossError(absl::StrCat(
        path, " does not name a step directory (step_ and digits)"));
  }
  const std::string dir = absl::StrCat(root_, "/", name);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::DataLossError(
        absl::StrCat(root_, "/latest names ", name, ", which is missing"));
  }
  return dir;
}

std::vector<std::string> CheckpointStore::Candidates() const {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root_, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory(ec) && name.rfind("step_", 0) == 0) {
      names.push_back(name);
    }
  }
  std::sort(names.rbegin(), names.rend());  // newest first
  std::string latest;
  if (absl::StatusOr<std::string> dir = Latest(); dir.ok()) {
    latest = fs::path(*dir).filename().string();
  }
  std::vector<std::string> dirs;
  for (const std::string& name : names) {
    // Newer than `latest`: not published (a crash between rename and the
    // pointer's update, or a run that was rolled back): never preferred.
    if (!latest.empty() && name > latest) continue;
    dirs.push_back(absl::StrCat(root_, "/", name));
  }
  return dirs;
}

}  // namespace shardtrain
