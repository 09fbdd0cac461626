"""The three tasks of the head-to-head, each behind the same small interface (book: chapter 9).

A task builds its model for a router, draws the training batch of a step (a pure function of the
seed and the step, so a resumed run sees the same batches), gives per-token losses (what Kool et
al.'s REINFORCE term needs) and evaluates a trained model.

* ``lm``: the character model :class:`~minimoe.models.TinyLM` on the pydoc corpus; routing groups
  are the tokens at one position of the batch (causal for every router); quality = validation loss
  (nats per character) and perplexity.
* ``clustered``: :class:`~minimoe.models.MoERegressor` on :func:`~minimoe.data.make_clustered_task`,
  whose true expert per input is known; quality = validation MSE and R^2, plus ``specialisation``.
* ``vision``: :class:`~minimoe.models.TinyViT` on :func:`~minimoe.data.make_shapes`, one image per
  routing group; quality = validation accuracy and loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..data import load_char_corpus, make_clustered_task, make_shapes
from ..models import MoERegressor, TinyLM, TinyViT
from ..ops import linear_assignment
from .configs import TaskConfig

# Fixed data: the dataset is the same for every seed; the seed varies the model's initialisation,
# the batch order and the routers' noise.
DATA_SEED = 0
EVAL_SEED = 1


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one training step's batch: a function of (seed, step) only."""
    return torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)


def token_expert_weights(routing) -> torch.Tensor:
    """``(..., T, E)``: the weight of each expert in each token's output (Soft MoE: summed over slots)."""
    return routing.slot_combine.sum(-1) if routing.is_soft else routing.combine


def specialisation(true_expert: torch.Tensor, chosen_expert: torch.Tensor, n_experts: int) -> float:
    """Agreement between the experts a router chose and the true ones, under the best one-to-one
    relabelling of experts (a router's expert 3 may well be the task's cluster 5): the largest
    fraction of inputs on a matching of the contingency table (an exact assignment problem, solved by
    :func:`~minimoe.ops.linear_assignment`). A dropped input (``chosen_expert = -1``) never agrees.
    1/E is chance for a uniform router, 1 is perfect."""
    n_true = int(true_expert.max()) + 1
    kept = chosen_expert >= 0
    table = torch.zeros(n_true, n_experts, dtype=torch.float64)
    table.index_put_((true_expert[kept], chosen_expert[kept]), torch.ones(int(kept.sum()), dtype=torch.float64),
                     accumulate=True)
    # one-to-one: each row of the shorter side gets its own column (capacity 1), as scipy's
    # rectangular linear_sum_assignment; the counts are integers, so an exact optimum is the same sum
    side = table if n_true <= n_experts else table.T
    partner = linear_assignment(side, 1)
    return float(side.gather(1, partner[:, None]).sum() / max(len(true_expert), 1))


class Task:
    """The interface the runner uses; see the module docstring."""

    name: str
    quality_metric: str  # the headline metric of the task
    higher_is_better: bool

    def __init__(self, config: TaskConfig):
        self.config = config

    def build_model(self, router: str, options: dict) -> torch.nn.Module:
        raise NotImplementedError

    def train_batch(self, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss_per_token(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The losses whose mean is the training objective, in the shape
        :func:`minimoe.losses.reinforce_loss` expects for this model."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict:
        raise NotImplementedError


class LanguageModelling(Task):
    name, quality_metric, higher_is_better = "lm", "val_loss", False

    def __init__(self, config: TaskConfig):
        super().__init__(config)
        if config.group_size != config.batch_size:
            raise ValueError(f"the lm task routes the batch's tokens at one position together: group_size "
                             f"({config.group_size}) must equal batch_size ({config.batch_size})")
        self.corpus = load_char_corpus(config.data.get("max_chars"), source=config.data.get("source", "pydoc"))
        block = config.model["block_size"]
        if config.eval_batches is None:
            self.val = self.whole_split_batches()
        else:
            self.val = self.random_batches(config.eval_batches, torch.Generator().manual_seed(EVAL_SEED))

    def random_batches(self, n: int, generator: torch.Generator) -> list:
        """``n`` validation batches of random windows (``batch_size`` windows each) drawn from ``generator``."""
        c = self.config
        return [self.corpus.batch("val", c.batch_size, c.model["block_size"], generator) for _ in range(n)]

    def whole_split_batches(self) -> list:
        """The whole validation split as consecutive windows of ``block_size + 1`` characters that
        overlap by one, so every character after the first is predicted exactly once, in batches of
        ``batch_size`` windows (characters after the last whole window are left out, fewer than
        ``block_size``). The last batch is filled up to ``batch_size`` with windows from the start of
        the order whose targets are ``-100`` (``cross_entropy``'s ignored index): they complete its
        routing groups, so that every group has the training's size, and count for nothing.

        The windows are put in a fixed random order (``EVAL_SEED``) before they are cut into batches:
        the LM routes the tokens at one position of a batch's sequences together, and 32 consecutive
        windows would make every routing group a run of neighbouring text, unlike the random windows
        of training, where a group mixes the whole corpus. A router that compares the tokens of a
        group (a capacity, expert choice, Sinkhorn) would then be measured on groups it never trained on."""
        c = self.config
        data, block = self.corpus.splits["val"], c.model["block_size"]
        n_windows = (len(data) - 1) // block
        if n_windows < 1:
            raise ValueError(f"the validation split ({len(data)} characters) is shorter than one window of "
                             f"block_size + 1 = {block + 1}")
        order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(EVAL_SEED))
        fill = -n_windows % c.batch_size
        windows = data[torch.cat([order, order[torch.arange(fill) % n_windows]])[:, None] * block
                       + torch.arange(block + 1)]
        targets = windows[:, 1:].clone()
        targets[n_windows:] = -100  # the fillers: routed with the others, scored for nothing
        return list(zip(windows[:, :-1].split(c.batch_size), targets.split(c.batch_size)))

    def build_model(self, router, options):
        c = self.config
        return TinyLM(self.corpus.vocab_size, d_model=c.d_model, n_layers=c.model["n_layers"],
                      n_heads=c.model["n_heads"], block_size=c.model["block_size"], n_experts=c.n_experts,
                      d_hidden=c.d_hidden, router=router, router_options=options, routing_groups="position")

    def train_batch(self, seed, step):
        return self.corpus.batch("train", self.config.batch_size, self.config.model["block_size"],
                                 step_generator(seed, step))

    def loss_per_token(self, output, targets):
        per_token = F.cross_entropy(output.flatten(0, 1), targets.flatten(), reduction="none")
        # the MoE layers see the tokens position-major, (L, B): the REINFORCE losses must follow them
        return per_token.view(targets.shape).t()

    def evaluate(self, model, device, batches=None):
        """Mean loss per predicted character over ``batches`` (default: the task's validation batches)."""
        total, count = 0.0, 0
        for x, y in (self.val if batches is None else batches):
            logits = model(x.to(device))
            total += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
            count += int((y != -100).sum())  # (fillers of the whole split's last batch count for nothing)
        val_loss = total / count
        return {"val_loss": val_loss, "val_perplexity": math.exp(val_loss)}


class Clustered(Task):
    name, quality_metric, higher_is_better = "clustered", "val_r2", True

    def __init__(self, config: TaskConfig):
        super().__init__(config)
        d = config.data
        data = make_clustered_task(d["n_samples"], d["d_in"], d["d_out"], d["n_clusters"], seed=DATA_SEED)
        n_val = (d["n_samples"] // 8) // config.group_size * config.group_size
        if n_val < config.group_size or config.batch_size % config.group_size:
            raise ValueError(f"clustered task: batch_size ({config.batch_size}) and n_samples/8 "
                             f"({d['n_samples'] // 8}) must be multiples of group_size ({config.group_size})")
        self.train_x, self.train_y = data.x[n_val:], data.y[n_val:]
        self.val_x, self.val_y, self.val_cluster = data.x[:n_val], data.y[:n_val], data.cluster[:n_val]

    def build_model(self, router, options):
        c, d = self.config, self.config.data
        return MoERegressor(d["d_in"], d["d_out"], d_model=c.d_model, d_hidden=c.d_hidden, n_experts=c.n_experts,
                            router=router, router_options=options, group_size=c.group_size)

    def train_batch(self, seed, step):
        index = torch.randint(0, len(self.train_x), (self.config.batch_size,), generator=step_generator(seed, step))
        return self.train_x[index], self.train_y[index]

    def loss_per_token(self, output, targets):
        return (output - targets).pow(2).mean(-1)  # one input is one token

    def evaluate(self, model, device):
        mse, chosen = 0.0, []
        n = len(self.val_x)
        chunk = max(self.config.group_size, self.config.batch_size)
        for start in range(0, n, chunk):
            x, y = self.val_x[start:start + chunk].to(device), self.val_y[start:start + chunk].to(device)
            mse += F.mse_loss(model(x), y, reduction="sum").item()
            weights = token_expert_weights(model.moe.last_routing).reshape(-1, self.config.n_experts)
            best = weights.argmax(-1)
            chosen.append(torch.where(weights.amax(-1) > 0, best, -1).cpu())
        mse /= n * self.val_y.shape[1]
        return {"val_mse": mse, "val_r2": 1.0 - mse / self.val_y.var(unbiased=False).item(),
                "specialisation": specialisation(self.val_cluster, torch.cat(chosen), self.config.n_experts)}


class Vision(Task):
    name, quality_metric, higher_is_better = "vision", "val_accuracy", True

    def __init__(self, config: TaskConfig):
        super().__init__(config)
        d, m = config.data, config.model
        patches = (d["image_size"] // m["patch_size"]) ** 2
        if config.group_size != patches:
            raise ValueError(f"the vision task routes one image per group: group_size ({config.group_size}) must "
                             f"equal the number of patches ({patches})")
        self.n_classes = d.get("n_classes", 8)
        if self.n_classes not in (8, 16):
            raise ValueError(f"vision task: n_classes must be 8 (shapes) or 16 (shapes x sizes), got {self.n_classes}")
        sizes = self.n_classes == 16
        self.train_x, self.train_y = make_shapes(d["n_train"], d["image_size"], seed=DATA_SEED, size_classes=sizes)
        self.val_x, self.val_y = make_shapes(d["n_val"], d["image_size"], seed=DATA_SEED + 1, size_classes=sizes)

    def build_model(self, router, options):
        c, m = self.config, self.config.model
        return TinyViT(self.n_classes, image_size=c.data["image_size"], patch_size=m["patch_size"], d_model=c.d_model,
                       n_layers=m["n_layers"], n_heads=m["n_heads"], n_experts=c.n_experts, d_hidden=c.d_hidden,
                       router=router, router_options=options, routing_groups="sequence")

    def train_batch(self, seed, step):
        index = torch.randint(0, len(self.train_x), (self.config.batch_size,), generator=step_generator(seed, step))
        return self.train_x[index], self.train_y[index]

    def loss_per_token(self, output, targets):
        return F.cross_entropy(output, targets, reduction="none")  # per image, shared by its patches

    def evaluate(self, model, device):
        correct, loss = 0, 0.0
        for start in range(0, len(self.val_x), self.config.batch_size):
            x = self.val_x[start:start + self.config.batch_size].to(device)
            y = self.val_y[start:start + self.config.batch_size].to(device)
            logits = model(x)
            correct += int((logits.argmax(-1) == y).sum())
            loss += F.cross_entropy(logits, y, reduction="sum").item()
        n = len(self.val_x)
        return {"val_accuracy": correct / n, "val_loss": loss / n}


TASK_CLASSES = {"lm": LanguageModelling, "clustered": Clustered, "vision": Vision}


def make_task(config: TaskConfig) -> Task:
    return TASK_CLASSES[config.task](config)
