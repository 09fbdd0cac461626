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


def test_the_weight_average_is_the_recursion_it_names_and_survives_a_resume(tmp_path):
    """ema_decay=beta: after every step ema <- beta ema + (1 - beta) w, from the initial weights. The
    average is recomputed here from the weights after each step (a hook on the optimiser), and the
    evaluation of the averaged weights is checked against evaluating that recomputed average; the
    model's own weights are back in place after the evaluation; a run killed and resumed gives the
    same row."""
    beta, steps = 0.8, 9

    def evaluate(m):
        return {"mse": _mse(m(XS[-1]), YS[-1]).mean().item()}

    def evaluated(m):  # as the loop evaluates: eval mode, no gradient
        m.eval()
        with torch.no_grad():
            value = evaluate(m)["mse"]
        m.train()
        return value

    model = _model()
    average = [p.detach().clone() for p in model.parameters()]

    def after_step(optimizer, args, kwargs):
        for a, p in zip(average, model.parameters()):
            a.mul_(beta).add_((1 - beta) * p.detach())

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(after_step)  # every optimiser's step, the loop's included
    try:
        history = train(model, _batch, _mse, steps=steps, lr=1e-2, eval_fn=evaluate, eval_every=0, progress=False,
                        ema_decay=beta)
    finally:
        handle.remove()
    row = history["eval"][-1]
    trained = [p.detach().clone() for p in model.parameters()]
    assert row["mse"] == evaluated(model)  # the weights are back after the averaged evaluation
    with torch.no_grad():
        for p, a in zip(model.parameters(), average):
            p.copy_(a)
    assert row["ema/mse"] == pytest.approx(evaluated(model), rel=1e-5)
    assert row["ema/mse"] != row["mse"]
    # killed after its step-6 checkpoint and resumed: the same row, the average included
    path = tmp_path / "run.pt"
    first = _model()
    train(first, _batch, _mse, steps=6, lr=1e-2, eval_fn=evaluate, eval_every=0, progress=False, ema_decay=beta,
          checkpoint=path, checkpoint_every=3)
    assert path.exists()
    resumed_model = _model()
    resumed = train(resumed_model, _batch, _mse, steps=steps, lr=1e-2, eval_fn=evaluate, eval_every=0, progress=False,
                    ema_decay=beta, checkpoint=path, checkpoint_every=3)
    assert all(torch.equal(p, q) for p, q in zip(resumed_model.parameters(), trained))
    assert resumed["eval"][-1]["ema/mse"] == row["ema/mse"]
    with pytest.raises(ValueError, match="without a weight average|with a weight average"):
        train(_model(), _batch, _mse, steps=steps, lr=1e-2, eval_fn=evaluate, progress=False, checkpoint=path)
    with pytest.raises(ValueError, match="ema_decay"):
        train(_model(), _batch, _mse, steps=2, ema_decay=1.0, eval_fn=evaluate, progress=False)
    with pytest.raises(ValueError, match="needs an eval_fn"):
        train(_model(), _batch, _mse, steps=2, ema_decay=0.9, progress=False)


def test_the_trained_weights_come_back_when_the_averaged_evaluation_fails():
    model = _model()
    calls = []

    def evaluate(m):
        calls.append(1)
        if len(calls) == 2:  # the second call of an evaluation is the one on the averaged weights
            raise RuntimeError("evaluation failed")
        return {"mse": 0.0}

    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(model, _batch, _mse, steps=3, lr=1e-2, eval_fn=evaluate, eval_every=0, progress=False, ema_decay=0.5)
    reference = _model()
    train(reference, _batch, _mse, steps=3, lr=1e-2, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    with pytest.raises(TypeError, match="on the averaged weights"):
        train(_model(), _batch, _mse, steps=2, eval_fn=lambda m, n=iter([{"a": 1}, 2.0]): next(n), progress=False,
              ema_decay=0.5)


def test_a_checkpoint_of_another_model_is_refused_and_leaves_the_model_as_it_was(tmp_path):
    """A strict load that fails has already copied the parameters whose names and shapes fit: the
    refusal must put them back, so that the caller's model is the one it passed in."""
    path = tmp_path / "run.pt"

    def dies_at_4(step):
        if step == 4:
            raise KeyboardInterrupt
        return _batch(step)

    with pytest.raises(KeyboardInterrupt):  # leaves the checkpoint of step 3
        train(_model(), dies_at_4, _mse, steps=6, lr=1e-2, progress=False, seed=1, checkpoint=path, checkpoint_every=3)
    torch.manual_seed(5)
    other = MoERegressor(6, 3, d_model=8, d_hidden=8, n_experts=4, router="softmax_topk",
                         router_options={"noise": "vmoe"}, group_size=8)
    other.extra = torch.nn.Parameter(torch.zeros(2))  # the same parameters and one more
    before = {name: value.clone() for name, value in other.state_dict().items()}
    with pytest.raises(ValueError, match="different model or optimiser"):
        train(other, _batch, _mse, steps=6, lr=1e-2, progress=False, seed=1, checkpoint=path, checkpoint_every=3)
    after = other.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="weight average"):
        train(_model(), _batch, _mse, steps=6, lr=1e-2, progress=False, seed=1, checkpoint=path, ema_decay=0.9)


def test_a_schedule_may_pass_through_zero_and_a_zero_step_leaves_the_weights():
    """A warm-up from 0 and a decay to 0 at the last step are common schedules: both are accepted, a
    step at rate 0 changes no weight (AdamW's update and decay are both scaled by the rate), and a
    constant rate of 0, which would train nothing, is refused."""
    def rate(step):  # 0 at step 0, then 1e-2, then 0 from step 3 on
        return 0.0 if step == 0 or step >= 3 else 1e-2

    start = {k: v.clone() for k, v in _model().state_dict().items()}
    first = _model()
    train(first, _batch, _mse, steps=1, lr=rate, progress=False, seed=4)
    assert all(torch.equal(start[k], v) for k, v in first.state_dict().items())
    three, four = _model(), _model()
    train(three, _batch, _mse, steps=3, lr=rate, progress=False, seed=4)
    train(four, _batch, _mse, steps=4, lr=rate, progress=False, seed=4)
    assert not all(torch.equal(start[k], v) for k, v in three.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(three.parameters(), four.parameters()))
    with pytest.raises(ValueError, match="lr"):
        train(_model(), _batch, _mse, steps=2, lr=0.0, progress=False)


def test_a_checkpoint_with_damaged_generator_state_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "run.pt"

    def dies_at_4(step):
        if step == 4:
            raise KeyboardInterrupt
        return _batch(step)

    with pytest.raises(KeyboardInterrupt):
        train(_model(), dies_at_4, _mse, steps=6, lr=1e-2, progress=False, seed=1, checkpoint=path, checkpoint_every=3)
    saved = torch.load(path, weights_only=False)
    saved["rng"]["python"] = "not a generator state"
    torch.save(saved, path)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(11)
    generator = torch.get_rng_state()
    with pytest.raises(ValueError, match="different model or optimiser"):
        train(model, _batch, _mse, steps=6, lr=1e-2, progress=False, seed=None, checkpoint=path, checkpoint_every=3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), generator)
