"""Toy data, the tiny models and the training loop."""
import torch
import torch.nn.functional as F

from minimoe.data import SHAPE_CLASSES, load_char_corpus, make_clustered_task, make_shapes
from minimoe.models import TinyLM, TinyViT
from minimoe.train import adamw_foreach, series, train


def test_char_corpus_batches_are_shifted_windows():
    corpus = load_char_corpus(max_chars=20_000)
    assert corpus.decode(corpus.encode("def f(x):")) == "def f(x):"
    x, y = corpus.batch("train", 4, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # the target is the next character


def test_shapes_are_deterministic_and_cover_every_class():
    a, la = make_shapes(400, seed=3)
    b, lb = make_shapes(400, seed=3)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert a.shape == (400, 1, 16, 16) and 0 <= a.min() and a.max() <= 1
    assert set(la.tolist()) == set(range(len(SHAPE_CLASSES)))
    assert not torch.equal(a, make_shapes(400, seed=4)[0])


def test_clustered_task_targets_follow_each_clusters_map():
    task = make_clustered_task(2000, seed=0)
    assert torch.equal(task.y, make_clustered_task(2000, seed=0).y)
    # Inputs of one cluster sit closer to their own centre than to others (the router can find them).
    centres = torch.stack([task.x[task.cluster == c].mean(0) for c in range(8)])
    nearest = torch.cdist(task.x, centres).argmin(-1)
    assert (nearest == task.cluster).float().mean() > 0.95


def _future_leak(model, vocab):
    torch.manual_seed(0)
    idx = torch.randint(0, vocab, (8, 32))
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % vocab
    with torch.no_grad():
        return (model(idx) - model(idx2))[:, :-1].abs().max().item()


def test_language_model_is_causal_with_token_choice_and_leaks_with_expert_choice():
    tc = TinyLM(20, d_model=32, n_heads=2, block_size=32, n_experts=4, d_hidden=32, router_options={"k": 1}).eval()
    ec = TinyLM(20, d_model=32, n_heads=2, block_size=32, n_experts=4, d_hidden=32, router="expert_choice").eval()
    assert _future_leak(tc, 20) < 1e-6
    assert _future_leak(ec, 20) > 1e-4


def test_vit_routes_each_image_on_its_own():
    torch.manual_seed(0)
    vit = TinyViT(8, d_model=32, n_heads=2, n_experts=4, d_hidden=32, router="expert_choice").eval()
    images = make_shapes(6, seed=1)[0]
    with torch.no_grad():
        together = vit(images)
        alone = torch.cat([vit(images[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_train_lowers_the_loss_and_records_routing():
    task = make_clustered_task(1024, d_in=16, d_out=8, seed=0)

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            from minimoe import MoELayer
            self.moe = MoELayer(16, 32, 8, "softmax_topk", router_options={"k": 2, "balance_loss": "switch"})
            self.head = torch.nn.Linear(16, 8)

        def moe_layers(self):
            return [self.moe]

        def aux_loss(self):
            return self.moe.aux_loss

        def forward(self, x):
            return self.head(x + self.moe(x))

    gen = torch.Generator().manual_seed(0)

    def batch(step):
        i = torch.randint(0, 1024, (128,), generator=gen)
        return task.x[i], task.y[i]

    history = train(Regressor(), batch, F.mse_loss, steps=150, lr=1e-2, progress=False,
                    eval_fn=lambda m: {"mse": F.mse_loss(m(task.x), task.y).item()}, eval_every=50)
    steps, loss = series(history["train"], "loss")
    assert steps == list(range(150)) and sum(loss[-20:]) < 0.5 * sum(loss[:20])
    assert [r["step"] for r in history["eval"]] == [50, 100, 150]
    row = history["train"][-1]
    assert {"moe0/drop_rate", "moe0/load_cv", "moe0/load"} <= row.keys() and row["aux_loss"] > 0
    assert abs(sum(row["moe0/load"]) - 1) < 1e-5


def test_foreach_adamw_gives_the_loops_bits():
    """Both training loops (``minimoe.train.train`` and the study's ``train_one``) step AdamW in
    torch's multi-tensor form on a CPU (``adamw_foreach``), which applies the per-parameter loop's
    kernels tensor by tensor. The committed reference study was trained with the loop, so its values
    stay reproducible only if the two forms agree to the bit. Oracle: the loop form (torch's CPU
    default), on a TinyLM whose gradients are clipped at every step (as both loops do)."""
    corpus = load_char_corpus(max_chars=20_000)
    assert adamw_foreach("cpu") is True and adamw_foreach(torch.device("cuda")) is None

    def final_parameters(foreach):
        torch.manual_seed(0)
        model = TinyLM(corpus.vocab_size, d_model=16, n_layers=2, n_heads=2, block_size=16, n_experts=4,
                       d_hidden=32, router="softmax_topk", router_options={"k": 2, "balance_loss": "switch"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=foreach)
        gen = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(12):
            x, y = corpus.batch("train", 4, 16, gen)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + model.aux_loss()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()], torch.stack(norms)

    loop, loop_norms = final_parameters(False)
    multi, multi_norms = final_parameters(True)
    assert (loop_norms > 0.5).all()  # the clipping scaled the gradients at every step
    assert torch.equal(loop_norms, multi_norms)
    assert len(loop) == len(multi) and all(torch.equal(a, b) for a, b in zip(loop, multi))


def test_the_mixed_corpus_holds_both_sources_in_every_split():
    """Prose and code interleaved in proportion: every tenth of the text, the validation split (the
    last tenth) included, holds code in the proportion of the whole corpus, within two chunks. Oracle:
    the text cut back into the two sources' own 2048-character chunks, in order."""
    from minimoe.data.text import _code_text, _default_text, mixed_sources_text

    text, code, prose = mixed_sources_text(), _code_text(), _default_text()
    assert len(text) == len(code) + len(prose)
    chunks = {source: {s[i:i + 2048] for i in range(0, len(s), 2048)} for source, s in (("code", code), ("prose", prose))}
    share, tenth = len(code) / len(text), len(text) // 10
    pos, code_in = 0, [0] * 10
    while pos < len(text):  # each next piece is a whole chunk of one source (the last of a source may be short)
        size = next(n for n in range(2048, 0, -1) if any(text[pos:pos + n] in c for c in chunks.values()))
        if text[pos:pos + size] in chunks["code"]:
            for k in range(10):
                lo, hi = k * tenth, len(text) if k == 9 else (k + 1) * tenth
                code_in[k] += max(0, min(pos + size, hi) - max(pos, lo))
        pos += size
    for k in range(10):
        part = len(text) - 9 * tenth if k == 9 else tenth
        assert abs(code_in[k] / part - share) < 2 * 2048 / part, (k, code_in[k] / part, share)
