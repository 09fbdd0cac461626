"""The head-to-head: every registered router on the same tasks at equal active compute.

Book: chapter 9, "What the routers teach us"; notebook 13, "The router zoo". From a shell::

    python -m minimoe.experiments run --task lm --routers all --scale toy --seeds 3
    python -m minimoe.experiments show runs/zoo-toy

From Python: ``run(...)`` writes a results folder and returns its ``results.csv``; ``read_results``
loads one; ``summarize`` gives mean and spread over seeds; ``stats`` compares routers over paired seeds
and ``claims`` re-tests the papers' claims on a results file. ``toy_lm`` is the notebooks' harness:
the character-level TinyLM trained over a (router, options, seed) grid on ``minimoe.train.train``,
evaluated with its routing statistics and compared with ``stats``' paired intervals; its ``Grid`` (results
keyed by (label, seed), with paired comparisons) serves any notebook's runs.
"""
from . import claims, stats, toy_lm
from .configs import SCALES, TASKS, TaskConfig, base_router, router_options, study_entries, study_variants, task_config
from .runner import RESULT_COLUMNS, TIMING_METRICS, read_results, run, summarize, train_one
from .tasks import make_task, specialisation, token_expert_weights
from .toy_lm import Grid

__all__ = ["claims", "stats", "toy_lm", "SCALES", "TASKS", "TaskConfig", "base_router", "router_options", "study_entries",
           "study_variants", "task_config",
           "RESULT_COLUMNS", "TIMING_METRICS", "read_results", "run", "summarize", "train_one", "make_task",
           "specialisation", "token_expert_weights", "Grid"]
