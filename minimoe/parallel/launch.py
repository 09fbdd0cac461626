"""Starting several ranks on one machine: from a script (``torchrun``) or from Python (``run_local``).

Book: chapter 8, "Running it". ``torchrun --nproc_per_node=W script.py`` starts ``W`` processes
with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; :func:`init_from_env` then
joins them. :func:`run_local` does the same from inside Python (a notebook, a test): it spawns ``W``
fresh interpreters that meet on a free local TCP port, runs a function on each, and returns what
each rank returned.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(world_size: int | None = None) -> str:
    """``"nccl"`` when CUDA is available with at least one GPU per rank, else ``"gloo"``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        if world_size is None or torch.cuda.device_count() >= world_size:
            return "nccl"
    return "gloo"


def init_from_env(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` described in the environment.

    Returns ``(rank, world_size, device)``: with NCCL each rank takes the GPU ``LOCAL_RANK``.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = backend or pick_backend(world)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    return rank, dist.get_world_size(), device


def _entry(rank, fn, world_size, port, backend, timeout_s, out_dir, args):
    torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_local(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined in a process
    group; return the list of their results (rank order). ``fn`` must be importable (defined at the
    top level of a module, not in a notebook cell). An exception on any rank is raised here; a run
    longer than ``timeout_s`` seconds is stopped with ``TimeoutError`` (collectives also time out
    after ``timeout_s``, so a rank that waits for a partner that died does not hang forever)."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_entry, args=(fn, world_size, free_port(), backend, timeout_s, out_dir, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s + 30.0
        while not context.join(timeout=0.1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                raise TimeoutError(f"run_local: the {world_size} ranks did not finish in {timeout_s + 30:.0f} s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
