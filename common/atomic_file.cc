#include "common/atomic_file.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

// The temporary files of the writes in progress, where a signal handler can
// read them: fixed slots (no allocation, no lock). A slot is owned by one
// write; its path is complete before it is marked ready, and the handler
// reads only ready slots. Writes beyond the slots still clean up after
// themselves on failure; they are only not removed by a signal.
constexpr int kTemporarySlots = 16;
struct TemporarySlot {
  std::atomic<bool> owned{false};
  std::atomic<bool> ready{false};
  char path[PATH_MAX];
};
TemporarySlot temporary_slots[kTemporarySlots];

// Marks `path` as a temporary file to remove on interrupt; the slot, or -1.
int RememberTemporary(const std::string& path) {
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kTemporarySlots; ++i) {
    TemporarySlot& slot = temporary_slots[i];
    bool expected = false;
    if (!slot.owned.compare_exchange_strong(expected, true)) continue;
    std::memcpy(slot.path, path.c_str(), path.size() + 1);
    slot.ready.store(true);
    return i;
  }
  return -1;
}

void ForgetTemporary(int slot) {
  if (slot < 0) return;
  temporary_slots[slot].ready.store(false);
  temporary_slots[slot].owned.store(false);
}

void RemoveTemporariesAndReraise(int signal_number) {
  for (TemporarySlot& slot : temporary_slots) {
    if (slot.ready.load()) ::unlink(slot.path);
  }
  ::signal(signal_number, SIG_DFL);
  ::raise(signal_number);
}

}  // namespace

void RemoveTemporaryFilesOnInterrupt() {
  struct sigaction action = {};
  action.sa_handler = RemoveTemporariesAndReraise;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
}

absl::Status WriteFileAtomically(
    const std::string& path,
    const std::function<absl::Status(std::FILE* file,
                                     const std::string& temp_path)>& write) {
  // Unique per process, so concurrent writers of one path (ranks sharing an
  // output directory) never share a temporary file.
  const std::string temp = absl::StrCat(path, ".tmp.", ::getpid());
  const int slot = RememberTemporary(temp);
  std::FILE* file = std::fopen(temp.c_str(), "wbe");
  if (file == nullptr) {
    ForgetTemporary(slot);
    return absl::InternalError(
        absl::StrCat("cannot create ", temp, ": ", strerror(errno)));
  }
  absl::Status status;
  try {
    status = write(file, temp);
  } catch (const std::bad_alloc&) {
    // A buffer sized by the input (a model's tensor) larger than this
    // machine can hold: an error naming the file, and no temporary left.
    status = absl::ResourceExhaustedError(
        absl::StrCat("writing ", path,
                     ": out of memory (the input asks for more memory "
                     "than this machine has)"));
  }
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
  ForgetTemporary(slot);
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
