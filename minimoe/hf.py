"""`minimoe`'s routers inside Hugging Face `transformers` MoE models (the optional extra ``minimoe[hf]``).

Book: chapter 1, "In a Hugging Face model" (under "A router carries its own rules"). The core
package never imports this module.

    from minimoe import hf
    gates = hf.swap_router(model, "sinkhorn_token_choice", capacity_factor=1.25)
    ...
    loss = task_loss + hf.router_losses(model, loss_per_token)   # the routers' own auxiliary losses

How: in every MoE block of a Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 model the block's
``gate`` (a router that returns ``(logits, top_k_weights, top_k_index)``) is replaced by a
:class:`MinimoeGate` that keeps the gate's ``weight`` (the checkpoint key ``...mlp.gate.weight`` is
unchanged), computes the logits, routes them with a `minimoe` router and hands the block's experts
the same three tensors. The block itself, its experts, its shared experts and Mixtral's input jitter
run as before. Details:

* **Groups.** A router that compares tokens (expert choice, Sinkhorn, BASE, USMoE, ...) routes the
  tokens of one *position* across the batch as a group (``grouping="position"``, the default: causal
  in a decoder, chapter 9's rule), or each sequence as a group (``grouping="sequence"``).
* **Variable experts per token** (expert choice, global top-c, sampled subsets) are handed to the
  experts as ``k_max`` choices per token, padded with weight 0 on a valid expert index (an index
  ``E`` would leave rows uninitialised in the grouped kernels).
* **Gradient rules** travel with the router: ``adjust_output`` (DenseMixer's dense backward, Kool's
  REINFORCE scaling) is applied to the block's output by a forward hook, with every expert run on
  every token through the block's own experts when the rule needs it; ``extra_loss`` (Kool's
  REINFORCE term) and the auxiliary losses are returned by :func:`router_losses`. HF's own
  ``router_aux_loss_coef`` recomputes a softmax top-k loss from the logits, wrong for any other
  router: leave ``output_router_logits`` off (asking for it after a swap is refused) and add
  :func:`router_losses` instead.
* **router=None** installs `minimoe`'s exact equivalent of the family's router: dropless softmax top-k
  (renormalised as the config says) for Mixtral, OLMoE and the Qwen models; for DeepSeek-V3
  ``loss_free`` with sigmoid scores, the correction bias, group-limited selection and the routed
  scaling factor (with ``bias_rate=0``, as HF's model never updates its bias; pass ``bias_rate`` to
  train it).
* **Padding**: with ``mask_padding=True`` the ``attention_mask`` of the model's forward becomes the
  router's ``token_mask``: the auxiliary losses and balance statistics skip padding tokens, as HF's
  ``load_balancing_loss_func`` does with the mask (routers that take a mask: softmax top-k, loss-free).
* **Precision**: the default routers take the softmax (or sigmoid) in float32 from the model's
  logits (``router_dtype="float32"``), as the families do, so a bfloat16 model is reproduced too.

**Soft MoE** (``swap_router(model, "soft_moe", slots_per_expert=S)``) has no per-token choices to
hand the experts, so it replaces the block instead of its gate: each MoE block becomes a
:class:`SoftMoEBlock` that adopts the block's own experts (and shared experts) under their own names
and computes, for the tokens ``x (G, T, d)`` of each routing group, the slot inputs ``D^T x``
(``D = slot_dispatch``, a softmax over the group's tokens), expert ``e`` on its ``S`` slot inputs
through the block's ``experts`` module, and each token's output ``C Y`` (``C = slot_combine``, a
softmax over all ``E * S`` slots); chapter 4, eqs. (10)-(11). The shared paths are added as the
family computes them (Qwen2-MoE's sigmoid-gated shared expert, DeepSeek-V3's shared experts), and
Mixtral's training jitter multiplies the block's input as before; the gate and what belongs to it
(DeepSeek-V3's correction bias, group-limited selection and ``routed_scaling_factor``) are not used.
The slot parameters ``slot_embed`` and ``scale`` live in ``block.gate.router`` and train. The groups
follow ``grouping``: ``"position"`` (the default) mixes the tokens at one position of every sequence of
the batch, which is causal (a token's output depends on no later token) and the same grouping in
training and in cached decoding, one position at a time; ``"sequence"`` mixes each sequence's tokens
and is not causal (a model trained so reads the future). ``slots_per_expert`` defaults to 1: ``E``
expert evaluations per routing group whatever its size, the Soft MoE paper's best setting at a fixed
cost. With ``mask_padding=True`` the padding is kept out of the slot mixtures (its dispatch logits
are ``-inf``), so a real token's output does not depend on the padding beside it; without it, padding
tokens are mixed into the slots like any token. Swapping another router in
afterwards puts the original block back (its gate as it was) and swaps that.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .routers import available, baselines, router_class
from .routers.base import Router

FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3")
_NO_ADJUST = Router.adjust_output  # the protocol's default: nothing to do after the block
GROUPINGS = ("position", "sequence")


def _family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"swap_router supports the model types {FAMILIES}; got a model of type {family!r} "
                         f"({type(model).__name__})")
    return family


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE blocks: modules with a ``gate`` that has a ``weight`` of shape (E, d) and ``experts``."""
    found = []
    for name, module in model.named_modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if isinstance(gate, nn.Module) and isinstance(experts, nn.Module) and \
                isinstance(getattr(gate, "weight", None), torch.Tensor) and gate.weight.dim() == 2:
            found.append((name, module))
    return found


def _default_router(family: str, config) -> tuple[str, dict]:
    k = config.num_experts_per_tok
    if family == "deepseek_v3":
        if not getattr(config, "norm_topk_prob", True):
            raise ValueError("router=None reproduces DeepSeek-V3's router with norm_topk_prob=True only; "
                             "choose a router explicitly")
        return "loss_free", {"k": k, "score": "sigmoid", "bias_on": "scores", "bias_rate": 0.0,
                             "n_group": config.n_group, "topk_group": config.topk_group,
                             "routed_scaling": float(config.routed_scaling_factor), "router_dtype": "float32"}
    renormalize = True if family == "mixtral" else bool(config.norm_topk_prob)
    # the softmax in float32 from the model-dtype logits, as these families' routers compute it
    return "softmax_topk", {"k": k, "capacity_factor": None, "renormalize": renormalize, "router_dtype": "float32"}


class MinimoeGate(nn.Module):
    """A block's gate replaced by a `minimoe` router: ``forward(hidden (N, d))`` returns
    ``(logits (N, E), weights (N, k), index (N, k))`` as HF's routers do. Keeps the gate's ``weight``;
    the router's own state (a loss-free bias, learned noise) lives under ``router``."""

    def __init__(self, weight: nn.Parameter | None, router: nn.Module, *, grouping: str, float32_logits: bool,
                 float32_weights: bool = False):
        super().__init__()
        self.weight = weight
        self.router = router
        self.grouping = grouping
        self.float32_logits = float32_logits
        self.float32_weights = float32_weights  # Mixtral hands its experts float32 weights
        self.batch_shape: tuple[int, int] | None = None   # (batch, sequence), set by the block's pre-hook
        self.mask_padding = False
        self.attention_mask: torch.Tensor | None = None   # (batch, length), set by the model's pre-hook
        self.last_routing = None
        self.last_input = None

    # the token order of a routing group and back: (B*S, ...) <-> (G, T, ...)
    def _to_groups(self, flat: torch.Tensor) -> torch.Tensor:
        B, S = self.batch_shape
        grid = flat.reshape(B, S, *flat.shape[1:])
        return grid.transpose(0, 1).contiguous() if self.grouping == "position" else grid

    def _from_groups(self, groups: torch.Tensor) -> torch.Tensor:
        grid = groups.transpose(0, 1) if self.grouping == "position" else groups
        return grid.reshape(-1, *groups.shape[2:])

    def _token_mask(self) -> torch.Tensor | None:
        """The model call's attention mask for these tokens, in the routing groups' order (with
        ``mask_padding``): its last ``sequence`` columns, as a decoder with a cache holds the past too."""
        mask, (B, S) = self.attention_mask, self.batch_shape
        if not self.mask_padding or mask is None:
            return None
        if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < S:
            raise ValueError(f"attention_mask must have shape (batch, length) = ({B}, >= {S}) with 1 for a real "
                             f"token and 0 for padding to mask the routing losses (mask_padding=True), got shape "
                             f"{tuple(mask.shape)}; pass the tokenizer's 2-D attention_mask, or swap with "
                             "mask_padding=False")
        return self._to_groups(mask[:, -S:].reshape(-1) != 0)

    def forward(self, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, self.weight.shape[1])
        if self.batch_shape is None or self.batch_shape[0] * self.batch_shape[1] != hidden.shape[0]:
            self.batch_shape = (1, hidden.shape[0])          # called on its own: one sequence
        hidden = self.router.router_input(hidden)            # the router's own input jitter, if it has one
        if self.float32_logits:
            logits = F.linear(hidden.float(), self.weight.float())
        else:
            logits = F.linear(hidden, self.weight)
        x = self._to_groups(hidden)
        token_mask = self._token_mask()
        if token_mask is None:
            routing = self.router.route(self._to_groups(logits), x)
        else:
            routing = self.router.route(self._to_groups(logits), x, token_mask=token_mask)
        self.last_routing, self.last_input = routing, x
        if routing.is_soft:
            raise ValueError("a soft router (Soft MoE) has no per-token choices to hand the block's experts")
        if routing.has_choices:
            index, weight = routing.choice_expert, routing.choice_weight
        else:  # a table routing: each token's experts, padded with weight 0 on a valid index
            mask = routing.mask
            k_max = max(int(mask.sum(-1).max()), 1)
            index = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :k_max]
            weight = routing.combine.gather(-1, index) * mask.gather(-1, index)
        weight = self._from_groups(weight)
        weight = weight.to(torch.promote_types(logits.dtype, torch.float32) if self.float32_weights else logits.dtype)
        return logits, weight, self._from_groups(index)


class SoftMoEGate(MinimoeGate):
    """The routing of a :class:`SoftMoEBlock`: ``forward(x (G, T, d))`` returns the Soft MoE routing
    of the groups ``x`` (``slot_dispatch`` and ``slot_combine``, ``(G, T, E, S)``). No gate weight:
    the router's ``slot_embed`` and ``scale`` take its place."""

    def __init__(self, router: nn.Module, *, grouping: str):
        super().__init__(None, router, grouping=grouping, float32_logits=False)

    def forward(self, x: torch.Tensor):
        token_mask = self._token_mask()   # with mask_padding: padding stays out of the slot mixtures
        routing = self.router.route(None, x) if token_mask is None else self.router.route(None, x, token_mask=token_mask)
        self.last_routing, self.last_input = routing, x
        return routing


class SoftMoEBlock(nn.Module):
    """An MoE block of a Hugging Face model with Soft MoE in place of its routing (module docstring).

    Holds the original block's ``experts`` (and ``shared_expert`` with ``shared_expert_gate``, or
    ``shared_experts``) under the same names, so their checkpoint keys do not move, and a
    :class:`SoftMoEGate` as ``gate``. ``forward(hidden (batch, sequence, d))`` returns a tensor of the
    same shape, as the family's block does and its decoder layer expects."""

    def __init__(self, block: nn.Module, router: nn.Module, *, family: str, grouping: str):
        super().__init__()
        self.family = family
        self.gate = SoftMoEGate(router, grouping=grouping)
        self.experts = block.experts
        if family == "qwen2_moe":
            self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        elif family == "deepseek_v3":
            self.shared_experts = block.shared_experts
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)   # Mixtral's block input jitter
        self.__dict__["hf_block"] = block   # the block as it was (not a submodule: no second copy of the keys)

    def extra_repr(self) -> str:
        return f"family={self.family!r}, grouping={self.gate.grouping!r}"

    def expert_outputs(self, slots: torch.Tensor) -> torch.Tensor:
        """``Y (G, E, S, d)``: expert ``e`` of the block on its slot inputs ``slots[:, e]``, all in one
        call of the block's experts (each slot one token with the single choice ``e`` at weight 1)."""
        G, E, S, d = slots.shape
        index = torch.arange(E, device=slots.device).view(1, E, 1, 1).expand(G, E, S, 1).reshape(-1, 1)
        ones = slots.new_ones(G * E * S, 1)
        return self.experts(slots.reshape(-1, d), index, ones).view(G, E, S, d)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The family's shared path on the tokens ``x (N, d)``, as its block computes it (None: none)."""
        if self.family == "qwen2_moe":
            return F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.family == "deepseek_v3":
            return self.shared_experts(x)
        return None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        d = shape[-1]
        tokens = hidden_states   # the shared paths see the block's input as it came
        if self.training and self.jitter_noise > 0:   # Mixtral: the block's input, routing and experts alike
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        gate = self.gate
        gate.batch_shape = (shape[0], shape[1]) if hidden_states.dim() == 3 else (1, hidden_states.numel() // d)
        x = gate._to_groups(hidden_states.reshape(-1, d))                 # (G, T, d)
        routing = gate(x)
        dispatch = routing.slot_dispatch.to(x.dtype)                      # (G, T, E, S): softmax over T
        combine = routing.slot_combine.to(x.dtype)                        # (G, T, E, S): softmax over E * S
        slots = torch.einsum("gtes,gtd->gesd", dispatch, x)               # each slot's input, D^T x
        out = torch.einsum("gtes,gesd->gtd", combine, self.expert_outputs(slots))
        out = gate.router.adjust_output(_ExpertsView(self, gate), x, routing, out)
        out = gate._from_groups(out)
        shared = self.shared_output(tokens.reshape(-1, d))
        if shared is not None:
            out = out + shared
        return out.reshape(shape)


class _ExpertsView:
    """What a router's ``adjust_output`` may ask of "the layer": every expert on every token."""

    def __init__(self, block: nn.Module, gate: MinimoeGate):
        self.block, self.gate = block, gate

    def all_expert_outputs(self, x: torch.Tensor, routing) -> torch.Tensor:
        """(E, G, T, d): expert e on every token of the groups ``x``, detached where not routed."""
        E = self.gate.router.n_experts
        flat = x.reshape(-1, x.shape[-1])
        ones = flat.new_ones(flat.shape[0], 1)
        outs = torch.stack([self.block.experts(flat, torch.full((flat.shape[0], 1), e, dtype=torch.long,
                                                                device=flat.device), ones)
                            for e in range(E)]).view(E, *x.shape)
        routed = routing.mask.permute(2, 0, 1).unsqueeze(-1)
        return torch.where(routed, outs, outs.detach())


def _pre_hook(module, args):
    hidden = args[0]
    if hidden.dim() == 3:
        module.gate.batch_shape = (hidden.shape[0], hidden.shape[1])


def _mask_hook(model, args, kwargs):
    asked = kwargs.get("output_router_logits")
    if asked or (asked is None and getattr(getattr(model, "config", None), "output_router_logits", False)):
        # HF would collect router logits by its own router classes (gone) and recompute a softmax top-k
        # loss from them, wrong for another router: refuse with the replacement, not an IndexError inside
        raise ValueError("output_router_logits=True does not work after minimoe.hf.swap_router: the model's "
                         "routers are minimoe's. Call the model with output_router_logits=False (set "
                         "model.config.output_router_logits = False) and add minimoe.hf.router_losses(model) "
                         "to the loss")
    # the model's forward is forward(input_ids, attention_mask, ...): the mask may come by position
    mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[1] if len(args) > 1 else None)
    for gate in swapped_gates(model):
        gate.attention_mask = mask if isinstance(mask, torch.Tensor) else None


def _post_hook(module, args, output):
    gate: MinimoeGate = module.gate
    routing = gate.last_routing
    if routing is None or type(gate.router).adjust_output is _NO_ADJUST:
        return output
    out = gate._to_groups(output.reshape(-1, output.shape[-1]))
    adjusted = gate.router.adjust_output(_ExpertsView(module, gate), gate.last_input, routing, out)
    return gate._from_groups(adjusted).reshape(output.shape)


def _restore_blocks(model: nn.Module) -> None:
    """Put back the original block of every :class:`SoftMoEBlock` (its gate as it was, on the device
    of its experts), so that another router can be swapped in."""
    for name, module in list(model.named_modules()):
        if isinstance(module, SoftMoEBlock):
            parent, _, attr = name.rpartition(".")
            block = module.hf_block
            weight = next(module.experts.parameters(), None)
            if weight is not None:
                block.gate.to(device=weight.device)
            setattr(model.get_submodule(parent) if parent else model, attr, block)


def _build_router(cls, name: str, d: int, E: int, options: dict):
    try:
        return cls(d, E, **options)
    except TypeError as err:
        raise TypeError(f"router {name!r} does not take these options {sorted(options)}: {err}") from None


def swap_router(model: nn.Module, router: str | None = None, *, grouping: str = "position",
                mask_padding: bool = False, **router_options) -> list[MinimoeGate]:
    """Replace the router of every MoE block of a Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3
    model by `minimoe`'s ``router`` (any registered name; ``None``: the family's own router, exactly),
    in place; returns the new gates. ``grouping``: ``"position"`` (default, causal) or ``"sequence"``
    (not causal in a decoder), the routing groups of routers that compare tokens. ``mask_padding=True``:
    the ``attention_mask`` passed to the model's forward becomes the router's ``token_mask``, so that
    its auxiliary losses and balance statistics skip padding (chapter 1, "Padding tokens"; for routers
    that take a mask, softmax top-k and loss-free balancing). ``router_options`` go to the router; an
    option it does not take is an error naming the router.

    A router without a gate (``"soft_moe"``: its slot parameters take the gate's place) replaces each
    block by a :class:`SoftMoEBlock` with the block's own experts and shared experts (module
    docstring); its options are those of :class:`minimoe.routers.SoftMoE` (``slots_per_expert``,
    default 1; ``normalize``; ``scale_init``), and the returned gates are the blocks'
    :class:`SoftMoEGate`. Swapping again, with any router, starts from the original blocks."""
    family = _family(model)
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    if not isinstance(mask_padding, bool):
        raise TypeError(f"mask_padding must be True or False, got {mask_padding!r}")
    soft_blocks = [(n, m.hf_block) for n, m in model.named_modules() if isinstance(m, SoftMoEBlock)]
    blocks = _blocks(model) + soft_blocks
    if not blocks:
        raise ValueError(f"the {family} model has no MoE block (a module with a gate and experts) to swap")
    if router is None:
        if router_options:
            raise ValueError("router=None reproduces the model's own router and takes no router_options; "
                             "name a router to pass options")
        router, router_options = _default_router(family, model.config)
    cls = router_class(router)
    if router in baselines():
        raise ValueError(f"router {router!r} is one of the study's baselines that do not learn ({', '.join(baselines())}); "
                         f"swap_router installs a learned router: one of {', '.join(available())}")
    if mask_padding and not cls.takes_token_mask:
        raise ValueError(f"mask_padding=True: router {router!r} does not take a token_mask (its statistics count "
                         "every token); use it with mask_padding=False")
    if router == "usmoe" and "grouping" not in router_options:
        router_options = {**router_options, "grouping": "sequence"}   # our groups are already the selection groups
    # every block's router built (every option checked) before anything changes
    routers = {name: _build_router(cls, router, block.gate.weight.shape[1], block.gate.weight.shape[0], router_options)
               for name, block in blocks}
    _restore_blocks(model)
    blocks = _blocks(model)
    routers = [routers[name] for name, _ in blocks]
    if routers[0].gate is None:   # no gate: the router routes from the tokens and replaces the block
        return _swap_blocks(model, family, blocks, routers, grouping, mask_padding)
    gates = []
    for (name, block), new_router in zip(blocks, routers):
        old = block.gate  # a MinimoeGate when swapping again: its weight is kept, its router replaced
        new_router.gate = None  # the logits come from the block's own gate weight
        new_router.to(device=old.weight.device)
        if family == "deepseek_v3" and router == "loss_free":
            with torch.no_grad():
                new_router.expert_bias.copy_(getattr(old, "e_score_correction_bias", new_router.expert_bias))
        gate = MinimoeGate(old.weight, new_router, grouping=grouping, float32_logits=family == "deepseek_v3",
                           float32_weights=family == "mixtral")
        gate.mask_padding = mask_padding
        block.gate = gate
        if not getattr(block, "_minimoe_hooks", False):
            block.register_forward_pre_hook(_pre_hook)
            block.register_forward_hook(_post_hook)
            block._minimoe_hooks = True
        gates.append(gate)
    if not getattr(model, "_minimoe_mask_hook", False):
        model.register_forward_pre_hook(_mask_hook, with_kwargs=True)
        model._minimoe_mask_hook = True
    model.train(model.training)
    return gates


def _swap_blocks(model: nn.Module, family: str, blocks, routers, grouping: str,
                 mask_padding: bool = False) -> list[SoftMoEGate]:
    """Replace each block by a :class:`SoftMoEBlock` running its router, in the block's parent."""
    gates = []
    for (name, block), new_router in zip(blocks, routers):
        weight = next(block.experts.parameters())
        new_router.to(device=weight.device, dtype=weight.dtype)   # the slot parameters in the experts' dtype
        soft = SoftMoEBlock(block, new_router, family=family, grouping=grouping)
        soft.gate.mask_padding = mask_padding
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, soft)
        gates.append(soft.gate)
    model.train(model.training)
    if not getattr(model, "_minimoe_mask_hook", False):
        model.register_forward_pre_hook(_mask_hook, with_kwargs=True)
        model._minimoe_mask_hook = True
    return gates


def swapped_gates(model: nn.Module) -> list[MinimoeGate]:
    """The :class:`MinimoeGate` modules of a model that :func:`swap_router` has changed (with Soft MoE,
    the :class:`SoftMoEGate` of each :class:`SoftMoEBlock`)."""
    return [m for m in model.modules() if isinstance(m, MinimoeGate)]


def router_losses(model: nn.Module, loss_per_token: torch.Tensor | None = None, *,
                  baseline: float | torch.Tensor | str = 0.0) -> torch.Tensor:
    """The sum over the swapped gates of the last forward's auxiliary losses, plus each router's
    ``extra_loss`` (Kool's REINFORCE term) when ``loss_per_token`` (the model's per-token losses,
    ``(batch, sequence)``) is given. Add it to the task loss."""
    gates = swapped_gates(model)
    if not gates:
        raise ValueError("the model has no swapped router: call minimoe.hf.swap_router first")
    total = None
    for gate in gates:
        routing = gate.last_routing
        if routing is None:
            raise ValueError("router_losses reads the last forward's routing: run the model first")
        term = routing.aux_loss
        if loss_per_token is not None:
            per_token = loss_per_token
            if per_token.dim() == 2 and gate.grouping == "position":
                per_token = per_token.transpose(0, 1).contiguous()   # the routing groups' token order
            extra = gate.router.extra_loss(routing, per_token, baseline=baseline)
            if extra is not None:
                term = term + extra
        total = term if total is None else total + term
    return total


def load_hf_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a state dict saved from the unswapped HF model into the swapped one: the gate weights
    keep their keys; DeepSeek-V3's ``e_score_correction_bias`` becomes the loss-free router's bias;
    router state the checkpoint does not have (learned noise, a fresh bias, Soft MoE's slot
    parameters) keeps its current value. In a :class:`SoftMoEBlock` the experts and shared experts
    keep their keys and the replaced gate's entries are dropped."""
    state = dict(state_dict)
    own = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, MinimoeGate):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, SoftMoEGate):
            state.pop(prefix + "weight", None)   # the gate Soft MoE replaced
        hf_bias = state.pop(prefix + "e_score_correction_bias", None)
        if hf_bias is not None and prefix + "router.expert_bias" in own:
            state[prefix + "router.expert_bias"] = hf_bias
        for key in own:
            if key.startswith(prefix + "router.") and key not in state:
                state[key] = own[key]
    return model.load_state_dict(state, strict=strict)

