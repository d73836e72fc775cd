#include "common/TorchCompat.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <dlfcn.h>

#if !HSDP_TORCH_AT_LEAST(2, 12) && HSDP_TORCH_HAS_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace hsdp::compat {

bool isStreamCapturing(const c10::Stream& stream) {
#if HSDP_TORCH_AT_LEAST(2, 13)
  return c10::impl::VirtualGuardImpl(stream.device_type()).isStreamCapturing(stream);
#elif HSDP_TORCH_AT_LEAST(2, 12)
  // 2.12's default DeviceGuardImplInterface::isStreamCapturing throws
  // ("Backend doesn't support stream capture query"); 2.13's returns false.
  // A device that does not override it (a PrivateUse1 backend) has no
  // graphs to capture into, so hsdp answers as 2.13 does; CUDA's own
  // override is asked, and its failure is not hidden.
  try {
    return c10::impl::VirtualGuardImpl(stream.device_type()).isStreamCapturing(stream);
  } catch (const c10::Error&) {
    if (stream.device_type() == c10::DeviceType::CUDA) {
      throw;
    }
    return false;
  }
#else
#if HSDP_TORCH_HAS_CUDA
  if (stream.device_type() == c10::DeviceType::CUDA) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const auto cudaStream =
        c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
    const cudaError_t err = cudaStreamIsCapturing(cudaStream, &status);
    TORCH_CHECK(
        err == cudaSuccess, "hsdp: cudaStreamIsCapturing failed: ", cudaGetErrorString(err));
    return status != cudaStreamCaptureStatusNone;
  }
#endif
  return false; // a stream of a device without graphs is never captured
#endif
}

bool isCapturing(c10::Device device) {
  return isStreamCapturing(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
}

namespace {
// cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode*),
// with cudaStreamCaptureModeThreadLocal = 1 (cuda_runtime_api.h,
// driver_types.h); cudaSuccess = 0.
using ExchangeCaptureMode = int (*)(int*);
constexpr int kThreadLocalCaptureMode = 1;

ExchangeCaptureMode exchangeCaptureMode() {
  static const auto fn = reinterpret_cast<ExchangeCaptureMode>(
      dlsym(RTLD_DEFAULT, "cudaThreadExchangeStreamCaptureMode"));
  return fn;
}
} // namespace

ThreadLocalCaptureMode::ThreadLocalCaptureMode() {
  if (auto exchange = exchangeCaptureMode()) {
    previous_ = kThreadLocalCaptureMode;
    set_ = exchange(&previous_) == 0;
  }
}

ThreadLocalCaptureMode::~ThreadLocalCaptureMode() {
  if (set_) {
    exchangeCaptureMode()(&previous_);
  }
}

} // namespace hsdp::compat
