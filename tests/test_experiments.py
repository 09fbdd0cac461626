"""minimoe.experiments: every router trains on every task, the results file, checkpoint and resume.

Oracles: the loss at the end of a short run against the loss at its start (each router must learn);
brute force over all relabellings for ``specialisation``; an uninterrupted run for the resumed one
(byte-identical results except the measured times); the causal structure of position grouping.
"""
import csv
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import minimoe
from minimoe.experiments import (RESULT_COLUMNS, TASKS, TIMING_METRICS, make_task, read_results,
                                 router_options, run, specialisation, task_config, train_one)
from minimoe.models import TinyLM

ROOT = Path(__file__).resolve().parents[1]
ROUTERS = minimoe.routers.available()
# small but real: the same models and code path as the toy scale, fewer steps
QUICK = {"lm": dict(steps=25, data=dict(max_chars=60_000)),
         "clustered": dict(steps=25, data=dict(n_samples=2048)),
         "vision": dict(steps=25, data=dict(n_train=512, n_val=64))}


@pytest.fixture(scope="module")
def tasks():
    return {name: make_task(task_config(name, "toy", **QUICK[name])) for name in TASKS}


def test_every_registered_router_has_study_options():
    """Each router states its study options (the protocol's study_options), and they build it."""
    config = task_config("lm", "toy")
    for name in ROUTERS:
        options = router_options(name, config)
        assert isinstance(options, dict)
        minimoe.routers.build(name, config.d_model, config.n_experts, **options)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("task_name", TASKS)
def test_every_router_trains_on_every_task(tasks, task_name, router):
    torch.set_num_threads(1)
    task = tasks[task_name]
    metrics, wall = train_one(task, router, seed=0, device=torch.device("cpu"), progress=False)
    assert all(v == v and abs(v) < float("inf") for v in metrics.values()), metrics
    assert metrics["train_loss_last"] < metrics["train_loss_first"], metrics
    assert {task.quality_metric, "drop_rate", "load_imbalance", "experts_per_token", "ms_per_step"} <= set(metrics)
    assert 0 <= metrics["drop_rate"] <= 1 and metrics["load_imbalance"] >= 1 - 1e-6
    # equal active compute: one expert per token on average wherever the router fixes the budget
    if router not in ("soft_moe", "probmoe_dynamic"):
        assert metrics["experts_per_token"] <= 1 + 1e-6
    if task_name == "clustered":
        assert 0 <= metrics["specialisation"] <= 1
    assert wall > 0


def test_stopping_early_trains_the_full_runs_first_steps_to_the_bit():
    """``stop_after`` (what the reference study's test uses on another processor) keeps the run's own
    cosine schedule and REINFORCE baseline: its steps are the full run's. Oracle: the full run. A
    schedule computed from the shorter length would change the third step's learning rate and fail."""
    torch.set_num_threads(1)
    task = make_task(task_config("clustered", "toy", steps=12, lr_schedule="cosine", warmup_steps=1,
                                 data=dict(n_samples=1024)))
    for router in ("softmax_topk", "kool_gumbel_matching"):
        full, _ = train_one(task, router, seed=3, device=torch.device("cpu"), progress=False)
        first, _ = train_one(task, router, seed=3, device=torch.device("cpu"), progress=False, stop_after=5)
        assert first["train_loss_first"] == full["train_loss_first"], router
        assert first["train_loss_last"] == first["train_loss_first"]  # five steps: the head is the tail
        assert first[task.quality_metric] != full[task.quality_metric]  # evaluated after 5 steps, not 12
        whole, _ = train_one(task, router, seed=3, device=torch.device("cpu"), progress=False, stop_after=12)
        assert {k: v for k, v in whole.items() if k not in TIMING_METRICS} == \
            {k: v for k, v in full.items() if k not in TIMING_METRICS}
    with pytest.raises(ValueError, match="stop_after"):
        train_one(task, "softmax_topk", seed=0, device=torch.device("cpu"), progress=False, stop_after=0)


def test_a_stopped_run_resumes_to_the_full_run_and_refuses_a_later_checkpoint(tmp_path):
    """A run stopped after 9 steps leaves its step-8 checkpoint; resuming it to the end gives the full
    run's metrics, and asking it for 5 steps is refused (the model is already 8 steps in)."""
    torch.set_num_threads(1)
    task = make_task(task_config("clustered", "toy", steps=12, checkpoint_every=4, data=dict(n_samples=1024)))
    cpu, checkpoint = torch.device("cpu"), tmp_path / "run.pt"
    full, _ = train_one(task, "kool_skip", seed=1, device=cpu, progress=False)
    train_one(task, "kool_skip", seed=1, device=cpu, progress=False, stop_after=9, checkpoint=checkpoint)
    assert torch.load(checkpoint, weights_only=False)["state"]["step"] == 8
    with pytest.raises(ValueError, match="past the 5 steps"):
        train_one(task, "kool_skip", seed=1, device=cpu, progress=False, stop_after=5, checkpoint=checkpoint)
    resumed, _ = train_one(task, "kool_skip", seed=1, device=cpu, progress=False, checkpoint=checkpoint)
    assert {k: v for k, v in resumed.items() if k not in TIMING_METRICS} == \
        {k: v for k, v in full.items() if k not in TIMING_METRICS}


def test_specialisation_is_the_best_relabelling_by_brute_force():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        true = torch.randint(0, 4, (60,), generator=gen)
        chosen = torch.randint(-1, 4, (60,), generator=gen)  # -1: dropped
        best = max(sum(int(c >= 0 and perm[c] == t) for t, c in zip(true.tolist(), chosen.tolist()))
                   for perm in itertools.permutations(range(4)))
        assert specialisation(true, chosen, 4) == pytest.approx(best / 60)
    true = torch.arange(8).repeat(5)
    assert specialisation(true, (true * 3) % 8, 8) == 1.0  # a relabelling is perfect agreement


def test_run_writes_the_tidy_results_file(tmp_path):
    path = run("clustered", "softmax_topk,soft_moe", scale="toy", seeds=2, out=tmp_path, progress=False,
               threads=1, steps=6, data=dict(n_samples=1024))
    with open(path, newline="") as f:
        assert tuple(next(csv.reader(f))) == RESULT_COLUMNS
    rows = read_results(tmp_path)
    runs = {(r["task"], r["router"], r["seed"]) for r in rows}
    assert runs == {("clustered", r, s) for r in ("softmax_topk", "soft_moe") for s in (0, 1)}
    for key in runs:
        metrics = {r["metric"] for r in rows if (r["task"], r["router"], r["seed"]) == key}
        assert {"val_mse", "val_r2", "specialisation", "drop_rate", "load_imbalance", "experts_per_token",
                "routing_entropy", "train_loss_first", "train_loss_last", "ms_per_step"} <= metrics
    assert {r["device"] for r in rows} == {"cpu"} and {r["steps"] for r in rows} == {6}
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    assert {"command", "commit", "date", "device", "torch", "configs", "router_options"} <= set(provenance)
    assert provenance["router_options"]["clustered"]["soft_moe"] == {"slots_per_expert": 64 // 8}
    assert not list((tmp_path / "checkpoints").glob("*.pt"))  # finished runs leave no checkpoint
    # the same call again finds everything done and changes nothing
    before = path.read_bytes()
    run("clustered", "softmax_topk,soft_moe", scale="toy", seeds=2, out=tmp_path, progress=False, threads=1,
        steps=6, data=dict(n_samples=1024))
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="different configuration of clustered"):
        run("clustered", "softmax_topk", scale="toy", seeds=1, out=tmp_path, progress=False, steps=7,
            data=dict(n_samples=1024))


def _cli(out, *extra):
    return [sys.executable, "-m", "minimoe.experiments", "run", "--task", "clustered", "--routers",
            "softmax_topk,kool_skip", "--scale", "toy", "--seeds", "1", "--steps", "300", "--checkpoint-every", "10",
            "--threads", "1", "--no-progress", "--out", str(out), *extra]


def _without_timings(path):
    rows = list(csv.DictReader(open(path, newline="")))
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows if r["metric"] not in TIMING_METRICS]


def test_a_killed_run_resumes_to_the_same_results(tmp_path):
    """Kill the CLI (SIGKILL) during the second training run, run the same command again, and compare
    with an uninterrupted run: the same rows, digit for digit, except the measured times."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    subprocess.run(_cli(reference), check=True, env=env, capture_output=True, cwd=ROOT)
    process = subprocess.Popen(_cli(interrupted), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               cwd=ROOT)
    checkpoint = interrupted / "checkpoints" / "clustered-kool_skip-seed0.pt"
    deadline = time.time() + 120
    while not checkpoint.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    # killed midway: the first run's rows are in, the second run is only in its checkpoint
    assert {r["router"] for r in read_results(interrupted)} == {"softmax_topk"}
    step = torch.load(checkpoint, weights_only=False)["state"]["step"]
    assert 0 < step < 300
    subprocess.run(_cli(interrupted), check=True, env=env, capture_output=True, cwd=ROOT)
    assert not checkpoint.exists()
    assert _without_timings(interrupted / "results.csv") == _without_timings(reference / "results.csv")
    assert len(_without_timings(reference / "results.csv")) > 10


def test_gpu_configuration_runs_one_step_on_cpu_at_tiny_sizes(tmp_path):
    tiny = {"lm": dict(batch_size=16, group_size=16, d_model=16, d_hidden=16, data=dict(max_chars=20_000),
                       model=dict(n_heads=2, block_size=16), eval_batches=1),
            "clustered": dict(batch_size=64, group_size=32, d_model=16, d_hidden=16, eval_batches=1,
                              data=dict(n_samples=512)),
            "vision": dict(batch_size=4, d_model=12, d_hidden=12, data=dict(n_train=8, n_val=4))}
    torch.set_num_threads(1)
    for name in TASKS:
        config = task_config(name, "gpu", steps=1, **tiny[name])
        assert config.n_experts == task_config(name, "gpu").n_experts  # the GPU model's shape, smaller widths
        task = make_task(config)
        for router in ("softmax_topk", "soft_moe", "kool_gumbel_matching"):
            metrics, _ = train_one(task, router, seed=0, device=torch.device("cpu"), progress=False)
            assert all(v == v for v in metrics.values())


def test_position_grouping_is_causal_for_every_router():
    """Routing the batch's tokens at one position together: changing a later character never changes an
    earlier prediction, even for routers whose groups see every token (expert choice, Soft MoE, BASE).
    Routing each sequence as a group does leak (the test can fail)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 20, (6, 12))
    changed = idx.clone()
    changed[:, 8:] = torch.randint(0, 20, (6, 4))
    for router in ("expert_choice", "soft_moe", "base", "sinkhorn_expert_choice"):
        for grouping, causal in (("position", True), ("sequence", False)):
            torch.manual_seed(1)
            model = TinyLM(20, d_model=16, n_layers=1, n_heads=2, block_size=12, n_experts=4, d_hidden=16,
                           router=router, router_options=router_options(router, task_config("lm", "toy")),
                           routing_groups=grouping).train()
            with torch.no_grad():
                same = torch.allclose(model(idx)[:, :8], model(changed)[:, :8], atol=1e-6)
            assert same == causal, (router, grouping)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="tasks must be"):
        run("speech", out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="routers must be"):
        run("lm", "no_such_router", out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="seeds must be"):
        run("lm", seeds=0, out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="scale must be"):
        task_config("lm", "huge")
    with pytest.raises(ValueError, match="unknown configuration fields"):
        task_config("lm", "toy", stepz=3)


def test_cli_show_prints_every_router(tmp_path):
    run("vision", "expert_choice,usmoe", scale="toy", seeds=1, out=tmp_path, progress=False, threads=1, steps=3,
        data=dict(n_train=64, n_val=32))
    out = subprocess.run([sys.executable, "-m", "minimoe.experiments", "show", str(tmp_path)], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    assert "val_accuracy" in out and "expert_choice" in out and "usmoe" in out


def test_the_whole_validation_split_predicts_every_character_once():
    from minimoe.experiments.tasks import LanguageModelling

    config = task_config("lm", "toy", eval_batches=None, data={"max_chars": 20_000})
    task = LanguageModelling(config)
    val, block = task.corpus.splits["val"], config.model["block_size"]
    n = (len(val) - 1) // block
    assert all(len(x) == len(y) == config.batch_size for x, y in task.val)      # every routing group full
    scored = [(x, y) for xs, ys in task.val for x, y in zip(xs, ys) if (y != -100).all()]
    fillers = [y for _, ys in task.val for y in ys if (y == -100).any()]
    assert len(fillers) == -n % config.batch_size > 0                            # the last batch is filled up
    assert all((y == -100).all() for y in fillers) and len(scored) + len(fillers) == len(task.val) * config.batch_size
    windows = torch.stack([torch.cat([x, y[-1:]]) for x, y in scored])          # (n, block + 1)
    targets = torch.cat([y for _, y in scored])
    assert len(targets) == n * block and len(val) - 1 - len(targets) < block   # all but a short tail
    # each window is a stretch of the split starting at a multiple of block: find where, by matching
    starts = {int(i) * block: i for i in range(n)}
    found = sorted(next(s for s in starts if torch.equal(val[s:s + block + 1], w)) for w in windows)
    assert found == sorted(starts)                                              # every window once: each character once
    assert all(torch.equal(y[:-1], x[1:]) for x, y in scored)                   # targets: the next character
    # in a fixed random order, not in the order of the text (a group of consecutive windows is not a training group)
    first = [next(s for s in starts if torch.equal(val[s:s + block + 1], w)) for w in windows[:8]]
    assert first != sorted(first) and LanguageModelling(config).val[0][0].equal(task.val[0][0])
    # the loss is per scored character: the fillers complete a routing group and count for nothing
    torch.manual_seed(0)
    model = task.build_model("softmax_topk", {"k": 1})
    model.eval()
    with torch.no_grad():
        value = task.evaluate(model, torch.device("cpu"))["val_loss"]
        total = sum(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
                    for x, y in task.val)  # the ignored index leaves the fillers out
    assert value == pytest.approx(total / len(targets), rel=1e-12)


def test_a_configuration_record_missing_a_later_field_matches_only_at_its_default():
    import dataclasses
    import json

    from minimoe.experiments.runner import same_configuration

    config = json.loads(json.dumps(dataclasses.asdict(task_config("clustered", "reference"))))
    old = {k: v for k, v in config.items() if k != "ema_decay"}  # a record written before ema_decay existed
    assert same_configuration(old, config) and same_configuration(config, config)
    assert not same_configuration(old, {**config, "ema_decay": 0.99})
    assert not same_configuration({**config, "steps": 1}, config)
    assert not same_configuration({**config, "unknown_field": 1}, config)


def test_the_noise_decomposition_recovers_known_parts():
    """minimoe.experiments.noise.decompose on synthetic runs with a known split: the paired difference of
    seed s on draw j is t_s + e_sj, training part t_s ~ N(0.1, 0.03^2) and evaluation part
    e_sj ~ N(0, 0.01^2), common to both routers' evaluations on draw j except for that. With 400 seeds
    and 30 draws the recovered standard deviations are within 10% of the truth."""
    import random

    from minimoe.experiments.noise import decompose

    rng = random.Random(3)
    rows, draws = [], 30
    for s in range(400):
        train_a = rng.gauss(2.0, 0.05)
        train_b = train_a - rng.gauss(0.1, 0.03)          # A - B = t_s
        shared = [rng.gauss(0, 0.05) for _ in range(draws)]  # how hard draw j is, for both
        own = [rng.gauss(0, 0.01) for _ in range(draws + 1)]
        row_a = {"router": "a", "seed": s, "whole": train_a, "fixed": train_a + shared[0] + own[-1]}
        row_b = {"router": "b", "seed": s, "whole": train_b, "fixed": train_b + shared[0]}
        for j in range(draws):
            row_a[f"draw{j}"] = train_a + shared[j] + own[j]
            row_b[f"draw{j}"] = train_b + shared[j]
        rows += [row_a, row_b]
    pair = decompose(rows, draws)["pairs"]["a - b"]
    assert pair["sd_eval_sampling"] == pytest.approx(0.01, rel=0.1)
    assert pair["sd_whole"] == pytest.approx(0.03, rel=0.1)
    assert pair["sd_fixed"] == pytest.approx((0.03**2 + 0.01**2) ** 0.5, rel=0.1)
    assert pair["eval_share_of_variance"] == pytest.approx(0.01**2 / (0.03**2 + 0.01**2), rel=0.25)
    assert pair["mean_whole"] == pytest.approx(0.1, abs=0.005)


def test_baselines_is_a_shorthand_in_a_router_list(tmp_path):
    """--routers all,baselines and softmax_topk,baselines expand the shorthand to the four baselines;
    a study on them trains and records every one (two clustered runs of a few steps)."""
    import minimoe
    from minimoe.experiments import read_results

    out = tmp_path / "zoo"
    run("clustered", "softmax_topk,baselines", scale="toy", seeds=1, out=out, steps=3, progress=False, threads=1)
    assert {r["router"] for r in read_results(out)} == {"softmax_topk", *minimoe.routers.baselines()}
    with pytest.raises(ValueError, match="'all' or 'baselines' or a comma-separated list"):
        run("clustered", "softmax_topk,baseline", scale="toy", seeds=1, out=tmp_path / "x", steps=3, progress=False)


def test_edge_cases_of_the_new_study_code(tmp_path):
    """A validation split shorter than a batch still fills every routing group; the noise measurement
    refuses what it could not decompose before it trains, and a zero variance gives NaN, not an error;
    a baselines table names a comparison it could not make."""
    import math

    from minimoe.experiments import claims, report
    from minimoe.experiments.noise import decompose, measure
    from minimoe.experiments.tasks import LanguageModelling

    task = LanguageModelling(task_config("lm", "toy", eval_batches=None, data={"max_chars": 1500}))
    assert [len(x) for x, _ in task.val] == [task.config.batch_size]
    scored = sum(int((y != -100).all(-1).sum()) for _, y in task.val)
    assert scored == (len(task.corpus.splits["val"]) - 1) // task.config.model["block_size"] < task.config.batch_size
    with pytest.raises(ValueError, match="seeds"):
        measure(["softmax_topk", "expert_choice"], seeds=1, draws=4)
    with pytest.raises(ValueError, match="draws"):
        measure(["softmax_topk", "expert_choice"], seeds=3, draws=1)
    with pytest.raises(ValueError, match="two routers"):
        measure(["softmax_topk"], seeds=3, draws=4)
    rows = [{"router": r, "seed": s, "whole": 1.0, "fixed": 1.0, "draw0": 1.0, "draw1": 1.0}
            for r in ("a", "b") for s in range(3)]
    assert math.isnan(decompose(rows, 2)["pairs"]["a - b"]["eval_share_of_variance"])
    lm = [{"task": "lm", "router": r, "seed": s, "metric": "val_loss", "value": 1.0 + 0.01 * s + (r == "hash") * 0.1}
          for r, seeds in (("softmax_topk", range(3)), ("hash", range(3)), ("dense", [3])) for s in seeds]
    table = report.baselines_table(lm, "lm")
    assert "—" in table.splitlines()[-1] and "− `hash`" in table
    with pytest.raises(ValueError, match="needs a margin"):
        claims.Claim("p", "c", "s", "x", "a", "b", noninferiority=True)
