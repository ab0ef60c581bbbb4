/* A stand-in for NVIDIA's libcudnn.so.9 in shardtrain's Debian 13 CUDA build
 * root (scripts/debian13 --cuda). Debian's nvidia-cudnn package downloads the
 * real library from NVIDIA at install time, which the build root must not do;
 * LibTorch's CUDA library still needs a libcudnn.so.9 to load and to link
 * against. Every entry point LibTorch imports is defined here and refuses:
 * CUDNN_STATUS_NOT_SUPPORTED, version 0. Without a GPU nothing calls them; on
 * a GPU host, install the real cuDNN instead of this root.
 *
 * scripts/cudnn-stub compiles this file with the list of imported symbols
 * (read from libtorch_cuda.so with nm) as SYMBOLS_FILE, one STUB(name) each. */
#include <stddef.h>

#define CUDNN_STATUS_NOT_SUPPORTED 3000 /* cuDNN 9's value */
#define STUB(name) \
  int name(void) { return CUDNN_STATUS_NOT_SUPPORTED; }

const char* cudnnGetErrorString(int status) {
  (void)status;
  return "cuDNN is not installed: shardtrain's build root has a stub "
         "libcudnn.so.9 (scripts/cudnn-stub.c)";
}
size_t cudnnGetVersion(void) { return 0; }
size_t cudnnGetCudartVersion(void) { return 0; }
size_t cudnnGetMaxDeviceVersion(void) { return 0; }

#include SYMBOLS_FILE
