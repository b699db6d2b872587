// layerstream — what the CUDA kernels' launchers share (internal to
// csrc/kernels/cuda; needs cuda_runtime.h). Not thread-safe beyond what the
// CUDA runtime is: each guard changes the calling thread's current device.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

namespace layerstream {
namespace cuda_detail {

// Clears the calling thread's last-error slot if it holds `err`, so that a
// reported error does not leak into a later, unrelated cudaGetLastError().
inline void clear_error(cudaError_t err) {
  if (err != cudaSuccess && cudaPeekAtLastError() == err) (void)cudaGetLastError();
}

inline bool is_per_device_default_stream(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

// A kernel must be launched with its stream's device current. Callers may be
// on a thread where another device is current (a framework thread, a device
// other than 0), so select the stream's device for the launch and restore the
// caller's afterwards. A default-stream handle names a stream of whichever
// device is current; for it the device is the output buffer's (torch hands
// out nullptr for "the default stream of cuda:N"), or the current one when
// the output is not device memory.
class StreamDeviceGuard {
 public:
  StreamDeviceGuard(cudaStream_t stream, const void* out_dev, const char* who) {
    int dev = -1;
    cudaError_t e = cudaSuccess;
    if (is_per_device_default_stream(stream)) {
      cudaPointerAttributes attr{};
      e = cudaPointerGetAttributes(&attr, out_dev);
      if (e != cudaSuccess) {
        clear_error(e);
        return;
      }
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return;
      if (attr.device < 0) return;
      dev = attr.device;
    } else {
      e = cudaStreamGetDevice(stream, &dev);
      if (e != cudaSuccess) {
        clear_error(e);
        LS_FAIL(who, ": cannot query the device of the CUDA stream (cudaStreamGetDevice: ",
                cudaGetErrorString(e), "); pass a live cudaStream_t");
      }
    }
    int cur = -1;
    e = cudaGetDevice(&cur);
    if (e != cudaSuccess) {
      clear_error(e);
      cur = -1;
    }
    if (cur == dev) return;
    e = cudaSetDevice(dev);
    if (e != cudaSuccess) {
      clear_error(e);
      LS_FAIL(who, ": cannot select CUDA device ", dev, " of the stream (cudaSetDevice: ",
              cudaGetErrorString(e), ")");
    }
    prev_ = cur;
  }
  ~StreamDeviceGuard() {
    if (prev_ >= 0) clear_error(cudaSetDevice(prev_));
  }
  StreamDeviceGuard(const StreamDeviceGuard&) = delete;
  StreamDeviceGuard& operator=(const StreamDeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace cuda_detail
}  // namespace layerstream
