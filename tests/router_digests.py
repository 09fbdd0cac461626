"""Digests of what every router computes: the guard that a refactor changed no bit.

``python tests/router_digests.py`` (from the repository root) records, for the processor it runs on,
the SHA-256 of

* every registered router's routing (slot table, combine weights, probabilities, aux loss) and of
  the gradients a loss on it sends to the router's parameters, in training and in evaluation, at
  two sizes (one group of 16 tokens, E = 4; 3 groups of 64 tokens, E = 8), as a ``MoELayer`` runs it:
  the layer's output and the gradients of every parameter (router and experts);
* a few steps of :func:`minimoe.train.train` per router (the training losses), and of every study
  entry through the study's runner on the three toy tasks (every metric but the measured times).

and writes them to ``tests/data/router_digests.json`` under the processor's signature.
``tests/test_router_digests.py`` recomputes them and asserts equality where the signature matches.
A change that only moves code keeps them; a change that rounds differently or alters a router fails
there, and is then either a bug or a change to record again (with the reason in its commit).
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

import minimoe
from minimoe.experiments.runner import cpu_signature

OUT = Path(__file__).resolve().parent / "data" / "router_digests.json"
SIZES = {"small": (1, 16, 16, 4), "large": (3, 64, 24, 8)}  # groups, tokens, d_model, experts
TRAIN_STEPS = 4
STUDY_STEPS = 6


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = torch.as_tensor(t).detach().contiguous().cpu().reshape(-1)
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:20]


def router_case(name: str, size: str, training: bool) -> dict:
    G, T, d, E = SIZES[size]
    torch.manual_seed(1234)
    options = {"slots_per_expert": 2} if name == "soft_moe" else {}
    layer = minimoe.MoELayer(d, 2 * d, E, router=name, router_options=options).double()
    layer.train(training)
    x = torch.randn(G, T, d, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(99)  # the routers' own draws
    out = layer(x, group_size=T)
    routing = layer.last_routing
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum() + routing.aux_loss
    if training:  # the protocol's extra training loss (REINFORCE), from a fixed per-token loss
        per_token = out.pow(2).sum(-1).reshape(-1)
        loss = loss + minimoe.losses.reinforce_loss(layer, per_token, baseline=0.5)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    if routing.is_soft:
        table = (routing.slot_dispatch, routing.slot_combine)
    else:
        table = (routing.position, routing.combine)
    return {"routing": digest(*table, routing.probs, routing.aux_loss), "output": digest(out),
            "grads": digest(*grads)}


def train_case(name: str) -> str:
    torch.manual_seed(7)
    options = {"slots_per_expert": 2} if name == "soft_moe" else {}
    model = minimoe.models.MoERegressor(6, 3, d_model=16, d_hidden=16, n_experts=4, router=name,
                                        router_options=options, group_size=16)
    data = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(TRAIN_STEPS, 32, 6, generator=data), torch.randn(TRAIN_STEPS, 32, 3, generator=data)
    history = minimoe.train.train(model, lambda step: (xs[step], ys[step]),
                                  lambda pred, y: (pred - y).pow(2).mean(), steps=TRAIN_STEPS, progress=False, seed=5)
    return digest(torch.tensor([row["loss"] for row in history["train"]], dtype=torch.float64),
                  *[p for p in model.parameters()])


def study_case(out: Path) -> dict:
    from minimoe.experiments import read_results, run, study_entries

    run("all", ",".join(study_entries()), scale="toy", seeds=1, out=out, steps=STUDY_STEPS, progress=False,
        threads=1)
    rows = read_results(out)
    return {f"{r['task']}/{r['router']}/{r['metric']}": repr(r["value"]) for r in rows
            if r["metric"] != "ms_per_step"}


def record() -> dict:
    routers = minimoe.routers.available()
    entry = {"torch": torch.__version__, "routers": {}, "train": {}}
    for name in routers:
        entry["routers"][name] = {f"{size}/{'train' if tr else 'eval'}": router_case(name, size, tr)
                                  for size in SIZES for tr in (True, False)}
        entry["train"][name] = train_case(name)
    with tempfile.TemporaryDirectory() as tmp:
        entry["study"] = study_case(Path(tmp) / "study")
    return entry


def signature_key() -> str:
    sig = cpu_signature()
    return f"{sig['cpu_capability']}-{sig['cpu_flags_sha1']}"


if __name__ == "__main__":
    torch.set_num_threads(1)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data[signature_key()] = record()
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"recorded {signature_key()} in {OUT}", file=sys.stderr)
