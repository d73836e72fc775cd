"""Registers "hsdp" with torch.distributed and builds the backend per group.

Importing this module must stay cheap (it runs inside ``import torch`` through
the autoload entry point): the C++ extension is imported by the creator.
"""

from __future__ import annotations

BACKEND_NAME = "hsdp"
DEVICES = ["cpu", "cuda"]  # a list: a bare string would be read letter by letter


def register() -> None:
    """Registers the ``hsdp`` backend name. Idempotent."""
    import torch.distributed as dist

    if not dist.is_available():  # a torch built without distributed support
        return
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=DEVICES
    )


def _create_backend(opts, backend_options):
    """c10d creator (extended API): one ProcessGroupHSDP per process group.

    The inner backends get their own store prefixes so their rendezvous keys
    never collide with each other or with anything else on the group's store.
    """
    import torch
    import torch.distributed as dist

    from hsdp_backend import _C

    store, rank, size, timeout = (
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
    )
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("hsdp/gloo/", store), rank, size, timeout)
    cuda = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        nccl_opts.global_ranks_in_group = list(opts.global_ranks_in_group)
        nccl_opts.group_name = str(opts.group_id)
        cuda = dist.ProcessGroupNCCL(
            dist.PrefixStore("hsdp/nccl/", store), rank, size, nccl_opts
        )
    return _C.create_backend(rank, size, timeout, cpu, cuda)
