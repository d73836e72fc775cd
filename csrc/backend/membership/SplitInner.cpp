#include "backend/membership/SplitInner.hpp"

#include <c10/util/Exception.h>

#include "common/TorchCompat.hpp"

namespace hsdp {

namespace {

#if !HSDP_TORCH_HAS_OPTIONS_CLONE
// Drops the one warning ProcessGroupGloo::split gives for options that are
// not ProcessGroupGloo::Options ("... Falling back to default options."),
// which splitWithOwnOptions asks for on purpose; passes on any other.
class DropGlooFallbackWarning : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Falling back to default options") == std::string::npos) {
      previous_->process(warning);
    }
  }

 private:
  c10::WarningHandler* previous_ = c10::WarningUtils::get_warning_handler();
};
#endif

} // namespace

c10::intrusive_ptr<c10d::Backend> splitWithOwnOptions(
    c10d::Backend& inner,
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    std::chrono::milliseconds timeout,
    const std::string* groupName,
    const std::string* groupDesc) {
  auto apply = [&](c10d::Backend::Options& opts) {
    opts.timeout = timeout;
#ifdef C10D_BACKEND_HAS_RECONFIGURE
    // A child has its members from the split: one cloned from a parent made
    // to await a reconfigure would refuse every call ("ProcessGroupGloo has
    // not been initialized"), as a hierarchical group's columns did.
    opts.enable_reconfigure = false;
#endif
    if (groupName) {
      opts.group_name = *groupName;
    }
    if (groupDesc) {
      opts.group_desc = *groupDesc;
    }
  };
#if HSDP_TORCH_HAS_OPTIONS_CLONE
  auto opts = inner.getBackendOptions()->clone();
  apply(*opts);
  return inner.split(store, ranks, opts);
#else
  auto parentOpts = inner.getBackendOptions();
  if (parentOpts->backend == "gloo") {
    // torch 2.13's ProcessGroupGloo::split keeps the options object it is
    // given as the child's own (global_ranks_in_group written into it), so
    // lending the parent's would leave parent and child sharing one object
    // and one gloo device, and that split hangs now and then in gloo's
    // connectFullMesh. Base options make it build the child its own
    // (ProcessGroupGloo::Options::create_default(): a default device, as
    // the parent's has, see _registration.py); the timeout is set after,
    // as create_default() takes torch's default.
    auto opts = c10::make_intrusive<c10d::Backend::Options>("gloo", timeout);
    apply(*opts);
    c10::intrusive_ptr<c10d::Backend> child;
    {
      DropGlooFallbackWarning drop;
      c10::WarningUtils::WarningHandlerGuard guard(&drop);
      child = inner.split(store, ranks, opts);
    }
    if (child) {
      child->setTimeout(timeout);
    }
    return child;
  }
  // Others (NCCL, which refuses options of another type): the parent's
  // object is lent, as torch 2.13's own ProcessGroup::splitGroup does, and
  // its base fields are restored after.
  auto& opts = parentOpts;
  const c10d::Backend::Options saved(*opts); // the base fields, which split may change
  auto restore = [&] {
    opts->timeout = saved.timeout;
    opts->group_name = saved.group_name;
    opts->group_desc = saved.group_desc;
    opts->global_ranks_in_group = saved.global_ranks_in_group;
  };
  apply(*opts);
  try {
    auto child = inner.split(store, ranks, opts);
    restore();
    return child;
  } catch (...) {
    restore();
    throw;
  }
#endif
}

} // namespace hsdp
