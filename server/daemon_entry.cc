// shardtraind: the first code that runs when the daemon is started. The
// daemon proper, shardtraind-server beside this program, loads some seventy
// shared libraries before any code of its own runs: about 100 ms in which a
// SIGHUP (a token rotation racing a restart) or a SIGTERM would end it with
// the default action, however early its own code blocks them. This program
// is static, so nothing is loaded before it runs; on x86-64 its ELF entry
// point blocks the startup signals (common/startup_signals.h) with one
// system call before the C library starts, and main then executes
// shardtraind-server with the same arguments. The mask survives the exec;
// the server takes the signals once its handlers are ready, so a signal
// sent at any time after this program's first instruction waits for them.
// (Before that instruction no program can act: a launcher that must signal
// a daemon it has just started should start it with the signals blocked,
// as `shardtrain daemon` does.)
//
// Only the C library (and common/startup_signals.cc, compiled in): no
// allocation, no C++ runtime.
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/startup_signals.h"

// SIGHUP, SIGINT, SIGTERM and SIGUSR1 as the kernel's 64-bit signal set.
extern "C" const unsigned long kShardtraindStartupMask =
    (1UL << (SIGHUP - 1)) | (1UL << (SIGINT - 1)) | (1UL << (SIGTERM - 1)) |
    (1UL << (SIGUSR1 - 1));

#if defined(__x86_64__) && defined(SHARDTRAIN_STATIC_ENTRY)
// The ELF entry (linked with -e shardtraind_entry): rt_sigprocmask(SIG_BLOCK,
// &kShardtraindStartupMask, NULL, 8), then the C library's own _start. %rdx
// is what _start hands on as rtld_fini: zero in a static program, as the
// kernel leaves it.
asm(R"(
  .text
  .globl shardtraind_entry
  .type shardtraind_entry, @function
shardtraind_entry:
  mov $14, %eax
  xor %edi, %edi
  lea kShardtraindStartupMask(%rip), %rsi
  xor %edx, %edx
  mov $8, %r10d
  syscall
  xor %edx, %edx
  jmp _start
  .size shardtraind_entry, .-shardtraind_entry
)");
#endif

int main(int argc, char** argv) {
  (void)argc;
  // Already blocked by the entry on x86-64; elsewhere from here on.
  shardtrain::HoldStartupSignals();

  static const char kServer[] = "shardtraind-server";
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) {
    fprintf(stderr,
            "shardtraind: cannot find this program (/proc/self/exe: %s)\n",
            strerror(errno));
    return 1;
  }
  path[n] = '\0';
  char* slash = strrchr(path, '/');
  const size_t dir =
      slash == nullptr ? 0 : static_cast<size_t>(slash - path) + 1;
  if (dir + sizeof(kServer) > sizeof(path)) {
    fprintf(stderr, "shardtraind: the path of %s is too long\n", path);
    return 1;
  }
  memcpy(path + dir, kServer, sizeof(kServer));
  execv(path, argv);
  fprintf(stderr, "shardtraind: cannot run %s: %s\n", path, strerror(errno));
  return 127;
}
