// Writing a file so that a reader sees either the old one or the whole new
// one, never a torn file: write a temporary file beside it (same directory,
// so the same file system), flush and fsync it, rename it over the target.
// On any failure the temporary file is removed and the target is untouched.
#ifndef SHARDTRAIN_COMMON_ATOMIC_FILE_H_
#define SHARDTRAIN_COMMON_ATOMIC_FILE_H_

#include <cstdio>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace shardtrain {

absl::Status WriteFileAtomically(const std::string& path,
                                 std::string_view contents);

// For writers that stream: `write` fills the temporary file, open for binary
// writing (`temp_path` is its name, for messages); a non-OK status from it
// abandons the write and is returned as is.
absl::Status WriteFileAtomically(
    const std::string& path,
    const std::function<absl::Status(std::FILE* file,
                                     const std::string& temp_path)>& write);

// From now on, SIGINT and SIGTERM remove the temporary file of every atomic
// write still in progress in this process, then end it as the signal would
// have (a command-line tool interrupted during a multi-gigabyte export leaves
// nothing behind). Call once, early in main(), from a process that has no
// handler of its own for these signals.
void RemoveTemporaryFilesOnInterrupt();

// Writes `bytes` of `data` to `file` (an atomic write's temporary file,
// `temp_path`); a short write is an error naming the file and the reason
// (e.g. the disk is full).
absl::Status WriteBytes(std::FILE* file, const void* data, size_t bytes,
                        const std::string& temp_path);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_ATOMIC_FILE_H_
