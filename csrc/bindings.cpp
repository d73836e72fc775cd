// The only translation unit that includes pybind11 (torch's bundled copy, so
// that c10d::Backend is the very type torch registered).

#include <torch/csrc/utils/pybind.h>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "backend/ProcessGroupHSDP.hpp"

namespace py = pybind11;

namespace {

hsdp::ProcessGroupHSDP& asHSDP(c10d::Backend* backend) {
  auto* hsdp = dynamic_cast<hsdp::ProcessGroupHSDP*>(backend);
  TORCH_CHECK_TYPE(
      hsdp != nullptr,
      "expected a group whose backend is hsdp, got backend '",
      backend ? backend->getBackendName() : std::string("none"),
      "'");
  return *hsdp;
}

// Backends are intrusively ref-counted: taking a new reference from the raw
// pointer pybind hands us is safe whatever holder torch bound the type with.
c10::intrusive_ptr<c10d::Backend> retain(c10d::Backend* backend) {
  return c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(
      backend);
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hsdp c10d backend (C++ core)";
  // Registers c10d's Python types (Backend, Work, ReduceOp) before we use them.
  py::module::import("torch.distributed");

  m.def(
      "create_backend",
      [](int rank,
         int size,
         std::chrono::milliseconds timeout,
         c10d::Backend* cpuBackend,
         c10d::Backend* cudaBackend) -> c10::intrusive_ptr<c10d::Backend> {
        TORCH_CHECK_VALUE(cpuBackend != nullptr, "cpu_backend is required");
        return c10::make_intrusive<hsdp::ProcessGroupHSDP>(
            rank,
            size,
            timeout,
            retain(cpuBackend),
            cudaBackend ? retain(cudaBackend)
                        : c10::intrusive_ptr<c10d::Backend>());
      },
      py::arg("rank"),
      py::arg("size"),
      py::arg("timeout"),
      py::arg("cpu_backend"),
      py::arg("cuda_backend") = nullptr);

  m.def("is_hsdp", [](c10d::Backend* backend) {
    return dynamic_cast<hsdp::ProcessGroupHSDP*>(backend) != nullptr;
  });

  m.def("comm_stats", [](c10d::Backend* backend) {
    py::dict out;
    for (const auto& [op, c] : asHSDP(backend).stats().snapshot()) {
      py::dict entry;
      entry["calls"] = c.calls;
      entry["collectives"] = c.collectives;
      entry["bytes"] = c.bytes;
      out[py::str(op)] = entry;
    }
    return out;
  });

  m.def("reset_comm_stats", [](c10d::Backend* backend) {
    asHSDP(backend).stats().reset();
  });

  m.def(
      "all_reduce_bucketed",
      [](c10d::Backend* backend,
         std::vector<at::Tensor> tensors,
         const c10d::ReduceOp& op,
         int64_t bucketBytes) {
        return asHSDP(backend).allreduceBucketed(tensors, op, bucketBytes);
      },
      py::arg("backend"),
      py::arg("tensors"),
      py::arg("op"),
      py::arg("bucket_bytes"),
      py::call_guard<py::gil_scoped_release>());
}
