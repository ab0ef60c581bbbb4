#include "server/backend.h"

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {

absl::Status BackendRegistry::Add(std::unique_ptr<BackendKind> kind) {
  if (Find(kind->name()) != nullptr) {
    return absl::AlreadyExistsError(
        absl::StrCat("backend '", kind->name(), "' is registered twice"));
  }
  kinds_.push_back(std::move(kind));
  return absl::OkStatus();
}

BackendKind* BackendRegistry::Find(const std::string& name) const {
  for (const std::unique_ptr<BackendKind>& kind : kinds_) {
    if (kind->name() == name) return kind.get();
  }
  return nullptr;
}

absl::StatusOr<BackendKind*> BackendRegistry::Get(
    const std::string& name) const {
  if (BackendKind* kind = Find(name); kind != nullptr) return kind;
  return absl::InvalidArgumentError(absl::StrCat(
      "--launcher: '", name, "' is not one of ", absl::StrJoin(Names(), ", ")));
}

std::vector<std::string> BackendRegistry::Names() const {
  std::vector<std::string> names;
  for (const std::unique_ptr<BackendKind>& kind : kinds_) {
    names.push_back(kind->name());
  }
  return names;
}

void BackendRegistry::AddFlags(CLI::App& app) {
  for (const std::unique_ptr<BackendKind>& kind : kinds_) kind->AddFlags(app);
}

std::string BackendRegistry::LauncherHelp() const {
  std::vector<std::string> rows;
  for (const std::unique_ptr<BackendKind>& kind : kinds_) {
    rows.push_back(absl::StrCat(kind->name(), " (", kind->summary(), ")"));
  }
  return absl::StrCat("where ranks run: ", absl::StrJoin(rows, " | "));
}

}  // namespace shardtrain
