// The tests' and benchmarks' module, hsdp_testing: built only with
// -C cmake.define.HSDP_BUILD_TESTING=ON (scripts/setup.sh), beside the
// package, never by a plain `pip install .`. The package never names it:
// the tests hand its NCCL-contract double to hsdp through the creator's
// injection point (tests/hooks.py), as any inner CPU backend.

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "common/Config.hpp"
#include "shm/Reduce.hpp"
#include "testing/HostStreams.hpp"
#include "testing/NcclContractBackend.hpp"
#include "testing/NullBackend.hpp"

namespace py = pybind11;

namespace {

using hsdp::testing::NcclContractBackend;

c10::intrusive_ptr<c10d::Backend> retain(c10d::Backend* backend) {
  return c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(backend);
}

NcclContractBackend& asDouble(c10d::Backend* backend) {
  auto* double_ = dynamic_cast<NcclContractBackend*>(backend);
  TORCH_CHECK_TYPE(
      double_ != nullptr,
      "expected the NCCL-contract double, got backend '",
      backend ? backend->getBackendName() : std::string("none"),
      "'");
  return *double_;
}

} // namespace

PYBIND11_MODULE(hsdp_testing, m) {
  m.doc() = "hsdp's test double of ProcessGroupNCCL, and the engine's kernel for the benchmarks";
  py::module::import("torch.distributed"); // c10d's Backend type, before we derive from it

  // The double as a c10d Backend: the inner CPU backend of an hsdp group
  // (tests/hooks.py), or a group's own backend (tests register it under a
  // name of their own to model a default group on NCCL). torch calls
  // perform_nocolor_split on a ProcessGroupNCCL it splits from when this
  // rank is not in the new group; the double has it as NCCL's binding has.
  py::class_<NcclContractBackend, c10d::Backend, c10::intrusive_ptr<NcclContractBackend>> double_(
      m, "NcclContractBackend");
  double_.def(
      py::init([](c10d::Backend* gloo,
                  int rank,
                  int size,
                  std::optional<int> release,
                  c10::intrusive_ptr<c10d::Store> store) {
        return c10::make_intrusive<NcclContractBackend>(
            retain(gloo), rank, size, release.value_or(TORCH_VERSION_MINOR), std::move(store));
      }),
      py::arg("gloo"),
      py::arg("rank"),
      py::arg("size"),
      py::arg("release") = py::none(),
      py::arg("store") = nullptr);
  double_.def_property_readonly("bf16_factor_as_float", &NcclContractBackend::bf16FactorAsFloat);
  // Set, not def'd: c10d's Backend may already carry hsdp's Python no-op of
  // that name (hsdp_backend/_registration.py), which .def would refuse to
  // overload.
  double_.attr("perform_nocolor_split") = py::cpp_function(
      [](NcclContractBackend& self, const at::Device&) {
        self.joinSplit(NcclContractBackend::kNoColor, 0);
      },
      py::name("perform_nocolor_split"),
      py::is_method(double_),
      py::call_guard<py::gil_scoped_release>());

  // The zero-cost limit of an inner backend at one rank (benchmarks/layer_cost.py).
  py::class_<
      hsdp::testing::NullBackend,
      c10d::Backend,
      c10::intrusive_ptr<hsdp::testing::NullBackend>>(m, "NullBackend")
      .def(
          py::init([](int rank, int size) {
            return c10::make_intrusive<hsdp::testing::NullBackend>(rank, size);
          }),
          py::arg("rank"),
          py::arg("size"));

  // Host threads as side streams, for an inner CPU backend whose Works keep
  // NCCL's stream contract (InnerCaps(streams=...)): the package's
  // PostStepStreams type, which hsdp_backend._C registers.
  m.def("host_streams", [] {
    py::module::import("hsdp_backend._C");
    return std::shared_ptr<hsdp::PostStepStreams>(std::make_shared<hsdp::testing::HostStreams>());
  });

  // The double's test hooks, on a Backend that must be the double.
  m.def("is_nccl_contract", [](c10d::Backend* backend) {
    return dynamic_cast<NcclContractBackend*>(backend) != nullptr;
  });
  m.def(
      "join_split",
      [](c10d::Backend* parent, int64_t color, int size) {
        asDouble(parent).joinSplit(color, size);
      },
      py::arg("parent"),
      py::arg("color"),
      py::arg("size"),
      py::call_guard<py::gil_scoped_release>());
  m.def("fail_next", [](c10d::Backend* backend, const std::string& message) {
    asDouble(backend).failNext(message);
  });
  m.def(
      "reductions", [](c10d::Backend* backend) { return asDouble(backend).receivedReductions(); });
  m.def("allocations", [](c10d::Backend* backend) { return asDouble(backend).allocations(); });
  // The double's ProcessGroupNCCL::isInitialized (any communicator, a pair's included).
  m.def("is_initialized", [](c10d::Backend* backend) { return asDouble(backend).isInitialized(); });
  // A backend's options' global ranks (c10d's Backend binding has no `options` before 2.14).
  m.def("global_ranks_in_group", [](c10d::Backend* backend) {
    return backend->getBackendOptions()->global_ranks_in_group;
  });
  m.def("shrunk_with_flags", [](c10d::Backend* backend) {
    return asDouble(backend).shrunkWithFlags();
  });

  // The engine's own SUM kernel on private memory, out = rows[0] + rows[1] +
  // ... in one pass, storing as a reduce-scatter whose streamStoreBytes is
  // stream_from_bytes would: the reduce-scatter's zero-communication limit
  // (tools/peers.py).
  m.def("reduce_rows", [](at::Tensor& out, const at::Tensor& rows, size_t streamFromBytes) {
    TORCH_CHECK_VALUE(
        rows.dim() == 2 && rows.size(0) >= 1 && rows.is_contiguous() && out.is_contiguous() &&
            rows.device().is_cpu() && out.device().is_cpu() && rows.scalar_type() == at::kFloat &&
            out.scalar_type() == at::kFloat && out.numel() == rows.size(1),
        "reduce_rows: expected contiguous float32 CPU rows [k, n] and out [n], got rows ",
        rows.sizes(),
        " and out ",
        out.sizes());
    std::vector<const void*> srcs;
    for (int64_t r = 0; r < rows.size(0); ++r) {
      srcs.push_back(rows[r].data_ptr());
    }
    py::gil_scoped_release nogil;
    hsdp::shm::reduce(
        out.data_ptr(),
        srcs.data(),
        static_cast<int>(srcs.size()),
        static_cast<size_t>(out.numel()),
        hsdp::shm::DType::F32,
        hsdp::shm::RedOp::Sum,
        hsdp::shm::Scale{},
        hsdp::shm::storeFor(out.nbytes(), streamFromBytes));
  });

  // Output bytes per rank from which a reduce-scatter of group_size ranks on
  // one host writes around the cache (0: never), for the setting
  // HSDP_SHM_STREAM_STORE_BYTES (None: auto), as the package derives it.
  m.def(
      "stream_store_bytes_for",
      [](int groupSize, std::optional<int64_t> setting) {
        hsdp::Config config;
        config.streamStoreBytes = setting;
        config.validate();
        return config.streamStoreBytesFor(groupSize);
      },
      py::arg("group_size"),
      py::arg("setting") = py::none());
}
