"""The expert-parallel MoE layer. Book: chapter 8, "Expert parallelism".

The ``E`` experts are split over the ``W`` ranks of a process group: rank ``r`` holds experts
``r * E/W, ..., (r + 1) * E/W - 1``. The router is replicated; every rank routes its own tokens
(its groups of ``T`` tokens) exactly as :class:`minimoe.MoELayer` would, then:

1. **dispatch**: sends every (token, expert) pair to the rank that holds the expert (all-to-all);
2. **experts**: runs its local experts on what it received;
3. **combine**: sends the outputs back (the reverse all-to-all) and adds them, weighted by the
   combine weights, into its tokens.

Notation (einsum letters, as in :mod:`minimoe.layers`): ``w`` rank (W), ``l`` local expert (E/W),
``g`` group, ``t`` token, ``c`` slot (C), ``d`` model width.

Two exchanges:

* ``exchange="capacity"``: the buffer of eq. (2) with static shape ``(E, G*C, d)`` = ``(w, l, g*c, d)``;
  the routing's slot positions say which row a token occupies; empty slots travel as zero rows
  (padding). Every rank sends and receives ``E * G * C`` rows whatever the routing did. When the
  router has no capacity (dropless routing), ``C`` is the largest number of slots any rank needs,
  agreed in the header exchange, so the shape is uniform across ranks but changes from call to call.
* ``exchange="variable"``: no buffer and no padding: the per-expert counts are exchanged first
  (a small all-to-all), then exactly the routed rows with uneven split sizes. The receiver runs
  each local expert on its rows (a loop over the ``E/W`` local experts).

Both evaluate the same function as the single-device layer on the same routing: same drops, same
outputs, same gradients (``tests/test_parallel.py``).
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..layers import Experts, MoELayer
from ..routers import DEFAULT_ROUTER, Router
from ..routing import Routing
from . import comm

EXCHANGES = ("capacity", "variable")


@dataclass
class ExchangeStats:
    """What one rank did in the last forward of an :class:`ExpertParallelMoELayer`.

    Counts are (token, expert) pairs. ``*_per_rank`` lists have one entry per rank of the group
    (this rank included: a pair for a local expert is "sent" to itself without using the network).
    ``slots`` is the number of buffer rows this rank's experts computed on (``W * (E/W) * G * C`` for
    the capacity exchange, the received pairs for the variable one), so ``padding = slots - received``
    rows were computed for nothing. Bytes count the token rows of the dispatch that leave this rank
    (the combine sends as many back, and the backward pass repeats both). Times are seconds on this
    rank's clock: ``comm_seconds`` includes waiting for the slowest rank unless ``measure_idle`` was
    on, which times that wait separately as ``idle_seconds`` (a barrier before each exchange).
    """

    rank: int
    world_size: int
    exchange: str
    experts: list
    tokens: int = 0
    dropped_tokens: int = 0
    sent_per_rank: list = field(default_factory=list)
    received_per_rank: list = field(default_factory=list)
    expert_load: list = field(default_factory=list)
    capacity: int | None = None
    slots: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    route_seconds: float = 0.0
    comm_seconds: float = 0.0
    idle_seconds: float = 0.0
    compute_seconds: float = 0.0
    backward_comm_seconds: float = 0.0

    @property
    def tokens_sent(self) -> int:
        return int(sum(self.sent_per_rank))

    @property
    def tokens_received(self) -> int:
        return int(sum(self.received_per_rank))

    @property
    def padding(self) -> int:
        return self.slots - self.tokens_received

    @property
    def buffer_fill(self) -> float:
        """Received pairs over computed slots (1: no padding)."""
        return self.tokens_received / self.slots if self.slots else 1.0

    @property
    def drop_rate(self) -> float:
        return self.dropped_tokens / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        """Plain numbers (JSON-ready), derived fields included."""
        out = asdict(self)
        out.update(tokens_sent=self.tokens_sent, tokens_received=self.tokens_received, padding=self.padding,
                   buffer_fill=self.buffer_fill, drop_rate=self.drop_rate)
        return out


class _Clock:
    """Host timers that first wait for the device, so that CUDA work is charged to the right phase."""

    def __init__(self, device):
        self.device = device

    def __call__(self):
        comm.synchronize(self.device)
        return time.perf_counter()


class ExpertParallelMoELayer(MoELayer):
    """A :class:`minimoe.MoELayer` whose experts are sharded over a ``torch.distributed`` process group.

    Args: those of :class:`minimoe.MoELayer` (``n_experts`` is the *total* number of experts), plus
        process_group: the group whose ranks share the experts (``None``: the default group). Its
            size must divide ``n_experts``.
        exchange: ``"capacity"`` (fixed-size buffers, padding shipped) or ``"variable"`` (counts
            first, then only the routed rows).
        measure_idle: put a barrier before each exchange and time it as ``idle_seconds`` (waiting for
            slower ranks), separating it from the transfer itself. Costs a barrier; off by default.
        sync_router: broadcast the router's parameters from the group's first rank at construction,
            so the replicated router starts identical everywhere (a collective: every rank of the
            group must build the layer).

    Shared experts (``n_shared_experts``) are replicated on every rank, like the router. A router that
    balances from its loads (``loss_free``: it calls the protocol's ``reduce_loads``) gets the loads of *all* ranks,
    one all-reduce (sum) per routing call, so every rank takes the same bias step and holds the same
    bias (chapter 10, "Global-batch statistics"); every rank must then route the same number of times.

    ``path`` is accepted so that a model's options carry over, and ignored: the capacity exchange
    always computes on the slot buffer (the index path of the single-device layer) and the variable
    exchange on the received rows.

    Each rank calls ``forward`` with its own tokens (the same shape on every rank for the capacity
    exchange); ``last_routing`` is this rank's routing and ``last_stats`` an :class:`ExchangeStats`.
    Gradients: the experts' weights receive the gradient from every rank's tokens through the
    reverse exchange; the router (and everything else that is replicated) receives only this
    rank's part and must be all-reduced by the caller, e.g. with
    :func:`minimoe.parallel.allreduce_replicated_grads`. Soft routers (every token in every slot) and
    DenseMixer's dense backward (every expert on every token) do not shard and raise ``ValueError``.
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        n_experts: int,
        router: str | Router = DEFAULT_ROUTER,
        *,
        router_options: dict | None = None,
        group_size: int | None = None,
        path: str = "index",
        activation: str = "gelu",
        bias: bool = True,
        process_group=None,
        exchange: str = "capacity",
        measure_idle: bool = False,
        sync_router: bool = True,
        n_shared_experts: int = 0,
    ):
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        # plain attributes, set before the module is initialised: _build_experts reads the group while
        # MoELayer.__init__ runs, so that a rank allocates only its own share of the experts
        self.exchange, self.measure_idle, self.process_group = exchange, bool(measure_idle), process_group
        super().__init__(d_model, d_hidden, n_experts, router, router_options=router_options, group_size=group_size,
                         path=path, activation=activation, bias=bias, n_shared_experts=n_shared_experts)
        # a router that balances from its loads (the protocol's reduce_loads) sees every rank's: one
        # all-reduce (sum) per routing call where it asks, none for the other routers
        self.router.set_load_reducer(comm.LoadAllReduce(process_group))
        self.last_stats: ExchangeStats | None = None
        self._forward_started = None
        if sync_router:
            broadcast_replicated(self.router, process_group)

    @classmethod
    def from_single_device(cls, layer: MoELayer, *, process_group=None, exchange: str = "capacity",
                           measure_idle: bool = False) -> "ExpertParallelMoELayer":
        """The sharded copy of ``layer``: the same router (copied) and this rank's slice of its experts.
        Call it on every rank with the same ``layer`` (built from the same seed, or loaded)."""
        if not isinstance(layer, MoELayer) or isinstance(layer, ExpertParallelMoELayer):
            raise TypeError(f"layer must be a single-device MoELayer, got {type(layer).__name__}")
        experts = layer.experts
        sharded = cls(layer.d_model, layer.d_hidden, layer.n_experts, copy.deepcopy(layer.router),
                      group_size=layer.group_size, path=layer.path, activation=experts.activation,
                      bias=experts.b_in is not None, process_group=process_group, exchange=exchange,
                      measure_idle=measure_idle, sync_router=False, n_shared_experts=layer.n_shared_experts)
        if layer.shared_experts is not None:
            sharded.shared_experts.to(device=experts.w_in.device, dtype=experts.w_in.dtype)
        sharded.experts.to(device=experts.w_in.device, dtype=experts.w_in.dtype)  # before copying: no rounding
        return load_single_device_weights(sharded, layer)

    def _build_experts(self, activation: str, bias: bool) -> Experts:
        """This rank's share of the experts: ``n_experts / world_size`` of them."""
        self.rank, self.world_size = comm.world_of(self.process_group)
        if self.n_experts % self.world_size:
            raise ValueError(
                f"n_experts={self.n_experts} is not divisible by the world size {self.world_size} of the process "
                f"group: every rank holds n_experts / world_size experts. Use a multiple of {self.world_size} "
                f"experts or a process group whose size divides {self.n_experts}")
        self.local_experts = self.n_experts // self.world_size
        self.first_expert = self.rank * self.local_experts
        return Experts(self.local_experts, self.d_model, self.d_hidden, activation, bias)

    def all_expert_outputs(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Not available: every expert on every token (DenseMixer's dense backward) would need every
        token on every rank."""
        raise ValueError(
            f"router {self.router.name!r} asks for every expert's output on every token (a dense backward, as "
            "DenseMixer's), which an expert-parallel layer cannot compute: its experts live on other ranks. Use "
            "the router in eval mode or a sparse router")

    @property
    def expert_ids(self) -> list[int]:
        """The global indices of the experts on this rank."""
        return list(range(self.first_expert, self.first_expert + self.local_experts))

    def forward(self, x: torch.Tensor, group_size: int | None = None, *,
                token_mask: torch.Tensor | None = None, token_keys: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's tokens ``x (..., d_model) -> (..., d_model)``, routed in groups of ``group_size``
        (``token_mask``: padding; ``token_keys``: for a hash router; as in :meth:`MoELayer.forward`).

        Runs :meth:`MoELayer.forward` unchanged (grouping, routing, the routing's gradient rules); only
        :meth:`apply_routing`, the dispatch, experts and combine, is distributed."""
        self._forward_started = _Clock(x.device)() if isinstance(x, torch.Tensor) else None
        return super().forward(x, group_size, token_mask=token_mask, token_keys=token_keys)

    def apply_routing(self, x: torch.Tensor, routing: Routing, path: str | None = None) -> torch.Tensor:
        """Eq. (2) for this rank's groups ``x (G, T, d)`` with experts on every rank of the group."""
        if routing.is_soft:
            raise ValueError(
                f"router {self.router.name!r} is a soft router: every slot "
                "mixes all tokens of its group, so there are no token rows to send to the experts' ranks. "
                "Expert parallelism needs a sparse router (a Routing with position/combine)")
        if x.dim() != 3 or routing.position.shape != x.shape[:2] + (self.n_experts,):
            raise ValueError(f"x must be (G, T, d) and routing.position (G, T, E={self.n_experts}); got "
                             f"{tuple(x.shape)} and {tuple(routing.position.shape)}")
        clock = _Clock(x.device)
        stats = ExchangeStats(rank=self.rank, world_size=self.world_size, exchange=self.exchange,
                              experts=self.expert_ids, tokens=x.shape[0] * x.shape[1])
        started, self._forward_started = getattr(self, "_forward_started", None), None
        if started is not None:  # called from forward: the time since then was spent routing
            stats.route_seconds = clock() - started
        stats.dropped_tokens = int((~routing.mask.any(-1)).sum())
        self.last_stats = stats
        if self.exchange == "capacity":
            return self._capacity_exchange(x, routing, stats, clock)
        return self._variable_exchange(x, routing, stats, clock)

    # -- the two exchanges ----------------------------------------------------------------------------

    def _wait(self, stats, clock):
        """With ``measure_idle``, a barrier: the time until the slowest rank arrives is idle time."""
        if self.measure_idle:
            start = clock()
            dist.barrier(group=self.process_group)
            stats.idle_seconds += clock() - start

    def _timed(self, stats, timer, key, fn, *args, **kwargs):
        start = timer()
        out = fn(*args, **kwargs)
        setattr(stats, key, getattr(stats, key) + timer() - start)
        return out

    def _capacity_exchange(self, x, routing, stats, clock):
        G, T, d = x.shape
        W, L, E = self.world_size, self.local_experts, self.n_experts
        position = routing.position
        g, t, e = (position >= 0).nonzero(as_tuple=True)
        load = torch.bincount(e, minlength=E)  # pairs this rank sends to each expert
        needed = routing.capacity if routing.capacity is not None else int(position.max().clamp_min(0)) + 1
        # The header: shapes must agree on every rank (static buffers), and a dropless routing needs
        # the largest slot count of all ranks; the loads give the receivers their statistics.
        header = torch.cat([torch.tensor([G, T, needed], device=load.device), load])
        self._wait(stats, clock)
        headers = self._timed(stats, clock, "comm_seconds", comm.all_gather_rows, header, self.process_group).cpu()
        shapes = headers[:, :2]
        if not bool((shapes == shapes[0]).all()):
            raise ValueError(
                "exchange='capacity' needs the same number of groups and tokens per group on every rank (the "
                f"buffers have one static shape); got (groups, group size) per rank {shapes.tolist()}. Give every "
                "rank the same number of tokens, or use exchange='variable'")
        C = int(headers[:, 2].max())
        stats.capacity = C
        mine = slice(3 + self.first_expert, 3 + self.first_expert + L)
        stats.sent_per_rank = load.view(W, L).sum(1).tolist()
        stats.received_per_rank = headers[:, mine].sum(1).tolist()
        stats.expert_load = headers[:, mine].sum(0).tolist()
        stats.slots = W * L * G * C
        row_bytes = d * x.element_size()
        stats.bytes_sent = stats.bytes_received = (W - 1) * L * G * C * row_bytes

        token_row = g * T + t
        slot_row = e * (G * C) + g * C + position[g, t, e]  # row of the (E * G * C, d) = (w, l, g*c, d) buffer
        flat_x = x.reshape(G * T, d)
        buffer = flat_x.new_zeros(E * G * C, d).index_copy(0, slot_row, flat_x[token_row])
        rows = [L * G * C] * W
        self._wait(stats, clock)
        received = self._timed(stats, clock, "comm_seconds", comm.all_to_all, buffer, rows, rows,
                               self.process_group, clock=stats.__dict__)
        # (w, l, g*c, d) -> (l, w*g*c, d): each local expert sees its slots from every rank at once
        xin = received.view(W, L, G * C, d).transpose(0, 1).reshape(L, W * G * C, d)
        y = self._timed(stats, clock, "compute_seconds", self.experts, xin)
        back = y.view(L, W, G * C, d).transpose(0, 1).reshape(W * L * G * C, d)
        self._wait(stats, clock)
        returned = self._timed(stats, clock, "comm_seconds", comm.all_to_all, back, rows, rows,
                               self.process_group, clock=stats.__dict__)
        weight = routing.combine[g, t, e].to(x.dtype).unsqueeze(-1)
        out = flat_x.new_zeros(G * T, d).index_add(0, token_row, returned[slot_row] * weight)
        return out.view(G, T, d)

    def _variable_exchange(self, x, routing, stats, clock):
        G, T, d = x.shape
        W, L, E = self.world_size, self.local_experts, self.n_experts
        g, t, e = (routing.position >= 0).nonzero(as_tuple=True)
        token_row = g * T + t
        order = torch.argsort(e * (G * T) + token_row)  # expert-major: rows for rank 0 first, then rank 1, ...
        rows_out, pair_e = token_row[order], e[order]
        load = torch.bincount(e, minlength=E)
        self._wait(stats, clock)
        # the counts first: a receiver must know how many rows each rank sends to each of its experts
        recv_load = self._timed(stats, clock, "comm_seconds", comm.exchange_counts, load, self.process_group)
        send_rows = load.view(W, L).sum(1).tolist()
        recv_by_rank_expert = recv_load.view(W, L)
        recv_rows = recv_by_rank_expert.sum(1).tolist()
        stats.sent_per_rank, stats.received_per_rank = send_rows, recv_rows
        stats.expert_load = recv_by_rank_expert.sum(0).tolist()
        stats.slots = sum(recv_rows)
        row_bytes = d * x.element_size()
        stats.bytes_sent = (sum(send_rows) - send_rows[self.rank]) * row_bytes
        stats.bytes_received = (sum(recv_rows) - recv_rows[self.rank]) * row_bytes

        flat_x = x.reshape(G * T, d)
        self._wait(stats, clock)
        received = self._timed(stats, clock, "comm_seconds", comm.all_to_all, flat_x[rows_out], send_rows,
                               recv_rows, self.process_group, clock=stats.__dict__)
        y = self._timed(stats, clock, "compute_seconds", self._local_experts_on_rows, received,
                        recv_by_rank_expert)
        self._wait(stats, clock)
        returned = self._timed(stats, clock, "comm_seconds", comm.all_to_all, y, recv_rows, send_rows,
                               self.process_group, clock=stats.__dict__)
        weight = routing.combine[g[order], t[order], pair_e].to(x.dtype).unsqueeze(-1)
        out = flat_x.new_zeros(G * T, d).index_add(0, rows_out, returned * weight)
        return out.view(G, T, d)

    def _local_experts_on_rows(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows arrive grouped by (source rank, local expert) with ``counts (W, L)``; sort them by expert,
        run each expert on its contiguous block (also when it is empty, so every expert weight gets a
        gradient tensor on every rank), and put the outputs back in arrival order."""
        L = self.local_experts
        expert_of_row = torch.repeat_interleave(torch.arange(L, device=rows.device).repeat(counts.shape[0]),
                                                counts.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)
        blocks = rows[by_expert].split(counts.sum(0).tolist())
        outputs = [self.experts._mlp(block, *params) for block, params in zip(blocks, self.experts.per_expert())]
        y_sorted = torch.cat(outputs) if outputs else rows
        return y_sorted[torch.argsort(by_expert)]

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_hidden={self.d_hidden}, n_experts={self.n_experts} "
                f"(experts {self.first_expert}..{self.first_expert + self.local_experts - 1} on rank {self.rank} "
                f"of {self.world_size}), group_size={self.group_size}, exchange={self.exchange!r}")


# -- moving weights and gradients -----------------------------------------------------------------------

def load_single_device_weights(sharded: ExpertParallelMoELayer, layer: MoELayer) -> ExpertParallelMoELayer:
    """Copy ``layer``'s weights into ``sharded``: the router whole (it is replicated) and, from the
    stacked expert weights, the slice of experts this rank holds. No communication."""
    if layer.n_experts != sharded.n_experts or layer.d_model != sharded.d_model or layer.d_hidden != sharded.d_hidden:
        raise ValueError(f"the layers differ: single-device (d_model, d_hidden, n_experts) = "
                         f"{(layer.d_model, layer.d_hidden, layer.n_experts)}, sharded "
                         f"{(sharded.d_model, sharded.d_hidden, sharded.n_experts)}")
    sharded.router.load_state_dict(layer.router.state_dict())
    if (layer.shared_experts is None) != (sharded.shared_experts is None) or \
            layer.n_shared_experts != sharded.n_shared_experts:
        raise ValueError(f"the layers differ in shared experts: single-device n_shared_experts="
                         f"{layer.n_shared_experts}, sharded {sharded.n_shared_experts}")
    if layer.shared_experts is not None:
        sharded.shared_experts.load_state_dict(layer.shared_experts.state_dict())
    mine = slice(sharded.first_expert, sharded.first_expert + sharded.local_experts)
    with torch.no_grad():
        for name in ("w_in", "b_in", "w_out", "b_out"):
            source, target = getattr(layer.experts, name), getattr(sharded.experts, name)
            if (source is None) != (target is None):
                raise ValueError(f"one layer has expert biases and the other has not ({name})")
            if source is not None:
                target.copy_(source[mine])
    return sharded


def expert_parallel_layers(module: nn.Module) -> list[ExpertParallelMoELayer]:
    return [m for m in module.modules() if isinstance(m, ExpertParallelMoELayer)]


def _sharded_parameter_ids(module: nn.Module) -> set[int]:
    return {id(p) for layer in expert_parallel_layers(module) for p in layer.experts.parameters()}


def replicated_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters every rank holds a copy of: all but the sharded experts' weights."""
    sharded = _sharded_parameter_ids(module)
    return [p for p in module.parameters() if id(p) not in sharded]


def broadcast_replicated(module: nn.Module, process_group=None) -> None:
    """Make every replicated parameter and buffer equal to the group's first rank's copy (the sharded
    experts are left alone). A collective: call it on every rank."""
    comm.require_initialized()
    src = comm.global_rank(process_group, 0)
    sharded = _sharded_parameter_ids(module)
    with torch.no_grad():
        for tensor in [p for p in module.parameters() if id(p) not in sharded] + list(module.buffers()):
            dist.broadcast(tensor.data, src=src, group=process_group)


def allreduce_replicated_grads(module: nn.Module, process_group=None, op: str = "sum") -> None:
    """Finish the backward pass of a model with expert-parallel layers, for the global objective
    ``sum_r loss_r`` (``op="sum"``) or ``mean_r loss_r`` (``op="mean"``, the DistributedDataParallel
    convention) over the ranks ``r`` of the group.

    A replicated parameter (router, attention, embeddings, ...) got only its own rank's gradient, so
    its gradient is all-reduced (summed; divided by W for ``"mean"``). A sharded expert weight
    already holds the gradient of ``sum_r loss_r``, delivered by the reverse exchange from every
    rank: it is left alone for ``"sum"`` and divided by W for ``"mean"``. A missing gradient counts
    as zero. A collective: call it on every rank, after backward, before the optimiser step.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    comm.require_initialized()
    world = dist.get_world_size(process_group)
    sharded = _sharded_parameter_ids(module)
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if id(p) in sharded:
            if op == "mean" and p.grad is not None:
                p.grad.div_(world)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=process_group)
        if op == "mean":
            p.grad.div_(world)


def convert_to_expert_parallel(module: nn.Module, *, process_group=None, exchange: str = "capacity",
                               measure_idle: bool = False, broadcast: bool = True) -> nn.Module:
    """Replace every single-device :class:`~minimoe.MoELayer` inside ``module`` (in place) by its
    :class:`ExpertParallelMoELayer` with the same weights; with ``broadcast``, then make all replicated
    weights equal to the first rank's. Build the same model on every rank (same seed), then call this
    on every rank: it is the one-line switch of a model to expert parallelism."""
    if isinstance(module, MoELayer) and not isinstance(module, ExpertParallelMoELayer):
        raise TypeError("pass a model that contains MoE layers; for a single layer use "
                        "ExpertParallelMoELayer.from_single_device")
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoELayer) and not isinstance(child, ExpertParallelMoELayer):
                setattr(parent, name, ExpertParallelMoELayer.from_single_device(
                    child, process_group=process_group, exchange=exchange, measure_idle=measure_idle))
    if broadcast:
        broadcast_replicated(module, process_group)
    return module


def gather_stats(layer: ExpertParallelMoELayer) -> list[dict]:
    """Every rank's :class:`ExchangeStats` of the layer's last forward, as dicts, on every rank."""
    if layer.last_stats is None:
        raise ValueError("the layer has not run a forward yet")
    out = [None] * layer.world_size
    dist.all_gather_object(out, layer.last_stats.as_dict(), group=layer.process_group)
    return out
