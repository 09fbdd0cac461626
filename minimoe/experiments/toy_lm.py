"""The toy-LM harness of the notebooks: the character-level :class:`~minimoe.models.TinyLM` on the
``pydoc_data`` corpus, trained on :func:`minimoe.train.train` over a (router, options, seed) grid
and compared with paired intervals (:mod:`minimoe.experiments.stats`, the method of chapter 9).

Notebooks 02, 04, 09, 11 and 14 train this model; what they share lives here::

    corpus = load_char_corpus()
    VAL = validation_batches(corpus, CONFIG["block_size"])
    grid = train_grid(corpus, CONFIG, {"top-2": ("softmax_topk", {"k": 2})}, batches=VAL)
    print(grid.table("top-2"))                      # means, and each row minus the reference [95%]

``CONFIG`` holds the model sizes (``d_model``, ``n_layers``, ``n_heads``, ``n_experts``,
``d_hidden``, ``block_size``) and the run (``batch_size``, ``steps``, ``lr``, ``seeds``). A seed fixes
the initial weights and the order of the training batches, the same for every router, so two routers
are compared through their per-seed differences: :meth:`Grid.versus` and :meth:`Grid.paired`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..metrics import routing_entropy
from ..models import TinyLM
from ..ops import expert_loads, max_violation
from ..train import train
from . import stats

__all__ = ["make_model", "lm_loss", "validation_batches", "evaluate", "unigram_loss", "load_cv", "train_run",
           "train_grid", "seconds_per_step", "cost_estimate", "format_interval", "Run", "Grid"]

MODEL_KEYS = ("d_model", "n_layers", "n_heads", "block_size", "n_experts", "d_hidden")


def make_model(corpus, config: dict, router: str, options: dict | None = None, *, seed: int = 0,
               **model_options) -> TinyLM:
    """The notebooks' TinyLM: sizes from ``config`` (``model_options`` override them or add
    ``n_shared_experts``, ``routing_groups``, ...), weights drawn after ``torch.manual_seed(seed)``."""
    missing = [key for key in MODEL_KEYS if key not in config and key not in model_options]
    if missing:
        raise ValueError(f"config lacks the model sizes {missing}; it needs {list(MODEL_KEYS)}")
    sizes = {key: config[key] for key in MODEL_KEYS if key in config}
    sizes.update(model_options)
    torch.manual_seed(seed)
    return TinyLM(corpus.vocab_size, router=router, router_options=dict(options or {}), **sizes)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-character cross-entropy (nats) of logits ``(B, T, V)`` against targets ``(B, T)``:
    the mean, or with ``reduction="none"`` one loss per token, shape ``(B, T)``."""
    if reduction == "none":
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def validation_batches(corpus, block_size: int, n_batches: int = 4, batch_size: int = 32, seed: int = 1234):
    """``n_batches`` fixed validation batches ``(inputs, targets)`` of the corpus's validation split."""
    gen = torch.Generator().manual_seed(seed)
    return [corpus.batch("val", batch_size, block_size, gen) for _ in range(n_batches)]


def load_cv(shares) -> float:
    """Load CV: standard deviation over mean of the experts' shares ``(layers, E)`` (or ``(E,)``),
    averaged over layers; 0 is perfect balance."""
    shares = np.atleast_2d(np.asarray(shares, dtype=float))
    return float((shares.std(-1) / shares.mean(-1)).mean())


def evaluate(model, batches, *, one_sequence_at_a_time: bool = False) -> dict:
    """The validation loss and the routing of every MoE layer on ``batches`` (no gradient; the
    model's mode is left as it is, so a model in training mode is evaluated with its training routing).

    Returns ``val_loss`` (the mean over all tokens), ``token_losses`` ``(N, T)``; ``k`` ``(layers, N, T)``,
    each layer's experts per token (the routing mask's row sums), with ``mean_k``, ``sd_k`` and ``drop``
    (the share of (layer, token) pairs with k = 0) pooled over layers and ``drop_per_layer``; ``shares``
    ``(layers, E)``, each expert's share of the routed pairs, with ``cv`` (:func:`load_cv`) and
    ``load_entropy`` (the shares' entropy over log E, 1 is uniform), averaged over layers;
    ``max_violation``, max load / mean load - 1 of each batch and layer, averaged; ``router_entropy``,
    the mean entropy (nats) of the router's distribution, when the routing has one; and ``stats``,
    each scalar of ``Routing.stats`` averaged over batches, one value per layer.
    ``one_sequence_at_a_time`` runs each sequence as a batch of one."""
    device = next(model.parameters()).device
    layers = model.moe_layers()
    losses, ks, counts, violations, entropies, layer_stats = [], [], 0, [], [], {}
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            pieces = [x[i:i + 1] for i in range(x.shape[0])] if one_sequence_at_a_time else [x]
            logits, masks = [], []
            for piece in pieces:
                logits.append(model(piece))
                masks.append(torch.stack([m.last_routing.mask for m in layers]).cpu())  # (layers, B, T, E)
                for i, m in enumerate(layers):
                    routing = m.last_routing
                    violations.append(float(max_violation(expert_loads(routing.mask.cpu()))))
                    if routing.probs is not None:
                        entropies.append(float(routing_entropy(routing.probs)))
                    for key, value in routing.stats.items():
                        value = torch.as_tensor(value)
                        if value.numel() == 1:
                            layer_stats.setdefault(key, [[] for _ in layers])[i].append(float(value))
            masks = torch.cat(masks, dim=1)
            losses.append(lm_loss(torch.cat(logits), y, reduction="none").cpu())
            ks.append(masks.sum(-1))
            counts = counts + masks.sum((1, 2)).double()
    token_losses, k = torch.cat(losses), torch.cat(ks, dim=1)
    shares = counts / counts.sum(-1, keepdim=True)
    plogp = torch.where(shares > 0, shares * shares.clamp_min(1e-300).log(), 0.0)
    n_experts = shares.shape[-1]
    return {"val_loss": float(token_losses.double().mean()), "token_losses": token_losses.numpy(),
            "k": k.numpy(), "mean_k": float(k.float().mean()), "sd_k": float(k.float().std()),
            "drop": float((k == 0).float().mean()), "drop_per_layer": (k == 0).float().flatten(1).mean(1).tolist(),
            "shares": shares.tolist(), "cv": load_cv(shares.numpy()),
            "load_entropy": float((-plogp.sum(-1) / math.log(n_experts)).mean()) if n_experts > 1 else 1.0,
            "max_violation": float(np.mean(violations)),
            "router_entropy": float(np.mean(entropies)) if entropies else float("nan"),
            "stats": {key: [float(np.mean(v)) for v in per_layer] for key, per_layer in layer_stats.items()}}


def unigram_loss(corpus, batches) -> float:
    """The baseline every model must beat: each character predicted by its training-set frequency
    (add-one smoothed), in nats per character on ``batches``."""
    counts = torch.bincount(corpus.splits["train"], minlength=corpus.vocab_size).double() + 1
    log_freq = (counts / counts.sum()).log()
    return float(np.mean([-log_freq[y].mean().item() for _, y in batches]))


@dataclass
class Run:
    """One trained model: ``model`` (in eval mode), the ``history`` of :func:`minimoe.train.train` and
    ``metrics`` (the final evaluation and what :func:`train_run` adds). ``run[key]`` reads a metric."""

    model: torch.nn.Module
    history: dict
    metrics: dict = field(default_factory=dict)

    def __getitem__(self, key):
        return self.metrics[key]


def _tail_metrics(history: dict, n_layers: int, fraction: float = 0.25) -> dict:
    """Routing in training, averaged over the last ``fraction`` of the steps: load CV of each batch
    (``train_cv``) and experts per token (``train_k``), over layers."""
    rows = history["train"][-max(1, int(len(history["train"]) * fraction)):]
    out = {}
    if all(f"moe{i}/load" in row for row in rows for i in range(n_layers)):
        out["train_cv"] = float(np.mean([load_cv([row[f"moe{i}/load"] for i in range(n_layers)]) for row in rows]))
    key = "mean_experts_per_token"
    if all(f"moe{i}/{key}" in row for row in rows for i in range(n_layers)):
        out["train_k"] = float(np.mean([row[f"moe{i}/{key}"] for row in rows for i in range(n_layers)]))
    return out


def train_run(corpus, config: dict, router: str, options: dict | None = None, seed: int = 0, *, batches=None,
              eval_every: int = 0, device=None, progress: bool = False, model_options: dict | None = None,
              **train_options) -> Run:
    """Train one model on :func:`minimoe.train.train`: :func:`make_model` with ``seed``, training
    batches of ``config["batch_size"]`` windows drawn in order from a generator seeded with ``seed``
    (the same batches for every router), ``config["steps"]`` AdamW steps at ``config["lr"]``,
    :func:`evaluate` on ``batches`` every ``eval_every`` steps and at the end (``batches=None``: no
    evaluation). ``train_options`` go to
    ``train`` as they are. The run's metrics are the final evaluation, ``ppl`` (its exponential),
    ``seconds`` and ``ms_step`` (wall time of the training steps), ``train_cv`` and ``train_k``."""
    model = make_model(corpus, config, router, options, seed=seed, **(model_options or {}))
    gen = torch.Generator().manual_seed(seed)
    size, block = config["batch_size"], config["block_size"]
    history = train(model, lambda step: corpus.batch("train", size, block, gen), lm_loss, steps=config["steps"],
                    lr=config["lr"], eval_fn=None if batches is None else (lambda m: evaluate(m, batches)),
                    eval_every=eval_every if batches is not None else 0, device=device, seed=seed, progress=progress,
                    desc=f"{router} seed {seed}", **train_options)
    model.eval()
    metrics = {key: value for key, value in history["eval"][-1].items() if key != "step"} if history["eval"] else {}
    if "val_loss" in metrics:
        metrics["ppl"] = math.exp(metrics["val_loss"])
    metrics.update(seconds=history["seconds"],
                   ms_step=1000 * history["train_seconds"] / max(1, len(history["train"])))
    metrics.update(_tail_metrics(history, len(model.moe_layers())))
    return Run(model, history, metrics)


def train_grid(corpus, config: dict, routers: dict, *, batches, seeds=None, after=None, **run_options) -> "Grid":
    """Train every router of ``routers`` (``{label: (router, options)}`` or ``(router, options,
    model_options)``) on every seed of ``seeds`` (default ``config["seeds"]``) with :func:`train_run`.
    ``after(run, label, seed)``, when given, returns a dict of metrics added to the run's."""
    seeds = tuple(config["seeds"] if seeds is None else seeds)
    runs = {}
    for label, spec in routers.items():
        router, options, model_options = (*spec, None) if len(spec) == 2 else spec
        for seed in seeds:
            run = train_run(corpus, config, router, options, seed, batches=batches, model_options=model_options,
                            **run_options)
            if after is not None:
                run.metrics.update(after(run, label, seed) or {})
            runs[(label, seed)] = run
    return Grid(runs)


def seconds_per_step(corpus, config: dict, router: str, options: dict | None = None, *, steps: int = 20,
                     device=None) -> float:
    """Wall time of one training step of a fresh model (the mean of ``steps`` steps), to say what a
    grid will cost before it runs."""
    run = train_run(corpus, {**config, "steps": steps}, router, options, 0, device=device)
    return run.history["train_seconds"] / steps


def cost_estimate(corpus, config: dict, router: str, options: dict | None = None, *, runs: int, steps: int = 20,
                  device=None) -> str:
    """What a grid of ``runs`` runs of ``config["steps"]`` steps will cost, from :func:`seconds_per_step`,
    as a line to print before it runs."""
    per_step = seconds_per_step(corpus, config, router, options, steps=steps, device=device)
    return (f"{per_step * 1000:.1f} ms per step -> about {per_step * config['steps'] * runs:.0f} s for {runs} runs "
            f"of {config['steps']} steps")


def format_interval(diff: stats.Paired) -> str:
    """One paired difference as ``"+0.012 [-0.030, +0.054]"``: its mean and 95% interval."""
    return f"{diff.mean:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]"


class Grid:
    """Results keyed by ``(label, seed)``: each a :class:`Run` or a dict of metrics (an evaluation).

    ``values(label, key)`` gives ``{seed: value}``; ``versus(reference)`` compares every label with
    the reference through paired differences over the common seeds, Holm-corrected over the family
    (:func:`minimoe.experiments.stats.versus`); ``paired(a, b)`` is one comparison; ``table(reference)``
    prints the means and each label minus the reference with its 95% interval."""

    def __init__(self, runs: dict):
        self.runs = dict(runs)

    def __getitem__(self, key):
        return self.runs[key]

    def __setitem__(self, key, value):
        self.runs[key] = value

    def __contains__(self, key):
        return key in self.runs

    def __len__(self):
        return len(self.runs)

    def items(self):
        return self.runs.items()

    @property
    def labels(self) -> list:
        return list(dict.fromkeys(label for label, _ in self.runs))

    @property
    def seeds(self) -> list:
        return list(dict.fromkeys(seed for _, seed in self.runs))

    def values(self, label, key: str = "val_loss") -> dict:
        """``{seed: value}`` of one metric of one label."""
        found = {seed: entry[key] for (lab, seed), entry in self.runs.items() if lab == label}
        if not found:
            raise KeyError(f"no runs of {label!r}; the labels are {self.labels}")
        return found

    def array(self, label, key: str = "val_loss") -> np.ndarray:
        """The values of one metric of one label, in seed order (for a plot)."""
        return np.array(list(self.values(label, key).values()), dtype=float)

    def mean(self, label, key: str = "val_loss") -> float:
        return float(self.array(label, key).mean())

    def summary(self, key: str = "val_loss", width: int = 24) -> str:
        """One line per label: the mean of ``key``, its value on every seed, and the seconds per run."""
        lines = []
        for label in self.labels:
            per_seed = ", ".join(f"{v:.3f}" for v in self.values(label, key).values())
            seconds = f", {self.mean(label, 'seconds'):.1f} s/run" if all(
                "seconds" in (e.metrics if isinstance(e, Run) else e) for (lab, _), e in self.runs.items()
                if lab == label) else ""
            lines.append(f"{str(label):{width}s} {key} {self.mean(label, key):.3f} (seeds: {per_seed}){seconds}")
        return "\n".join(lines)

    def versus(self, reference, key: str = "val_loss", labels=None, *, alpha: float = 0.05) -> dict:
        """Every label of ``labels`` (default all) minus ``reference``: ``{label: {"diff": Paired,
        "p_holm": ..., "separated": ...}}``, Holm over those labels."""
        labels = [lab for lab in (self.labels if labels is None else labels) if lab != reference]
        return stats.versus({lab: self.values(lab, key) for lab in [reference, *labels]}, reference, alpha=alpha)

    def paired(self, a, b, key: str = "val_loss", other: "Grid | None" = None) -> stats.Paired:
        """``a - b`` of one metric over their common seeds (``b`` read from ``other`` when given)."""
        x, y = self.values(a, key), (other or self).values(b, key)
        seeds = sorted(set(x) & set(y))
        return stats.paired([x[s] for s in seeds], [y[s] for s in seeds])

    def table(self, reference, key: str = "val_loss", columns: dict | None = None, labels=None,
              lower_is_better: bool = True, width: int = 26) -> str:
        """A table: each label's mean of ``key`` and of ``columns`` (``{heading: metric}`` or
        ``{heading: (metric, format)}``, format ".3f" by default), and the label minus ``reference`` as
        ``stats.describe`` writes it (interval, Holm p-value over the labels, verdict)."""
        labels = self.labels if labels is None else list(labels)
        columns = {h: (c, ".3f") if isinstance(c, str) else tuple(c) for h, c in (columns or {}).items()}
        versus = self.versus(reference, key, labels)
        lines = [f"{'router':{width}s} {key:>9s} " + " ".join(f"{h:>9s}" for h in columns)
                 + f"  minus {reference} [95% interval], p (Holm): verdict"]
        for label in labels:
            cells = " ".join(f"{self.mean(label, metric):9{fmt}}" for metric, fmt in columns.values())
            text = "(reference)" if label == reference else stats.describe(versus[label], lower_is_better=lower_is_better)
            lines.append(f"{str(label):{width}s} {self.mean(label, key):9.3f} {cells}  {text}")
        return "\n".join(lines)
