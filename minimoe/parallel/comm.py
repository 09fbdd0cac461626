"""The collectives of expert parallelism, with autograd. Book: chapter 8, "Dispatch and combine as all-to-all".

:func:`all_to_all` moves rows of a tensor between the ranks of a process group: rank ``r`` sends
``send_rows[s]`` consecutive rows to rank ``s`` and receives ``recv_rows[s]`` rows from it. As a
linear map of all ranks' inputs it is a permutation of rows, so its adjoint (the backward) is the
same exchange with the sizes swapped: the gradient of a received row travels back to the rank that
sent it. Both directions use ``torch.distributed.all_to_all_single``, which gloo implements on CPU
tensors (uneven split sizes and empty splits included; checked with torch 2.13) and NCCL on CUDA
tensors, so one code path serves a laptop and a GPU node.

Every rank must take part in every collective in the same order. In particular, every rank must
run the backward pass of every forward that built a graph: the backward of one rank's exchange
delivers gradients that other ranks are waiting for.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def require_initialized() -> None:
    """Raise a RuntimeError that says how to start torch.distributed when it is not running."""
    if not dist.is_available():
        raise RuntimeError("this build of torch has no torch.distributed; expert parallelism needs it")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group('gloo') "
            "(CPU) or ('nccl') (GPU) on every rank first; torchrun sets the environment for it, e.g. "
            "`torchrun --nproc_per_node=2 your_script.py` (or use minimoe.parallel.run_local)")


def world_of(group) -> tuple[int, int]:
    """``(rank, world size)`` of this process within ``group`` (``None``: the default group)."""
    require_initialized()
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives name their source globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a host clock measures it (CUDA launches are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _AllToAll(torch.autograd.Function):
    """Rows out by ``send_rows``, rows in by ``recv_rows``; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, anchor, send_rows, recv_rows, group, clock):
        ctx.sizes, ctx.group, ctx.clock = (list(send_rows), list(recv_rows)), group, clock
        return _exchange(x, send_rows, recv_rows, group)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.sizes
        start = time.perf_counter()
        grad_x = _exchange(grad, recv_rows, send_rows, ctx.group)
        if ctx.clock is not None:
            synchronize(grad_x.device)
            ctx.clock["backward_comm_seconds"] = ctx.clock.get("backward_comm_seconds", 0.0) + (
                time.perf_counter() - start)
        return grad_x, None, None, None, None, None


def _exchange(x: torch.Tensor, send_rows, recv_rows, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows),
                           group=group)
    return out


def all_to_all(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group=None, *,
               clock: dict | None = None) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (shape ``(sum(send_rows), ...)``).

    Returns a tensor of ``sum(recv_rows)`` rows: first the rows rank 0 sent here, then rank 1's, ...
    When autograd is on, the result always requires grad (even if ``x`` does not), so that every rank
    runs the reverse exchange in backward and no rank waits for a partner that skipped it. ``clock``
    (a dict) accumulates the seconds the backward exchange took under ``"backward_comm_seconds"``.
    """
    if len(send_rows) != len(recv_rows):
        raise ValueError(f"send_rows and recv_rows must both have one entry per rank, got {len(send_rows)} "
                         f"and {len(recv_rows)}")
    if x.shape[0] != sum(send_rows):
        raise ValueError(f"x has {x.shape[0]} rows but send_rows sum to {sum(send_rows)}")
    if torch.is_grad_enabled():
        anchor = x.new_empty(0).requires_grad_()
        return _AllToAll.apply(x, anchor, send_rows, recv_rows, group, clock)
    return _exchange(x, send_rows, recv_rows, group)


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """All-to-all of integer counts ``(world * m,)``: entry block ``s`` goes to rank ``s``; returns the
    ``(world * m,)`` blocks received, block ``s`` from rank ``s``. No gradient."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_gather_rows(row: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's 1-D tensor ``row`` (all of the same length), stacked ``(world, len)``. No gradient."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(parts, row.contiguous(), group=group)
    return torch.stack(parts)


class LoadAllReduce:
    """``loads -> sum over the ranks of the group of their loads`` (one all-reduce, no gradient): set
    as a router's ``reduce_loads`` by the expert-parallel layer so a balancing rule that learns from
    the loads (loss-free balancing, chapter 10) sees the global batch and every rank stays in step.
    Deep copies share the group handle (a process group cannot be copied)."""

    def __init__(self, group=None):
        self.group = group
        self.calls = 0

    def __call__(self, loads: torch.Tensor) -> torch.Tensor:
        total = loads.detach().clone().contiguous()
        self.calls += 1
        try:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as error:  # a peer gone or out of step: say what must match
            raise RuntimeError(
                f"the all-reduce of the expert loads failed on this rank's routing call {self.calls} ({error}). A "
                "router that balances from the loads (loss-free balancing) sums them over the ranks once per "
                "routing call, so every rank must route the same number of times, in the same order of layers; "
                "check that every rank runs the same forward passes (and that no rank stopped)") from error
        return total

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"LoadAllReduce(group={self.group!r})"
