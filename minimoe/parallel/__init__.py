"""Expert parallelism over ``torch.distributed``: the MoE layer with its experts sharded across ranks.

Book: chapter 8 (Expert parallelism); notebook 12 (expert parallelism on a laptop).

* :class:`ExpertParallelMoELayer` -- same parameters as :class:`minimoe.MoELayer`, plus
  ``process_group`` and ``exchange="capacity" | "variable"``; gloo on CPU, NCCL on GPUs.
* :func:`convert_to_expert_parallel` -- switch a whole model (e.g. :class:`minimoe.models.TinyLM`)
  in one call; :meth:`ExpertParallelMoELayer.from_single_device`, :func:`load_single_device_weights`.
* :func:`allreduce_replicated_grads`, :func:`broadcast_replicated` -- the replicated weights.
* :class:`ExchangeStats`, :func:`gather_stats` -- per-rank traffic, buffer fill, drops and times.
* :func:`send_counts`, :func:`expected_overflow`, :func:`max_load_bound`, :func:`idle_fraction` --
  the chapter's formulas.
* :func:`run_local`, :func:`init_from_env` -- start ranks from Python or under ``torchrun``;
  ``python -m minimoe.parallel.demo`` is the notebook's experiment.
"""
from .analysis import expected_overflow, idle_fraction, max_load_bound, send_counts
from .comm import all_to_all
from .launch import free_port, init_from_env, pick_backend, run_local
from .layer import (EXCHANGES, ExchangeStats, ExpertParallelMoELayer, allreduce_replicated_grads,
                    broadcast_replicated, convert_to_expert_parallel, expert_parallel_layers, gather_stats,
                    load_single_device_weights, replicated_parameters)

__all__ = ["ExpertParallelMoELayer", "ExchangeStats", "EXCHANGES", "convert_to_expert_parallel",
           "load_single_device_weights", "allreduce_replicated_grads", "broadcast_replicated",
           "replicated_parameters", "expert_parallel_layers", "gather_stats", "all_to_all", "send_counts",
           "expected_overflow", "max_load_bound", "idle_fraction", "run_local", "init_from_env", "pick_backend",
           "free_port"]
