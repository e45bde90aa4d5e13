"""CPU shims that let real DP+MoE fault tolerance run without GPUs.

vLLM 0.32's CPU build lacks three things the FT path needs:

* ``CpuCommunicator.all_gatherv`` / ``reduce_scatterv`` raise
  ``NotImplementedError``; DP+MoE calls both every step.
* they must run on the DP group's CPU (gloo) group: FT ``retry`` rebuilds
  exactly that group, and a collective left on the original device group
  fails forever after the first recovery ("Application timeout caused pair
  closure").
* the worker sentinel's ``retry`` calls ``clean_buffers()`` on the all2all
  manager, which the CPU manager does not implement; it has no buffers, so a
  no-op is right.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators import all2all
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )

    CpuCommunicator.all_gatherv = _all_gatherv
    CpuCommunicator.reduce_scatterv = _reduce_scatterv
    all2all.AgRsAll2AllManager.clean_buffers = _no_buffers
    _INSTALLED = True


def _no_buffers(self: Any) -> None:
    """The CPU all2all manager owns no buffers that a fault could dirty."""


def _group(comm: Any) -> Any:
    """The DP CPU group when it spans this communicator, else its own group."""
    from vllm.distributed import get_dp_group

    dp = get_dp_group()
    if dp.world_size == comm.world_size:
        return dp.cpu_group
    return comm.device_group


def _sizes(comm: Any, rows: int, group: Any) -> list[int]:
    import torch
    import torch.distributed as dist

    local = torch.tensor([rows], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(comm.world_size)]
    dist.all_gather(every, local, group=group)
    return [int(t.item()) for t in every]


def _gatherv_one(comm: Any, tensor: Any, dim: int, sizes: list[int] | None) -> Any:
    import torch
    import torch.distributed as dist

    group = _group(comm)
    rows = tensor.movedim(dim, 0).contiguous()
    sizes = sizes if sizes is not None else _sizes(comm, rows.shape[0], group)
    padded = rows.new_zeros((max(sizes), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(comm.world_size)]
    dist.all_gather(parts, padded, group=group)
    joined = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
    return joined.movedim(0, dim).contiguous()


def _all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
    if isinstance(input_, list):
        return [_gatherv_one(self, t, dim, sizes) for t in input_]
    return _gatherv_one(self, input_, dim, sizes)


def _reduce_scatterv(self: Any, input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
    import torch
    import torch.distributed as dist

    dim = dim % input_.dim()
    total = input_.shape[dim]
    if sizes is None:
        sizes = [total // self.world_size] * self.world_size
    # gloo's bf16 reduction is not dependable; sum in fp32.
    summed = input_.to(torch.float32).contiguous()
    dist.all_reduce(summed, group=_group(self))
    start = sum(sizes[: self.rank_in_group])
    mine = summed.narrow(dim, start, sizes[self.rank_in_group])
    return mine.to(input_.dtype).contiguous()
