"""The MoE layer: experts, dispatch and combine. Book: chapter 1, "The unified layer" (eq. 2).

Notation (einsum letters):
    g  routing group          t  token within a group (T per group)
    e  expert (E)             c  slot within an expert's buffer (C per expert per group)
    d  model width            h  expert hidden width

Three interchangeable ways to evaluate eq. (2), ``out[t] = sum_{e,c} C[t,e,c] MLP_e(sum_t' D[t',e,c] x[t'])``:

* ``path="index"`` (default): the faster of the two layouts below. On an accelerator: the slot
  buffers with a capacity (static shapes), the grouped path without one (no padding). On a CPU,
  where counting the pairs is free: the grouped path when the experts get at least 256 rows each
  on average or the slot buffers would be at least twice the routed pairs (a dropless routing with
  unequal loads), else the slot buffers, whose one batched matmul beats a loop over small
  segments (measured on a 2-core CPU: ``python -m benchmarks``, appendix "Performance").
* ``path="slots"``: copy each dispatched token into its slot of a per-expert buffer ``(E, G*C, d)``,
  run all experts with one batched matmul, and scatter-add each slot's output, weighted, into its
  token. Memory is O(E*C*d) = O(capacity_factor * k * T * d); no (T, E, C) tensor is ever built.
  Every shape is static, the layout of a capacity-bound accelerator kernel; a dropless routing
  pads every expert's buffer to the busiest expert's load.
* ``path="grouped"``: list the routed (token, expert) pairs sorted by expert (token order within
  an expert), gather their tokens into one ``(P, d)`` block, run expert e on its own contiguous
  segment (one grouped matmul, as MegaBlocks does) and scatter-add each output, weighted, into its
  token. Only the P routed pairs are computed (P <= k*T): no empty slot and no padding, so a
  dropless routing with a 6x imbalance costs what a balanced one does, in memory O(P*d). On an
  accelerator it reads nothing on the host when the router states a bound on its pairs
  (``Routing.max_pairs``) and the device has a grouped matmul for the dtype (CUDA, bfloat16);
  otherwise it reads the E segment lengths once. The slot path with a capacity never reads.
* ``path="einsum"``: build D and C as dense (G, T, E, C) tensors and contract, exactly eq. (2).
  The teaching form and the oracle of the tests; memory O(T*E*C).
* ``path="loop"``: a Python loop over experts, each on the tokens it took. The form most
  tutorials show; a second oracle and the baseline of the benchmark.

A token no expert took gets exactly 0 (the residual connection around the layer carries it).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from .ops._checks import autocast_on, check_bool, check_choice, check_int, check_tensor, reads_are_free
from .ops.allocation import stable_argsort_ids
from .routers import DEFAULT_ROUTER, Router, build
from .routing import Routing

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}
# Each activation's derivative times a gradient, written into ``out``: the kernels autograd runs
# for these activations, from the activation's input.
_ACTIVATION_BACKWARD = {
    "gelu": lambda grad, pre, out: torch.ops.aten.gelu_backward.grad_input(grad, pre, grad_input=out),
    "relu": lambda grad, pre, out: torch.ops.aten.threshold_backward.grad_input(grad, pre, 0, grad_input=out),
    "silu": lambda grad, pre, out: torch.ops.aten.silu_backward.grad_input(grad, pre, grad_input=out),
}


def _second_layer(hidden, w_out, bias):
    """``bias + hidden @ w_out`` for every expert at once (``bias`` ``(E, 1, d)`` or None)."""
    return torch.bmm(hidden, w_out) if bias is None else torch.baddbmm(bias, hidden, w_out)


class _ExpertsOutput(torch.autograd.Function):
    """The batched experts' second layer, ``y = bias + act(pre) @ w_out`` (``baddbmm``), whose backward
    writes the gradient of ``pre`` over the gradient of the hidden units ``act(pre)``. Both are
    ``(E, N, h)``, every expert's hidden units at once; autograd would allocate a third such tensor
    for the activation's backward while the other two are alive. The backward makes the hidden
    units' gradient itself, so nothing else holds it. It runs autograd's kernels in autograd's
    order: the same values, bit for bit (``tests/test_layer.py``). Under ``create_graph`` autograd
    differentiates a recomputation instead; under autocast the experts do not use this function."""

    @staticmethod
    def forward(ctx, pre, w_out, bias, name):
        ctx.name, ctx.has_bias = name, bias is not None
        hidden = ACTIVATIONS[name](pre)
        ctx.save_for_backward(pre, hidden, w_out)
        return _second_layer(hidden, w_out, bias)

    @staticmethod
    def backward(ctx, grad):
        pre, hidden, w_out = ctx.saved_tensors
        grad_bias = grad.sum(1, keepdim=True) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if torch.is_grad_enabled():  # create_graph: autograd differentiates a recomputation instead
            wanted = [t for t, need in zip((pre, w_out), ctx.needs_input_grad[:2]) if need]
            grads = iter(torch.autograd.grad(torch.bmm(ACTIVATIONS[ctx.name](pre), w_out), wanted, grad,
                                             create_graph=True))
            return (*(next(grads) if need else None for need in ctx.needs_input_grad[:2]), grad_bias, None)
        # autograd's formulas for baddbmm: the bias summed over the broadcast rows (above), hidden
        # and w_out by one bmm each
        grad_w_out = hidden.transpose(1, 2).bmm(grad) if ctx.needs_input_grad[1] else None
        grad_pre = None
        if ctx.needs_input_grad[0]:
            grad_hidden = grad.bmm(w_out.transpose(1, 2))
            grad_pre = _ACTIVATION_BACKWARD[ctx.name](grad_hidden, pre, grad_hidden)  # ours alone: in place
        return grad_pre, grad_w_out, grad_bias, None


PATHS = ("index", "slots", "grouped", "einsum", "loop")
# On a CPU the grouped path's loop over segments beats one batched matmul over the slot buffers from
# about this many rows per expert on (d = 256, hidden 512, 2 cores; below it the slots win by up
# to 1.6x at 32 rows per expert)
GROUPED_ROWS_PER_EXPERT = 256


class Experts(nn.Module):
    """E two-layer MLPs with stacked weights ``w_in (E, d, h)``, ``w_out (E, h, d)`` and biases."""

    def __init__(self, n_experts: int, d_model: int, d_hidden: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        n_experts = check_int(n_experts, "n_experts", low=1)
        d_model = check_int(d_model, "d_model", low=1)
        d_hidden = check_int(d_hidden, "d_hidden", low=1)
        self.activation = check_choice(activation, "activation", sorted(ACTIVATIONS))
        bias = check_bool(bias, "bias")
        self.w_in = nn.Parameter(torch.empty(n_experts, d_model, d_hidden))
        self.w_out = nn.Parameter(torch.empty(n_experts, d_hidden, d_model))
        self.b_in = nn.Parameter(torch.zeros(n_experts, d_hidden)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(n_experts, d_model)) if bias else None
        # Each expert initialised like an nn.Linear of its own shape.
        nn.init.uniform_(self.w_in, -1 / math.sqrt(d_model), 1 / math.sqrt(d_model))
        nn.init.uniform_(self.w_out, -1 / math.sqrt(d_hidden), 1 / math.sqrt(d_hidden))

    def forward(self, xin: torch.Tensor) -> torch.Tensor:
        """All experts at once: ``xin (E, N, d) -> (E, N, d)``."""
        pre = torch.bmm(xin, self.w_in) if self.b_in is None else torch.baddbmm(self.b_in.unsqueeze(1), xin, self.w_in)
        bias = None if self.b_out is None else self.b_out.unsqueeze(1)
        # (under autocast the matmuls' dtypes are autocast's, which a custom backward does not see)
        if torch.is_grad_enabled() and (pre.requires_grad or self.w_out.requires_grad) and \
                not autocast_on(xin.device.type):
            return _ExpertsOutput.apply(pre, self.w_out, bias, self.activation)
        return _second_layer(ACTIVATIONS[self.activation](pre), self.w_out, bias)

    def grouped(self, xs: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert on its own segment of rows: ``xs (P, d) -> (P, d)``, for rows sorted by expert
        (``expert (P,)`` names each row's expert, ``counts (E,)`` gives the segment lengths).

        One grouped matmul (``F.grouped_mm``) where the device has one for the dtype (CUDA,
        bfloat16); otherwise one fused matmul-plus-bias per non-empty segment, which on a CPU is what
        a grouped matmul does inside, without gathering a bias for every row."""
        if _grouped_mm_fits(xs, self.w_in, self.w_out):
            act = ACTIVATIONS[self.activation]
            ends = counts.cumsum(0).to(torch.int32)
            hidden = F.grouped_mm(xs.contiguous(), self.w_in, offs=ends)
            if self.b_in is not None:
                hidden = hidden + self.b_in.index_select(0, expert)
            y = F.grouped_mm(act(hidden), self.w_out, offs=ends)
            return y + self.b_out.index_select(0, expert) if self.b_out is not None else y
        # segment lengths on the host: free on a CPU, one synchronisation on an accelerator
        lengths = counts.tolist()
        if not any(lengths):  # nothing routed: an empty output that still has a graph to backpropagate
            return self._mlp(xs, *self.per_expert()[0])
        # one split, not a slice per segment: the backward of E slices would add E full-size gradients
        return torch.cat([self._mlp(segment, *params)
                          for n, segment, params in zip(lengths, xs.split(lengths), self.per_expert()) if n])

    def forward_one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e alone: ``x (N, d) -> (N, d)``."""
        return self._mlp(x, *(None if p is None else p[e] for p in (self.w_in, self.b_in, self.w_out, self.b_out)))

    def per_expert(self) -> list[tuple]:
        """Each expert's ``(w_in, b_in, w_out, b_out)`` as views, split in one autograd op.

        Indexing ``w_in[e]`` once per expert would make autograd materialise a full-size zero
        gradient for every expert (O(E^2 d h)); ``unbind`` splits the stacked weights once."""
        parts = [p.unbind(0) if p is not None else [None] * self.w_in.shape[0]
                 for p in (self.w_in, self.b_in, self.w_out, self.b_out)]
        return list(zip(*parts))

    def _mlp(self, x, w_in, b_in, w_out, b_out):
        act = ACTIVATIONS[self.activation]
        return F.linear(act(F.linear(x, w_in.t(), b_in)), w_out.t(), b_out)


def _grouped_mm_fits(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether to use ``F.grouped_mm`` (torch 2.8+), which needs no segment length on the host: on
    CUDA in bfloat16; on a CPU only when simulating an accelerator (the tests of the sync-free
    path), since there a loop over the segments is as fast and reads the lengths for free. Every
    row must be a multiple of 16 bytes, and autocast off."""
    if not hasattr(F, "grouped_mm") or reads_are_free(rows) or autocast_on(rows.device.type):
        return False
    if rows.device.type == "cpu" and torch.compiler.is_compiling():
        return False  # the compiler's shape rule for a CPU grouped matmul asks for bfloat16
    supported = (torch.bfloat16,) if rows.device.type == "cuda" else (torch.float32, torch.float64)
    if rows.dtype not in supported or any(w.dtype != rows.dtype for w in weights):
        return False
    return all(n * rows.element_size() % 16 == 0 for w in weights for n in (*rows.shape[1:], *w.shape[1:]))


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer that runs any registered router.

    Args:
        d_model, d_hidden, n_experts: token width, expert hidden width, number of experts.
        router: a registered router name (see ``minimoe.routers.available()``) or a ``Router``.
        router_options: keyword arguments for ``minimoe.routers.build`` when ``router`` is a name.
        group_size: tokens per routing group; ``None`` routes all tokens of a call as one group.
            Inputs ``(..., d_model)`` are flattened and split into groups of ``group_size``.
        path: ``"index"`` (fast: slot buffers with a capacity, sorted segments without), ``"slots"``
            (per-expert slot buffers), ``"grouped"`` (sorted segments, no padding), ``"einsum"``
            (eq. 2 literally) or ``"loop"`` (loop over experts).
        n_shared_experts: experts every token passes through, beside the routed ones (DeepSeekMoE;
            chapter 10, "Shared and fine-grained experts"): each an MLP of width ``d_hidden`` whose
            output is added, with weight 1, to the routed output. 0 (default): none.
        shared_expert_gate: multiply the shared experts' summed output by a learned per-token gate
            ``sigmoid(x w_g)`` (``w_g`` a ``d_model`` vector, the ``Linear(d_model, 1)``
            ``shared_gate``): Qwen2-MoE's gated shared expert, ``out = routed(x) + sigmoid(x w_g) *
            shared(x)``. Needs ``n_shared_experts >= 1``; False (default): weight 1.

    After each forward, ``last_routing`` holds the :class:`Routing` (with ``aux_loss`` and ``stats``).
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
        n_shared_experts: int = 0,
        shared_expert_gate: bool = False,
    ):
        super().__init__()
        self.d_model = check_int(d_model, "d_model", low=1)
        self.d_hidden = check_int(d_hidden, "d_hidden", low=1)
        self.n_experts = check_int(n_experts, "n_experts", low=1)
        self.router = self._build_router(router, router_options)
        self.group_size = check_int(group_size, "group_size", low=1, allow_none=True)
        self.path = check_choice(path, "path", PATHS)
        self.experts = self._build_experts(activation, bias)
        self.n_shared_experts = check_int(n_shared_experts, "n_shared_experts", low=0)
        # replicated on every rank by the expert-parallel layer, like the router
        self.shared_experts = (Experts(self.n_shared_experts, d_model, d_hidden, activation, bias)
                               if self.n_shared_experts else None)
        if check_bool(shared_expert_gate, "shared_expert_gate") and not self.n_shared_experts:
            raise ValueError("shared_expert_gate=True gates the shared experts' output: it needs n_shared_experts >= 1, "
                             f"got n_shared_experts={self.n_shared_experts}")
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_expert_gate else None
        self.last_routing: Routing | None = None

    def _build_router(self, router, router_options) -> Router:
        """``router`` itself (a ``Router`` built for this layer's sizes) or the router registered under
        that name, built with ``router_options``."""
        if router_options is not None and not isinstance(router_options, dict):
            raise TypeError(f"router_options must be a dict of the router's options, got {router_options!r}")
        if isinstance(router, Router):
            if router_options:
                raise ValueError("router_options are only used when router is a name")
            if (router.d_model, router.n_experts) != (self.d_model, self.n_experts):
                raise ValueError(f"router was built for d_model={router.d_model}, n_experts={router.n_experts}; "
                                 f"the layer has d_model={self.d_model}, n_experts={self.n_experts}")
            return router
        if isinstance(router, str):
            return build(router, self.d_model, self.n_experts, **(router_options or {}))
        raise TypeError(f"router must be a registered name or a Router, got {type(router).__name__}")

    def _build_experts(self, activation: str, bias: bool) -> "Experts":
        """The routed experts this layer holds: all ``n_experts`` of them (the expert-parallel layer
        holds its rank's share)."""
        return Experts(self.n_experts, self.d_model, self.d_hidden, activation, bias)

    def shared_output(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Sum of the shared experts' outputs on every token ``tokens (N, d)`` (None without any),
        times ``sigmoid(tokens w_g)`` with ``shared_expert_gate`` (Qwen2-MoE)."""
        if self.shared_experts is None:
            return None
        n, d = tokens.shape
        out = self.shared_experts(tokens.unsqueeze(0).expand(self.n_shared_experts, n, d)).sum(0)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(tokens)) * out
        return out

    def __getstate__(self):
        # copy.deepcopy, pickle and torch.save(model) copy the layer, not its last forward: that routing
        # holds the autograd graph of the step that made it (and the router's lazy statistics)
        state = super().__getstate__()  # (nn.Module's: without a compiled call bound to this layer)
        state = dict(state if isinstance(state, dict) else self.__dict__)
        state["last_routing"] = None
        return state

    @property
    def takes_token_keys(self) -> bool:
        """Whether this layer's router routes by each token's key (hash routing): a model then passes
        its inputs as ``token_keys`` (:class:`minimoe.models.Block` asks this before it does)."""
        return self.router.takes_token_keys

    @property
    def aux_loss(self) -> torch.Tensor:
        """The auxiliary loss of the last forward (0 before any)."""
        return self.last_routing.aux_loss if self.last_routing is not None else torch.zeros(())

    def forward(self, x: torch.Tensor, group_size: int | None = None, *,
                token_mask: torch.Tensor | None = None, token_keys: torch.Tensor | None = None) -> torch.Tensor:
        """``x (..., d_model) -> (..., d_model)``; ``group_size`` overrides the layer's for this call
        (the models pass the sequence length to route each sequence as its own group). ``token_mask``
        (``x.shape[:-1]``, False or 0 for padding) goes to the router, whose auxiliary losses and
        balance statistics then skip the padding (:meth:`minimoe.routers.Router.route`).
        ``token_keys`` (ids ``x.shape[:-1]`` or raw vectors ``(*x.shape[:-1], D)``) is what the model
        knows of each token before any layer: it goes to a router that routes by it
        (:attr:`~minimoe.routers.Router.takes_token_keys`, hash routing) and is ignored by the others."""
        check_tensor(x, "x", min_dim=1, last_dim=self.d_model, shape_hint="(..., d_model)")
        group_size = check_int(group_size, "group_size", low=1, allow_none=True)
        tokens = x.reshape(-1, self.d_model)
        n = tokens.shape[0]
        group_size = group_size or self.group_size or n
        if n == 0:  # no tokens: an empty output and an empty routing, as torch's layers do
            self.last_routing = self.router(tokens.view(0, 0, self.d_model))
            return x * 0  # (keeps the autograd link to x, so a loss on it can still call backward)
        if n % group_size:
            raise ValueError(f"the input has {n} tokens, not a multiple of group_size={group_size}")
        groups = tokens.view(n // group_size, group_size, self.d_model)
        weight = self.experts.w_in
        if weight.dtype != x.dtype and not autocast_on(x.device.type):
            raise TypeError(f"x has dtype {x.dtype} but the experts' weights are {weight.dtype}: the layer's parts must "
                            f"share one dtype; convert the whole layer (layer.to({x.dtype})) or x, or run under "
                            "torch.autocast")
        # the three steps: route, dispatch-compute-combine (eq. 2), then the router's own rule on the
        # output (the router protocol: DenseMixer's dense backward, Kool's REINFORCE scaling, ...)
        extra = {}
        if token_mask is not None:
            if not isinstance(token_mask, torch.Tensor) or tuple(token_mask.shape) != tuple(x.shape[:-1]):
                raise ValueError(f"token_mask must be a tensor of the tokens' shape {tuple(x.shape[:-1])}, got "
                                 f"{tuple(token_mask.shape) if isinstance(token_mask, torch.Tensor) else token_mask!r}")
            extra["token_mask"] = token_mask.reshape(groups.shape[:2])
        if self.router.takes_token_keys:
            extra["token_keys"] = self._group_keys(token_keys, x, groups)
        routing = self.router(groups, **extra)
        self.last_routing = routing
        out = self.apply_routing(groups, routing)
        out = self.router.adjust_output(self, groups, routing, out)
        shared = self.shared_output(tokens)
        if shared is not None:
            out = out + shared.view_as(out).to(out.dtype)
        return out.to(x.dtype).view_as(x)  # under autocast the experts' matmuls return a lower precision

    def _group_keys(self, token_keys, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """``token_keys`` of the tokens ``x (..., d)`` in the layer's groups: ``(G, T)`` or ``(G, T, D)``."""
        if token_keys is None:
            raise ValueError(f"router {self.router.name!r} routes each token by its key: call the layer as "
                             "MoELayer(x, token_keys=...) with the token ids (x.shape[:-1]) or raw input vectors "
                             "(x.shape[:-1] + (D,)); the models of minimoe.models pass their inputs")
        if not isinstance(token_keys, torch.Tensor):
            raise TypeError(f"token_keys must be a torch.Tensor, got {type(token_keys).__name__}")
        tokens = tuple(x.shape[:-1])
        vector = token_keys.is_floating_point()
        if tuple(token_keys.shape[:len(tokens)]) != tokens or token_keys.dim() != len(tokens) + vector:
            raise ValueError(f"token_keys must have the tokens' shape {tokens} (ids) or {(*tokens, 'D')} (vectors), "
                             f"got {tuple(token_keys.shape)}")
        return token_keys.reshape(*groups.shape[:2], *token_keys.shape[len(tokens):])

    def all_expert_outputs(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every expert on every token of the groups ``x (G, T, d)``: ``(E, G, T, d)``, detached where
        ``routing`` did not dispatch the pair, so that each expert's weights learn only from the
        tokens routed to it (for a router's :meth:`~minimoe.routers.Router.adjust_output` that needs
        all experts, DenseMixer's). E times the experts' cost of a top-1 layer."""
        G, T, d = x.shape
        E = self.n_experts
        y_all = self.experts(x.reshape(1, G * T, d).expand(E, G * T, d)).view(E, G, T, d)
        routed = routing.mask.permute(2, 0, 1).unsqueeze(-1)  # (E, G, T, 1)
        return torch.where(routed, y_all, y_all.detach())

    def apply_routing(self, x: torch.Tensor, routing: Routing, path: str | None = None) -> torch.Tensor:
        """Evaluate eq. (2) for groups ``x (G, T, d)`` and a given routing, by the chosen path."""
        path = path or self.path
        if routing.is_soft or path == "einsum":
            return self._einsum(x, routing)
        if path == "loop":
            return self._loop(x, routing)
        if path == "index":
            path = self._fast_path(x, routing)
        if path == "grouped":
            return self._grouped(x, routing)
        return self._slots(x, routing)

    def _fast_path(self, x: torch.Tensor, routing: Routing) -> str:
        """``"grouped"`` or ``"slots"`` for ``path="index"`` (see the module docstring)."""
        if not reads_are_free(x):
            return "slots" if routing.capacity is not None else "grouped"
        pairs = int(routing.num_pairs())
        padded = self.n_experts * x.shape[0] * routing.num_slots
        return "grouped" if pairs >= GROUPED_ROWS_PER_EXPERT * self.n_experts or padded >= 2 * pairs else "slots"

    def _einsum(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        dispatch = routing.dispatch_tensor().to(x.dtype)  # (g, t, e, c)
        combine = routing.combine_tensor().to(x.dtype)
        G, T, E, C = dispatch.shape
        xin = torch.einsum("gtec,gtd->egcd", dispatch, x).reshape(E, G * C, self.d_model)
        y = self.experts(xin).view(E, G, C, self.d_model)
        return torch.einsum("gtec,egcd->gtd", combine, y)

    def _grouped(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        G, T, d = x.shape
        E, N = self.n_experts, G * T
        flat_x = x.reshape(N, d)
        # a pair list of static length (the router's bound) only where a grouped matmul can take it
        # without the segment lengths; elsewhere the lengths are read anyway, and the list is exact
        bound = routing.max_pairs if _grouped_mm_fits(flat_x, self.experts.w_in, self.experts.w_out) else None
        # the routed pairs, expert-major: expert 0's tokens in token order, then expert 1's, ...
        if routing.has_choices:
            expert, token, weight, counts, valid = self._sorted_choices(x, routing, bound)
        else:
            pair_mask = (routing.position >= 0).reshape(N, E).t()
            counts = pair_mask.sum(1)
            if reads_are_free(x) or bound is None:
                expert, token = pair_mask.nonzero(as_tuple=True)  # the list's length is data: a host read
                valid = None
            else:
                # a list of static length (the router's bound), padded at the end with -1: no host read
                pairs = torch.nonzero_static(pair_mask, size=min(bound, N * E), fill_value=-1)
                valid = pairs[:, :1] >= 0
                expert, token = pairs.clamp_min(0).unbind(1)  # padding reads token 0 with weight 0
            weight = routing.combine.reshape(N * E).index_select(0, token * E + expert)
        weight = weight.to(x.dtype).unsqueeze(-1)
        if valid is None and not _grouped_mm_fits(flat_x, self.experts.w_in, self.experts.w_out):
            lengths = counts.tolist()  # (read on the host: the list's length above already was)
            if any(lengths):
                return self._segments(flat_x, token, weight, lengths).view(G, T, d)
        y = self.experts.grouped(flat_x.index_select(0, token), expert, counts)
        contribution = y * weight
        if valid is not None:  # a grouped matmul leaves the padding rows unwritten: any value
            contribution = torch.where(valid, contribution, 0.0)
        # each token's outputs are added in expert order, as on the index path and in the einsum
        out = flat_x.new_zeros(N, d).index_add(0, token, contribution.to(flat_x.dtype))
        return out.view(G, T, d)

    def _segments(self, flat_x, token, weight, lengths) -> torch.Tensor:
        """The grouped path where the segment lengths are on the host (a CPU): expert e's segment of
        the sorted pairs runs through its MLP and is added, weighted, into its tokens' outputs right
        away. The same sums in the same order as one matmul per segment, a concatenation and one
        index_add, without the two (P, d) tensors of the concatenated outputs and their weighted copy
        (the peak of forward + backward is in what autograd keeps)."""
        out = flat_x.new_zeros(flat_x.shape)
        rows = flat_x.index_select(0, token).split(lengths)  # one gather (and one index_add backward)
        for n, x_e, token_e, weight_e, params in zip(lengths, rows, token.split(lengths), weight.split(lengths),
                                                     self.experts.per_expert()):
            if n:  # in expert order: each token's outputs are added in expert order, as on the other paths
                out.index_add_(0, token_e, (self.experts._mlp(x_e, *params) * weight_e).to(out.dtype))
        return out

    def _sorted_choices(self, x: torch.Tensor, routing: Routing, bound: int | None):
        """The grouped path's pair list from each token's k choices (``Routing.choice_*``): the kept
        choices sorted by expert (token order within an expert, as a stable sort of the token-major
        list keeps it), with their experts, tokens, weights, the segment lengths and, on an
        accelerator, which rows of the static-length list are real pairs (else None)."""
        E, (*_, k) = self.n_experts, routing.choice_expert.shape
        n_choices = x.shape[0] * x.shape[1] * k
        kept = routing.choice_slot.reshape(n_choices) >= 0
        # a dropped choice gets the key E: sorted after every expert's segment
        key = torch.where(kept, routing.choice_expert.reshape(n_choices), E)
        counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))[:E]
        order = stable_argsort_ids(key, E)
        if reads_are_free(x) or bound is None:
            order, valid = order[:int(counts.sum())], None  # the list's length is data: a host read
        else:  # static length: the router's bound, with dropped choices (weight 0) as the padding
            order = order[:min(bound, n_choices)]
            valid = (key.index_select(0, order) < E).unsqueeze(-1)
        expert = key.index_select(0, order).clamp_max(E - 1)
        weight = routing.choice_weight.reshape(n_choices).index_select(0, order)
        return expert, order // k, weight, counts, valid

    def _slots(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        G, T, d = x.shape
        E, C = self.n_experts, routing.num_slots
        N, slots = G * T, E * G * C
        # Every shape here is known before any routing value is: no listing of the dispatched pairs
        # (whose number is data), so an accelerator never waits for the host. Each candidate pair's
        # row in the (E * G * C, d) buffer; a pair not dispatched goes to one extra row, dropped. The
        # candidates are each token's k choices when the router gives them, else all its E experts.
        if routing.has_choices:
            per_token = routing.choice_expert.shape[-1]
            e = routing.choice_expert.reshape(G, T, per_token)
            position = routing.choice_slot.reshape(G, T, per_token)
            pair_weight = routing.choice_weight
        else:
            per_token = E
            e = torch.arange(E, device=x.device).view(1, 1, E)
            position = routing.position.reshape(G, T, E)
            pair_weight = routing.combine
        g = torch.arange(G, device=x.device).view(G, 1, 1)
        slot = torch.where(position >= 0, e * (G * C) + g * C + position, slots).reshape(-1)
        # each slot's candidate pair, or n_pairs (no pair) for an empty slot
        n_pairs = N * per_token
        slot_pair = torch.full((slots + 1,), n_pairs, dtype=torch.long, device=x.device)
        slot_pair = slot_pair.scatter(0, slot, torch.arange(n_pairs, device=x.device))[:slots]
        empty = (slot_pair == n_pairs).unsqueeze(-1)
        slot_token = torch.where(empty.squeeze(-1), 0, slot_pair // per_token)
        flat_x = x.reshape(N, d)
        # index_select, not x[rows]: its backward is an index_add, not a (much slower) index_put
        # an empty slot holds zeros (in place: index_select keeps nothing for its backward, one buffer less)
        buffer = flat_x.index_select(0, slot_token).masked_fill_(empty, 0.0)
        y = self.experts(buffer.view(E, G * C, d)).view(slots, d)
        combine = torch.cat([pair_weight.reshape(n_pairs), pair_weight.new_zeros(1)])
        weight = combine.index_select(0, slot_pair).to(x.dtype).unsqueeze(-1)  # 0 for an empty slot
        # slots in expert order: each token's outputs are added in expert order, as in the einsum;
        # an empty slot adds 0 * MLP(0) = 0 to token 0
        out = flat_x.new_zeros(N, d).index_add(0, slot_token, (y * weight).to(flat_x.dtype))
        return out.view(G, T, d)

    def _loop(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        G, T, d = x.shape
        flat_x = x.reshape(G * T, d)
        mask = routing.mask.reshape(G * T, self.n_experts)
        weights = routing.combine.reshape(G * T, self.n_experts).to(x.dtype)
        out = torch.zeros_like(flat_x)
        for e, params in enumerate(self.experts.per_expert()):
            rows = mask[:, e].nonzero(as_tuple=True)[0]
            if rows.numel():
                y = self.experts._mlp(flat_x[rows], *params) * weights[rows, e, None]
                out = out.index_add(0, rows, y.to(out.dtype))
        return out.view(G, T, d)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_hidden={self.d_hidden}, n_experts={self.n_experts}, "
                f"group_size={self.group_size}, path={self.path!r}, n_shared_experts={self.n_shared_experts}"
                + (", shared_expert_gate=True" if self.shared_gate is not None else ""))


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of ``model`` (itself included), in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def router_losses(model: nn.Module, loss_per_token: torch.Tensor, *,
                  baseline: float | torch.Tensor = 0.0) -> torch.Tensor | None:
    """The sum of every MoE layer's :meth:`~minimoe.routers.Router.extra_loss` for the last forward
    of ``model`` (the router protocol's extra training losses, e.g. Kool's REINFORCE term), given
    that forward's per-token or per-example task losses; None when no router adds one. Used by
    :func:`minimoe.train.train`; add it to the objective in a loop of one's own."""
    total = None
    for layer in moe_layers(model):
        if layer.last_routing is None:
            continue
        term = layer.router.extra_loss(layer.last_routing, loss_per_token, baseline=baseline)
        if term is not None:
            total = term if total is None else total + term
    return total


def reroute(model: nn.Module, router: str, **options) -> nn.Module:
    """Training-free re-routing (chapter 6, "USMoE without training"): a copy of ``model`` in which every
    MoE layer's router is replaced by a new ``router`` (a registered name, built with ``options``) that
    reuses the trained gate weights. The experts and every other weight are unchanged; the original
    model is not modified.

    Example: ``reroute(trained_token_choice_model, "usmoe", k=2, alpha=0.5)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module with MoELayers, got {type(model).__name__}")
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model has no MoELayer to re-route")
    if any(m.router.gate is None for m in layers):
        raise ValueError("model has a router without a gate (soft_moe): there are no gate weights to reuse")
    # the last routing holds tensors of the autograd graph, which cannot be deep-copied (nor need be)
    memo = {id(m.last_routing): None for m in layers if m.last_routing is not None}
    new = copy.deepcopy(model, memo)
    for layer in [m for m in new.modules() if isinstance(m, MoELayer)]:
        old = layer.router
        fresh = build(router, old.d_model, old.n_experts, **options).to(old.gate.weight.device)
        if fresh.gate is None:
            raise ValueError(f"router {router!r} has no gate to take the trained gate weights")
        with torch.no_grad():
            fresh.gate.weight.copy_(old.gate.weight)
        fresh.train(old.training)
        layer.router = fresh
    return new
