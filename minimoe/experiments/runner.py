"""Train every (task, router, seed) of a head-to-head, checkpointing as it goes (book: chapter 9).

A run writes into one folder:

* ``results.csv``: the tidy results, one row per (task, router, seed, metric) with columns
  ``RESULT_COLUMNS``; rewritten atomically after each finished training run;
* ``provenance.json``: the command, commit, device, date, library versions and every configuration;
* ``checkpoints/<task>-<router>-seed<s>.pt``: the state of the training run in progress (model,
  optimiser, random generators, moving baseline, the metrics gathered so far), written every
  ``checkpoint_every`` steps and at least every two minutes (atomically), and deleted when that run's
  rows are in ``results.csv``; beside it ``<task>-<router>-seed<s>.claim`` while a process trains it.

Commands may share a folder: each run is claimed by the process that trains it (a lock the kernel
releases when that process ends, however it ends), so a second command on the folder trains the runs
no one holds, then waits for the others and takes over any whose command died; finished runs'
rows are merged into ``results.csv`` under the folder's lock.

Running the same command again resumes: finished runs are skipped, the interrupted one continues from
its checkpoint. Batches are a function of (seed, step) and the generators are restored, so a resumed
run computes exactly what an uninterrupted one would have (only the measured times differ).

Why a locked CSV and not a database. Optuna's shared storages put every trial in SQLite (or another
database) behind SQLAlchemy, where the database serialises the writers; its journal storage appends
each operation to one log file under a file lock instead. MLflow's file store gives every run a
directory of its own, one file per metric appended line by line, so concurrent runs never touch the
same file, and a reader walks the directories. A study here writes once per finished run (hundreds of
writes, each a few kilobytes), and what it must leave behind is one tidy table that git can diff and
the book reads. So the table is the store: readers validate it (:func:`read_results`), a writer merges
its run's rows into the file as it is now under the folder's ``flock`` and replaces it atomically
(the journal's safety, without a second format to export), and a run is claimed before it trains, as
MLflow's per-run directory keeps two writers off one run.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import contextlib
import io
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from .. import routers as router_registry
from ..ops._checks import check_bool, check_int
from ..progress import progress as progress_bar
from ..train import atomic_write, pick_device, remove_write_leftovers, seed_everything, set_aside, train, warmup_cosine
from .configs import TASKS, TaskConfig, base_router, router_options, study_variants, task_config
from .tasks import make_task

RESULT_COLUMNS = ("task", "scale", "router", "seed", "metric", "value", "steps", "wall_time_s", "device")
# Measured times: the only columns/metrics a resumed run does not reproduce exactly.
TIMING_METRICS = ("ms_per_step",)
ROUTING_METRICS = {  # results-file name -> key in Routing.stats
    "drop_rate": "drop_rate",
    "load_imbalance": "load_imbalance",
    "experts_per_token": "mean_experts_per_token",
    "routing_entropy": "routing_entropy",
}
CHECKPOINT_SECONDS = 120.0
BASELINE_MOMENTUM = 0.9  # moving average of the batch losses: the REINFORCE baseline (chapter 5)


def _routing_metrics(row: dict) -> dict:
    """Mean over the model's MoE layers of one training row's routing metrics (``moe{i}/...``)."""
    sums, counts = {}, {}
    for i in itertools.count():
        if f"moe{i}/load" not in row:
            break
        for name, key in ROUTING_METRICS.items():
            if f"moe{i}/{key}" in row:
                sums[name] = sums.get(name, 0.0) + row[f"moe{i}/{key}"]
                counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums}


def lr_schedule(config):
    """The learning rate of a run: ``config.lr``, or with ``lr_schedule="cosine"`` the schedule
    :func:`minimoe.train.warmup_cosine` (a linear warm-up over ``warmup_steps`` steps, then half a
    cosine down to 0 at the last step), as ``train(lr=...)`` takes it."""
    if config.lr_schedule == "constant":
        return config.lr
    return warmup_cosine(config.lr, config.steps, config.warmup_steps)


def learning_rate(config, step: int) -> float:
    """The learning rate of ``step`` (0-based) of a run of ``config`` (:func:`lr_schedule`). A function
    of the step alone, so a resumed run needs no scheduler state."""
    schedule = lr_schedule(config)
    return schedule(step) if callable(schedule) else schedule


def train_one(task, router: str, seed: int, *, device: torch.device, checkpoint: Path | None = None,
              progress: bool = True, stop_after: int | None = None) -> tuple[dict, float]:
    """Train one model of the study with :func:`minimoe.train.train` and evaluate it. Returns
    ``(metrics, wall_time_s)``; resumes from ``checkpoint`` when the file exists and writes it as it goes.

    ``router`` is a study entry (:func:`~minimoe.experiments.configs.study_entries`); what it needs
    beyond the task loss (Kool's REINFORCE term, ...) it brings through the router protocol.
    ``stop_after=n`` trains only the first ``n`` steps of the configured run, with the run's own
    learning-rate schedule, so those steps are the full run's steps to the bit (a check on another
    processor compares them: ``tests/test_reference_study.py``); the metrics are those of the model
    after ``n`` steps, without the routing metrics unless ``n`` reaches the last quarter of the run,
    where they are averaged. ``n`` beyond the run's length trains the whole run."""
    config = task.config
    if stop_after is not None:
        stop_after = check_int(stop_after, "stop_after (the number of steps to train; None: the whole run)", low=1)
    last_step = config.steps if stop_after is None else min(stop_after, config.steps)
    seed_everything(seed)
    model = task.build_model(base_router(router), router_options(router, config)).to(device)
    # routing metrics: mean over the last quarter of training, where the routers have settled
    window_start = config.steps - max(1, int(round(config.steps * config.stats_window)))
    history = train(model, lambda step: task.train_batch(seed, step), task.loss_per_token, steps=last_step,
                    lr=lr_schedule(config), weight_decay=0.01, eval_fn=lambda m: task.evaluate(m, device), eval_every=0,
                    device=device, seed=None, grad_clip=1.0, progress=progress, leave=False,
                    desc=f"{task.name} {router} seed {seed}", checkpoint=checkpoint,
                    checkpoint_every=config.checkpoint_every, checkpoint_seconds=CHECKPOINT_SECONDS,
                    stats_from=window_start, baseline_momentum=BASELINE_MOMENTUM, ema_decay=config.ema_decay)
    # (the weight average's metrics, "ema/val_loss", are recorded as "ema_val_loss")
    metrics = {key.replace("ema/", "ema_"): value for key, value in history["eval"][-1].items() if key != "step"}
    losses = [row["loss"] for row in history["train"]]
    head, tail = losses[:5], losses[-5:]
    metrics["train_loss_first"] = sum(head) / len(head)
    metrics["train_loss_last"] = sum(tail) / len(tail)
    routing = [_routing_metrics(row) for row in history["train"][window_start:]]
    for name in ROUTING_METRICS:
        values = [row[name] for row in routing if name in row]
        if values:
            metrics[name] = sum(values) / len(values)
    metrics["ms_per_step"] = 1e3 * history["train_seconds"] / max(len(history["train"]), 1)
    return metrics, history["seconds"]


def _checkpoint_name(item) -> str:
    task_name, router, seed = item
    return f"{task_name}-{router}-seed{seed}.pt"


_TASKS_BUILT: dict = {}  # per process: a task's data is built once and shared by its runs


def _train_job(config, task_name: str, router: str, seed: int, device, checkpoint: Path, progress: bool):
    """One (task, router, seed) run, in this process or a worker: ``(metrics, wall_time_s)``."""
    key = repr(config)
    if key not in _TASKS_BUILT:
        _TASKS_BUILT.clear()
        _TASKS_BUILT[key] = make_task(config)
    return train_one(_TASKS_BUILT[key], router, seed, device=device, checkpoint=checkpoint, progress=progress)


def _git_commit() -> tuple[str, bool]:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        # changes to the package's code (not to committed results) make the commit an incomplete record
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "minimoe",
                                     ":(exclude)minimoe/experiments/results"], cwd=root,
                                    capture_output=True, text=True).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


#: The code that decides what the committed results are: the mathematics, the routers, the routing
#: result, the layer, the models, the losses and metrics, the training loop, the data and the study's
#: tasks and configurations.
ROUTING_CODE = ("minimoe/ops", "minimoe/routers", "minimoe/routing.py", "minimoe/layers.py", "minimoe/models",
                "minimoe/losses.py", "minimoe/metrics.py", "minimoe/train.py", "minimoe/data",
                "minimoe/experiments/tasks.py", "minimoe/experiments/configs.py", "minimoe/experiments/runner.py")


def study_origin(folder: str | Path) -> dict:
    """Which commit made a results folder, and whether the code that decides what the routers compute
    (:data:`ROUTING_CODE`) has changed since: ``{"commit", "date", "changed": [files] or None (no git
    history to tell), "sentence"}``. The sentence is what ``show`` prints and chapter 9 says."""
    provenance = json.loads((Path(folder) / "provenance.json").read_text())
    commit, date = provenance.get("commit", "unknown"), provenance.get("date", "?")[:10]
    root = Path(__file__).resolve().parents[2]
    changed = None
    try:
        # against the working tree: uncommitted edits count too
        out = subprocess.run(["git", "diff", "--name-only", commit, "--", *ROUTING_CODE], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split()
        changed = sorted(out)
    except (OSError, subprocess.CalledProcessError):
        pass
    head = f"Made by commit {commit[:7]} on {date}"
    if changed is None:
        sentence = f"{head} (no git history here to compare it with the code)."
    elif changed:
        sentence = (f"{head}; the routing code has changed since ({len(changed)} files), so the values are the "
                    "committed runs', checked against today's code by tests/test_reference_study.py, not "
                    "today's bits.")
    else:
        sentence = f"{head}; the routing code is unchanged since."
    return {"commit": commit, "date": date, "changed": changed, "sentence": sentence}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def cpu_signature() -> dict:
    """What decides the floating-point results of a CPU run besides the code and the seed: the
    processor model and the vector instructions torch's kernels use (``AVX2``, ``AVX512``, ...).
    Runs on two machines with the same signature and versions give the same bits; otherwise the
    last digits differ and, through discrete routing decisions, so can more (chapter 9)."""
    import hashlib

    model, flags = platform.processor() or platform.machine(), ""
    try:  # Linux: the model name hides the generation on a virtual machine, the feature flags do not
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        model, flags = info.get("model name", model), " ".join(sorted(info.get("flags", "").split()))
    except OSError:
        pass
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags_sha1": hashlib.sha1(flags.encode()).hexdigest()[:12] if flags else None}


def same_processor(provenance: dict) -> bool:
    """Whether this process runs on the processor signature and torch of a results folder's
    ``provenance`` (then its CPU runs reproduce bit for bit)."""
    return (all(provenance.get(k) == v for k, v in cpu_signature().items())
            and provenance.get("torch") == torch.__version__)


def _parse_list(value, allowed, what, *, extra=(), groups=None) -> list[str]:
    """``"all"`` (every name of ``allowed``) or a list of names of ``allowed`` and ``extra``, in which
    ``"all"`` may stand for the whole of ``allowed`` (``"all,ssr_p0"``) and a name of ``groups``
    (``{name: names}``) for its names (``"all,baselines"``)."""
    groups = {"all": list(allowed), **(groups or {})}
    if not isinstance(value, (str, list, tuple)) and value is not None:
        raise TypeError(f"{what} must be 'all', a comma-separated string or a list of {sorted(allowed)}, got {value!r}")
    items = ["all"] if value is None else (value.split(",") if isinstance(value, str) else list(value))
    items = list(dict.fromkeys(name for item in items for name in groups.get(item, [item])))
    known = [*allowed, *extra, *(name for names in groups.values() for name in names)]
    unknown = [item for item in items if item not in known]
    if unknown or not items:
        shorthands = " or ".join(repr(g) for g in groups)
        raise ValueError(f"{what} must be {shorthands} or a comma-separated list of {sorted(set(known))}, "
                         f"got {value!r}")
    return items


def same_configuration(recorded: dict, config: dict) -> bool:
    """Whether a provenance record of a task's configuration describes ``config`` (a
    ``dataclasses.asdict`` of a :class:`~minimoe.experiments.configs.TaskConfig`, through JSON): equal
    field for field, except that a field the record lacks, one added to ``TaskConfig`` after the
    record was written, must hold its default, which is what the recorded runs did."""
    fields = TaskConfig.__dataclass_fields__

    def default(name):
        field = fields[name]
        return field.default_factory() if field.default is dataclasses.MISSING else field.default

    extra = set(recorded) - set(config)
    missing = [k for k in config if k not in recorded]
    if extra or any(k not in fields or default(k) != config[k] for k in missing):
        return False
    return all(recorded[k] == config[k] for k in config if k in recorded)


def _check_same_setup(provenance: dict, setup: dict, out: Path) -> None:
    """A folder is resumed only with the configuration it was started with (tasks and routers it has
    not seen yet may be added)."""
    clashes = [] if provenance["scale"] == setup["scale"] else ["scale"]
    clashes += [f"configuration of {t}" for t, c in setup["configs"].items()
                if t in provenance["configs"] and not same_configuration(provenance["configs"][t], c)]
    clashes += [f"options of {r} on {t}" for t, opts in setup["router_options"].items() for r, o in opts.items()
                if provenance["router_options"].get(t, {}).get(r, o) != o]
    if clashes:
        raise ValueError(f"{out} holds results made with a different {', '.join(clashes)}; rerun with --fresh "
                         f"or another --out")


class DamagedResults(ValueError):
    """A results file that cannot be read as it is: the message names the file, the row and the fix."""


def read_results(path: str | Path) -> list[dict]:
    """The rows of a results file (a ``results.csv`` or the folder holding it), values as numbers.

    Validated on read: the columns of :data:`RESULT_COLUMNS`, numbers where numbers belong, one row per
    (task, router, seed, metric). A file that fails raises :class:`DamagedResults` naming the file,
    the row and what to do."""
    if not isinstance(path, (str, Path)) or str(path) == "":
        raise TypeError(f"path must be a results folder or its results.csv, got {path!r}")
    path = Path(path)
    if path.is_dir():
        if (path / "results.csv").is_file() or path.name != "results.csv":
            path = path / "results.csv"
            if not path.exists():
                raise FileNotFoundError(f"{path.parent} holds no results.csv: give a results folder or its results.csv")
            if path.is_dir():
                raise DamagedResults(f"{path} is a folder, not a results file; move it away, or rerun with --fresh")
        else:
            raise DamagedResults(f"{path} is a folder, not a results file; move it away, or rerun with --fresh")
    fix = f"restore {path} from a copy, delete the damaged rows, or rerun with --fresh"
    try:
        # utf-8-sig: a file saved by a spreadsheet starts with a byte-order mark, which is not a column name
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            missing = [c for c in RESULT_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise DamagedResults(f"{path} is not a results file: it lacks the column(s) {missing} "
                                     f"(header {reader.fieldnames}); {fix}")
            rows = list(reader)
    except UnicodeDecodeError as error:
        raise DamagedResults(f"{path} is not a text results file ({error}); {fix}") from None
    seen = set()
    for line, row in enumerate(rows, start=2):
        if None in row or any(row[c] in (None, "") for c in RESULT_COLUMNS):  # fields missing or too many
            raise DamagedResults(f"{path}, line {line}: a truncated or damaged row {row}; {fix}")
        try:
            row["seed"], row["steps"] = int(row["seed"]), int(row["steps"])
            row["value"], row["wall_time_s"] = float(row["value"]), float(row["wall_time_s"])
        except (TypeError, ValueError):
            raise DamagedResults(f"{path}, line {line}: a truncated or damaged row {row}; {fix}") from None
        if not (math.isfinite(row["value"]) and math.isfinite(row["wall_time_s"])):
            # a finished run's metrics are finite (training stops at a non-finite loss): an edit or damage
            raise DamagedResults(f"{path}, line {line}: a non-finite value in {row}; {fix}")
        key = (row["task"], row["router"], row["seed"], row["metric"])
        if key in seen:
            raise DamagedResults(f"{path}, line {line}: a second row for {key}; {fix}")
        seen.add(key)
    return rows


def complete_runs(rows: list[dict]) -> set[tuple]:
    """The (task, router, seed) runs of ``rows`` that hold every metric a finished run of their task has
    (the union over the task's runs, the measured time included): a run with a metric missing was
    damaged, and is rerun rather than taken for finished."""
    metrics: dict = {}
    by_run: dict = {}
    for r in rows:
        metrics.setdefault(r["task"], set()).add(r["metric"])
        by_run.setdefault((r["task"], r["router"], r["seed"]), set()).add(r["metric"])
    return {run for run, names in by_run.items() if names >= metrics[run[0]] and "ms_per_step" in names}


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive lock on a results folder (``.lock``, flock), held while one process reads and
    writes its provenance or results: two ``run`` commands on one folder, side by side, each merge
    their rows into the file as it is instead of writing back what they read at start."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one writer at a time is then the user's to ensure
        yield
        return
    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_results(path: Path, rows: list[dict]) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=RESULT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        # repr keeps every digit, so equal numbers give byte-identical files
        writer.writerow({**row, "value": repr(float(row["value"])), "wall_time_s": f"{row['wall_time_s']:.3f}"})
    atomic_write(path, out.getvalue().encode())


def run(tasks="all", routers="all", *, scale: str = "toy", seeds: int = 3, out: str | Path | None = None,
        device: str | None = None, threads: int | None = None, workers: int = 1, fresh: bool = False,
        progress: bool = True, command: str | None = None, **overrides) -> Path:
    """Train every router on every task for seeds ``0 .. seeds-1`` and write the results folder.

    Args:
        tasks, routers: ``"all"``, a comma-separated string or a list of names.
        scale: ``"toy"`` (a laptop CPU) or ``"gpu"`` (one large GPU); see :data:`configs.SCALES`.
        out: the results folder (default ``runs/zoo-<scale>``); an existing one is resumed.
        threads: CPU threads for torch during the run (restored after), in each worker. The toy models
            are so small that one thread is as fast as two, and a second thread that waits on a busy
            core can make each step many times slower.
        workers: processes training runs side by side (``workers=2, threads=1`` uses both cores of a
            2-core machine). Every run is a function of (task, router, seed) alone, so the results do
            not depend on the number of workers (only the measured times do).
        fresh: delete the folder's results and checkpoints first.
        overrides: configuration fields for every task (e.g. ``steps=20``), see :func:`task_config`.

    Returns the path of ``results.csv``.
    """
    if threads is not None:
        check_int(threads, "threads", low=1)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return run(tasks, routers, scale=scale, seeds=seeds, out=out, device=device, workers=workers,
                       fresh=fresh, progress=progress, command=command, **overrides)
        finally:
            torch.set_num_threads(previous)
    tasks = _parse_list(tasks, TASKS, "tasks")
    variants_of = study_variants()
    # "all" is every registered router; "baselines" the four that do not learn (hash, random, dense, dense_wide)
    routers = _parse_list(routers, router_registry.available(), "routers", extra=variants_of,
                          groups={"baselines": router_registry.baselines()})
    check_int(seeds, "seeds", low=1)  # the seeds are 0 .. seeds - 1
    check_int(workers, "workers", low=1)
    # everything is checked before the folder is touched: a bad override must not leave a provenance.json
    configs = {t: task_config(t, scale, **dict(overrides)) for t in tasks}
    torch_device = pick_device(device)
    fresh, progress = check_bool(fresh, "fresh"), check_bool(progress, "progress")
    if out is not None and not isinstance(out, (str, Path)):
        raise TypeError(f"out must be a folder path or None, got {out!r}")
    if out is not None and not str(out).strip():  # Path("") is the current folder: results would land there
        raise ValueError(f"out must name a folder (or be None for runs/zoo-<scale>), got {str(out)!r}")
    out = Path(out if out is not None else f"runs/zoo-{scale}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file; give a folder for the results")
    results_path, provenance_path = out / "results.csv", out / "provenance.json"
    checkpoints = out / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    if fresh:
        with _folder_lock(out):
            for path in [results_path, provenance_path, *checkpoints.glob("*.pt")]:
                if path.is_dir():  # a folder where a file belongs: set aside, not deleted
                    set_aside(path)
                else:
                    path.unlink(missing_ok=True)
    with _folder_lock(out):  # the provenance and the plan; the lock is released while the runs train
        plan, pending, order = _provenance_and_plan(out, tasks, routers, configs, scale, seeds, torch_device,
                                                    command, variants_of, results_path, provenance_path)
    return _train_and_record(out, plan, pending, order, configs, scale, torch_device, workers, progress,
                             checkpoints, results_path)


def _provenance_and_plan(out, tasks, routers, configs, scale, seeds, torch_device, command, variants_of,
                         results_path, provenance_path):
    """:func:`run` after its checks, under the folder's lock: check and extend ``provenance.json``, read
    the results so far, and return the plan, its runs still to train and the plan's order."""
    if results_path.exists() and not provenance_path.exists():
        raise ValueError(f"{out} holds results.csv but no provenance.json: the configuration its runs were made "
                         "with is unknown, so new runs could not be paired with them. Restore provenance.json, "
                         "or rerun with --fresh or another --out")
    commit, dirty = _git_commit()
    setup = {"scale": scale, "configs": {t: dataclasses.asdict(c) for t, c in configs.items()},
             "router_options": {t: {r: router_options(r, c) for r in routers} for t, c in configs.items()}}
    setup = json.loads(json.dumps(setup))  # tuples -> lists, as read back from the file
    command = command or " ".join(["python -m minimoe.experiments", *sys.argv[1:]])
    now = datetime.datetime.now().isoformat(timespec="seconds")
    if provenance_path.exists():
        try:
            provenance = json.loads(provenance_path.read_text(encoding="utf-8"))
            _check_same_setup(provenance, setup, out)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{provenance_path} is damaged ({type(error).__name__}: {error}); restore it from a "
                             "copy, or rerun with --fresh or another --out") from None
        # every later command that added to the folder, with the code it ran (a resumed run may add
        # tasks, routers and seeds; the reproduction test reruns a run at the current commit)
        provenance.setdefault("resumed", []).append({"date": now, "command": command, "commit": commit,
                                                     "uncommitted_changes": dirty,
                                                     "device": device_name(torch_device), **cpu_signature()})
        provenance["configs"].update(setup["configs"])
        for t, options in setup["router_options"].items():
            provenance["router_options"].setdefault(t, {}).update(options)
    else:
        provenance = {"command": command, "commit": commit, "uncommitted_changes": dirty, "date": now,
                      "device": device_name(torch_device), **cpu_signature(), "torch": torch.__version__,
                      "python": platform.python_version(), **setup}
    variants = {r: variants_of[r][0] for r in routers if r in variants_of}
    if variants:  # which registered router each variant name runs (its options are in router_options)
        provenance.setdefault("variants", {}).update(variants)
    atomic_write(provenance_path, (json.dumps(provenance, indent=1) + "\n").encode())

    rows = read_results(results_path) if results_path.exists() else []
    wrong_steps = sorted({(r["task"], r["steps"]) for r in rows if r["task"] in configs
                          and r["steps"] != configs[r["task"]].steps})
    if wrong_steps:
        raise ValueError(f"{results_path} holds runs of {wrong_steps} (task, steps), but this command trains "
                         f"{ {t: c.steps for t, c in configs.items()} }: rerun with --fresh or another --out")
    done = complete_runs(rows)
    plan = [(t, r, s) for t in tasks for r in routers for s in range(seeds)]
    pending = [item for item in plan if item not in done]
    order = {item: i for i, item in enumerate(plan)}
    return plan, pending, order


def _claim_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name[:-len(".pt")] + ".claim")


@contextlib.contextmanager
def _run_claim(path: Path, *, wait: bool):
    """A claim on one (task, router, seed) run: ``checkpoints/<run>.claim``, flock'ed by the process
    training the run. Yields ``None`` when this process holds the claim, else (``wait=False`` and another
    live process holds it) the holder's note (``pid ... on host ... since ...``).

    A lock, not a marker file: the kernel releases it when its holder ends, however it ends (SIGKILL,
    a power cut of one machine), so a claim is never left stale and a dead command's run is taken over
    by the next command, which resumes from its checkpoint. The holder removes the file before
    releasing the lock; a waiter that then gets the lock on the removed file sees it is no longer the
    file at the path, and tries again. Without flock (Windows), claims are not taken: one command per
    folder at a time is then the user's to ensure."""
    try:
        import fcntl
    except ImportError:
        yield None
        return
    while True:
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.seek(0)
            note = handle.read().strip() or "another process"
            handle.close()
            yield note
            return
        try:
            mine = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            mine = False
        if mine:
            break
        handle.close()  # its holder removed it while this process waited: claim the file at the path
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {platform.node()} since "
                     f"{datetime.datetime.now().isoformat(timespec='seconds')}\n")
        handle.flush()
        yield None
    finally:
        path.unlink(missing_ok=True)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _record(out: Path, item, metrics: dict, wall: float, scale: str, steps: int, device_type: str,
            order: dict) -> None:
    """Merge one finished run's rows into the results file as it is now (other processes may have added
    theirs), under the folder's lock, written atomically."""
    task_name, router, seed = item
    results_path = out / "results.csv"
    new = [{"task": task_name, "scale": scale, "router": router, "seed": seed, "metric": name, "value": value,
            "steps": steps, "wall_time_s": wall, "device": device_type} for name, value in metrics.items()]
    with _folder_lock(out):
        current = read_results(results_path) if results_path.exists() else []
        merged = [r for r in current if (r["task"], r["router"], r["seed"]) != item] + new  # (a damaged run: replaced)
        # plan order, whatever order the runs finished in: the same results give the same file;
        # runs of other commands keep their order, after this plan's
        merged = [r for _, r in sorted(enumerate(merged), key=lambda ir: (
            order.get((ir[1]["task"], ir[1]["router"], ir[1]["seed"]), len(order)), ir[0]))]
        _write_results(results_path, merged)


def _claimed_job(out: Path, item, config, scale: str, order: dict, device, progress: bool, wait: bool):
    """One pending run, in this process or a worker: claim it (:func:`_run_claim`), and unless it is
    finished by now (another command trained it meanwhile), train it, record its rows and delete its
    checkpoint. Returns ``("trained", None)``, ``("done", None)`` or, when another live process holds the
    claim and ``wait`` is False, ``("busy", holder's note)``."""
    checkpoint = out / "checkpoints" / _checkpoint_name(item)
    with _run_claim(_claim_path(checkpoint), wait=wait) as holder:
        if holder is not None:
            return "busy", holder
        # a command killed while writing this run's checkpoint left its temporary file; the claim is
        # ours, so no one writes it now
        remove_write_leftovers(checkpoint)
        results_path = out / "results.csv"
        with _folder_lock(out):
            rows = read_results(results_path) if results_path.exists() else []
        if item in complete_runs(rows):
            # a command that died between recording the run and removing its checkpoint left it behind
            if checkpoint.is_file():
                checkpoint.unlink()
            return "done", None
        if checkpoint.is_dir():  # not a checkpoint train() could read or write: set aside, as a damaged one
            aside = set_aside(checkpoint)
            warnings.warn(f"checkpoint {checkpoint} is a folder, not a checkpoint: set aside as {aside.name}; the "
                          "run starts from step 0", RuntimeWarning, stacklevel=2)
        metrics, wall = _train_job(config, *item, device, checkpoint, progress)
        _record(out, item, metrics, wall, scale, config.steps, torch.device(device).type, order)
        checkpoint.unlink(missing_ok=True)
        return "trained", None


#: What the last :func:`run` of this process did: the runs it ``trained``, those another command on the
#: folder trained meanwhile (``by_others``) and those it found finished (``already_done``, a count).
LAST_RUN: dict = {}


def _train_and_record(out, plan, pending, order, configs, scale, torch_device, workers, progress, checkpoints,
                      results_path):
    """Train the pending runs, each under its claim (:func:`_run_claim`): two commands on one folder
    train different runs side by side, and neither trains a run the other is training or has finished.
    A first pass skips the runs another live command holds; a second waits for each of them, and trains
    it if that command ended without finishing it (killed: then from its checkpoint)."""
    LAST_RUN.clear()
    LAST_RUN.update(trained=[], by_others=[], already_done=len(plan) - len(pending))

    def jobs(items, wait):  # yields (item, status, note) as each run is settled
        if workers == 1:
            for item in items:
                yield item, *_claimed_job(out, item, configs[item[0]], scale, order, torch_device, progress, wait)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # separate processes (spawned, so no torch state is shared), each with the main process's thread
        # count; each claims, trains and records its run
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=torch.set_num_threads,
                                 initargs=(torch.get_num_threads(),)) as pool:
            # seed-major: an interrupted study holds whole seeds of every task and router
            futures = {pool.submit(_claimed_job, out, item, configs[item[0]], scale, order, torch_device, False,
                                   wait): item
                       for item in sorted(items, key=lambda item: (item[2], order[item]))}
            failures = []
            for future in as_completed(futures):
                if future.exception() is not None:  # the other runs go on; the failures are raised at the end
                    failures.append((futures[future], future.exception()))
                    continue
                yield futures[future], *future.result()
        if failures:
            raise RuntimeError("runs failed (their checkpoints are kept; the same command resumes): " +
                               "; ".join(f"{'/'.join(map(str, item))}: {error!r}" for item, error in failures)) \
                from failures[0][1]

    def settled():
        busy = []
        for item, status, note in jobs(pending, wait=False):
            if status == "busy":
                busy.append((item, note))
                continue
            yield item, status
        for item, note in busy:
            print(f"waiting for {'/'.join(map(str, item))}, which another command is training ({note})",
                  file=sys.stderr, flush=True)
        yield from ((item, status) for item, status, _ in jobs([item for item, _ in busy], wait=True))

    for item, status in progress_bar(settled(), desc=f"zoo ({scale})", enabled=progress,
                                     initial=len(plan) - len(pending), total=len(plan)):
        LAST_RUN["trained" if status == "trained" else "by_others"].append(item)
    return results_path


def summarize(rows: list[dict], metric: str, *, task: str | None = None) -> dict:
    """``{router: (mean, half-range, n_seeds)}`` of one metric (over seeds), in first-seen order."""
    values = {}
    for row in rows:
        if row["metric"] == metric and (task is None or row["task"] == task):
            values.setdefault(row["router"], []).append(row["value"])
    return {r: (sum(v) / len(v), (max(v) - min(v)) / 2, len(v)) for r, v in values.items()}
