"""Named configurations of the head-to-head (book: chapter 9, "The router zoo").

Two things are fixed here so that every comparison is on equal footing:

* :func:`router_options`: each registered router at the **same active compute**, one expert
  evaluation per token on average (``E * C = T`` slots per routing group, or ``k = 1``), as the
  router's class states it (the router protocol's ``study_options``). Routers that choose a
  variable number of experts spend what their rule gives them (``probmoe_dynamic`` draws 1 or 2;
  DenseMixer runs every expert in its backward pass); the results file records the measured
  ``experts_per_token`` so the reader sees the spend.
* ``SCALES``: per task, a ``toy`` configuration (a 2-core CPU, one thread: every router on every
  task, three seeds, in about two minutes), a ``reference`` configuration (the study of chapter 9:
  8 paired seeds, 24 on the clustered task, about 6 CPU-hours) and a ``gpu`` configuration (sized for one GPU with ~80 GB;
  its run time is whatever a run on one reports: none is quoted here until one has been measured).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from .. import routers as router_registry
from ..ops._checks import check_float, check_int, check_positive_float

# Every registered router enters the study at one expert evaluation per token on average, with the
# options its class states (Router.study_options: capacity factor 1, or dropless with k = 1, Soft
# MoE's E * S = T slots, ...); entries that run a router with other options are declared beside it
# (Router.study_variants, e.g. ssr_p0). Nothing here names a router.


@dataclass(frozen=True)
class TaskConfig:
    """Sizes of one task at one scale. ``group_size`` is the number of tokens routed together."""

    task: str
    steps: int
    batch_size: int
    lr: float
    n_experts: int
    d_model: int
    d_hidden: int
    group_size: int
    model: dict = field(default_factory=dict)  # model-specific sizes (layers, heads, block size, ...)
    data: dict = field(default_factory=dict)  # data-specific sizes
    # lm: validation batches of random windows drawn once (EVAL_SEED), or None: the whole validation
    # split in consecutive windows, every character predicted once (the other tasks always use all of it)
    eval_batches: int | None = 4
    # a weight average for evaluation (minimoe.train.train's ema_decay): its metrics are recorded too,
    # as ema_<metric>; None: none
    ema_decay: float | None = None
    checkpoint_every: int = 50  # steps (the runner also checkpoints at least every 2 minutes)
    stats_window: float = 0.25  # routing metrics: mean over the last quarter of training steps
    # "constant", or "cosine": linear warm-up over ``warmup_steps`` then cosine decay to 0. A decayed
    # learning rate ends every run at a settled point, so the seed-to-seed spread of the final metric
    # is the spread of the solutions, not of the last few noisy steps (the reference scale uses it)
    lr_schedule: str = "constant"
    warmup_steps: int = 0

    def __post_init__(self):
        # checked when a configuration is made or overridden, before a run writes anything
        for name in ("steps", "batch_size", "n_experts", "d_model", "d_hidden", "group_size", "checkpoint_every"):
            check_int(getattr(self, name), name, low=1)
        check_int(self.eval_batches, "eval_batches (None: the whole validation split)", low=1, allow_none=True)
        check_float(self.ema_decay, "ema_decay", low=0.0, high=1.0, low_open=True, high_open=True, allow_none=True)
        check_positive_float(self.lr, "lr")
        check_float(self.stats_window, "stats_window", low=0.0, high=1.0, low_open=True)
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        check_int(self.warmup_steps, "warmup_steps", low=0)  # a run shorter than its warm-up warms up throughout
        for name in ("model", "data"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(f"{name} must be a dict of sizes, got {getattr(self, name)!r}")


#: ``SCALES[scale][task]``: the sizes of each task at the ``"toy"`` and ``"gpu"`` scales.
SCALES: dict[str, dict[str, TaskConfig]] = {
    "toy": {
        # 16 sequences of 32 characters, 8 experts; the routing groups are the 16 tokens at the same
        # position of the batch (routing_groups="position": causal for every router)
        "lm": TaskConfig("lm", steps=120, batch_size=16, lr=3e-3, n_experts=8, d_model=32, d_hidden=64,
                         group_size=16, model=dict(n_layers=2, n_heads=4, block_size=32),
                         data=dict(max_chars=200_000)),
        # one MoE layer on 8 clusters; groups of 64 inputs
        "clustered": TaskConfig("clustered", steps=200, batch_size=256, lr=5e-3, n_experts=8, d_model=32,
                                d_hidden=32, group_size=64, data=dict(n_samples=8192, d_in=16, d_out=8,
                                                                     n_clusters=8)),
        # a 4-block ViT on 16 x 16 shapes, MoE in blocks 2 and 4; each image's 16 patches are a group
        "vision": TaskConfig("vision", steps=120, batch_size=32, lr=3e-3, n_experts=8, d_model=32, d_hidden=64,
                             group_size=16, model=dict(n_layers=2, n_heads=4, patch_size=4),
                             data=dict(n_train=4096, n_val=512, image_size=16)),
    },
    # Built for statistical power on a 2-core CPU (chapter 9, "The reference study"): every router,
    # 8 paired seeds, two worker processes of one thread, about 6 CPU-hours in all. Each task is one on
    # which the choice of experts matters, and each run trains to a settled point (cosine decay):
    "reference": {
        # prose and Python code interleaved (two kinds of sequence that want different experts);
        # 32 sequences of 64 characters, the 32 tokens at one position are a routing group. Evaluated
        # on the whole validation split; 1600 steps, not 800: at 800 the models are still far from
        # settled and the seed-to-seed spread of a paired difference is what makes the LM hard to
        # read (minimoe.experiments.noise measured it: results/lm-noise-cpu)
        "lm": TaskConfig("lm", steps=1600, batch_size=32, lr=4e-3, n_experts=8, d_model=64, d_hidden=128,
                         group_size=32, model=dict(n_layers=2, n_heads=4, block_size=64),
                         data=dict(max_chars=None, source="mixed"), eval_batches=None, checkpoint_every=200,
                         lr_schedule="cosine", warmup_steps=30),
        # 32 clusters on 8 experts: each expert must serve four clusters, so which clusters a router
        # puts together (and how it splits them under capacity) decides the fit
        "clustered": TaskConfig("clustered", steps=3000, batch_size=256, lr=5e-3, n_experts=8, d_model=32,
                                d_hidden=32, group_size=64, data=dict(n_samples=65_536, d_in=16, d_out=8,
                                                                     n_clusters=32),
                                checkpoint_every=1000, lr_schedule="cosine", warmup_steps=100),
        # 16 classes (8 shapes x 2 sizes) on 8 experts, 4096 validation images
        "vision": TaskConfig("vision", steps=1600, batch_size=64, lr=3e-3, n_experts=8, d_model=48,
                             d_hidden=96, group_size=16, model=dict(n_layers=2, n_heads=4, patch_size=4),
                             data=dict(n_train=32_768, n_val=8192, image_size=16, n_classes=16),
                             checkpoint_every=400, lr_schedule="cosine", warmup_steps=50),
    },
    "gpu": {
        "lm": TaskConfig("lm", steps=1500, batch_size=128, lr=1e-3, n_experts=16, d_model=256, d_hidden=512,
                         group_size=128, model=dict(n_layers=4, n_heads=8, block_size=128),
                         data=dict(max_chars=None), eval_batches=16, checkpoint_every=250),
        "clustered": TaskConfig("clustered", steps=2000, batch_size=4096, lr=2e-3, n_experts=16, d_model=128,
                                d_hidden=128, group_size=512, data=dict(n_samples=262_144, d_in=32, d_out=16,
                                                                       n_clusters=16),
                                eval_batches=8, checkpoint_every=250),
        "vision": TaskConfig("vision", steps=1500, batch_size=128, lr=1e-3, n_experts=16, d_model=192,
                             d_hidden=384, group_size=64, model=dict(n_layers=6, n_heads=6, patch_size=4),
                             data=dict(n_train=65_536, n_val=4096, image_size=32),
                             eval_batches=8, checkpoint_every=250),
    },
}

TASKS = ("lm", "clustered", "vision")


def task_config(task: str, scale: str, **overrides) -> TaskConfig:
    """The configuration of ``task`` at ``scale`` (``"toy"``, ``"reference"`` or ``"gpu"``), with fields replaced by
    ``overrides`` (``model=`` and ``data=`` dicts are merged into the defaults, not replaced)."""
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(f"scale must be one of {tuple(SCALES)}, got {scale!r}")
    if not isinstance(task, str) or task not in SCALES[scale]:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    config = SCALES[scale][task]
    for key in ("model", "data"):
        if key in overrides:
            if not isinstance(overrides[key], dict):
                raise TypeError(f"{key} must be a dict of the fields to change, got {overrides[key]!r}")
            overrides[key] = {**getattr(config, key), **overrides[key]}
    unknown = set(overrides) - set(config.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown configuration fields {sorted(unknown)}; allowed: "
                         f"{sorted(config.__dataclass_fields__)}")
    return replace(config, **overrides)


def study_variants() -> dict[str, tuple[str, dict]]:
    """Study entries that are not registered routers: one router with other options, added to a study by
    name (``--routers all,ssr_p0,softmax_topk_dropless``) because a paper's claim is about that contrast
    (chapter 9, "The papers' claims"). ``{name: (router, options)}``; the options replace the router's
    study options. Declared by the routers themselves (:meth:`minimoe.routers.Router.study_variants`)."""
    variants = {}
    for name in router_registry.available():
        for variant, options in router_registry.router_class(name).study_variants().items():
            if variant in variants or variant in router_registry.available():
                raise ValueError(f"study entry {variant!r} of router {name!r} is already a study entry")
            variants[variant] = (name, copy.deepcopy(options))
    return variants


def study_entries() -> list[str]:
    """Every name a study can train: the registered routers, then the :func:`study_variants`, then
    the baselines that do not learn (:func:`minimoe.routers.baselines`: hash, random, dense, dense_wide)."""
    return [*router_registry.available(), *study_variants(), *router_registry.baselines()]


def base_router(name: str) -> str:
    """The registered router behind a study entry (a router or a baseline is its own base)."""
    if name in router_registry.available() or name in router_registry.baselines():
        return name
    variants = study_variants()
    if name not in variants:
        raise ValueError(f"no study entry {name!r}; known: {sorted(study_entries())}")
    return variants[name][0]


def router_options(router: str, config: TaskConfig) -> dict:
    """The options of ``router`` (a registered router or a :func:`study_variants` name) at one expert
    per token for ``config`` (a fresh dict): the router's :meth:`~minimoe.routers.Router.study_options`
    for the task's routing groups and experts."""
    variants = study_variants()
    if router in variants:
        return copy.deepcopy(variants[router][1])
    if router not in router_registry.available() and router not in router_registry.baselines():
        raise ValueError(f"no study entry {router!r}; known: {sorted(study_entries())}")
    options = router_registry.router_class(router).study_options(group_size=config.group_size,
                                                                   n_experts=config.n_experts)
    return copy.deepcopy(options)
