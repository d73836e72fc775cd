// The one place where the torch releases hsdp supports (2.11 to 2.15) differ
// for the C++ extension. Each difference names the release that brought it;
// everything else in csrc/ is written against the newest API and reaches the
// older ones through here. The Python half of the same list is
// src/hsdp_backend/_torch_compat.py; docs/versions.md is the table of both.
#pragma once

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/headeronly/version.h>

#define HSDP_TORCH_AT_LEAST(major, minor)                                                          \
  (TORCH_VERSION_MAJOR > (major) ||                                                                \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// CMakeLists.txt refuses other releases at configure time with the range and
// the version it found; this catches a build that bypassed it.
#if !HSDP_TORCH_AT_LEAST(2, 11) || HSDP_TORCH_AT_LEAST(2, 16)
#error "hsdp_backend supports torch 2.11 to 2.15 (docs/versions.md)"
#endif

// 2.14: Backend::Options::clone(), which a split uses to give the child its
// own copy of the parent's options.
#define HSDP_TORCH_HAS_OPTIONS_CLONE HSDP_TORCH_AT_LEAST(2, 14)
// 2.14: Backend::setBoundDeviceId became virtual (a backend hears of the
// device init_process_group(device_id=...) binds it to).
#define HSDP_TORCH_HAS_VIRTUAL_SET_BOUND_DEVICE HSDP_TORCH_AT_LEAST(2, 14)
// 2.14: ProcessGroup::splitGroup splits each distinct backend once; before,
// it called split() once per device type the backend serves (cpu and cuda:
// twice on the same hsdp backend).
#define HSDP_TORCH_SPLITS_ONCE_PER_BACKEND HSDP_TORCH_AT_LEAST(2, 14)
// 2.15: Backend::isInitialized() (split() callers check that the parent's
// communicator exists) and startTimeEstimate()/endTimeEstimate().
#define HSDP_TORCH_HAS_IS_INITIALIZED HSDP_TORCH_AT_LEAST(2, 15)
// 2.14: Backend::gather_single (a gather into one flat tensor on the root;
// torchcomms' naming, as the other *_single methods of that release).
#define HSDP_TORCH_HAS_GATHER_SINGLE HSDP_TORCH_AT_LEAST(2, 14)
// 2.14: Backend::addEphemeralTimeout, which torch.distributed calls on every
// group's backends (before, only on ProcessGroupNCCL).
#define HSDP_TORCH_HAS_EPHEMERAL_TIMEOUT HSDP_TORCH_AT_LEAST(2, 14)
#define HSDP_TORCH_HAS_TIME_ESTIMATE HSDP_TORCH_AT_LEAST(2, 15)
// 2.14: Backend::registerAbortHook / unregisterAbortHook
// (C10D_BACKEND_HAS_HOOKS); 2.15: supportsAbortHooks, which says they are honoured.
#define HSDP_TORCH_HAS_ABORT_HOOKS HSDP_TORCH_AT_LEAST(2, 14)
#define HSDP_TORCH_HAS_SUPPORTS_ABORT_HOOKS HSDP_TORCH_AT_LEAST(2, 15)
// 2.12: Backend::suspend / resume / getMemoryStats (ProcessGroupNCCL's
// communicators' device memory, released and taken back).
#define HSDP_TORCH_HAS_SUSPEND HSDP_TORCH_AT_LEAST(2, 12)
// 2.14: ProcessGroupNCCL hands NCCL a bf16 PREMUL_SUM's factor intact.
// Before (2.11.0, 2.12.x, 2.13.0, read from their libtorch_cuda.so:
// docs/versions.md) getNcclReduceOp built it with `unpackPreMulSum<float,
// ncclBfloat16>`: a host factor as a 4-byte float, of which NCCL's
// ncclRedOpCreatePreMulSum copies ncclTypeSize(ncclBfloat16) = 2 bytes and
// reads them as a bf16 (the float's low half: 0 for every power of two),
// and a bf16 factor tensor read with const_data_ptr<float>() (raises).
// hsdp sends no bf16 PREMUL_SUM there (planReduce: InnerCaps).
#define HSDP_TORCH_NCCL_BF16_PREMUL_SUM_INTACT HSDP_TORCH_AT_LEAST(2, 14)

namespace hsdp::compat {

// 2.13 renamed c10d's NCCLPreMulSumSupplement / makeNCCLPreMulSum to
// PreMulSumSupplement / makePreMulSum (the same types).
#if HSDP_TORCH_AT_LEAST(2, 13)
using PreMulSumSupplement = c10d::PreMulSumSupplement;
template <typename T>
c10d::ReduceOp makePreMulSum(const T& factor) {
  return c10d::makePreMulSum(factor);
}
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
template <typename T>
c10d::ReduceOp makePreMulSum(const T& factor) {
  return c10d::makeNCCLPreMulSum(factor);
}
#endif

// Whether `backend` has its communicator (ProcessGroupNCCL: none until its
// first collective or an eager connect; a split needs the parent's). Asked
// only from 2.15, where Backend::isInitialized() exists: before, a split of
// a parent without one was NCCL's own failure, and hsdp assumes it has one.
inline bool isInitialized(c10d::Backend& backend) {
#if HSDP_TORCH_HAS_IS_INITIALIZED
  return backend.isInitialized();
#else
  return true;
#endif
}

// Whether `stream` is being captured into a CUDA graph (where an event may
// not be queried). 2.12 added DeviceGuardImplInterface::isStreamCapturing;
// before it, CUDA's own query answers (TorchCompat.cpp: the one file that
// includes the CUDA runtime's headers, and only for those releases).
bool isStreamCapturing(const c10::Stream& stream);
// The same, of `device`'s current stream.
bool isCapturing(c10::Device device);

// While it lives, this thread's CUDA stream-capture mode is
// cudaStreamCaptureModeThreadLocal, as ProcessGroupNCCL's watchdog sets it
// around its event queries: a query from this thread (a flight-record dump,
// from the SIGUSR1 thread or a failing call) then does not invalidate a
// graph capture another thread has in progress in the default, global mode.
// The CUDA runtime torch loaded is asked by name (no CUDA headers needed on
// any release); a no-op where torch has none.
class ThreadLocalCaptureMode {
 public:
  ThreadLocalCaptureMode();
  ~ThreadLocalCaptureMode();
  ThreadLocalCaptureMode(const ThreadLocalCaptureMode&) = delete;
  ThreadLocalCaptureMode& operator=(const ThreadLocalCaptureMode&) = delete;

 private:
  int previous_ = 0;
  bool set_ = false;
};

} // namespace hsdp::compat
