// The only translation unit that includes pybind11 (torch's bundled copy, so
// that c10d::Backend is the very type torch registered).

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/ProcessGroupHSDP.hpp"
#include "shm/Reduce.hpp"
#ifdef HSDP_BUILD_TESTING
#include "testing/NcclContractBackend.hpp"
#endif

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
  return c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(backend);
}

#ifdef HSDP_BUILD_TESTING
hsdp::testing::NcclContractBackend& asNcclContract(c10d::Backend* backend) {
  auto* double_ = dynamic_cast<hsdp::testing::NcclContractBackend*>(&asHSDP(backend).cpuInner());
  TORCH_CHECK_TYPE(
      double_ != nullptr, "this hsdp group was not created with HSDP_ENGINE=nccl_contract");
  return *double_;
}
#endif

// A read-write property of Config whose new value is checked with the rest
// of the object before it is kept.
template <typename T>
void checkedField(py::class_<hsdp::Config>& cls, const char* name, T hsdp::Config::*member) {
  cls.def_property(
      name,
      [member](const hsdp::Config& c) { return c.*member; },
      [member](hsdp::Config& c, T value) {
        hsdp::Config next = c;
        next.*member = std::move(value);
        next.validate();
        c = std::move(next);
      });
}

constexpr const char* kNoTestDouble =
    "HSDP_ENGINE=nccl_contract selects the tests' NCCL-contract double, which this build does not "
    "have: it is built with -C cmake.define.HSDP_BUILD_TESTING=ON (scripts/setup.sh does)";

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hsdp c10d backend (C++ core)";
  // Registers c10d's Python types (Backend, Work, ReduceOp) before we use them.
  py::module::import("torch.distributed");

  // Argument errors (common/Errors.hpp): RuntimeError as gloo's, and
  // ValueError/TypeError as NCCL's. Registered after torch's translator, so
  // tried before it, wherever the exception surfaces (a call, or wait()).
  auto newError = [&m](const char* name, PyObject* base, const char* doc) {
    auto bases = py::make_tuple(py::handle(PyExc_RuntimeError), py::handle(base));
    auto cls = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
        (std::string("hsdp_backend._C.") + name).c_str(), doc, bases.ptr(), nullptr));
    m.attr(name) = cls;
    return cls.release().ptr(); // kept for the life of the process
  };
  static PyObject* argumentError = newError(
      "ArgumentError",
      PyExc_ValueError,
      "An invalid argument to an hsdp collective: a RuntimeError (as gloo raises) and a ValueError (as NCCL).");
  static PyObject* argumentTypeError = newError(
      "ArgumentTypeError",
      PyExc_TypeError,
      "Tensors of mismatched dtypes in an hsdp collective: a RuntimeError (as gloo raises) and a TypeError (as NCCL).");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const hsdp::ArgumentError& e) {
      PyErr_SetString(argumentError, e.what_without_backtrace());
    } catch (const hsdp::ArgumentTypeError& e) {
      PyErr_SetString(argumentTypeError, e.what_without_backtrace());
    }
  });

  // The settings object (common/Config.hpp). Every assignment is checked:
  // a value out of range raises ValueError naming the field.
  py::class_<hsdp::Config> config(
      m, "Config", "Every setting of hsdp (src/hsdp_backend/config.py).");
  config.def(py::init<>());
  config.def_property(
      "engine",
      [](const hsdp::Config& c) { return std::string(hsdp::Config::engineName(c.engine)); },
      [](hsdp::Config& c, const std::string& name) { c.engine = hsdp::Config::parseEngine(name); });
  checkedField(config, "slot_bytes", &hsdp::Config::slotBytes);
  checkedField(config, "spin_us", &hsdp::Config::spinUs);
  checkedField(config, "yield_us", &hsdp::Config::yieldUs);
  checkedField(config, "one_shot_bytes", &hsdp::Config::oneShotBytes);
  checkedField(config, "direct_read_bytes", &hsdp::Config::directReadBytes);
  checkedField(config, "direct_all_reduce_bytes", &hsdp::Config::directAllReduceBytes);
  checkedField(config, "stream_store_bytes", &hsdp::Config::streamStoreBytes);
  checkedField(config, "pool_bytes", &hsdp::Config::poolBytes);
  checkedField(config, "pool_chunk_bytes", &hsdp::Config::poolChunkBytes);
  checkedField(config, "timeout_ms", &hsdp::Config::timeoutMs);
  checkedField(config, "trace_entries", &hsdp::Config::traceEntries);
  checkedField(config, "trace_dir", &hsdp::Config::traceDir);
  checkedField(config, "fsdp_shim", &hsdp::Config::fsdpShim);
  checkedField(config, "fsdp_comm_buffers", &hsdp::Config::fsdpCommBuffers);
  checkedField(config, "fsdp_bucket_bytes", &hsdp::Config::fsdpBucketBytes);
  checkedField(config, "run_backend_map", &hsdp::Config::runBackendMap);
  checkedField(config, "run_verbose", &hsdp::Config::runVerbose);
  checkedField(config, "test_hosts", &hsdp::Config::testHosts);
  config.def(
      "stream_store_bytes_for",
      &hsdp::Config::streamStoreBytesFor,
      py::arg("group_size"),
      "Output bytes per rank from which a reduce-scatter of group_size ranks on one host "
      "writes around the cache (0: never).");

  // Benchmarks: the engine's own SUM kernel on private memory, out = rows[0]
  // + rows[1] + ... in one pass, storing as a reduce-scatter whose
  // streamStoreBytes is stream_from_bytes would: the reduce-scatter's
  // zero-communication limit (benchmarks/peers.py).
  m.def("_reduce_rows", [](at::Tensor& out, const at::Tensor& rows, size_t streamFromBytes) {
    TORCH_CHECK_VALUE(
        rows.dim() == 2 && rows.size(0) >= 1 && rows.is_contiguous() && out.is_contiguous() &&
            rows.device().is_cpu() && out.device().is_cpu() && rows.scalar_type() == at::kFloat &&
            out.scalar_type() == at::kFloat && out.numel() == rows.size(1),
        "_reduce_rows: expected contiguous float32 CPU rows [k, n] and out [n], got rows ",
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

  m.def(
      "create_backend",
      [](c10d::Store& store,
         int rank,
         int size,
         std::chrono::milliseconds timeout,
         c10d::Backend* cpuBackend,
         c10d::Backend* cudaBackend,
         const hsdp::Config& config,
         std::optional<std::string> hostIdentity) -> c10::intrusive_ptr<c10d::Backend> {
        TORCH_CHECK_VALUE(cpuBackend != nullptr, "cpu_backend is required");
        config.validate();
        std::unique_ptr<hsdp::InnerRoute> cpu;
        if (config.engine == hsdp::Config::Engine::NcclContract) {
#ifdef HSDP_BUILD_TESTING
          // Tests only: the CPU route runs the code CUDA tensors take.
          cpu = std::make_unique<hsdp::InnerRoute>(
              c10::make_intrusive<hsdp::testing::NcclContractBackend>(
                  retain(cpuBackend), rank, size),
              hsdp::InnerCaps{"nccl_contract", true, true, false, true},
              rank);
#else
          TORCH_CHECK_VALUE(false, kNoTestDouble);
#endif
        } else {
          cpu = std::make_unique<hsdp::InnerRoute>(
              retain(cpuBackend), hsdp::InnerCaps{"gloo", false, false, true}, rank);
        }
        std::unique_ptr<hsdp::InnerRoute> cuda;
        if (cudaBackend) {
          cuda = std::make_unique<hsdp::InnerRoute>(
              retain(cudaBackend), hsdp::InnerCaps{"nccl", true, true}, rank);
        }
        py::gil_scoped_release nogil; // the rendezvous blocks on the store
        return c10::make_intrusive<hsdp::ProcessGroupHSDP>(
            store,
            rank,
            size,
            timeout,
            std::move(cpu),
            std::move(cuda),
            config,
            std::move(hostIdentity));
      },
      py::arg("store"),
      py::arg("rank"),
      py::arg("size"),
      py::arg("timeout"),
      py::arg("cpu_backend"),
      py::arg("cuda_backend"),
      py::arg("config"),
      py::arg("host_identity") = py::none());

  // Writes the flight record of every hsdp group of this process; returns
  // the files' paths.
  m.def("dump_trace", [](const std::string& reason) {
    py::gil_scoped_release nogil;
    return hsdp::FlightRecorder::dumpAll(reason);
  });

  m.def("cpu_engine", [](c10d::Backend* backend) {
    auto& hsdp = asHSDP(backend);
    return py::make_tuple(hsdp.cpuEngine(), hsdp.shmUnavailableReason(), hsdp.shmDirectReads());
  });

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

  m.def("buffer_stats", [](c10d::Backend* backend) {
    const auto s = asHSDP(backend).bufferStats();
    py::dict out;
    out["reserved_bytes"] = s.pool.reservedBytes;
    out["live_bytes"] = s.pool.liveBytes;
    out["chunks"] = s.pool.chunks;
    out["allocations"] = s.pool.allocations;
    out["fallbacks"] = s.fallbacks;
    out["pooled_calls"] = s.pooledCalls;
    return out;
  });

  m.def("reset_comm_stats", [](c10d::Backend* backend) { asHSDP(backend).stats().reset(); });

  m.def(
      "all_reduce_divided_by",
      [](c10d::Backend* backend,
         at::Tensor tensor,
         const c10d::ReduceOp& op,
         double divideBy,
         bool asyncOp) {
        return asHSDP(backend).allreduceDividedBy(tensor, op, divideBy, asyncOp);
      },
      py::arg("backend"),
      py::arg("tensor"),
      py::arg("op"),
      py::arg("divide_by"),
      py::arg("async_op"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "reduce_scatter_divided_by",
      [](c10d::Backend* backend,
         at::Tensor output,
         at::Tensor input,
         const c10d::ReduceOp& op,
         double divideBy,
         bool asyncOp) {
        return asHSDP(backend).reduceScatterDividedBy(output, input, op, divideBy, asyncOp);
      },
      py::arg("backend"),
      py::arg("output"),
      py::arg("input"),
      py::arg("op"),
      py::arg("divide_by"),
      py::arg("async_op"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "all_reduce_bucketed",
      [](c10d::Backend* backend,
         std::vector<at::Tensor> tensors,
         const c10d::ReduceOp& op,
         int64_t bucketBytes,
         bool asyncOp,
         double divideBy) {
        return asHSDP(backend).allreduceBucketed(tensors, op, bucketBytes, asyncOp, divideBy);
      },
      py::arg("backend"),
      py::arg("tensors"),
      py::arg("op"),
      py::arg("bucket_bytes"),
      py::arg("async_op"),
      py::arg("divide_by") = 1.0,
      py::call_guard<py::gil_scoped_release>());

#ifdef HSDP_BUILD_TESTING
  // The NCCL-contract double as a group's own backend (tests register it
  // under a name of their own to model a default group on NCCL). torch calls
  // perform_nocolor_split on a ProcessGroupNCCL it splits from when this
  // rank is not in the new group; the double's binding has it as NCCL's has.
  using NcclContract = hsdp::testing::NcclContractBackend;
  py::class_<NcclContract, c10d::Backend, c10::intrusive_ptr<NcclContract>> ncclContract(
      m, "_NcclContractBackend");
  // Set, not def'd: c10d's Backend may already carry hsdp's Python no-op of
  // that name (_registration.py), which .def would refuse to overload.
  ncclContract.attr("perform_nocolor_split") = py::cpp_function(
      [](NcclContract& self, const at::Device&) { self.joinSplit(NcclContract::kNoColor, 0); },
      py::name("perform_nocolor_split"),
      py::is_method(ncclContract),
      py::call_guard<py::gil_scoped_release>());
  m.def("_nccl_contract_create", [](c10d::Backend* gloo, int rank, int size) {
    return c10::make_intrusive<NcclContract>(retain(gloo), rank, size);
  });
  m.def(
      "_nccl_contract_join_split",
      [](c10d::Backend* parent, int64_t color, int size) {
        auto* double_ = dynamic_cast<NcclContract*>(parent);
        TORCH_CHECK_TYPE(double_ != nullptr, "split_from is not the NCCL-contract double");
        double_->joinSplit(color, size);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("_is_nccl_contract", [](c10d::Backend* backend) {
    return dynamic_cast<NcclContract*>(backend) != nullptr;
  });

  // Test hooks of the NCCL-contract double (HSDP_ENGINE=nccl_contract).
  m.def("_nccl_contract_fail_next", [](c10d::Backend* backend, const std::string& message) {
    asNcclContract(backend).failNext(message);
  });
  m.def("_nccl_contract_reductions", [](c10d::Backend* backend) {
    return asNcclContract(backend).receivedReductions();
  });
  m.def("_nccl_contract_allocations", [](c10d::Backend* backend) {
    return asNcclContract(backend).allocations();
  });
#endif
}
