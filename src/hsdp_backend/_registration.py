"""Registers "hsdp" with torch.distributed and builds the backend per group.

Importing this module must stay cheap (it runs inside ``import torch`` through
the autoload entry point): the C++ extension is imported by the creator.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

BACKEND_NAME = "hsdp"
DEVICES = ["cpu", "cuda"]  # a list: a bare string would be read letter by letter


@dataclasses.dataclass
class Hooks:
    """The creator's injection points: None in a user's process.

    * ``inner_cpu(opts, gloo) -> (backend, caps)``: the group's inner CPU
      backend in place of the Gloo group built for it, with what it does
      natively (``_C.InnerCaps``). Called before anything else is built for
      the group; it also takes part in a split the group is created by, if
      its backend is the one split from.
    * ``host_identity(opts) -> str | None``: the host this rank is on,
      in place of the machine's own (None: the machine's).

    The tests set them (tests/hooks.py): a test double of NCCL as the inner
    CPU backend, several pretended hosts on one machine.
    """

    inner_cpu: Optional[Callable[[Any, Any], tuple]] = None
    host_identity: Optional[Callable[[Any], Optional[str]]] = None


hooks = Hooks()


def register() -> None:
    """Registers the ``hsdp`` backend name. Idempotent."""
    import torch.distributed as dist

    if not dist.is_available():  # a torch built without distributed support
        return
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=DEVICES)
    _allow_new_group_beside_splitting()
    from hsdp_backend import _torch_compat

    _torch_compat.mark_self_recording(BACKEND_NAME)  # hsdp_backend.trace is its recorder


def _allow_new_group_beside_splitting() -> None:
    """Lets ``new_group`` run on an hsdp default group bound to a device.

    hsdp supports splitting (DeviceMesh and ``split_group`` need it once
    ``init_process_group(device_id=...)`` binds the default group), and then
    torch's ``new_group`` asks every non-member to take part in an NCCL
    "no-color" split through ``perform_nocolor_split``, a method only
    ProcessGroupNCCL's binding has. hsdp builds a new group's communicators
    from scratch among its members (its creator is never handed a
    communicator to split), so a non-member has nothing to do: the method is
    given to c10d's Backend binding as a no-op where no subclass defines it.
    """
    from torch._C._distributed_c10d import Backend

    if not hasattr(Backend, "perform_nocolor_split"):
        Backend.perform_nocolor_split = _no_color_split_not_needed


def _no_color_split_not_needed(backend, device) -> None:
    return None


_NCCL_CREATORS = ("nccl", "nccl-legacy")


def _wrap_nccl_creators() -> None:
    """Wraps torch's NCCL creators with not_split_from_hsdp, once each.

    torch 2.14 registers its built-in backends lazily (an entry point that
    ``Backend._ensure_backend_registered`` loads the first time a group names
    one), so they are registered here first, when the first hsdp group is
    created: a later ``new_group(backend="nccl")`` then finds the wrapped
    creator. (torch 2.13 creates NCCL groups inline, not through a plugin:
    there hsdp cannot step in.)
    """
    import torch.distributed as dist

    ensure = getattr(dist.Backend, "_ensure_backend_registered", None)
    for name in _NCCL_CREATORS:
        if ensure is not None:
            try:
                ensure(name)
            except Exception:  # noqa: BLE001 - a torch without that backend
                continue
        plugin = dist.Backend._plugins.get(name.upper())
        if plugin is not None and not hasattr(plugin.creator_fn, "__wrapped__"):
            creator = not_split_from_hsdp(plugin.creator_fn)
            dist.Backend._plugins[name.upper()] = plugin._replace(creator_fn=creator)


def not_split_from_hsdp(creator):
    """Wraps a backend creator that can split only from its own kind.

    With a device-bound hsdp default group, torch hands every new group's
    creator hsdp as the communicator to split from, and NCCL's creator
    refuses it (``AssertionError("Expected split_from to be
    ProcessGroupNCCL")``), so ``new_group(backend="nccl")`` and
    ``init_device_mesh(..., backend_override=...)`` failed. hsdp's
    non-members take no part in a split (the no-op above), so the new
    group's members build their communicator from scratch among themselves,
    as they do under a default group that is not device-bound: correct, at
    the cost of a communicator set up anew rather than split.
    """

    def create(opts, backend_options):
        parent = getattr(opts, "split_from", None)  # torch >= 2.12 hands one
        if parent is not None:
            from hsdp_backend import _C

            if _C.is_hsdp(parent):
                opts.split_from = None
        return creator(opts, backend_options)

    create.__wrapped__ = creator
    return create


def _create_backend(opts, backend_options):
    """c10d creator (extended API): one ProcessGroupHSDP per process group.

    The inner backends get their own store prefixes so their rendezvous keys
    never collide with each other or with anything else on the group's store.
    """
    import logging

    from hsdp_backend import _torch_compat

    problem = _torch_compat.unsupported()
    if problem is not None:  # before the extension, built for another torch, fails to load
        raise RuntimeError(
            f"[rank {opts.group_rank}/{opts.group_size}] init_process_group: {problem}"
        )

    from hsdp_backend import _C, config, fsdp

    store, rank, size, timeout = (
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
    )
    # init_process_group(enable_reconfigure=True), torch 2.14+: the group gets its members
    # from dist._reconfigure, and so does its inner Gloo.
    reconfigurable = bool(getattr(opts, "enable_reconfigure", False))
    cpu, cpu_caps = _inner_cpu(opts, reconfigurable)
    settings = config.resolve()
    _wrap_nccl_creators()
    cuda = _inner_cuda(opts, backend_options, reconfigurable)
    fsdp.install_automatically(settings)
    _collect_cycles_before_finalization()
    host = hooks.host_identity(opts) if hooks.host_identity is not None else None
    # None without CUDA: the C++ default (this release's), never asked.
    bf16_premul_sum = None
    if cuda is not None:
        bf16_premul_sum = _torch_compat.nccl_bf16_premul_sum(
            settings.nccl_bf16_premul_sum, _torch_compat.probe_nccl_bf16_premul_sum
        )
    backend = _C.create_backend(
        store,
        rank,
        size,
        timeout,
        cpu,
        cuda,
        settings,
        host,
        cpu_caps,
        reconfigurable,
        cuda_bf16_premul_sum=bf16_premul_sum,
        global_ranks=list(opts.global_ranks_in_group) or list(range(size)),
    )
    route, why_not, _ = _C.cpu_route(backend)
    if route == "gloo" and settings.cpu_route == "auto" and not reconfigurable:
        # One line: the group was meant for shared memory and did not get it.
        logging.getLogger("hsdp_backend").warning(
            "hsdp: [rank %d/%d] group %s runs its CPU collectives on gloo: %s",
            rank,
            size,
            opts.group_id,
            why_not,
        )
    return backend


def _inner_cpu(opts, reconfigurable):
    """The group's inner Gloo (or the backend the tests inject in its place) and its caps."""
    import torch.distributed as dist

    gloo_options = {"enable_reconfigure": True} if reconfigurable else {}
    cpu = dist.ProcessGroupGloo(
        dist.PrefixStore("hsdp/gloo/", opts.store),
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        **gloo_options,
    )
    # As torch does for its own Gloo groups: splitting (what builds the
    # inter-host groups) maps the new group's ranks through this list.
    cpu.options.global_ranks_in_group = list(opts.global_ranks_in_group) or list(
        range(opts.group_size)
    )
    if hooks.inner_cpu is not None:
        return hooks.inner_cpu(opts, cpu)
    return cpu, None


def _inner_cuda(opts, backend_options, reconfigurable):
    """The group's inner ProcessGroupNCCL, or None where this process has no CUDA."""
    import torch
    import torch.distributed as dist

    parent = _split_parent(opts)
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    if reconfigurable:
        raise RuntimeError(
            f"[rank {opts.group_rank}/{opts.group_size}] init_process_group: "
            "enable_reconfigure=True is served on CPU only, and this process sees a GPU: the "
            "ProcessGroupNCCL hsdp wraps for CUDA tensors cannot be reconfigured "
            "(CUDA_VISIBLE_DEVICES= hides the GPU)"
        )
    return dist.ProcessGroupNCCL(
        dist.PrefixStore("hsdp/nccl/", opts.store),
        opts.group_rank,
        opts.group_size,
        _inner_nccl_options(opts, backend_options, parent),
    )


def _split_parent(opts):
    """The ProcessGroupNCCL this group's NCCL is to be split from, or None.

    torch hands the creator one (``opts.split_from``) when the default
    group is device-bound; its non-members then join the split through
    ``perform_nocolor_split``, collective over every rank of the parent, so
    the members must join it too or everyone blocks. Anything but a
    ProcessGroupNCCL (an hsdp default group: its non-members do nothing)
    means a communicator of our own.
    """
    import torch.distributed as dist

    from hsdp_backend import _torch_compat

    parent = _torch_compat.split_source(opts)
    if (
        parent is not None
        and dist.is_nccl_available()
        and isinstance(parent, dist.ProcessGroupNCCL)
    ):
        return parent
    return None


def _group_color(opts) -> int:
    """The split color torch's own NCCL creator gives this group's ranks."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._process_group_color(list(opts.global_ranks_in_group))


def _inner_nccl_options(opts, backend_options, parent):
    """The options of the group's inner ProcessGroupNCCL, as torch's own NCCL
    creator fills them in (distributed_c10d._create_nccl_process_group):

    * a user's ``ProcessGroupNCCL.Options`` given as ``pg_options`` (high
      priority streams, ``config``: CTAs, blocking, ...) are the inner NCCL's
      own; options of another kind are not NCCL's and are left alone;
    * the group's timeout, ranks and name, and ``enable_reconfigure``;
    * the ProcessGroupNCCL to split from (``_split_parent``) and the color
      of this group's ranks.
    """
    import torch.distributed as dist

    nccl_opts = backend_options
    if not isinstance(nccl_opts, dist.ProcessGroupNCCL.Options):
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts.is_high_priority_stream = False
    nccl_opts._timeout = opts.timeout
    nccl_opts.global_ranks_in_group = list(opts.global_ranks_in_group)
    nccl_opts.group_name = str(opts.group_id)
    if getattr(opts, "enable_reconfigure", False):
        nccl_opts.enable_reconfigure = True
    if isinstance(parent, dist.ProcessGroupNCCL):
        nccl_opts.split_from = parent
        nccl_opts.split_color = _group_color(opts)
    return nccl_opts


_exit_hook_registered = False


def _collect_cycles_before_finalization() -> None:
    """Frees, at exit, the process groups that only reference cycles still hold.

    DeviceMesh, DTensor and FSDP2 keep groups in reference cycles, so a group
    destroyed with ``destroy_process_group`` is freed by the cyclic collector,
    whenever it runs. If that is during interpreter finalization, a Gloo
    group (hsdp's inner one, the inter-host groups) frees Works whose tensors
    reach Python from its own threads, which then find the interpreter gone
    and take the process down with SIGABRT ("terminate called without an
    active exception"; measured: 1 of 20 two-rank gloo runs of the example
    without its final gc.collect). An atexit handler runs while the
    interpreter is whole, so collecting there lets them go down cleanly.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        import atexit
        import gc

        atexit.register(gc.collect)
        _exit_hook_registered = True
