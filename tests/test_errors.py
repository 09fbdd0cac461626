"""Bad input, tried as a new user would: every row is one call, the exception it must raise, and the
words its message must contain (the argument's name, and where useful the value or what is allowed).
Never a NaN, a silently wrong result, an error from deep inside torch, or a hang.

The table is the contract of ``minimoe.ops._checks``, the one validation layer every public entry uses.
It runs in a few seconds: every call fails before any real work.
"""
import math
import re
import subprocess
import sys

import pytest
import torch

import minimoe
import minimoe.exercises
from minimoe import MoELayer, losses, ops, reroute
from minimoe.experiments import configs as zoo_configs
from minimoe.experiments import runner
from minimoe.models import MoERegressor, TinyLM, TinyViT
from minimoe.routers import build
from minimoe.train import pick_device, train

S = torch.randn(2, 16, 4)  # two groups of 16 tokens, 4 experts
x = torch.randn(2, 16, 8)
nan_S = S.clone().index_fill_(1, torch.tensor([3]), float("nan"))
inf_S = S.clone().index_fill_(1, torch.tensor([3]), float("inf"))
meta = torch.empty(2, 16, 8, device="meta")


def layer(**kw):
    return MoELayer(8, 16, 4, **kw)


def lm():
    return TinyLM(10, d_model=8, n_layers=1, n_heads=2, block_size=8, n_experts=2, d_hidden=8)


def dummy_train(**kw):
    model = torch.nn.Linear(2, 1)
    defaults = dict(steps=2, progress=False)
    return train(model, lambda s: (torch.randn(4, 2), torch.randn(4, 1)), torch.nn.functional.mse_loss,
                 **{**defaults, **kw})


def route(name, logits=S, train_mode=True, **options):
    router = build(name, 8, 4, **options)
    router.train(train_mode)
    return router.route(logits)


def forward(name, inputs=x, **options):
    return build(name, 8, 4, **options)(inputs)


def run_zoo(**kw):
    kw = {"scale": "toy", "seeds": 1, "progress": False, "out": "/tmp/minimoe-test-errors-never-written", **kw}
    return runner.run("clustered", "softmax_topk", **kw)


ROUTERS = minimoe.routers.available()

# (id, call, exception type, regex the message must match)
CASES = [
    # ---------------------------------------------------------------- ops.sinkhorn
    ("sinkhorn-list", lambda: ops.sinkhorn([[1.0, 2.0]]), TypeError, "scores must be a torch.Tensor"),
    ("sinkhorn-int", lambda: ops.sinkhorn(torch.ones(4, 2, dtype=torch.long)), TypeError, "floating-point"),
    ("sinkhorn-1d", lambda: ops.sinkhorn(torch.randn(4)), ValueError, "scores must have shape"),
    ("sinkhorn-nan", lambda: ops.sinkhorn(nan_S), ValueError, "scores contains NaN"),
    ("sinkhorn-inf", lambda: ops.sinkhorn(inf_S), ValueError, "scores contains inf"),
    ("sinkhorn-eps0", lambda: ops.sinkhorn(S, 0.0), ValueError, "eps must be a finite number > 0, got 0"),
    ("sinkhorn-eps-neg", lambda: ops.sinkhorn(S, -1.0), ValueError, "eps must be"),
    ("sinkhorn-eps-nan", lambda: ops.sinkhorn(S, float("nan")), ValueError, "eps must be"),
    ("sinkhorn-eps-inf", lambda: ops.sinkhorn(S, float("inf")), ValueError, "eps must be"),
    ("sinkhorn-eps-str", lambda: ops.sinkhorn(S, "1"), TypeError, "eps must be a real number, got '1'"),
    ("sinkhorn-max-iter0", lambda: ops.sinkhorn(S, max_iter=0), ValueError, "max_iter must be >= 1"),
    ("sinkhorn-max-iter-float", lambda: ops.sinkhorn(S, max_iter=10.0), TypeError, "max_iter must be an int"),
    ("sinkhorn-tol-neg", lambda: ops.sinkhorn(S, tol=-1e-3), ValueError, "tol must be"),
    ("sinkhorn-tol-inf", lambda: ops.sinkhorn(S, tol=float("inf")), ValueError, "tol must be"),
    ("sinkhorn-method", lambda: ops.sinkhorn(S, method="fast"), ValueError, "method must be one of"),
    ("sinkhorn-grad", lambda: ops.sinkhorn(S, grad="yes"), ValueError, "grad must be one of"),
    ("sinkhorn-last-update", lambda: ops.sinkhorn(S, last_update="both"), ValueError, "last_update must be one of"),
    ("sinkhorn-row-sums-neg", lambda: ops.sinkhorn(S, row_sums=-1.0), ValueError, "row_sums must be finite and > 0"),
    ("sinkhorn-row-sums-shape", lambda: ops.sinkhorn(S, row_sums=torch.ones(5)), ValueError, "row_sums must broadcast"),
    ("sinkhorn-col-sums-total", lambda: ops.sinkhorn(S, col_sums=torch.ones(4)), ValueError, "same total"),
    ("sinkhorn-init-shape", lambda: ops.sinkhorn(S, init=torch.zeros(7)), ValueError, "init must be a column potential"),
    ("sinkhorn-meta", lambda: ops.sinkhorn(torch.empty(4, 2, device="meta")), ValueError, "scores is on the meta device"),
    # ---------------------------------------------------------------- ops: allocation, capacity
    ("tca-k0", lambda: ops.token_choice_allocation(S, 0, 4), ValueError, "k must be >= 1"),
    ("tca-k-big", lambda: ops.token_choice_allocation(S, 5, 4), ValueError, "k must be <= 4"),
    ("tca-k-float", lambda: ops.token_choice_allocation(S, 1.5, 4), TypeError, "k must be an int, got 1.5"),
    ("tca-capacity0", lambda: ops.token_choice_allocation(S, 1, 0), ValueError, "capacity must be >= 1"),
    ("tca-capacity-str", lambda: ops.token_choice_allocation(S, 1, "4"), TypeError, "capacity must be an int"),
    ("tca-int-scores", lambda: ops.token_choice_allocation(torch.randint(0, 3, (16, 4)), 1, 4), TypeError,
     "floating-point"),
    ("tca-list", lambda: ops.token_choice_allocation([[0.1, 0.2]], 1, 1), TypeError, "torch.Tensor"),
    ("tca-1d", lambda: ops.token_choice_allocation(torch.randn(16), 1, 4), ValueError, "scores must have shape"),
    ("eca-capacity-big", lambda: ops.expert_choice_allocation(S, 17), ValueError, "capacity must be <= 16"),
    ("eca-capacity0", lambda: ops.expert_choice_allocation(S, 0), ValueError, "capacity must be >= 1"),
    ("top-k-op-k0", lambda: ops.top_k(S, 0), ValueError, "k must be >= 1"),
    ("capacity-factor0", lambda: ops.compute_capacity(16, 4, 0.0), ValueError, "capacity_factor must be"),
    ("capacity-tokens0", lambda: ops.compute_capacity(0, 4, 1.0), ValueError, "tokens must be >= 1"),
    ("capacity-rounding", lambda: ops.compute_capacity(16, 4, 1.0, rounding="floor"), ValueError, "rounding must be"),
    ("capacity-too-small", lambda: ops.compute_capacity(4, 64, 1.0), ValueError, "raise capacity_factor"),
    ("capacity-multiple0", lambda: ops.compute_capacity(16, 4, 1.0, multiple_of=0), ValueError, "multiple_of must be"),
    # ---------------------------------------------------------------- ops: assignment, Gumbel-matching
    ("la-capacity-small", lambda: ops.linear_assignment(S, 3), ValueError, "capacity is too small: the experts have 12 slots for 16 tokens"),
    ("la-capacity-vector-neg", lambda: ops.linear_assignment(S, [8, 8, 8, -1]), ValueError, "capacity must be >= 0"),
    ("la-capacity-vector-float", lambda: ops.linear_assignment(S, torch.full((4,), 4.0)), TypeError, "capacity must hold integers"),
    ("la-duals-scipy", lambda: ops.linear_assignment(S, 4, method="scipy", return_duals=True), ValueError, "return_duals=True needs"),
    ("la-method", lambda: ops.linear_assignment(S, 4, method="hungarian"), ValueError, "method must be one of"),
    ("la-nan", lambda: ops.linear_assignment(nan_S, 4), ValueError, "scores contains NaN"),
    ("la-capacity-float", lambda: ops.linear_assignment(S, 4.0), TypeError, "capacity must be an int"),
    ("gm-capacity-small", lambda: ops.gumbel_matching_sample(S, 3), ValueError, "capacity"),
    ("gm-generator-int", lambda: ops.gumbel_matching_sample(S, 4, generator=7), TypeError,
     r"generator must be a torch.Generator or None, got 7.*manual_seed\(7\)"),
    ("gm-tau0", lambda: ops.gumbel_matching_sample(S, 4, tau=0.0), ValueError, "tau must be"),
    ("skip-generator-str", lambda: ops.skip_sample(S, 4, generator="seed"), TypeError, "generator must be"),
    ("skip-capacity0", lambda: ops.skip_sample(S, 0), ValueError, "capacity must be >= 1"),
    ("estimator-name", lambda: ops.sample_estimator(S, "magic", 4), ValueError, "estimator must be one of"),
    ("sinkhorn-return-potentials-str", lambda: ops.sinkhorn(S, return_potentials="yes"), TypeError,
     "return_potentials must be True or False"),
    ("tca-batch-priority-str", lambda: ops.token_choice_allocation(S, 1, 4, batch_priority="no"), TypeError,
     "batch_priority must be True or False, got 'no'"),
    ("topk-op-renormalize-int", lambda: ops.top_k(S, 1, renormalize=1), TypeError, "renormalize must be True or False"),
    ("skip-proposal-str", lambda: ops.skip_sample(S, 4, sinkhorn_proposal="yes"), TypeError, "sinkhorn_proposal must be"),
    ("budget-tokens-str", lambda: ops.selection_budget(1.5, "16", 4), TypeError, "tokens must be an int"),
    ("budget-experts0", lambda: ops.selection_budget(1.5, 16, 0), ValueError, "experts must be >= 1"),
    ("count-assignments-neg", lambda: ops.count_balanced_assignments(-1, 2, 2), ValueError, "n_tokens must be >= 0"),
    ("count-assignments-float", lambda: ops.count_balanced_assignments(4, 2.0, 2), TypeError, "n_experts must be an int"),
    # ---------------------------------------------------------------- ops: k-subsets
    ("ks-k0", lambda: ops.ksubset_marginals(S, 0), ValueError, r"k must be in \[1, E\] = \[1, 4\].*got k=0"),
    ("ks-k-big", lambda: ops.ksubset_log_partition(S, 5), ValueError, r"k must be in \[1, E\].*got k=5"),
    ("ks-k-float", lambda: ops.ksubset_marginals(S, 2.0), TypeError, "k must be an int"),
    ("ks-nan", lambda: ops.ksubset_marginals(nan_S, 2), ValueError, "logits contains NaN"),
    ("ks-sample-generator", lambda: ops.ksubset_sample(S, 2, generator=3), TypeError, "generator must be"),
    ("rs-kmin-gt-kmax", lambda: ops.range_subset_marginals(S, 3, 2), ValueError, "k_min must be <= k_max, got k_min=3, k_max=2"),
    ("rs-kmax-big", lambda: ops.range_subset_sample(S, 1, 9), ValueError, "k_max must be in .*got k_max=9"),
    ("rs-kmin0", lambda: ops.range_subset_map(S, 0, 2), ValueError, "k_min must be in .*got k_min=0"),
    # ---------------------------------------------------------------- ops: selection, sparse OT
    ("topc-c-neg", lambda: ops.global_topc(S, -1), ValueError, "c must be >= 0"),
    ("topc-c-big", lambda: ops.global_topc(S, 65), ValueError, "c must be <= 64"),
    ("topc-c-float", lambda: ops.global_topc(S, 2.5), TypeError, "c must be an int"),
    ("unified-alpha", lambda: ops.unified_score(S, 1.5), ValueError, "alpha must be"),
    ("unified-ec-score", lambda: ops.unified_score(S, 0.5, ec_score="softmax"), ValueError, "ec_score must be one of"),
    ("budget-k0", lambda: ops.selection_budget(0, 16, 4), ValueError, "k .* must be in"),
    ("budget-k-nan", lambda: ops.selection_budget(float("nan"), 16, 4), ValueError, "k .* must be in"),
    ("sparse-capacity-small", lambda: ops.sparsity_constrained_plan(torch.rand(16, 4), 3), ValueError,
     r"capacity=3 makes eq. \(9\) infeasible.*smallest feasible capacity is 4"),
    ("sparse-gamma0", lambda: ops.sparsity_constrained_plan(torch.rand(16, 4), 8, gamma=0.0), ValueError, "gamma must be"),
    ("sparse-method", lambda: ops.sparsity_constrained_plan(torch.rand(16, 4), 8, method="lbfgs"), ValueError,
     "method must be one of"),
    ("simplex-nonzeros0", lambda: ops.sparse_simplex_projection(torch.rand(5), 0), ValueError, "max_nonzeros must be >= 1"),
    # ---------------------------------------------------------------- routers: build and options
    ("build-unknown", lambda: build("no_such_router", 8, 4), ValueError, "unknown router name 'no_such_router'.*softmax_topk"),
    ("build-name-int", lambda: build(3, 8, 4), TypeError, "router name must be a string"),
    ("build-typo", lambda: build("softmax_topk", 8, 4, capacity_facter=1.0), TypeError,
     r"unknown option 'capacity_facter' \(did you mean 'capacity_factor'\?\); valid options: .*balance_loss"),
    ("build-typo-densemixer", lambda: build("densemixer", 8, 4, renormalise=True), TypeError,
     "did you mean 'renormalize'.*valid options: .*batch_priority"),
    ("build-typo-ssr", lambda: build("ssr", 8, 4, xi=0.5), TypeError, "unknown option 'xi'.*valid options: .*eps"),
    ("build-d-model0", lambda: build("softmax_topk", 0, 4), ValueError, "d_model must be >= 1"),
    ("build-n-experts0", lambda: build("softmax_topk", 8, 0), ValueError, "n_experts must be >= 1"),
    ("build-n-experts-float", lambda: build("softmax_topk", 8, 4.0), TypeError, "n_experts must be an int, got 4.0"),
    ("topk-k5", lambda: build("softmax_topk", 8, 4, k=5), ValueError, "k must be <= 4"),
    ("topk-k0", lambda: build("softmax_topk", 8, 4, k=0), ValueError, "k must be >= 1"),
    ("topk-capacity-factor0", lambda: build("softmax_topk", 8, 4, capacity_factor=0.0), ValueError, "capacity_factor"),
    ("topk-capacity-factor-str", lambda: build("softmax_topk", 8, 4, capacity_factor="1.25"), TypeError,
     "capacity_factor must be a real number or None, got '1.25'"),
    ("topk-noise", lambda: build("softmax_topk", 8, 4, noise="gaussian"), ValueError, "noise must be one of"),
    ("topk-vmoe-needs-noise", lambda: build("softmax_topk", 8, 4, balance_loss="vmoe"), ValueError, "needs noise"),
    ("topk-balance-loss", lambda: build("softmax_topk", 8, 4, balance_loss="gshard3"), ValueError, "balance_loss must be"),
    ("topk-balance-weight-nan", lambda: build("softmax_topk", 8, 4, balance_loss="switch",
                                              balance_loss_weight=float("nan")), ValueError, "balance_loss_weight must be"),
    ("topk-balance-weight-neg", lambda: build("softmax_topk", 8, 4, balance_loss="switch", balance_loss_weight=-1),
     ValueError, "balance_loss_weight must be a finite number >= 0, got -1"),
    ("topk-z-loss-nan", lambda: build("softmax_topk", 8, 4, z_loss_weight=float("nan")), ValueError, "z_loss_weight must be"),
    ("topk-z-loss-str", lambda: build("softmax_topk", 8, 4, z_loss_weight="0.001"), TypeError, "z_loss_weight must be a real"),
    ("topk-renormalize-str", lambda: build("softmax_topk", 8, 4, renormalize="False"), TypeError,
     "renormalize must be True or False, got 'False'"),
    ("topk-bpr-int", lambda: build("softmax_topk", 8, 4, batch_priority=1), TypeError, "batch_priority must be True or False"),
    ("topk-noise-std0", lambda: build("softmax_topk", 8, 4, noise="vmoe", noise_std=0.0), ValueError, "noise_std must be"),
    ("topk-min-capacity-neg", lambda: build("softmax_topk", 8, 4, min_capacity=-1), ValueError, "min_capacity must be >= 0"),
    ("topk-rounding", lambda: build("softmax_topk", 8, 4, capacity_rounding="floor"), ValueError, "capacity_rounding must be"),
    ("topk-generator-int", lambda: build("softmax_topk", 8, 4, noise="vmoe", generator=7), TypeError, "generator must be"),
    ("ec-capacity-factor-neg", lambda: build("expert_choice", 8, 4, capacity_factor=-2.0), ValueError, "capacity_factor"),
    ("ec-capacity-factor-none", lambda: build("expert_choice", 8, 4, capacity_factor=None), TypeError,
     "capacity_factor must be a real number"),
    ("ec-noise", lambda: build("expert_choice", 8, 4, noise="shazeer"), ValueError, "noise must be one of None, 'vmoe'"),
    ("sinkhorn-tc-eps0", lambda: build("sinkhorn_token_choice", 8, 4, eps=0), ValueError, "eps must be"),
    ("sinkhorn-tc-iters0", lambda: build("sinkhorn_token_choice", 8, 4, sinkhorn_iters=0), ValueError, "sinkhorn_iters must be >= 1"),
    ("sinkhorn-tc-tol-neg", lambda: build("sinkhorn_token_choice", 8, 4, sinkhorn_tol=-1), ValueError, "sinkhorn_tol must be"),
    ("sinkhorn-tc-last-update", lambda: build("sinkhorn_token_choice", 8, 4, last_update="cols"), ValueError,
     "last_update must be one of"),
    ("sinkhorn-tc-balance-tol0", lambda: build("sinkhorn_token_choice", 8, 4, balance_tol=0), ValueError, "balance_tol must be"),
    ("sinkhorn-tc-combine", lambda: build("sinkhorn_token_choice", 8, 4, combine="mean"), ValueError, "combine must be one of"),
    ("sinkhorn-tc-eval", lambda: build("sinkhorn_token_choice", 8, 4, eval_routing="greedy"), ValueError, "eval_routing"),
    ("sinkhorn-ec-capacity-none", lambda: build("sinkhorn_expert_choice", 8, 4, capacity_factor=None), TypeError,
     "capacity_factor must be a real number"),
    ("base-method", lambda: build("base", 8, 4, method="greedy"), ValueError, "method must be one of"),
    ("ssr-p", lambda: build("ssr", 8, 4, p=1.5), ValueError, "p must be a finite number >= 0 and <= 1, got 1.5"),
    ("ssr-p-nan", lambda: build("ssr", 8, 4, p=float("nan")), ValueError, "p must be"),
    ("ssr-tol-inf", lambda: build("ssr", 8, 4, tol=float("inf")), ValueError, "tol must be a finite number >= 0"),
    ("ssr-cost", lambda: build("ssr", 8, 4, cost="quadratic"), ValueError, "cost must be one of"),
    ("ssr-noise-neg", lambda: build("ssr", 8, 4, noise_scale=-0.1), ValueError, "noise_scale must be"),
    ("ssr-eval-mode", lambda: build("ssr", 8, 4, eval_mode="noisy"), ValueError, "eval_mode must be one of"),
    ("ssr-seed-neg", lambda: build("ssr", 8, 4, seed=-1), ValueError, "seed must be >= 0"),
    ("ssr-seed-str", lambda: build("ssr", 8, 4, seed="0"), TypeError, "seed must be an int or None"),
    ("ssr-noisy-weights-softmax", lambda: build("ssr", 8, 4, cost="softmax", noisy_weights=True), ValueError,
     "noisy_weights=True needs cost='linear'"),
    ("ssr-detach-str", lambda: build("ssr", 8, 4, detach_plan="no"), TypeError, "detach_plan must be True or False"),
    ("sparse-ec-gamma0", lambda: build("sparsity_constrained_ec", 8, 4, gamma=0.0), ValueError, "gamma must be"),
    ("sparse-ec-method", lambda: build("sparsity_constrained_ec", 8, 4, ot_method="lbfgs"), ValueError, "ot_method must be"),
    ("sparse-ec-iters-neg", lambda: build("sparsity_constrained_ec", 8, 4, ot_iters=-1), ValueError, "ot_iters must be >= 0"),
    ("soft-slots0", lambda: build("soft_moe", 8, 4, slots_per_expert=0), ValueError, "slots_per_expert must be >= 1"),
    ("soft-normalize-str", lambda: build("soft_moe", 8, 4, normalize="yes"), TypeError, "normalize must be True or False"),
    ("soft-scale0", lambda: build("soft_moe", 8, 4, scale_init=0.0), ValueError, "scale_init must be"),
    ("usmoe-k0", lambda: build("usmoe", 8, 4, k=0), ValueError, r"k \(experts per token on average\) must be in"),
    ("usmoe-k-big", lambda: build("usmoe", 8, 4, k=4.5), ValueError, "must be in"),
    ("usmoe-alpha", lambda: build("usmoe", 8, 4, alpha=-0.1), ValueError, "alpha must be"),
    ("usmoe-grouping", lambda: build("usmoe", 8, 4, grouping="batch"), ValueError, "grouping must be one of"),
    ("usmoe-balance-weight-neg", lambda: build("usmoe", 8, 4, balance_loss="switch", balance_loss_weight=-1.0),
     ValueError, "balance_loss_weight must be"),
    ("probmoe-k-big", lambda: build("probmoe_exact", 8, 4, k=5), ValueError, "k must be <= 4"),
    ("probmoe-generator", lambda: build("probmoe_exact", 8, 4, generator=0), TypeError, "generator must be"),
    ("probmoe-kmin-gt-kmax", lambda: build("probmoe_dynamic", 8, 4, k_min=3, k_max=2), ValueError, "k_min must be <= 2"),
    ("probmoe-renormalize-str", lambda: build("probmoe_exact", 8, 4, renormalize="True"), TypeError, "renormalize must be"),
    ("densemixer-k0", lambda: build("densemixer", 8, 4, k=0), ValueError, "k must be >= 1"),
    ("kool-skip-estimator", lambda: build("kool_skip", 8, 4, estimator="gm_iw"), ValueError, "estimator must be one of"),
    ("kool-skip-tau0", lambda: build("kool_skip", 8, 4, tau=0), ValueError, "tau must be"),
    ("kool-skip-min-capacity-str", lambda: build("kool_skip", 8, 4, min_capacity="2"), TypeError, "min_capacity must be an int"),
    ("kool-gm-capacity-factor", lambda: build("kool_gumbel_matching", 8, 4, capacity_factor=0.5), ValueError,
     "capacity_factor must be >= 1"),
    ("kool-gm-method", lambda: build("kool_gumbel_matching", 8, 4, method="magic"), ValueError, "method must be one of"),
    ("kool-gm-generator", lambda: build("kool_gumbel_matching", 8, 4, generator=1), TypeError, "generator must be"),
    # ---------------------------------------------------------------- routers: inputs
    ("router-x-4d", lambda: forward("softmax_topk", torch.randn(2, 2, 16, 8)), ValueError, "x must have shape"),
    ("router-x-1d", lambda: forward("softmax_topk", torch.randn(8)), ValueError, "x must have shape"),
    ("router-x-width", lambda: forward("softmax_topk", torch.randn(16, 6)), ValueError, "d_model=8 .*got shape \\(16, 6\\)"),
    ("router-x-list", lambda: forward("softmax_topk", [[0.0] * 8]), TypeError, "x must be a torch.Tensor"),
    ("router-x-int", lambda: forward("softmax_topk", torch.ones(16, 8, dtype=torch.long)), TypeError, "floating-point"),
    ("router-x-meta", lambda: forward("softmax_topk", meta), ValueError, "x is on the meta device"),
    ("router-x-float64", lambda: forward("softmax_topk", x.double()), TypeError,
     "x has dtype torch.float64 but the router's parameters are torch.float32"),
    ("router-x-bf16", lambda: forward("expert_choice", x.bfloat16()), TypeError, "x has dtype torch.bfloat16"),
    ("router-logits-nan", lambda: route("softmax_topk", nan_S), ValueError, "logits contains NaN"),
    ("router-logits-inf", lambda: route("expert_choice", inf_S), ValueError, "logits contains inf"),
    ("router-logits-experts", lambda: route("softmax_topk", torch.randn(16, 5)), ValueError, "n_experts=4"),
    ("router-logits-1d", lambda: route("softmax_topk", torch.randn(4)), ValueError, "logits must have shape"),
    ("router-capacity-rounds-to-0", lambda: build("softmax_topk", 8, 64)(torch.randn(10, 8)), ValueError, "capacity_factor"),
    ("router-shazeer-needs-x", lambda: route("softmax_topk", noise="shazeer"), ValueError, "noise='shazeer'"),
    ("router-soft-moe-needs-x", lambda: build("soft_moe", 8, 4).route(None), TypeError, "soft_moe computes its logits"),
    ("router-soft-moe-nan", lambda: forward("soft_moe", torch.full((16, 8), float("nan"))), ValueError, "x contains NaN"),
    ("router-base-meta", lambda: forward("base", meta), ValueError, "meta device"),
    # ---------------------------------------------------------------- the layer
    ("layer-path", lambda: layer(path="fast"), ValueError, "path must be one of"),
    ("layer-router-dims", lambda: layer(router=build("softmax_topk", 6, 4)), ValueError, "d_model=6"),
    ("layer-router-int", lambda: layer(router=3), TypeError, "router must be"),
    ("layer-router-options-list", lambda: layer(router_options=[("k", 2)]), TypeError, "router_options must be a dict"),
    ("layer-router-options-typo", lambda: layer(router_options={"kk": 2}), TypeError, "unknown option 'kk'.*valid options"),
    ("layer-router-options-with-module", lambda: layer(router=build("softmax_topk", 8, 4), router_options={"k": 2}),
     ValueError, "router_options are only used"),
    ("layer-d-hidden0", lambda: MoELayer(8, 0, 4), ValueError, "d_hidden must be >= 1"),
    ("layer-n-experts-neg", lambda: MoELayer(8, 16, -1), ValueError, "n_experts must be >= 1"),
    ("layer-activation", lambda: layer(activation="tanh"), ValueError, "activation must be one of"),
    ("layer-bias-str", lambda: layer(bias="no"), TypeError, "bias must be True or False"),
    ("layer-group-size0", lambda: layer(group_size=0), ValueError, "group_size must be >= 1"),
    ("layer-x-width", lambda: layer()(torch.randn(16, 7)), ValueError, "d_model=8"),
    ("layer-group-size-mismatch", lambda: layer(group_size=5)(torch.randn(16, 8)), ValueError, "group_size=5"),
    ("layer-call-group-size0", lambda: layer()(x, group_size=0), ValueError, "group_size must be >= 1, got 0"),
    ("layer-call-group-size-neg", lambda: layer()(x, group_size=-4), ValueError, "group_size must be >= 1"),
    ("layer-call-group-size-float", lambda: layer()(x, group_size=16.0), TypeError, "group_size must be an int"),
    ("layer-x-meta", lambda: layer()(meta), ValueError, "x is on the meta device"),
    ("layer-x-str", lambda: layer()("tokens"), TypeError, "x must be a torch.Tensor"),
    ("layer-x-float64", lambda: layer()(x.double()), TypeError, "x has dtype torch.float64"),
    ("layer-x-int", lambda: layer()(torch.ones(16, 8, dtype=torch.long)), TypeError, "floating-point"),
    ("layer-x-nan", lambda: layer()(torch.full((16, 8), float("nan"))), ValueError, "logits contains NaN"),
    ("reroute-no-moe", lambda: reroute(torch.nn.Linear(2, 2), "usmoe"), ValueError, "no MoELayer"),
    ("reroute-not-module", lambda: reroute("model", "usmoe"), TypeError, "model must be a torch.nn.Module"),
    ("reroute-unknown-router", lambda: reroute(lm(), "magic"), ValueError, "unknown router name"),
    ("reroute-typo", lambda: reroute(lm(), "usmoe", kk=2), TypeError, "unknown option 'kk'"),
    # ---------------------------------------------------------------- models
    ("lm-n-experts-neg", lambda: TinyLM(10, n_experts=-1), ValueError, r"n_experts \(0: a dense model\) must be >= 0, got -1"),
    ("lm-heads", lambda: TinyLM(10, d_model=10, n_heads=4), ValueError, "d_model=10 must be divisible by n_heads=4"),
    ("lm-vocab0", lambda: TinyLM(0), ValueError, "vocab_size must be >= 1"),
    ("lm-layers0", lambda: TinyLM(10, n_layers=0), ValueError, "n_layers must be >= 1"),
    ("lm-moe-every0", lambda: TinyLM(10, moe_every=0), ValueError, "moe_every must be >= 1"),
    ("lm-routing-groups", lambda: TinyLM(10, routing_groups="token"), ValueError, "routing_groups must be one of"),
    ("lm-router-options-list", lambda: TinyLM(10, router_options=["k"]), TypeError, "router_options must be a dict"),
    ("lm-router-typo", lambda: TinyLM(10, router_options={"capacity_facter": 1.0}), TypeError, "did you mean 'capacity_factor'"),
    ("lm-idx-float", lambda: lm()(torch.zeros(2, 4)), TypeError, "idx must hold token ids"),
    ("lm-idx-long", lambda: lm()(torch.zeros(2, 9, dtype=torch.long)), ValueError, r"length <= 8"),
    ("lm-idx-range", lambda: lm()(torch.full((2, 4), 12)), ValueError, r"token ids in \[0, vocab_size=10\)"),
    ("lm-idx-negative", lambda: lm()(torch.full((2, 4), -1)), ValueError, "token ids"),
    ("vit-channels", lambda: TinyViT(3)(torch.randn(2, 3, 16, 16)), ValueError,
     r"images must have shape \(batch, channels=1, 16, 16\), got \(2, 3, 16, 16\)"),
    ("vit-size", lambda: TinyViT(3)(torch.randn(2, 1, 8, 8)), ValueError, "images must have shape"),
    ("vit-3d", lambda: TinyViT(3)(torch.randn(1, 16, 16)), ValueError, "images must have shape"),
    ("vit-patch", lambda: TinyViT(3, image_size=16, patch_size=5), ValueError, "divisible by patch_size=5"),
    ("vit-classes0", lambda: TinyViT(0), ValueError, "n_classes must be >= 1"),
    ("regressor-width", lambda: MoERegressor(4, 2, group_size=8)(torch.randn(16, 5)), ValueError, r"\(N, d_in=4\)"),
    ("regressor-group", lambda: MoERegressor(4, 2, group_size=0), ValueError, "group_size must be >= 1"),
    # ---------------------------------------------------------------- train
    ("train-grad-clip-neg", lambda: dummy_train(grad_clip=-1), ValueError, "grad_clip .* must be a finite number > 0, got -1"),
    ("train-grad-clip0", lambda: dummy_train(grad_clip=0), ValueError, "grad_clip"),
    ("train-grad-clip-nan", lambda: dummy_train(grad_clip=float("nan")), ValueError, "grad_clip"),
    ("train-steps0", lambda: dummy_train(steps=0), ValueError, "steps must be >= 1"),
    ("train-steps-float", lambda: dummy_train(steps=10.0), TypeError, "steps must be an int"),
    ("train-lr0", lambda: dummy_train(lr=0), ValueError, "lr must be"),
    ("train-lr-str", lambda: dummy_train(lr="3e-3"), TypeError, "lr must be a real number"),
    ("train-weight-decay-neg", lambda: dummy_train(weight_decay=-0.1), ValueError, "weight_decay must be"),
    ("train-eval-every-neg", lambda: dummy_train(eval_every=-1), ValueError, "eval_every must be >= 0"),
    ("train-seed-neg", lambda: dummy_train(seed=-1), ValueError, "seed must be >= 0"),
    ("train-device", lambda: dummy_train(device="gpu"), ValueError, "device must name a torch device"),
    ("train-device-int", lambda: pick_device(3.5), TypeError, "device must be"),
    ("train-progress-str", lambda: dummy_train(progress="no"), TypeError, "progress must be True or False"),
    ("train-loss-fn", lambda: dummy_train(loss_fn=None) if False else train(torch.nn.Linear(2, 1), lambda s: None, None,
                                                                          steps=1), TypeError, "loss_fn must be callable"),
    ("train-model", lambda: train("model", lambda s: None, torch.nn.functional.mse_loss, steps=1), TypeError,
     "model must be a torch.nn.Module"),
    ("train-frozen", lambda: train(torch.nn.Linear(2, 1).requires_grad_(False), lambda s: None,
                                   torch.nn.functional.mse_loss, steps=1), ValueError, "no trainable parameters"),
    ("train-get-batch-tensor", lambda: train(torch.nn.Linear(2, 1), lambda s: torch.randn(4, 2),
                                             torch.nn.functional.mse_loss, steps=1, progress=False), TypeError,
     r"get_batch\(step\) must return a pair of tensors"),
    ("train-loss-not-scalar", lambda: train(torch.nn.Linear(2, 1), lambda s: (torch.randn(4, 2), torch.randn(4, 1)),
                                            lambda a, b: (a - b) ** 2 > 0, steps=1, progress=False), TypeError,
     "loss_fn must return a floating-point tensor"),
    ("train-eval-fn-list", lambda: dummy_train(eval_fn=lambda m: [1.0]), TypeError, "eval_fn must return a dict"),
    ("train-eval-fn-not-callable", lambda: dummy_train(eval_fn="val"), TypeError, "eval_fn must be callable"),
    # ---------------------------------------------------------------- losses and metrics
    ("reinforce-baseline", lambda: losses.reinforce_loss(lm(), torch.randn(4), baseline="median"), ValueError,
     "baseline must be"),
    ("reinforce-ints", lambda: losses.reinforce_loss(lm(), torch.ones(4, dtype=torch.long)), TypeError, "loss_per_token"),
    # ---------------------------------------------------------------- experiments
    ("zoo-steps-neg", lambda: run_zoo(steps=-3), ValueError, "steps must be >= 1, got -3"),
    ("zoo-steps0", lambda: run_zoo(steps=0), ValueError, "steps must be >= 1, got 0"),
    ("zoo-checkpoint0", lambda: run_zoo(checkpoint_every=0), ValueError, "checkpoint_every must be >= 1"),
    ("zoo-lr-str", lambda: run_zoo(lr="fast"), TypeError, "lr must be a real number"),
    ("zoo-unknown-field", lambda: run_zoo(stepz=3), ValueError, "unknown configuration fields"),
    ("zoo-seeds0", lambda: run_zoo(seeds=0), ValueError, "seeds must be >= 1, got 0"),
    ("zoo-threads0", lambda: run_zoo(threads=0), ValueError, "threads must be >= 1"),
    ("zoo-scale", lambda: runner.run("lm", "softmax_topk", scale="huge"), ValueError, "scale must be one of"),
    ("zoo-task", lambda: runner.run("speech", "softmax_topk"), ValueError, "tasks must be 'all' or"),
    ("zoo-router", lambda: runner.run("lm", "softmax_top1"), ValueError, "routers must be 'all' or"),
    ("zoo-routers-int", lambda: runner.run("lm", 3), TypeError, "routers must be"),
    ("zoo-device", lambda: run_zoo(device="tpu"), ValueError, "device must name"),
    ("zoo-stats-window", lambda: zoo_configs.task_config("lm", "toy", stats_window=0), ValueError, "stats_window must be"),
    ("zoo-data-override", lambda: zoo_configs.task_config("lm", "toy", data=5), TypeError, "data must be a dict"),
    ("zoo-router-options", lambda: zoo_configs.router_options("magic", zoo_configs.task_config("lm", "toy")),
     ValueError, "no study entry 'magic'"),
    # ---------------------------------------------------------------- exercise checkers
    ("exercise-not-callable", lambda: minimoe.exercises.check_token_choice_allocation(3), TypeError,
     "takes your function as its first argument"),
    ("exercise-seed", lambda: minimoe.exercises.check_sinkhorn_step(lambda *a: None, seed=-1), ValueError, "seed must be >= 0"),
    ("exercise-n-random", lambda: minimoe.exercises.check_token_choice_allocation(lambda *a: None, n_random=-5),
     ValueError, "n_random must be >= 0"),
    ("exercise-draws", lambda: minimoe.exercises.check_ksubset_sample(lambda *a: None, draws=10), ValueError,
     "draws must be >= 100"),
    ("exercise-verbose", lambda: minimoe.exercises.check_global_topc(lambda *a: None, verbose="yes"), TypeError,
     "verbose must be True or False"),
    ("exercise-unknown-option", lambda: minimoe.exercises.check_capacity(lambda *a: None, seed=1), TypeError, "seed"),
]



def test_the_table_is_large_and_its_ids_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) >= 150, len(ids)
    assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error, f"a subclass ({type(info.value).__name__}) is not the documented error"


def test_a_failed_run_writes_nothing(tmp_path):
    """A bad override is refused before the results folder is created or provenance.json written."""
    out = tmp_path / "zoo"
    with pytest.raises(ValueError, match="steps must be >= 1"):
        run_zoo(out=out, steps=-3)
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--checkpoint-every", "0"), ("--seeds", "0"),
                                         ("--steps", "-2"), ("--threads", "0")])
def test_the_cli_refuses_zero_and_negative_counts(tmp_path, capsys, flag, value):
    """`--steps 0` used to fall back to the task's default through an `if v`. The CLI's own entry point,
    in this process (the next test runs one case as a command)."""
    from minimoe.experiments.__main__ import main

    out = tmp_path / "zoo"
    with pytest.raises(SystemExit) as exited:
        main(["run", "--task", "clustered", "--routers", "softmax_topk", "--out", str(out), "--no-progress",
              flag, value])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    name = flag.lstrip("-").replace("-", "_")
    assert re.search(f"{name}.* must be >= 1", stderr), stderr
    assert "Traceback" not in stderr
    assert not out.exists()


def test_the_cli_command_exits_2_with_the_message_and_no_traceback(tmp_path):
    out = tmp_path / "zoo"
    done = subprocess.run([sys.executable, "-m", "minimoe.experiments", "run", "--task", "clustered", "--routers",
                           "softmax_topk", "--out", str(out), "--no-progress", "--steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert re.search("steps.* must be >= 1", done.stderr), done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_empty_inputs_give_empty_results_everywhere():
    """One rule for T = 0 (no tokens): every op and router returns empty tensors of the right shape, and
    the layer an empty output, as torch's own layers do; nothing raises and no statistic is NaN."""
    empty = torch.zeros(2, 0, 4)
    assert ops.sinkhorn(empty).shape == (2, 0, 4)
    assert ops.sinkhorn(torch.zeros(0, 16, 4)).shape == (0, 16, 4)
    assert ops.token_choice_allocation(empty, 1, 2).shape == (2, 0, 4)
    assert ops.global_topc(empty, 0).shape == (2, 0, 4)
    for name in minimoe.routers.available():
        router = build(name, 8, 4).train()
        routing = router(torch.zeros(2, 0, 8))
        assert routing.mask.shape[-2] == 0, name
        assert float(routing.aux_loss) == 0.0
        assert all(math.isfinite(float(v)) for v in routing.stats.values()), (name, routing.stats)
        moe = MoELayer(8, 16, 4, router=name)
        out = moe(torch.zeros(0, 8, requires_grad=True))
        assert out.shape == (0, 8)
        out.sum().backward()  # a loss on an empty batch can still call backward


def test_no_case_hangs_and_the_table_runs_fast():
    """Every bad call fails before doing work: the whole table in well under a few seconds."""
    import time

    start = time.perf_counter()
    for _, call, error, _ in CASES:
        with pytest.raises(error):
            call()
    assert time.perf_counter() - start < 30
