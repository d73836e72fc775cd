// The only translation unit that includes pybind11 (torch's bundled copy, so
// that c10d::Backend is the very type torch registered).

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

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
  return c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(backend);
}

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

// Argument errors (common/Errors.hpp): RuntimeError as gloo's, and
// ValueError/TypeError as NCCL's. Registered after torch's translator, so
// tried before it, wherever the exception surfaces (a call, or wait()).
void bindErrors(py::module& m) {
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
}

// The settings object (common/Config.hpp), and what an inner backend does
// natively (routes/InnerRoute.hpp).
void bindSettings(py::module& m) {
  // The settings object (common/Config.hpp). Every assignment is checked:
  // a value out of range raises ValueError naming the field.
  py::class_<hsdp::Config> config(
      m, "Config", "Every setting of hsdp (src/hsdp_backend/config.py).");
  config.def(py::init<>());
  config.def_property(
      "cpu_route",
      [](const hsdp::Config& c) { return std::string(hsdp::Config::cpuRouteName(c.cpuRoute)); },
      [](hsdp::Config& c, const std::string& name) {
        c.cpuRoute = hsdp::Config::parseCpuRoute(name);
      });
  checkedField(config, "slot_bytes", &hsdp::Config::slotBytes);
  checkedField(config, "spin_us", &hsdp::Config::spinUs);
  checkedField(config, "yield_us", &hsdp::Config::yieldUs);
  checkedField(config, "one_shot_bytes", &hsdp::Config::oneShotBytes);
  checkedField(config, "direct_read_bytes", &hsdp::Config::directReadBytes);
  config.def("pooled_read_bytes", &hsdp::Config::pooledReadBytes);
  checkedField(config, "direct_all_reduce_bytes", &hsdp::Config::directAllReduceBytes);
  checkedField(config, "stream_store_bytes", &hsdp::Config::streamStoreBytes);
  checkedField(config, "stream_slot_bytes", &hsdp::Config::streamSlotBytes);
  checkedField(config, "stream_slot_timed_bytes", &hsdp::Config::streamSlotTimedBytes);
  checkedField(config, "pool_bytes", &hsdp::Config::poolBytes);
  checkedField(config, "pool_chunk_bytes", &hsdp::Config::poolChunkBytes);
  checkedField(config, "timeout_ms", &hsdp::Config::timeoutMs);
  checkedField(config, "trace_entries", &hsdp::Config::traceEntries);
  checkedField(config, "nccl_bf16_premul_sum", &hsdp::Config::ncclBf16PremulSum);
  checkedField(config, "trace_dir", &hsdp::Config::traceDir);
  checkedField(config, "fsdp_shim", &hsdp::Config::fsdpShim);
  checkedField(config, "fsdp_bucket_bytes", &hsdp::Config::fsdpBucketBytes);
  checkedField(config, "run_backend_map", &hsdp::Config::runBackendMap);
  checkedField(config, "run_verbose", &hsdp::Config::runVerbose);

  // Side streams for an inner backend whose Works follow NCCL's stream
  // contract; a model of them comes from an injected backend's own module.
  py::class_<hsdp::PostStepStreams, std::shared_ptr<hsdp::PostStepStreams>>(
      m, "PostStepStreams", "Side streams for post-steps (csrc/backend/WorkOnStream.hpp).");

  // What an inner backend does natively (routes/InnerRoute.hpp), for an
  // inner CPU backend handed to create_backend in Gloo's place.
  py::class_<hsdp::InnerCaps> caps(
      m,
      "InnerCaps",
      "What an inner c10d backend does natively (csrc/backend/routes/InnerRoute.hpp).");
  caps.def(
      py::init([](std::string name,
                  bool nativeScale,
                  bool nativeCoalescing,
                  bool fixedCompletionPool,
                  std::shared_ptr<hsdp::PostStepStreams> streams,
                  std::optional<bool> bf16PreMulSum) {
        hsdp::InnerCaps caps{std::move(name), nativeScale, nativeCoalescing, fixedCompletionPool};
        caps.bf16PreMulSum = bf16PreMulSum.value_or(caps.bf16PreMulSum);
        caps.streams = std::move(streams);
        return caps;
      }),
      py::arg("name"),
      py::kw_only(),
      py::arg("native_scale") = false,
      py::arg("native_coalescing") = false,
      py::arg("fixed_completion_pool") = false,
      // None: host-complete Works, as Gloo's (routes/PostSteps.hpp).
      py::arg("streams") = nullptr,
      // None: as this torch release's ProcessGroupNCCL (common/TorchCompat.hpp).
      py::arg("bf16_premul_sum") = py::none());
  caps.def_readonly("name", &hsdp::InnerCaps::name);
  caps.def_readonly("bf16_premul_sum", &hsdp::InnerCaps::bf16PreMulSum);
}

// Creating a group, and what a group says about itself.
// hsdp_backend._registration's creator of a group's backend.
void bindCreateBackend(py::module& m) {
  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store,
         int rank,
         int size,
         std::chrono::milliseconds timeout,
         c10d::Backend* cpuBackend,
         c10d::Backend* cudaBackend,
         const hsdp::Config& config,
         std::optional<std::string> hostIdentity,
         std::optional<hsdp::InnerCaps> cpuCaps,
         bool awaitReconfigure,
         std::optional<bool> cudaBf16PreMulSum,
         std::vector<uint64_t> globalRanks) -> c10::intrusive_ptr<c10d::Backend> {
        TORCH_CHECK_VALUE(cpuBackend != nullptr, "cpu_backend is required");
        config.validate();
        // Gloo's, unless another inner CPU backend was injected with its own.
        auto cpu = std::make_unique<hsdp::InnerRoute>(
            retain(cpuBackend),
            cpuCaps.value_or(hsdp::InnerCaps{"gloo", false, false, /*fixedCompletionPool=*/true}),
            rank);
        std::unique_ptr<hsdp::InnerRoute> cuda;
        if (cudaBackend) {
          hsdp::InnerCaps nccl{"nccl", /*nativeScale=*/true, /*nativeCoalescing=*/true};
          nccl.streams = std::make_shared<hsdp::DeviceStreams>();
          nccl.bf16PreMulSum = cudaBf16PreMulSum.value_or(nccl.bf16PreMulSum);
          cuda = std::make_unique<hsdp::InnerRoute>(retain(cudaBackend), std::move(nccl), rank);
        }
        py::gil_scoped_release nogil; // the rendezvous blocks on the store
        auto group = c10::make_intrusive<hsdp::ProcessGroupHSDP>(
            store,
            rank,
            size,
            timeout,
            std::move(cpu),
            std::move(cuda),
            config,
            std::move(hostIdentity),
            awaitReconfigure);
        // As on torch's own groups: the barrier's guess of a rank's GPU reads
        // its global rank (ProcessGroupNCCL::guessDeviceForRank).
        group->getBackendOptions()->global_ranks_in_group = std::move(globalRanks);
        return group;
      },
      py::arg("store"),
      py::arg("rank"),
      py::arg("size"),
      py::arg("timeout"),
      py::arg("cpu_backend"),
      py::arg("cuda_backend"),
      py::arg("config"),
      py::arg("host_identity") = py::none(),
      py::arg("cpu_caps") = py::none(),
      // init_process_group(enable_reconfigure=True): no members until reconfigure.
      py::arg("await_reconfigure") = false,
      // Whether the inner NCCL keeps a bf16 PREMUL_SUM's factor (None: as
      // this release's ProcessGroupNCCL: _torch_compat.nccl_bf16_premul_sum).
      py::arg("cuda_bf16_premul_sum") = py::none(),
      // The members' global ranks (torch's opts.global_ranks_in_group).
      py::arg("global_ranks") = std::vector<uint64_t>{});
}

// What a group serves and has counted, and its flight record.
void bindGroups(py::module& m) {
  // The inner backend a group's route for `device_type` runs on (Gloo, NCCL,
  // or one injected in Gloo's place), as c10d's own Backend object.
  m.def("inner_backend", [](c10d::Backend* backend, const std::string& deviceType) {
    auto& hsdp = asHSDP(backend);
    if (deviceType == "cpu") {
      return retain(&hsdp.cpuInner());
    }
    TORCH_CHECK_VALUE(
        deviceType == "cuda" && hsdp.cudaInner() != nullptr,
        "inner_backend: this group has no inner backend for '",
        deviceType,
        "'");
    return retain(hsdp.cudaInner());
  });

  // Writes the flight record of every hsdp group of this process; returns
  // the files' paths.
  m.def("dump_trace", [](const std::string& reason) {
    py::gil_scoped_release nogil;
    return hsdp::FlightRecorder::dumpAll(reason);
  });

  // (what serves the group's CPU collectives, why not shared memory if it
  // does not, from what size per rank it reads peers directly: 0 never).
  m.def("cpu_route", [](c10d::Backend* backend) {
    auto& hsdp = asHSDP(backend);
    return py::make_tuple(hsdp.cpuRoute(), hsdp.shmUnavailableReason(), hsdp.shmDirectReadBytes());
  });

  // Why the engine does not read peers' memory (empty: it does, or no engine).
  m.def("why_no_direct_reads", [](c10d::Backend* backend) {
    return asHSDP(backend).shmWhyNoDirectReads();
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
}

// The collectives hsdp adds to c10d's (hsdp_backend/__init__.py).
void bindCollectives(py::module& m) {
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
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hsdp c10d backend (C++ core)";
  // Registers c10d's Python types (Backend, Work, ReduceOp) before we use them.
  py::module::import("torch.distributed");
  bindErrors(m);
  bindSettings(m);
  bindCreateBackend(m);
  bindGroups(m);
  bindCollectives(m);
}
