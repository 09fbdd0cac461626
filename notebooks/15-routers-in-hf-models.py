# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Your router in a real model
#
# Companion to {doc}`../book/01-moe-layer`, section {ref}`ch1-hf`. The routers of this book are not
# tied to `minimoe`'s own tiny models: `minimoe.hf.swap_router` puts any of them into the MoE blocks
# of a Hugging Face `transformers` model. Here we build a small Mixtral and a small DeepSeek-V3 from
# their configs (nothing is downloaded), check that the swap with no router named changes nothing,
# then train three routers in each model on the book's character corpus and compare them.
#
# *Run time:* about 20 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: width 256 instead of 64, 4 layers instead of 2, 16 experts instead of
# 8, 2,000 steps of 64 sequences of 128 characters instead of 40 of 16 of 64, 3 seeds instead of 2 — about
# 17,000 times the arithmetic of the CPU scale.

# %%
# Install minimoe when it is missing (e.g. on Colab), with its Hugging Face extra.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book,hf] @ git+https://github.com/minimoe-book/minimoe"])

# %%
import os
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

with warnings.catch_warnings():  # transformers imports tqdm.auto, which warns when ipywidgets is absent
    warnings.simplefilter("ignore")
    import transformers

from minimoe import hf
from minimoe.data import load_char_corpus
from minimoe.experiments import stats

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
if SCALE == "cpu":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    CONFIG = dict(hidden=64, layers=2, experts=8, steps=40, batch=16, block=64, seeds=(0, 1), lr=3e-3)
else:
    CONFIG = dict(hidden=256, layers=4, experts=16, steps=2000, batch=64, block=128, seeds=(0, 1, 2), lr=1e-3)
DEVICE = "cuda" if SCALE == "gpu" and torch.cuda.is_available() else "cpu"
corpus = load_char_corpus()
START = time.perf_counter()
print(f"SCALE={SCALE}, device={DEVICE}, transformers {transformers.__version__}, config={CONFIG}")

# %% [markdown]
# ## Two models from their configs
#
# A Mixtral block routes with a softmax top-2, renormalised; a DeepSeek-V3 block scores experts with
# sigmoids, adds a correction bias for the choice only, limits each token to the best groups of
# experts and scales the weights (chapter 10 derives why the bias balances). Both keep their experts
# in one fused tensor and take `(weights, expert indices)` from their gate.

# %%
def tiny_model(family, seed):
    torch.manual_seed(seed)
    common = dict(vocab_size=corpus.vocab_size, hidden_size=CONFIG["hidden"], intermediate_size=2 * CONFIG["hidden"],
                  num_hidden_layers=CONFIG["layers"], num_attention_heads=4, max_position_embeddings=CONFIG["block"],
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=CONFIG["experts"],
                                            num_experts_per_tok=2, router_jitter_noise=0.0)
        return transformers.MixtralForCausalLM(config).to(DEVICE)
    config = transformers.DeepseekV3Config(**common, num_key_value_heads=4, n_routed_experts=CONFIG["experts"],
                                           num_experts_per_tok=2, moe_intermediate_size=CONFIG["hidden"],
                                           n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    model = transformers.DeepseekV3ForCausalLM(config)
    for module in model.modules():   # HF starts the router at zero weights: give it something to route
        if type(module).__name__ == "DeepseekV3TopkRouter":
            torch.nn.init.normal_(module.weight, std=0.02)
    return model.to(DEVICE)


ids = corpus.batch("val", 4, CONFIG["block"], torch.Generator().manual_seed(0))[0].to(DEVICE)
for family in ("mixtral", "deepseek_v3"):
    model = tiny_model(family, seed=0).eval()
    with torch.no_grad():
        before = model(ids).logits
        gates = hf.swap_router(model)               # no router named: minimoe's copy of the model's own
        after = model(ids).logits
    print(f"{family:12s} {len(gates)} MoE blocks; {type(gates[0].router).__name__} reproduces HF's router: "
          f"max |logits after - before| = {(after - before).abs().max():.1e}")
    assert torch.allclose(after, before, atol=1e-5)

# %% [markdown]
# ## Three routers in each model
#
# In each model we train the family's own router (as `router=None` installs it), Sinkhorn token
# choice (a balanced plan in every batch, chapter 2) and loss-free balancing with a moving bias
# (chapter 10). A router that compares tokens sees each position of the batch as one group, so the
# models stay causal. Each router's own losses come back through `hf.router_losses`.

# %%
ROUTERS = {"own router": None,
           "sinkhorn_token_choice": ("sinkhorn_token_choice", {"k": 2, "capacity_factor": None, "renormalize": True}),
           "loss_free": ("loss_free", {"k": 2, "bias_rate": 1e-2})}


def train_one(family, label, seed):
    model = tiny_model(family, seed).train()
    spec = ROUTERS[label]
    gates = hf.swap_router(model) if spec is None else hf.swap_router(model, spec[0], **spec[1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(CONFIG["steps"]):
        x, y = (t.to(DEVICE) for t in corpus.batch("train", CONFIG["batch"], CONFIG["block"], generator))
        per_token = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        loss = per_token.mean() + hf.router_losses(model, per_token)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return evaluate(model, gates)


@torch.no_grad()
def evaluate(model, gates):
    model.eval()
    generator = torch.Generator().manual_seed(1234)
    losses, loads = [], torch.zeros(CONFIG["experts"])
    for _ in range(4):
        x, y = (t.to(DEVICE) for t in corpus.batch("val", 32, CONFIG["block"], generator))
        losses.append(F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item())
        for gate in gates:
            loads += gate.last_routing.tokens_per_expert().sum(0).float().cpu()
    return {"val_loss": sum(losses) / len(losses), "imbalance": float(loads.max() / loads.mean())}

# %%
results = {}
for family in ("mixtral", "deepseek_v3"):
    for label in ROUTERS:
        for seed in CONFIG["seeds"]:
            results[(family, label, seed)] = train_one(family, label, seed)
        row = [results[(family, label, s)] for s in CONFIG["seeds"]]
        print(f"{family:12s} {label:22s} val loss " + ", ".join(f"{r['val_loss']:.3f}" for r in row)
              + "; load imbalance " + ", ".join(f"{r['imbalance']:.2f}" for r in row))
print(f"{time.perf_counter() - START:.0f} s so far")

# %% [markdown]
# ## What the runs show
#
# Each router against the model's own, paired over the seeds (chapter 9's method). With two seeds an
# interval has one degree of freedom ($t = 12.7$), and 40 steps are far too few to rank routers by
# their loss; a separation here says only that one router was steadily ahead after 40 steps. What
# the runs do show is the mechanism: how evenly each router spreads the routed pairs over the experts
# (imbalance = largest load over mean load, 1 is perfect). The plan balances every batch by
# construction; the loss-free bias has to learn its way there, one step of $\gamma$ at a time.

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, family in zip(axes, ("mixtral", "deepseek_v3")):
    values = {label: {s: results[(family, label, s)]["val_loss"] for s in CONFIG["seeds"]} for label in ROUTERS}
    for label, entry in stats.versus(values, "own router").items():
        print(f"{family:12s} {label:22s} minus own router: {stats.describe(entry)}")
    for i, label in enumerate(ROUTERS):
        ax.scatter([results[(family, label, s)]["imbalance"] for s in CONFIG["seeds"]], [i] * len(CONFIG["seeds"]),
                   s=30)
    ax.set_yticks(range(len(ROUTERS)), list(ROUTERS))
    ax.set_xlabel("load imbalance at evaluation (1 = balanced)")
    ax.set_ylabel("router")
    ax.set_title(f"{family}: one dot per seed")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## On a real checkpoint
#
# The same two lines work on a pretrained model on a GPU; loading the weights is the reader's step
# (nothing is downloaded here). The gate weights keep their checkpoint keys, so a swapped model can
# also load a saved state dict with `hf.load_hf_state_dict`.
#
# ```python
# model = transformers.AutoModelForCausalLM.from_pretrained("<a Mixtral, OLMoE, Qwen-MoE or DeepSeek-V3>")
# hf.swap_router(model, "sinkhorn_token_choice", k=2, capacity_factor=1.25)
# # in the training loop: loss = per_token.mean() + hf.router_losses(model, per_token)
# ```

# %%
print(f"notebook ran in {time.perf_counter() - START:.0f} s")
