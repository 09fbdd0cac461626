"""minimoe.experiments.toy_lm, the notebooks' toy-LM harness: what it computes, checked by hand."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minimoe.data import load_char_corpus
from minimoe.experiments import stats, toy_lm
from minimoe.train import train

CONFIG = dict(d_model=16, n_layers=2, n_heads=2, n_experts=4, d_hidden=16, block_size=16, batch_size=4,
              steps=3, seeds=(0, 1, 2), lr=3e-3)


@pytest.fixture(scope="module")
def corpus():
    return load_char_corpus(max_chars=20_000)


@pytest.fixture(scope="module")
def val(corpus):
    return toy_lm.validation_batches(corpus, CONFIG["block_size"], n_batches=2, batch_size=6)


def test_make_model_takes_the_config_and_the_seed(corpus):
    a = toy_lm.make_model(corpus, CONFIG, "softmax_topk", {"k": 2}, seed=3)
    b = toy_lm.make_model(corpus, CONFIG, "softmax_topk", {"k": 2}, seed=3)
    c = toy_lm.make_model(corpus, CONFIG, "softmax_topk", {"k": 2}, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert len(a.moe_layers()) == CONFIG["n_layers"] and a.moe_layers()[0].router.k == 2
    wide = toy_lm.make_model(corpus, CONFIG, "softmax_topk", {"k": 2}, n_experts=6, n_shared_experts=1)
    assert wide.moe_layers()[0].n_experts == 6
    with pytest.raises(ValueError, match="d_hidden"):
        toy_lm.make_model(corpus, {k: v for k, v in CONFIG.items() if k != "d_hidden"}, "softmax_topk")


def test_lm_loss_is_the_cross_entropy():
    logits, targets = torch.randn(2, 5, 7), torch.randint(7, (2, 5))
    per_token = -logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(toy_lm.lm_loss(logits, targets, reduction="none"), per_token)
    torch.testing.assert_close(toy_lm.lm_loss(logits, targets), per_token.mean())


def test_evaluate_loss_and_routing_statistics_by_hand(corpus, val):
    model = toy_lm.make_model(corpus, CONFIG, "expert_choice", {"capacity_factor": 1.0}, seed=0).eval()
    result = toy_lm.evaluate(model, val)
    losses, ks, counts = [], [], 0
    with torch.no_grad():
        for x, y in val:
            logits = model(x)
            losses.append(-logits.log_softmax(-1).gather(-1, y[..., None])[..., 0])
            masks = torch.stack([m.last_routing.mask for m in model.moe_layers()])  # (layers, B, T, E)
            ks.append(masks.sum(-1))
            counts = counts + masks.sum((1, 2)).double()
    losses, k = torch.cat(losses), torch.cat(ks, 1)
    assert result["val_loss"] == pytest.approx(float(losses.double().mean()), abs=1e-6)
    np.testing.assert_allclose(result["token_losses"], losses.numpy(), atol=1e-6)
    assert np.array_equal(result["k"], k.numpy())
    assert result["drop"] == pytest.approx(float((k == 0).float().mean()))
    assert result["drop"] > 0, "expert choice at capacity factor 1 leaves some tokens to no expert"
    assert result["drop_per_layer"] == pytest.approx(result["stats"]["drop_rate"], abs=1e-6)
    assert result["mean_k"] == pytest.approx(1.0)  # E experts x T/E slots per sequence of T tokens
    shares = (counts / counts.sum(-1, keepdim=True)).numpy()
    np.testing.assert_allclose(result["shares"], shares)
    assert result["cv"] == pytest.approx(float((shares.std(-1) / shares.mean(-1)).mean()), abs=1e-12)
    assert result["cv"] == pytest.approx(0.0, abs=1e-12) and result["max_violation"] == pytest.approx(0.0)


def test_evaluate_sees_imbalance_and_one_sequence_at_a_time(corpus, val):
    model = toy_lm.make_model(corpus, CONFIG, "softmax_topk", {"k": 2, "capacity_factor": None}, seed=1).eval()
    with torch.no_grad():
        model.moe_layers()[0].router.gate.weight[0] += 5.0  # expert 0 becomes everyone's favourite
    result = toy_lm.evaluate(model, val)
    assert np.all(result["k"] == 2) and result["drop"] == 0 and result["sd_k"] == 0
    assert result["cv"] > 0.1 and result["max_violation"] > 0.1
    assert 0 < result["load_entropy"] < 1
    one = toy_lm.evaluate(model, val, one_sequence_at_a_time=True)  # token choice ignores the batch
    assert one["val_loss"] == pytest.approx(result["val_loss"], abs=1e-5)
    assert np.array_equal(one["k"], result["k"])


def test_unigram_loss_by_hand(corpus, val):
    counts = np.bincount(corpus.splits["train"].numpy(), minlength=corpus.vocab_size) + 1.0
    log_freq = np.log(counts / counts.sum())
    by_hand = np.mean([-log_freq[y.numpy()].mean() for _, y in val])
    assert toy_lm.unigram_loss(corpus, val) == pytest.approx(by_hand, rel=1e-12)


def test_the_grid_trains_what_train_trains(corpus, val):
    """Each run of a grid is minimoe.train.train on make_model with the seed's batches, to the bit."""
    routers = {"top-2": ("softmax_topk", {"k": 2, "capacity_factor": None}),
               "EC": ("expert_choice", {"capacity_factor": 2.0})}
    grid = toy_lm.train_grid(corpus, CONFIG, routers, batches=val, seeds=(0, 1))
    assert sorted(grid.runs) == [("EC", 0), ("EC", 1), ("top-2", 0), ("top-2", 1)]
    for (label, seed), run in grid.items():
        router, options = routers[label]
        model = toy_lm.make_model(corpus, CONFIG, router, options, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        history = train(model, lambda step: corpus.batch("train", CONFIG["batch_size"], CONFIG["block_size"], gen),
                        lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), steps=CONFIG["steps"],
                        lr=CONFIG["lr"], eval_every=0, seed=seed, progress=False)
        assert [r["loss"] for r in run.history["train"]] == [r["loss"] for r in history["train"]]
        model.eval()
        assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(), model.parameters()))
        assert run["val_loss"] == toy_lm.evaluate(model, val)["val_loss"]
        assert run["ppl"] == pytest.approx(math.exp(run["val_loss"]))
        assert not run.model.training
    assert grid["top-2", 0]["train_k"] == 2.0 and grid.labels == ["top-2", "EC"] and grid.seeds == [0, 1]
    summary = grid.summary().splitlines()
    assert len(summary) == 2 and f"{grid['EC', 1]['val_loss']:.3f}" in summary[1] and "s/run" in summary[1]
    np.testing.assert_array_equal(grid.array("EC"), [grid["EC", 0]["val_loss"], grid["EC", 1]["val_loss"]])


def test_grid_statistics_are_the_paired_intervals_of_stats():
    values = {"A": [1.0, 1.2, 0.9, 1.1], "B": [1.11, 1.3, 1.0, 1.21], "C": [0.5, 1.9, 0.2, 1.0]}
    grid = toy_lm.Grid({(label, seed): {"val_loss": v} for label, vs in values.items() for seed, v in enumerate(vs)})
    assert grid.values("B") == dict(enumerate(values["B"]))
    expected = stats.versus(values, "A")
    got = grid.versus("A")
    assert set(got) == {"B", "C"}
    for label in got:
        assert got[label]["diff"] == expected[label]["diff"] and got[label]["p_holm"] == expected[label]["p_holm"]
    assert grid.paired("B", "A") == stats.paired(values["B"], values["A"])
    assert got["B"]["separated"] and got["B"]["diff"].mean > 0  # B is worse on every seed, by a steady margin
    table = grid.table("A")
    assert stats.describe(got["B"]) in table and "separated (worse)" in table and "(reference)" in table
    assert "half" not in table and "±" not in table
    with pytest.raises(KeyError, match="labels"):
        grid.values("D")
