"""The one training loop, minimoe.train.train: what the study needs of it (schedule, checkpoint and
resume, early stop, per-token losses) holds for the notebooks too."""
import math

import pytest
import torch

from minimoe.models import MoERegressor
from minimoe.train import train, warmup_cosine


def _model(router="softmax_topk", options=None):
    torch.manual_seed(0)
    return MoERegressor(6, 3, d_model=8, d_hidden=8, n_experts=4, router=router,
                        router_options=options or {"noise": "vmoe"}, group_size=8)


XS, YS = torch.randn(12, 16, 6, generator=torch.Generator().manual_seed(2)), torch.randn(12, 16, 3)


def _batch(step):
    return XS[step], YS[step]


def _mse(pred, y):
    return (pred - y).pow(2).mean(-1)  # one loss per example


def test_warmup_cosine_is_the_schedule_it_says():
    lr = warmup_cosine(1.0, 10, 3)
    assert [lr(s) for s in range(3)] == [1 / 3, 2 / 3, 1.0]
    assert lr(3) == 1.0 and math.isclose(lr(9), 0.5 * (1 + math.cos(math.pi * 6 / 7)))
    assert warmup_cosine(1.0, 2, 5)(0) == 1.0  # a warm-up longer than the run ends at the run's last step
    with pytest.raises(ValueError, match="steps"):
        warmup_cosine(1.0, 0)


def test_a_killed_run_resumes_to_the_uninterrupted_run(tmp_path):
    """A run that dies at step 7 (its last checkpoint: step 6) and is started again with the same call
    ends with the parameters and history of a run that never stopped: generators, optimiser and the
    REINFORCE baseline are restored. Here with noisy routing, so the generators matter."""
    kwargs = dict(steps=12, lr=warmup_cosine(1e-2, 12, 2), progress=False, seed=3, checkpoint_every=3)
    whole = _model()
    full = train(whole, _batch, _mse, **kwargs)

    def dies_at_7(step):
        if step == 7:
            raise KeyboardInterrupt
        return _batch(step)

    path = tmp_path / "run.pt"
    with pytest.raises(KeyboardInterrupt):
        train(_model(), dies_at_7, _mse, checkpoint=path, **kwargs)
    assert torch.load(path, weights_only=False)["state"]["step"] == 6
    resumed_model = _model()
    resumed = train(resumed_model, _batch, _mse, checkpoint=path, **kwargs)
    assert [r["loss"] for r in resumed["train"]] == [r["loss"] for r in full["train"]]
    for a, b in zip(whole.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="past the 4 steps"):
        train(_model(), _batch, _mse, checkpoint=path, **{**kwargs, "steps": 4})


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", None])
def test_a_damaged_checkpoint_is_named_set_aside_and_the_run_restarts(tmp_path, content):
    path = tmp_path / "run.pt"
    if content is None:
        torch.save({"model": {}}, path)  # readable, but not one of ours
    else:
        path.write_bytes(content)
    with pytest.warns(RuntimeWarning, match=f"checkpoint {path} .*set aside as run.pt.damaged"):
        history = train(_model(), _batch, _mse, steps=2, progress=False, checkpoint=path)
    fresh = train(_model(), _batch, _mse, steps=2, progress=False)
    assert [r["loss"] for r in history["train"]] == [r["loss"] for r in fresh["train"]]
    assert (tmp_path / "run.pt.damaged").exists()  # kept for a look, not deleted


def test_early_stop_and_per_token_losses():
    rows = []

    def stop(row):
        rows.append(row)
        return row["step"] >= 4

    history = train(_model(), _batch, _mse, steps=10, progress=False, eval_every=2, stop=stop,
                    eval_fn=lambda m: {"mse": float(_mse(m(XS[0]), YS[0]).mean())})
    assert [r["step"] for r in rows] == [2, 4] and len(history["train"]) == 4
    assert [r["step"] for r in history["eval"]] == [2, 4]  # the stopped model was evaluated once at its end
    with pytest.raises(ValueError, match="stop .*needs an eval_fn"):
        train(_model(), _batch, _mse, steps=2, progress=False, stop=lambda row: True)
    # a per-example loss trains as its mean does (the same objective for a router without extra loss)
    a, b = _model(), _model()
    ha = train(a, _batch, _mse, steps=3, progress=False)
    hb = train(b, _batch, lambda p, y: _mse(p, y).mean(), steps=3, progress=False)
    assert [r["loss"] for r in ha["train"]] == [r["loss"] for r in hb["train"]]


def test_a_non_finite_loss_stops_the_run_with_its_step():
    calls = []

    def nan_from_step_2(pred, y):
        calls.append(1)
        return _mse(pred, y) * (float("nan") if len(calls) > 2 else 1.0)

    with pytest.raises(FloatingPointError, match="mine: the training loss is nan at step 2"):
        train(_model(), _batch, nan_from_step_2, steps=4, progress=False, desc="mine")
