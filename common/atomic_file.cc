#include "common/atomic_file.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace shardtrain {

absl::Status WriteFileAtomically(
    const std::string& path,
    const std::function<absl::Status(std::FILE* file,
                                     const std::string& temp_path)>& write) {
  // Unique per process, so concurrent writers of one path (ranks sharing an
  // output directory) never share a temporary file.
  const std::string temp = absl::StrCat(path, ".tmp.", ::getpid());
  std::FILE* file = std::fopen(temp.c_str(), "wbe");
  if (file == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot create ", temp, ": ", strerror(errno)));
  }
  absl::Status status = write(file, temp);
  if (status.ok() && (std::fflush(file) != 0 || ::fsync(::fileno(file)) != 0)) {
    status = absl::InternalError(
        absl::StrCat("cannot write ", temp, ": ", strerror(errno)));
  }
  if (std::fclose(file) != 0 && status.ok()) {
    status = absl::InternalError(
        absl::StrCat("cannot close ", temp, ": ", strerror(errno)));
  }
  if (status.ok() && std::rename(temp.c_str(), path.c_str()) != 0) {
    status = absl::InternalError(absl::StrCat("cannot rename ", temp, " to ",
                                              path, ": ", strerror(errno)));
  }
  if (!status.ok()) std::remove(temp.c_str());
  return status;
}

absl::Status WriteFileAtomically(const std::string& path,
                                 std::string_view contents) {
  return WriteFileAtomically(
      path, [&](std::FILE* file, const std::string& temp) -> absl::Status {
        if (std::fwrite(contents.data(), 1, contents.size(), file) !=
            contents.size()) {
          return absl::InternalError(
              absl::StrCat("cannot write ", temp, ": ", strerror(errno)));
        }
        return absl::OkStatus();
      });
}

absl::Status WriteBytes(std::FILE* file, const void* data, size_t bytes,
                        const std::string& temp_path) {
  if (std::fwrite(data, 1, bytes, file) != bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot write ", temp_path, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
