"""A census of hostile cases: what a careless or hostile user tries on the public API (the ops, every
registered router, the layer, the models, ``train``, the experiments' store and CLI, the exercise
checkers), each case a real attempt with its expected outcome: a clear error (the right exception
type, a message naming the argument and what is allowed, or the file and the fix) or a correct result.

Each case is classified as ``clear`` (the error expected, with its message), ``correct`` (a result that
passes the case's checks), ``unclear`` (another error, or a message that does not say what to change),
``silent`` (a result where an error was due, or a wrong result), ``hang`` (past its time limit) or
``data lost`` (a case of that class whose data checks failed). The test asserts clear-or-correct for
each; ``python tests/test_hostile.py`` prints the census table by class and verdict.

Hang-prone cases run under a per-case alarm (a Python loop that does not end is interrupted); the
few that could hang inside one native call run in a subprocess with a time limit.
"""
from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

import minimoe
from minimoe import MoELayer, ops, routers
from minimoe import metrics as mm

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("data lost", "damaged files", "hangs/unbounded", "silent wrong results", "unclear errors")
CASE_SECONDS = 20


@dataclass
class Case:
    name: str
    kind: str                      # one of CLASSES: the class of defect the case probes
    fn: Callable                   # fn(tmp: Path) -> None; asserts its own checks when a result is due
    error: type | tuple | None     # the exception expected, None: a result
    match: str = ""                # a regex the message must match (the argument, what is allowed)
    pending: str = ""              # "fix pending in <file>": a defect in a file this change may not touch
    subprocess: bool = False
    or_result: bool = False        # the error or a correct result are both right (a documented rule)
    seconds: float = CASE_SECONDS
    marks: list = field(default_factory=list)


CASES: list[Case] = []


def add(name, kind, fn, error=None, match="", **kw):
    CASES.append(Case(name, kind, fn, error, match, **kw))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def S(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


# --------------------------------------------------------------------------------------------- ops
E_ARG = (ValueError, TypeError)

add("global_topc c=0 on scores picks nothing", "silent wrong results",
    lambda tmp: _assert(ops.global_topc(S(4, 3), 0).sum() == 0))
add("global_topc c > T*E", "unclear errors", lambda tmp: ops.global_topc(S(4, 3), 13), ValueError, r"\bc\b.*12")
add("global_topc c negative", "unclear errors", lambda tmp: ops.global_topc(S(4, 3), -1), ValueError, r"\bc\b")
add("global_topc c as float 2.0", "unclear errors", lambda tmp: ops.global_topc(S(4, 3), 2.0), TypeError, r"\bc\b.*int")
add("global_topc integer scores", "unclear errors", lambda tmp: ops.global_topc(torch.ones(4, 3, dtype=torch.long), 2),
    TypeError, r"scores.*floating")
add("global_topc NaN score", "silent wrong results",
    lambda tmp: ops.global_topc(torch.tensor([[0.0, float("nan")], [1.0, 2.0]]), 2), ValueError, r"NaN")
add("global_topc batched (2, T, E) gives c per matrix", "silent wrong results",
    lambda tmp: _assert(ops.global_topc(S(2, 4, 3), 5).sum((-2, -1)).tolist() == [5, 5]))
add("global_topc on a 1-D vector", "unclear errors", lambda tmp: ops.global_topc(S(6), 2), ValueError, r"shape")
add("topc_threshold c=0 (no threshold selects nothing)", "unclear errors", lambda tmp: ops.topc_threshold(S(3, 3), 0),
    ValueError, r"\bc\b.*>= 1")

add("ksubset_marginals k > E", "unclear errors", lambda tmp: ops.ksubset_marginals(S(2, 4), 5), ValueError, r"\bk\b.*4")
add("ksubset_marginals k = 0", "unclear errors", lambda tmp: ops.ksubset_marginals(S(2, 4), 0), ValueError, r"\bk\b")
add("ksubset_marginals k = True", "unclear errors", lambda tmp: ops.ksubset_marginals(S(2, 4), True), TypeError, r"\bk\b")
add("ksubset_marginals inf logit", "silent wrong results",
    lambda tmp: ops.ksubset_marginals(torch.tensor([[float("inf"), 0.0, 1.0]]), 2), ValueError, r"inf")
add("ksubset_marginals huge logits sum to k", "silent wrong results",
    lambda tmp: _close(ops.ksubset_marginals(S(3, 6, dtype=torch.float64) * 1e30, 2).sum(-1), 2.0))
add("ksubset_marginals float16 sums to k", "silent wrong results",
    lambda tmp: _close(ops.ksubset_marginals(S(3, 6).half(), 2).float().sum(-1), 2.0, atol=2e-2))
add("ksubset_marginals of no rows", "silent wrong results",
    lambda tmp: _assert(ops.ksubset_marginals(torch.zeros(0, 5), 2).shape == (0, 5)))
add("ksubset_log_partition k = E is the total sum", "silent wrong results",
    lambda tmp: _close(ops.ksubset_log_partition(torch.tensor([[1.0, 2.0, 3.0]]), 3), 6.0))
add("ksubset_sample exactly k at huge logits", "silent wrong results",
    lambda tmp: _assert((ops.ksubset_sample(S(50, 6) * 1e30, 3, generator=_gen()).sum(-1) == 3).all()))
add("ksubset_sample generator as an int seed", "unclear errors",
    lambda tmp: ops.ksubset_sample(S(2, 4), 2, generator=3), TypeError, r"generator.*torch.Generator\(\)\.manual_seed\(3\)")
add("range_subset_marginals k_min > k_max", "unclear errors",
    lambda tmp: ops.range_subset_marginals(S(2, 4), 3, 2), ValueError, r"k_min.*k_max|k_max.*k_min")
add("range_subset_sample k_max > E", "unclear errors",
    lambda tmp: ops.range_subset_sample(S(2, 4), 1, 5, generator=_gen()), ValueError, r"k_max")

add("sinkhorn eps = 0", "unclear errors", lambda tmp: ops.sinkhorn(S(4, 2), 0.0), ValueError, r"eps")
add("sinkhorn eps negative", "unclear errors", lambda tmp: ops.sinkhorn(S(4, 2), -1.0), ValueError, r"eps")
add("sinkhorn eps NaN", "unclear errors", lambda tmp: ops.sinkhorn(S(4, 2), float("nan")), ValueError, r"eps")
add("sinkhorn eps as a string", "unclear errors", lambda tmp: ops.sinkhorn(S(4, 2), "0.1"), TypeError, r"eps")
add("sinkhorn max_iter = 0", "unclear errors", lambda tmp: ops.sinkhorn(S(4, 2), max_iter=0), ValueError, r"max_iter")
add("sinkhorn tol negative", "unclear errors", lambda tmp: ops.sinkhorn(S(4, 2), tol=-1.0), ValueError, r"tol")
add("sinkhorn on a 1-D vector", "unclear errors", lambda tmp: ops.sinkhorn(S(4)), ValueError, r"shape")
add("sinkhorn integer scores", "unclear errors", lambda tmp: ops.sinkhorn(torch.ones(4, 2, dtype=torch.int32)),
    TypeError, r"scores.*floating")
add("sinkhorn marginals with different totals", "silent wrong results",
    lambda tmp: ops.sinkhorn(S(4, 2), row_sums=1.0, col_sums=torch.tensor([1.0, 1.0])), ValueError, r"sum|total")
add("sinkhorn negative column sums", "silent wrong results",
    lambda tmp: ops.sinkhorn(S(4, 2), col_sums=torch.tensor([5.0, -1.0])), ValueError, r"col_sums")
add("sinkhorn bfloat16 plan rows sum to 1", "silent wrong results",
    lambda tmp: _close(ops.sinkhorn(S(8, 4).bfloat16()).float().sum(-1), 1.0, atol=3e-2))
add("sinkhorn float64 tiny eps 1e-300", "hangs/unbounded",
    lambda tmp: _finite_or_eps_error(lambda: ops.sinkhorn(S(8, 4, dtype=torch.float64), 1e-300)), None,
    subprocess=True, seconds=60)
add("sinkhorn float16 scores near its max", "hangs/unbounded",
    lambda tmp: _finite_or_eps_error(lambda: ops.sinkhorn((S(8, 4) * 6e4).clamp(-6e4, 6e4).half(), 1e-3)), None,
    subprocess=True, seconds=60)

add("linear_assignment capacity too small", "unclear errors",
    lambda tmp: ops.linear_assignment(S(9, 2), 4), ValueError, r"capacity")
add("linear_assignment capacity 0", "unclear errors", lambda tmp: ops.linear_assignment(S(4, 2), 0), ValueError, r"capacity")
add("linear_assignment capacity vector of wrong length", "unclear errors",
    lambda tmp: ops.linear_assignment(S(4, 2), torch.tensor([2, 2, 2])), ValueError, r"capacity")
add("linear_assignment negative capacity entry", "unclear errors",
    lambda tmp: ops.linear_assignment(S(4, 2), torch.tensor([5, -1])), ValueError, r"capacity")
add("linear_assignment capacity as float 2.5", "unclear errors",
    lambda tmp: ops.linear_assignment(S(4, 2), 2.5), TypeError, r"capacity")
add("linear_assignment inf score", "silent wrong results",
    lambda tmp: ops.linear_assignment(torch.tensor([[float("inf"), 0.0], [0.0, 1.0]]), 1), ValueError, r"inf")
add("linear_assignment is optimal (brute force)", "silent wrong results", lambda tmp: _assignment_optimal())
add("linear_assignment of no tokens", "silent wrong results",
    lambda tmp: _assert(ops.linear_assignment(torch.zeros(0, 3), 1).shape == (0,)))
add("gumbel_matching_sample tau = 0", "unclear errors",
    lambda tmp: ops.gumbel_matching_sample(S(4, 2), 2, tau=0.0), ValueError, r"tau")
add("gumbel_matching_sample generator int", "unclear errors",
    lambda tmp: ops.gumbel_matching_sample(S(4, 2), 2, generator=0), TypeError, r"generator")
add("gumbel_matching_sample is balanced", "silent wrong results",
    lambda tmp: _assert(torch.bincount(ops.gumbel_matching_sample(S(8, 4), 2, generator=_gen()), minlength=4).tolist()
                        == [2, 2, 2, 2]))
add("count_balanced_assignments negative tokens", "unclear errors",
    lambda tmp: ops.count_balanced_assignments(-1, 2, 2), ValueError, r"n_tokens|tokens")
add("count_balanced_assignments infeasible is 0", "silent wrong results",
    lambda tmp: _assert(ops.count_balanced_assignments(5, 2, 2) == 0))
add("balanced_assignments beyond max_count", "hangs/unbounded",
    lambda tmp: ops.balanced_assignments(12, 3, 4, max_count=10), ValueError, r"max_count")
add("floyd_warshall on a non-square matrix", "unclear errors",
    lambda tmp: ops.floyd_warshall(torch.zeros(3, 4)), ValueError, r"cost|square")

add("compute_capacity capacity_factor negative", "unclear errors",
    lambda tmp: ops.compute_capacity(16, 4, -1.0), ValueError, r"capacity_factor")
add("compute_capacity capacity_factor inf", "unclear errors",
    lambda tmp: ops.compute_capacity(16, 4, float("inf")), ValueError, r"capacity_factor")
add("compute_capacity rounding misspelt", "unclear errors",
    lambda tmp: ops.compute_capacity(16, 4, 1.0, rounding="ceiling"), ValueError, r"rounding.*'ceil'")
add("compute_capacity zero experts", "unclear errors", lambda tmp: ops.compute_capacity(16, 0, 1.0), ValueError, r"experts")
add("compute_capacity 16 tokens 4 experts factor 1", "silent wrong results",
    lambda tmp: _assert(ops.compute_capacity(16, 4, 1.0) == 4))
add("top_k k > E", "unclear errors", lambda tmp: ops.top_k(torch.softmax(S(3, 4), -1), 5), ValueError, r"\bk\b")
add("top_k k = 0", "unclear errors", lambda tmp: ops.top_k(torch.softmax(S(3, 4), -1), 0), ValueError, r"\bk\b")
add("top_k renormalize='yes'", "unclear errors",
    lambda tmp: ops.top_k(torch.softmax(S(3, 4), -1), 2, renormalize="yes"), TypeError, r"renormalize")
add("token_choice_allocation capacity 0", "unclear errors",
    lambda tmp: ops.token_choice_allocation(torch.softmax(S(4, 3), -1), 1, 0), ValueError, r"capacity.*>= 1")
add("token_choice_allocation k > E", "unclear errors",
    lambda tmp: ops.token_choice_allocation(torch.softmax(S(4, 3), -1), 4, 2), ValueError, r"\bk\b")
add("expert_choice_allocation capacity > T", "unclear errors",
    lambda tmp: ops.expert_choice_allocation(S(4, 3), 5), ValueError, r"capacity")
add("expert_choice_allocation capacity negative", "unclear errors",
    lambda tmp: ops.expert_choice_allocation(S(4, 3), -1), ValueError, r"capacity")
add("sparse_simplex_projection max_nonzeros 0", "unclear errors",
    lambda tmp: ops.sparse_simplex_projection(S(5), 0), ValueError, r"max_nonzeros")
add("sparse_simplex_projection total negative", "unclear errors",
    lambda tmp: ops.sparse_simplex_projection(S(5), 2, total=-1.0), ValueError, r"total")
add("sparse_simplex_projection is on the simplex", "silent wrong results",
    lambda tmp: _sparse_projection_ok())
add("sparsity_constrained_plan infeasible capacity", "unclear errors",
    lambda tmp: ops.sparsity_constrained_plan(S(8, 2), 1), ValueError, r"capacity")
add("sparsity_constrained_plan gamma 0", "unclear errors",
    lambda tmp: ops.sparsity_constrained_plan(S(8, 2), 4, gamma=0.0), ValueError, r"gamma")
add("bias_update misspelt update rule", "unclear errors",
    lambda tmp: ops.bias_update(torch.zeros(4), torch.ones(4), 1e-3, update="sgn"), ValueError, r"update")
add("bias_update rate NaN", "unclear errors",
    lambda tmp: ops.bias_update(torch.zeros(4), torch.ones(4), float("nan")), ValueError, r"rate")
add("bias_update loads of another length", "unclear errors",
    lambda tmp: ops.bias_update(torch.zeros(4), torch.ones(3), 1e-3), ValueError, r"loads|bias")
add("bias_update NaN load", "silent wrong results",
    lambda tmp: ops.bias_update(torch.zeros(2), torch.tensor([1.0, float("nan")]), 1e-3), ValueError, r"NaN|loads")
add("unified_score alpha 2", "unclear errors", lambda tmp: ops.unified_score(S(3, 4), 2.0), ValueError, r"alpha")
add("unified_score ec_score misspelt", "unclear errors",
    lambda tmp: ops.unified_score(S(3, 4), 0.5, ec_score="sigmiod"), ValueError, r"ec_score")
add("selection_budget k negative", "unclear errors", lambda tmp: ops.selection_budget(-1.0, 8, 4), ValueError, r"\bk\b")
add("exchangeable_drop_probability selected > T*E", "unclear errors",
    lambda tmp: ops.exchangeable_drop_probability(4, 2, 9), ValueError, r"selected")
add("gaussian_top1_probability noise_std 0", "unclear errors",
    lambda tmp: ops.gaussian_top1_probability(S(3, 4), 0.0), ValueError, r"noise_std")
add("sinkhorn_balance tau 0", "unclear errors", lambda tmp: ops.sinkhorn_balance(S(4, 2), tau=0.0), ValueError, r"tau")
add("sample_categorical all -inf row", "silent wrong results",
    lambda tmp: ops.sample_categorical(torch.full((2, 3), float("-inf")), _gen()), ValueError, r"log_probs")
add("skip_sample capacity below T/E skips the overflow", "silent wrong results", lambda tmp: _skip_overflow())
add("sample_categorical NaN log-probability", "silent wrong results",
    lambda tmp: ops.sample_categorical(torch.tensor([[0.0, float("nan"), -1.0]]), _gen()), ValueError, r"log_probs.*NaN")
add("reinforce_surrogate shapes that do not match", "unclear errors",
    lambda tmp: ops.reinforce_surrogate(torch.zeros(4), torch.zeros(5), torch.zeros(4)), ValueError,
    r"loss_per_token|shape")
add("solve_selection_lp misspelt constraint", "unclear errors",
    lambda tmp: ops.solve_selection_lp(S(4, 3), budgett=4), TypeError, r"budgett")
add("estimator misspelt", "unclear errors",
    lambda tmp: ops.sample_estimator(S(8, 2), "reinforc", 4, generator=_gen()), ValueError, r"estimator")

# metrics
add("metrics.drop_rate on a float mask", "unclear errors",
    lambda tmp: mm.drop_rate(torch.ones(4, 2)), TypeError, r"mask.*bool")
add("metrics.load_imbalance of no tokens", "silent wrong results",
    lambda tmp: _assert(math.isfinite(float(mm.load_imbalance(torch.zeros(0, 4, dtype=torch.bool))))))
add("metrics.routing_entropy of NaN probs", "silent wrong results",
    lambda tmp: mm.routing_entropy(torch.tensor([[0.5, float("nan")]])), ValueError, r"probs.*NaN|NaN")
add("metrics.tokens_per_expert on a 1-D mask", "unclear errors",
    lambda tmp: mm.tokens_per_expert(torch.ones(4, dtype=torch.bool)), ValueError, r"mask.*shape")


# --------------------------------------------------------------------------------------------- routers
def _router(name, **options):
    return routers.build(name, 8, 4, **options)


ROUTER_OPTIONS = {}  # name -> the options its constructor takes
for _name in routers.available():
    import inspect

    _cls = type(routers.build(_name, 8, 4))
    ROUTER_OPTIONS[_name] = set(inspect.signature(_cls.__init__).parameters) - {"self", "d_model", "n_experts",
                                                                                "options"}

for _name in routers.available():
    add(f"{_name}: a misspelt option", "unclear errors",
        lambda tmp, n=_name: routers.build(n, 8, 4, capacity_factr=1.0), E_ARG, r"capacity_factr")
    add(f"{_name}: x with the wrong d_model", "unclear errors",
        lambda tmp, n=_name: _router(n)(S(2, 6, 5)), ValueError, r"d_model")
    add(f"{_name}: integer token ids given as x", "unclear errors",
        lambda tmp, n=_name: _router(n)(torch.ones(2, 6, 8, dtype=torch.long)), TypeError, r"floating")
    add(f"{_name}: n_experts = 0", "unclear errors", lambda tmp, n=_name: routers.build(n, 8, 0), ValueError,
        r"n_experts")
    add(f"{_name}: NaN in the gate's weight, eval", "silent wrong results",
        lambda tmp, n=_name: _nan_weight(n), ValueError, r"NaN")
    add(f"{_name}: a float64 copy routes float64 tokens", "silent wrong results",
        lambda tmp, n=_name: _float64_router(n))
    add(f"{_name}: a group of one token", "silent wrong results", lambda tmp, n=_name: _one_token(n), ValueError,
        r"capacity_factor=1.0 .*tokens=1.*raise capacity_factor or pass min_capacity>=1", or_result=True)
    add(f"{_name}: copy, pickle and state_dict after a backward", "unclear errors",
        lambda tmp, n=_name: _copy_after_backward(n))
    if "k" in ROUTER_OPTIONS[_name]:
        add(f"{_name}: k > n_experts", "unclear errors", lambda tmp, n=_name: _router(n, k=5)(S(2, 6, 8)),
            ValueError, r"\bk\b.*(4|n_experts)")
    if "capacity_factor" in ROUTER_OPTIONS[_name]:
        add(f"{_name}: capacity_factor = -1", "unclear errors",
            lambda tmp, n=_name: _router(n, capacity_factor=-1.0)(S(1, 8, 8)), ValueError, r"capacity_factor")

add("routers.build with an unknown name", "unclear errors", lambda tmp: routers.build("softmax-topk", 8, 4),
    ValueError, r"softmax_topk")
add("routers.build d_model = 0", "unclear errors", lambda tmp: routers.build("softmax_topk", 0, 4), ValueError,
    r"d_model")
add("routers.build d_model as a float", "unclear errors", lambda tmp: routers.build("softmax_topk", 8.0, 4),
    TypeError, r"d_model")
add("softmax_topk noise misspelt", "unclear errors", lambda tmp: _router("softmax_topk", noise="gausian"),
    ValueError, r"noise")
add("router x on the meta device", "unclear errors",
    lambda tmp: _router("softmax_topk")(torch.empty(2, 4, 8, device="meta")), ValueError, r"meta")
add("ssr eps = 0", "unclear errors", lambda tmp: _router("ssr", eps=0.0), ValueError, r"eps")
add("probmoe_dynamic k_min > k_max", "unclear errors", lambda tmp: _router("probmoe_dynamic", k_min=3, k_max=2),
    ValueError, r"k_min|k_max")
add("soft_moe slots_per_expert 0", "unclear errors", lambda tmp: _router("soft_moe", slots_per_expert=0),
    ValueError, r"slots_per_expert")


# --------------------------------------------------------------------------------------------- the layer
add("MoELayer d_hidden = 0", "unclear errors", lambda tmp: MoELayer(8, 0, 4), ValueError, r"d_hidden")
add("MoELayer path misspelt", "unclear errors", lambda tmp: MoELayer(8, 16, 4, path="einsums"), ValueError,
    r"path.*einsum")
add("MoELayer activation unknown", "unclear errors", lambda tmp: MoELayer(8, 16, 4, activation="swish2"),
    ValueError, r"activation")
add("MoELayer router_options not a dict", "unclear errors",
    lambda tmp: MoELayer(8, 16, 4, router_options=[("k", 2)]), TypeError, r"router_options")
add("MoELayer group_size 0", "unclear errors", lambda tmp: MoELayer(8, 16, 4, group_size=0), ValueError, r"group_size")
add("MoELayer n_shared_experts -1", "unclear errors", lambda tmp: MoELayer(8, 16, 4, n_shared_experts=-1),
    ValueError, r"n_shared_experts")
add("MoELayer a router built for other experts", "unclear errors",
    lambda tmp: MoELayer(8, 16, 4, router=routers.build("softmax_topk", 8, 6)), ValueError, r"n_experts|experts")
add("MoELayer a router built for another d_model", "unclear errors",
    lambda tmp: MoELayer(8, 16, 4, router=routers.build("softmax_topk", 6, 4)), ValueError, r"d_model")
add("MoELayer x with the wrong last dimension", "unclear errors", lambda tmp: MoELayer(8, 16, 4)(S(3, 5, 7)),
    ValueError, r"d_model")
add("MoELayer tokens not a multiple of group_size", "silent wrong results",
    lambda tmp: MoELayer(8, 16, 4, group_size=4)(S(2, 5, 8)), ValueError, r"group_size=4")
add("MoELayer einsum path equals the index path", "silent wrong results", lambda tmp: _paths_agree())
add("MoELayer NaN in an expert weight shows in the output (not hidden)", "silent wrong results",
    lambda tmp: _assert(torch.isnan(_nan_expert()).any()))
add("train with NaN expert weights stops at the loss", "silent wrong results", lambda tmp: _train_nan_expert(),
    FloatingPointError, r"loss is nan at step 0")
add("MoELayer no tokens", "silent wrong results",
    lambda tmp: _assert(MoELayer(8, 16, 4)(torch.zeros(0, 8)).shape == (0, 8)))


# --------------------------------------------------------------------------------------------- models, data
from minimoe.models import MoERegressor, TinyLM, TinyViT  # noqa: E402

add("TinyLM vocab_size 0", "unclear errors", lambda tmp: TinyLM(0), ValueError, r"vocab_size")
add("TinyLM d_model not divisible by n_heads", "unclear errors", lambda tmp: TinyLM(10, d_model=30, n_heads=4),
    ValueError, r"n_heads")
add("TinyLM sequence longer than block_size", "unclear errors",
    lambda tmp: _tiny_lm()(torch.zeros(1, 17, dtype=torch.long)), ValueError, r"block_size")
add("TinyLM token id >= vocab_size", "unclear errors",
    lambda tmp: _tiny_lm()(torch.full((1, 8), 10, dtype=torch.long)), ValueError, r"vocab_size|token")
add("TinyLM negative token id", "unclear errors",
    lambda tmp: _tiny_lm()(torch.full((1, 8), -1, dtype=torch.long)), ValueError, r"vocab_size|token")
add("TinyLM float inputs", "unclear errors", lambda tmp: _tiny_lm()(torch.zeros(1, 8)), TypeError, r"ids|integer|long")
add("TinyLM moe_every 0", "unclear errors", lambda tmp: TinyLM(10, moe_every=0), ValueError, r"moe_every")
add("TinyLM routing_groups misspelt", "unclear errors", lambda tmp: TinyLM(10, routing_groups="sequnce"),
    ValueError, r"routing_groups")
add("TinyLM with probmoe_exact runs", "silent wrong results",
    lambda tmp: _assert(torch.isfinite(_tiny_lm(router="probmoe_exact")(torch.zeros(2, 8, dtype=torch.long))).all()))
add("TinyLM deepcopy after a backward", "unclear errors", lambda tmp: _lm_copy_after_backward())
add("TinyViT image size mismatch", "unclear errors",
    lambda tmp: TinyViT(3, image_size=8, patch_size=4, n_layers=1, d_model=16, n_heads=2, d_hidden=16)(
        torch.zeros(2, 1, 12, 12)), ValueError, r"image_size|image")
add("TinyViT patch_size not dividing image_size", "unclear errors",
    lambda tmp: TinyViT(3, image_size=10, patch_size=4), ValueError, r"patch_size")
add("TinyViT wrong channel count", "unclear errors",
    lambda tmp: TinyViT(3, image_size=8, patch_size=4, n_layers=1, d_model=16, n_heads=2, d_hidden=16)(
        torch.zeros(2, 3, 8, 8)), ValueError, r"channels")
add("MoERegressor wrong d_in", "unclear errors",
    lambda tmp: MoERegressor(4, 2, group_size=8)(torch.zeros(8, 5)), ValueError, r"d_in")
add("make_clustered_task n_clusters 0", "unclear errors",
    lambda tmp: minimoe.data.make_clustered_task(64, n_clusters=0), ValueError, r"n_clusters")
add("make_shapes n negative", "unclear errors", lambda tmp: minimoe.data.make_shapes(-3), ValueError, r"\bn\b")
add("load_char_corpus of an empty text", "unclear errors", lambda tmp: minimoe.data.load_char_corpus(text=""),
    ValueError, r"text")


# --------------------------------------------------------------------------------------------- train
from minimoe.train import atomic_write, train  # noqa: E402


def _regression():
    torch.manual_seed(0)
    model = MoERegressor(4, 2, d_model=8, d_hidden=8, n_experts=4, group_size=8)
    x, y = S(8, 4), S(8, 2, seed=1)
    return model, (lambda step: (x, y)), torch.nn.functional.mse_loss


def _train(**kw):
    model, batch, loss = _regression()
    return train(model, kw.pop("get_batch", batch), kw.pop("loss_fn", loss), **{"steps": 3, "progress": False, **kw})


add("train steps 0", "unclear errors", lambda tmp: _train(steps=0), ValueError, r"steps")
add("train lr NaN", "unclear errors", lambda tmp: _train(lr=float("nan")), ValueError, r"\blr\b")
add("train lr schedule negative later", "silent wrong results",
    lambda tmp: _train(lr=lambda s: 1e-3 if s == 0 else -1e-3), ValueError, r"\blr\b.*step 1")
add("train lr schedule NaN later", "silent wrong results",
    lambda tmp: _train(lr=lambda s: 1e-3 if s < 2 else float("nan")), ValueError, r"\blr\b.*step 2")
add("train get_batch returns one tensor", "unclear errors",
    lambda tmp: _train(get_batch=lambda s: S(8, 4)), TypeError, r"get_batch")
add("train loss_fn returns a float", "unclear errors",
    lambda tmp: _train(loss_fn=lambda out, y: 1.0), TypeError, r"loss_fn")
add("train device 'gpu'", "unclear errors", lambda tmp: _train(device="gpu"), ValueError, r"device")
add("train device 'cuda' without CUDA", "unclear errors", lambda tmp: _train(device="cuda"), ValueError, r"CUDA")
add("train eval_fn returns a float", "unclear errors", lambda tmp: _train(eval_fn=lambda m: 0.5, eval_every=0),
    TypeError, r"eval_fn")
add("train checkpoint_every 0", "unclear errors", lambda tmp: _train(checkpoint_every=0), ValueError,
    r"checkpoint_every")
add("train grad_clip -1", "unclear errors", lambda tmp: _train(grad_clip=-1.0), ValueError, r"grad_clip")
add("train seed -1", "unclear errors", lambda tmp: _train(seed=-1), ValueError, r"seed")
add("train NaN targets", "silent wrong results",
    lambda tmp: _train(get_batch=lambda s: (S(8, 4), torch.full((8, 2), float("nan")))), FloatingPointError,
    r"loss is nan")
add("train checkpoint in a folder not made yet", "data lost",
    lambda tmp: _assert(_train(checkpoint=tmp / "new" / "deeper" / "run.pt", checkpoint_every=1) is not None))
add("train checkpoint path is a folder", "unclear errors", lambda tmp: _train(checkpoint=tmp),
    ValueError, r"checkpoint.*folder|directory")
add("train resume from another model's checkpoint", "damaged files", lambda tmp: _foreign_checkpoint(tmp),
    ValueError, r"\.pt.*(another|different) model")
add("train checkpoint that is an empty file", "damaged files", lambda tmp: _empty_checkpoint(tmp))
add("train interrupted, resumed: same result", "data lost", lambda tmp: _interrupted_resume(tmp))
add("a second damaged checkpoint keeps the first one set aside", "data lost", lambda tmp: _damaged_twice(tmp))
add("atomic_write of bad data keeps the old file", "data lost", lambda tmp: _atomic_keeps_old(tmp))


# --------------------------------------------------------------------------------------------- experiments
from minimoe.experiments import read_results, run  # noqa: E402
from minimoe.experiments.runner import DamagedResults  # noqa: E402

TINY = dict(scale="toy", seeds=1, steps=2, progress=False, threads=1)


def _tiny_study(tmp):
    return run("clustered", "softmax_topk", out=tmp / "zoo", **TINY)


add("run seeds 0", "unclear errors", lambda tmp: run("clustered", "softmax_topk", out=tmp, **{**TINY, "seeds": 0}),
    ValueError, r"seeds")
add("run steps -5", "unclear errors", lambda tmp: run("clustered", "softmax_topk", out=tmp, **{**TINY, "steps": -5}),
    ValueError, r"steps")
add("run a misspelt task", "unclear errors", lambda tmp: run("clusterd", "softmax_topk", out=tmp, **TINY),
    ValueError, r"tasks.*clustered")
add("run a router list with an empty name", "unclear errors",
    lambda tmp: run("clustered", "softmax_topk,,expert_choice", out=tmp, **TINY), ValueError, r"routers")
add("run out is an empty string", "silent wrong results",
    lambda tmp: run("clustered", "softmax_topk", out="", **TINY), ValueError, r"out")
add("run out is a file", "unclear errors",
    lambda tmp: run("clustered", "softmax_topk", out=_touch(tmp / "f"), **TINY), ValueError, r"out.*file")
add("run workers 0", "unclear errors", lambda tmp: run("clustered", "softmax_topk", out=tmp, **{**TINY, "workers": 0}),
    ValueError, r"workers")
add("run an unknown override", "unclear errors",
    lambda tmp: run("clustered", "softmax_topk", out=tmp, **{**TINY, "stepz": 3}), E_ARG, r"stepz")
add("results.csv is a folder", "damaged files", lambda tmp: read_results(_mkdir(tmp / "r" / "results.csv")),
    DamagedResults, r"results.csv.*folder")
add("results.csv saved by Excel (BOM, CRLF)", "damaged files", lambda tmp: _excel_results(tmp))
add("results.csv with a NaN value", "damaged files", lambda tmp: _nan_value(tmp), DamagedResults,
    r"results.csv, line \d+.*value.*--fresh")
add("a results folder whose results.csv is a folder", "damaged files",
    lambda tmp: read_results(_mkdir(tmp / "r" / "results.csv").parent), DamagedResults, r"results.csv.*folder")
add("run --fresh on a folder whose results.csv is a folder", "damaged files", lambda tmp: _fresh_over_folder(tmp))
add("provenance.json a JSON list", "damaged files", lambda tmp: _provenance(tmp, "[1, 2]"), ValueError,
    r"provenance.json is damaged.*--fresh")
add("provenance.json empty", "damaged files", lambda tmp: _provenance(tmp, ""), ValueError,
    r"provenance.json is damaged.*--fresh")
add("a checkpoint that is a folder", "damaged files", lambda tmp: _checkpoint_folder(tmp))
add("a run claimed by a live process is not trained twice", "data lost", lambda tmp: _claimed_busy(tmp))
add("show of a folder with no results file", "unclear errors",
    lambda tmp: _show(_mkdir(tmp / "empty")), FileNotFoundError, r"empty holds no results.csv")
add("CLI run --seeds 0", "unclear errors", lambda tmp: _cli_error(["run", "--seeds", "0", "--out", str(tmp)], "seeds"))
add("CLI run --device tpu", "unclear errors", lambda tmp: _cli_error(["run", "--device", "tpu", "--out", str(tmp)],
                                                                     "device"))
add("CLI show of a missing folder", "unclear errors",
    lambda tmp: _cli_error(["show", str(tmp / "nowhere")], "no results"))
add("CLI show --markdown of a damaged file", "damaged files", lambda tmp: _cli_markdown_damaged(tmp))


# --------------------------------------------------------------------------------------------- exercises
from minimoe import exercises as ex  # noqa: E402

add("checker given None", "unclear errors", lambda tmp: ex.check_global_topc(None), TypeError, r"callable|cannot be called")
add("checker given the result, not the function", "unclear errors",
    lambda tmp: ex.check_global_topc(torch.zeros(3, 3)), TypeError, r"function")
add("checker verbose='no'", "unclear errors", lambda tmp: ex.check_capacity(ops.compute_capacity, verbose="no"),
    TypeError, r"verbose")
add("checker seed -1", "unclear errors", lambda tmp: ex.check_global_topc(ops.global_topc, seed=-1), ValueError, r"seed")
add("checker draws 0", "unclear errors", lambda tmp: ex.check_ksubset_sample(lambda l, k, g: None, draws=0),
    ValueError, r"draws")
add("checker on a crashing submission says FAIL", "silent wrong results",
    lambda tmp: _assert(ex.check_global_topc(lambda s, c: 1 / 0, verbose=False) is False))
add("checker on a NaN submission fails", "silent wrong results",
    lambda tmp: _assert(ex.check_drop_probability(lambda t, e, n: float("nan"), verbose=False) is False))
add("checker on a float mask fails", "silent wrong results",
    lambda tmp: _assert(ex.check_global_topc(lambda s, c: ops.global_topc(s, c).double(), verbose=False) is False))
add("checker passes the package's own function", "silent wrong results",
    lambda tmp: _assert(ex.check_global_topc(ops.global_topc, verbose=False) is True))
add("checker unknown option", "unclear errors", lambda tmp: ex.check_global_topc(ops.global_topc, sed=1),
    TypeError, r"sed")


# --------------------------------------------------------------------------------------------- helpers
def _assert(condition, what=""):
    if not condition:
        raise AssertionError(what or "wrong result")


def _close(got, want, atol=1e-6):
    got = torch.as_tensor(got, dtype=torch.float64)
    _assert(torch.allclose(got, torch.full_like(got, want), atol=atol), f"{got} != {want}")


def _finite_or_eps_error(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = fn()
        except ValueError as error:
            _assert("eps" in str(error) or "scores" in str(error), str(error))
            return
    plan = getattr(plan, "plan", plan)
    _assert(torch.isfinite(plan.float()).all(), "a non-finite plan")


def _assignment_optimal():
    import itertools

    scores = S(6, 3, dtype=torch.float64, seed=4)
    got = ops.linear_assignment(scores, 2)
    best = max(sum(scores[t, e] for t, e in enumerate(a)) for a in itertools.product(range(3), repeat=6)
               if max(a.count(e) for e in range(3)) <= 2)
    _close(scores[torch.arange(6), got].sum(), float(best), atol=1e-9)


def _skip_overflow():
    sample = ops.skip_sample(S(8, 2), 3, generator=_gen())
    kept = torch.bincount(sample.assignment[sample.keep], minlength=2)
    _assert((kept <= 3).all() and bool(sample.keep.any()), f"kept per expert {kept.tolist()}")


def _train_nan_expert():
    model, batch, loss = _regression()
    with torch.no_grad():
        next(model.moe.experts.parameters()).fill_(float("nan"))
    train(model, batch, loss, steps=2, progress=False)


def _show(path):
    from minimoe.experiments.__main__ import show

    return show(path)


def _sparse_projection_ok():
    p = ops.sparse_simplex_projection(S(7, dtype=torch.float64), 3)
    _assert(abs(float(p.sum()) - 1) < 1e-9 and (p >= 0).all() and int((p > 0).sum()) <= 3)


def _nan_weight(name):
    router = _router(name).eval()
    with torch.no_grad():
        next(router.parameters())[0].fill_(float("nan"))
    return router(S(2, 8, 8))


def _float64_router(name):
    router = _router(name).double().eval()
    routing = router(S(2, 8, 8, dtype=torch.float64))
    weights = routing.combine if routing.combine is not None else routing.slot_combine
    _assert(torch.isfinite(weights).all() and weights.dtype == torch.float64, f"{weights.dtype}")


def _one_token(name):
    layer = MoELayer(8, 16, 4, router=name)
    for mode in (layer.train, layer.eval):
        mode()
        y = layer(S(1, 1, 8))
        _assert(y.shape == (1, 1, 8) and torch.isfinite(y).all())


def _copy_after_backward(name):
    layer = MoELayer(8, 16, 4, router=name).train()
    layer(S(2, 8, 8)).square().mean().backward()
    twin = copy.deepcopy(layer)
    pickle.loads(pickle.dumps(layer))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    twin.load_state_dict(layer.state_dict())


def _paths_agree():
    torch.manual_seed(0)
    index = MoELayer(8, 16, 4, router="softmax_topk", router_options={"k": 2}).eval()
    einsum = copy.deepcopy(index)
    einsum.path = "einsum"
    x = S(2, 8, 8)
    torch.testing.assert_close(index(x), einsum(x), rtol=1e-5, atol=1e-6)


def _nan_expert():
    layer = MoELayer(8, 16, 4).eval()
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.fill_(float("nan"))
            break
    return layer(S(2, 8, 8))


def _tiny_lm(**kw):
    torch.manual_seed(0)
    return TinyLM(10, d_model=16, n_layers=1, n_heads=2, block_size=16, n_experts=4, d_hidden=16, **kw)


def _lm_copy_after_backward():
    lm = _tiny_lm()
    lm(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    copy.deepcopy(lm)


def _foreign_checkpoint(tmp):
    path = tmp / "run.pt"
    _train(checkpoint=path, steps=3, checkpoint_every=1)
    _assert(path.exists())
    other = MoERegressor(4, 2, d_model=12, d_hidden=8, n_experts=4, group_size=8)
    x, y = S(8, 4), S(8, 2)
    train(other, lambda s: (x, y), torch.nn.functional.mse_loss, steps=5, progress=False, checkpoint=path)


def _empty_checkpoint(tmp):
    path = tmp / "run.pt"
    path.write_bytes(b"")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _train(checkpoint=path, steps=2)
    _assert(len(history["train"]) == 2 and (tmp / "run.pt.damaged").exists())
    _assert(any("run.pt" in str(w.message) for w in caught), "no warning named the file")


def _damaged_twice(tmp):
    path = tmp / "run.pt"
    for content in (b"first", b"second"):
        path.write_bytes(content)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(checkpoint=path, steps=1)
    _assert((tmp / "run.pt.damaged").read_bytes() == b"first" and (tmp / "run.pt.damaged.1").read_bytes() == b"second",
            f"{sorted(p.name for p in tmp.iterdir())}")


def _interrupted_resume(tmp):
    path = tmp / "run.pt"
    model, batch, loss = _regression()
    calls = []

    def stopping(step):
        if step == 4 and not calls:
            calls.append(step)
            raise KeyboardInterrupt
        return batch(step)

    with contextlib.suppress(KeyboardInterrupt):
        train(model, stopping, loss, steps=6, progress=False, checkpoint=path, checkpoint_every=2)
    model2, _, _ = _regression()
    resumed = train(model2, batch, loss, steps=6, progress=False, checkpoint=path, checkpoint_every=2)
    model3, _, _ = _regression()
    straight = train(model3, batch, loss, steps=6, progress=False)
    _assert([r["loss"] for r in resumed["train"]] == [r["loss"] for r in straight["train"]], "resume differs")


def _atomic_keeps_old(tmp):
    path = tmp / "results.csv"
    path.write_bytes(b"old")
    with contextlib.suppress(TypeError):
        atomic_write(path, "not bytes")
    _assert(path.read_bytes() == b"old" and sorted(p.name for p in tmp.iterdir()) == ["results.csv"],
            f"{sorted(p.name for p in tmp.iterdir())}")


def _touch(path):
    path.write_text("x")
    return path


def _mkdir(path):
    path.mkdir(parents=True)
    return path


def _fresh_over_folder(tmp):
    """--fresh sets a folder that sits where results.csv belongs aside (not deleted), then runs."""
    out = tmp / "zoo"
    (out / "results.csv").mkdir(parents=True)
    (out / "results.csv" / "keep.txt").write_text("a user's file")
    rows = read_results(run("clustered", "softmax_topk", out=out, fresh=True, **TINY))
    aside = [p for p in out.iterdir() if p.name.startswith("results.csv.") and p.is_dir()]
    _assert(rows and len(aside) == 1 and (aside[0] / "keep.txt").read_text() == "a user's file")


def _excel_results(tmp):
    path = _tiny_study(tmp)
    rows = read_results(path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_text().replace("\n", "\r\n").encode())
    _assert(read_results(path) == rows)


def _nan_value(tmp):
    path = _tiny_study(tmp)
    header, first, *rest = path.read_text().splitlines()
    cells = first.split(",")
    cells[5] = "nan"
    path.write_text("\n".join([header, ",".join(cells), *rest]) + "\n")
    read_results(path)


def _provenance(tmp, text):
    _tiny_study(tmp)
    (tmp / "zoo" / "provenance.json").write_text(text)
    run("clustered", "softmax_topk", out=tmp / "zoo", **TINY)


def _checkpoint_folder(tmp):
    out = tmp / "zoo"
    (out / "checkpoints" / "clustered-softmax_topk-seed0.pt").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run("clustered", "softmax_topk", out=out, **TINY)
    _assert(len(read_results(out)) > 0)


def _claimed_busy(tmp):
    from minimoe.experiments.runner import _run_claim

    out = tmp / "zoo"
    (out / "checkpoints").mkdir(parents=True)
    claim = out / "checkpoints" / "clustered-softmax_topk-seed0.claim"
    with _run_claim(claim, wait=False) as holder:
        _assert(holder is None)
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys
            f = open({str(claim)!r}, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                sys.exit(3)
            """)], timeout=60)
        _assert(child.returncode == 3, "the claim did not exclude another process")
    _assert(not claim.exists(), "the claim file was left behind")


def _cli(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minimoe.experiments", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _cli_error(args, word):
    result = _cli(args)
    _assert(result.returncode == 2 and word in result.stderr and "Traceback" not in result.stderr, result.stderr[-600:])


def _cli_markdown_damaged(tmp):
    path = _tiny_study(tmp)
    path.write_text(path.read_text().replace("wall_time_s", "walltime"))
    _cli_error(["show", "--markdown", str(tmp / "zoo")], "results.csv")


# --------------------------------------------------------------------------------------------- classify
class _Timeout(BaseException):
    pass


@contextlib.contextmanager
def _alarm(seconds):
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def classify(c: Case, tmp: Path) -> tuple[str, str]:
    """``(verdict, detail)`` of one case."""
    if c.subprocess:
        index = CASES.index(c)
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_hostile as h; from pathlib "
                f"import Path; v, d = h.classify(h.CASES[{index}].__class__(**{{**h.CASES[{index}].__dict__, "
                f"'subprocess': False}}), Path({str(tmp)!r})); print(v); print(d)")
        try:
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=c.seconds,
                                    cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            return "hang", f"past {c.seconds:.0f} s"
        lines = result.stdout.strip().splitlines()
        return (lines[0], "\n".join(lines[1:])) if lines else ("unclear", result.stderr[-800:])
    try:
        with _alarm(c.seconds), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c.fn(tmp)
    except _Timeout:
        return "hang", f"past {c.seconds:.0f} s"
    except AssertionError as error:
        if c.kind == "data lost":
            return "data lost", str(error)
        return "silent", f"wrong result: {error}"
    except Exception as error:  # noqa: BLE001
        text = f"{type(error).__name__}: {error}"
        if c.error is not None and isinstance(error, c.error) and re.search(c.match, str(error), re.S):
            return "clear", text
        return "unclear", text
    if c.error is not None and not c.or_result:
        return "silent", f"no error (expected {c.error})"
    return "correct", ""


@pytest.mark.parametrize("c", [pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=c.pending)]
                                            if c.pending else []) for c in CASES])
def test_hostile_case(c, tmp_path):
    verdict, detail = classify(c, tmp_path)
    assert verdict in ("clear", "correct"), f"{c.name} [{c.kind}]: {verdict}: {detail}"


def census(only=None) -> dict:
    import tempfile

    table: dict = {}
    failures = []
    for c in CASES:
        if only and only not in c.name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            verdict, detail = classify(c, Path(tmp))
        table.setdefault(c.kind, {}).setdefault(verdict, 0)
        table[c.kind][verdict] += 1
        if verdict not in ("clear", "correct"):
            failures.append((c, verdict, detail))
    return {"table": table, "failures": failures}


if __name__ == "__main__":
    result = census(sys.argv[1] if len(sys.argv) > 1 else None)
    verdicts = ("clear", "correct", "unclear", "silent", "hang", "data lost")
    print(f"{'class':24s}" + "".join(f"{v:>10s}" for v in verdicts) + f"{'total':>8s}")
    totals = {v: 0 for v in verdicts}
    for kind in CLASSES:
        counts = result["table"].get(kind, {})
        for v in verdicts:
            totals[v] += counts.get(v, 0)
        print(f"{kind:24s}" + "".join(f"{counts.get(v, 0):10d}" for v in verdicts) + f"{sum(counts.values()):8d}")
    n = sum(totals.values())
    print(f"{'all':24s}" + "".join(f"{totals[v]:10d}" for v in verdicts) + f"{n:8d}")
    print(f"clear or correct: {totals['clear'] + totals['correct']} of {n} "
          f"({100 * (totals['clear'] + totals['correct']) / max(n, 1):.1f}%)")
    for c, verdict, detail in result["failures"]:
        print(f"\n[{verdict}] {c.name} ({c.kind}){' -- ' + c.pending if c.pending else ''}\n    {detail[:600]}")
