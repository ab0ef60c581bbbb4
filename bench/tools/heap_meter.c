/* heap_meter: the peak of live heap bytes of a process, measured the same
 * way for any program (our ranks and PyTorch's alike), for the benchmarks.
 *
 *   gcc -O2 -shared -fPIC -o heap_meter.so bench/tools/heap_meter.c
 *   HEAP_METER_OUT=peaks.txt LD_PRELOAD=$PWD/heap_meter.so PROGRAM ...
 *
 * Every malloc-family call is counted by the usable size glibc gives it
 * (malloc_usable_size), which is what the block costs; at exit one line
 * "<pid> <peak bytes> <argv[0]>" is appended to $HEAP_METER_OUT. LibTorch's
 * CPU tensors (posix_memalign), NumPy arrays, Gloo buffers and C++ objects
 * are all counted; Python's small-object arenas (mmap'ed directly) and
 * memory-mapped files are not. The calls go straight to glibc's own
 * implementations (__libc_*), so no dlsym bootstrapping is needed. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static _Atomic int64_t live_bytes;
static _Atomic int64_t peak_bytes;

static void* counted(void* p) {
  if (p != NULL) {
    const int64_t now =
        atomic_fetch_add_explicit(&live_bytes, (int64_t)malloc_usable_size(p),
                                  memory_order_relaxed) +
        (int64_t)malloc_usable_size(p);
    int64_t peak = atomic_load_explicit(&peak_bytes, memory_order_relaxed);
    while (now > peak && !atomic_compare_exchange_weak_explicit(
                             &peak_bytes, &peak, now, memory_order_relaxed,
                             memory_order_relaxed)) {
    }
  }
  return p;
}

static void uncount(void* p) {
  if (p != NULL) {
    atomic_fetch_sub_explicit(&live_bytes, (int64_t)malloc_usable_size(p),
                              memory_order_relaxed);
  }
}

void* malloc(size_t n) { return counted(__libc_malloc(n)); }
void* calloc(size_t n, size_t size) { return counted(__libc_calloc(n, size)); }
void free(void* p) {
  uncount(p);
  __libc_free(p);
}
void* realloc(void* p, size_t n) {
  if (p == NULL) return malloc(n);
  if (n == 0) {
    free(p);
    return NULL;
  }
  const size_t old = malloc_usable_size(p);
  void* q = __libc_realloc(p, n);
  if (q == NULL) return NULL; /* p is untouched and still counted */
  atomic_fetch_sub_explicit(&live_bytes, (int64_t)old, memory_order_relaxed);
  return counted(q);
}
void* memalign(size_t align, size_t n) {
  return counted(__libc_memalign(align, n));
}
void* aligned_alloc(size_t align, size_t n) { return memalign(align, n); }
int posix_memalign(void** out, size_t align, size_t n) {
  if (align % sizeof(void*) != 0 || (align & (align - 1)) != 0) return EINVAL;
  void* p = memalign(align, n);
  if (p == NULL) return ENOMEM;
  *out = p;
  return 0;
}
void* valloc(size_t n) { return memalign((size_t)sysconf(_SC_PAGESIZE), n); }

__attribute__((destructor)) static void report(void) {
  const char* path = getenv("HEAP_METER_OUT");
  if (path == NULL || *path == '\0') return;
  char name[256] = "?";
  FILE* cmdline = fopen("/proc/self/cmdline", "r");
  if (cmdline != NULL) {
    size_t got = fread(name, 1, sizeof(name) - 1, cmdline);
    name[got] = '\0';
    fclose(cmdline);
  }
  FILE* out = fopen(path, "a");
  if (out == NULL) return;
  fprintf(out, "%d %lld %s\n", (int)getpid(),
          (long long)atomic_load(&peak_bytes), name);
  fclose(out);
}
