"""A core install (torch, numpy, tqdm only) runs every router, the exercises and the experiments.

scipy, POT and hypothesis are test oracles (the ``test`` extra) and matplotlib is for the book: a
subprocess makes them unimportable and then uses the package end to end. In this process scipy is
the oracle for the pure-torch replacements (``linear_assignment(method="auto")`` without scipy, the
relabelling of ``experiments.specialisation``, the chi-square p-value of chapter 7's checker).
"""
import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment
from scipy.stats import chi2

from minimoe.ops import linear_assignment, solve_assignment

BLOCKED = ("scipy", "ot", "hypothesis", "matplotlib")

# Run first in every subprocess: a finder at the front of sys.meta_path refuses the optional packages.
# Importing one raises ModuleNotFoundError, as when it is not installed. The finder itself does not
# raise (torch._dynamo probes optional modules with importlib.util.find_spec, which would propagate
# it): it returns a spec without an origin, whose loader raises.
BLOCK = textwrap.dedent(f"""
    import importlib.machinery
    import sys
    BLOCKED = {BLOCKED!r}
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                return importlib.machinery.ModuleSpec(name, self, origin=None)
            return None

        def create_module(self, spec):
            raise ModuleNotFoundError(f"No module named {{spec.name!r}} (blocked: a core install)", name=spec.name)

        def exec_module(self, module):
            raise AssertionError("unreachable")

    sys.meta_path.insert(0, Blocker())
""")


def run_core(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter with the optional packages blocked; it must exit 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    result = subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(script), *args], env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def test_blocker_blocks():
    result = run_core("""
        for name in BLOCKED:
            try:
                __import__(name)
            except ImportError:
                print("blocked", name)
    """)
    assert result.stdout.split() == [w for name in BLOCKED for w in ("blocked", name)]


def test_core_install_runs_routers_exercises_and_experiments(tmp_path):
    result = run_core("""
        import subprocess, sys
        import torch
        import minimoe
        from minimoe.exercises import check_ksubset_sample
        from minimoe.ops import ksubset_sample, linear_assignment, solve_assignment

        torch.manual_seed(0)
        x = torch.randn(2, 16, 8)
        for name in minimoe.routers.available():
            layer = minimoe.MoELayer(d_model=8, d_hidden=16, n_experts=4, router=name, group_size=16)
            layer.train()
            out = layer(x)
            (out.square().mean() + layer.aux_loss).backward()
            assert torch.isfinite(out).all(), name
            layer.eval()
            with torch.no_grad():
                assert layer(x).shape == x.shape, name
            print("router ok", name)

        # the exact solvers, and what needs scipy says so
        S = torch.randn(3, 12, 4, dtype=torch.float64)
        assert (torch.stack([torch.bincount(z, minlength=4) for z in linear_assignment(S, 3)]) <= 3).all()
        for call in (lambda: linear_assignment(S, 3, method="scipy"),
                     lambda: solve_assignment(S, 3, method="assignment")):
            try:
                call()
            except ImportError as error:
                assert "pip install scipy" in str(error) and 'method="auto"' in str(error), error
            else:
                raise AssertionError("method needing scipy ran without it")
        try:
            minimoe.ops.solve_selection_lp(torch.randn(4, 3), budget=2)
        except ImportError as error:
            assert "pip install scipy" in str(error), error
        else:
            raise AssertionError("solve_selection_lp ran without scipy")

        sample = lambda r, k, gen: ksubset_sample(r, k, generator=gen)
        assert check_ksubset_sample(sample, draws=500, verbose=False)
        print("exercises ok")

        # `python -m minimoe.experiments run ...`, in this interpreter so that the blocker holds
        import runpy
        sys.argv = ["minimoe.experiments", "run", "--task", "clustered", "--routers", "base,kool_gumbel_matching",
                    "--scale", "toy", "--seeds", "1", "--steps", "2", "--out", OUT, "--no-progress",
                    "--threads", "1", "--device", "cpu"]
        try:
            runpy.run_module("minimoe.experiments", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            assert exit.code in (0, None), exit.code
        print("scipy imported:", any(n.split(".")[0] in BLOCKED for n in sys.modules))
    """.replace("OUT", repr(str(tmp_path / "zoo"))), timeout=240)
    routers_ok = [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("router ok")]
    import minimoe
    assert routers_ok == minimoe.routers.available()
    assert "exercises ok" in result.stdout
    assert "results:" in result.stdout and (tmp_path / "zoo").is_dir()
    assert result.stdout.rstrip().endswith("scipy imported: False")


# --- the pure-torch replacements against scipy ------------------------------------------------------

def scipy_total(S, capacity):
    M = np.repeat(S.numpy(), min(capacity, S.shape[0]), axis=1)
    rows, cols = linear_sum_assignment(M, maximize=True)
    return float(M[rows, cols].sum())


def brute_total(S, capacity):
    T, E = S.shape
    return max(sum(float(S[t, e]) for t, e in enumerate(z)) for z in itertools.product(range(E), repeat=T)
               if np.bincount(z, minlength=E).max() <= capacity)


def random_instances(n=50, seed=0):
    """(scores (T, E) float64, capacity): balanced, with slack, ties (integer scores), E in 1..6."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        E = int(torch.randint(1, 7, (1,), generator=gen))
        T = int(torch.randint(1, 25, (1,), generator=gen))
        capacity = -(-T // E) + (int(torch.randint(0, 3, (1,), generator=gen)) if i % 2 else 0)
        if i % 3 == 0:  # many ties
            S = torch.randint(-2, 3, (T, E), generator=gen).double()
        else:
            S = torch.randn(T, E, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen) * 10 + 0.1)
        yield S, capacity


def test_auto_without_scipy_matches_scipy(tmp_path):
    """Totals (ties allow different optima) of method="auto" with scipy blocked vs scipy's optimum."""
    instances = list(random_instances())
    path = tmp_path / "instances.pt"
    torch.save(instances, path)
    run_core(f"""
        import torch
        from minimoe.ops import linear_assignment, solve_assignment
        out = []
        for S, c in torch.load({str(path)!r}):
            out.append((linear_assignment(S, c), linear_assignment(S.float(), c), solve_assignment(S, c),
                        linear_assignment(S[None].expand(3, -1, -1), c)))
        torch.save(out, {str(path)!r} + ".out")
        assert "scipy" not in sys.modules
    """)
    results = torch.load(str(path) + ".out")
    for (S, c), (z, z32, z_solve, z_batch) in zip(instances, results):
        best = scipy_total(S, c)
        tol = 1e-7 * (1 + S.abs().max().item())
        for assignment in (z, z32, z_solve, *z_batch):
            assert assignment.dtype == torch.long and assignment.shape == (S.shape[0],)
            assert torch.bincount(assignment, minlength=S.shape[1]).max() <= c
            assert abs(S.gather(1, assignment[:, None]).sum().item() - best) <= tol
        if S.shape[1] ** S.shape[0] <= 5000:
            assert abs(brute_total(S, c) - best) <= tol


def test_auto_with_scipy_is_optimal():
    for S, c in random_instances(20, seed=1):
        for z in (linear_assignment(S, c), solve_assignment(S, c)):
            assert abs(S.gather(1, z[:, None]).sum().item() - scipy_total(S, c)) <= 1e-9 * (1 + S.abs().max().item())


def test_specialisation_matches_hungarian():
    from minimoe.experiments.tasks import specialisation

    gen = torch.Generator().manual_seed(2)
    for i in range(40):
        n_true = int(torch.randint(1, 9, (1,), generator=gen))
        E = int(torch.randint(1, 9, (1,), generator=gen))
        N = int(torch.randint(1, 300, (1,), generator=gen))
        true = torch.randint(0, n_true, (N,), generator=gen)
        true[0] = n_true - 1  # the table has n_true rows
        chosen = torch.randint(-1 if i % 2 else 0, E, (N,), generator=gen)
        if i % 4 == 0:  # a router that mostly follows the clusters
            chosen = torch.where(torch.rand(N, generator=gen) < 0.7, true % E, chosen)
        kept = chosen >= 0
        table = np.zeros((n_true, E))
        np.add.at(table, (true[kept].numpy(), chosen[kept].numpy()), 1)
        rows, cols = linear_sum_assignment(table, maximize=True)
        assert specialisation(true, chosen, E) == float(table[rows, cols].sum() / N)


def test_chi2_sf_matches_scipy():
    from minimoe.exercises.chapter7 import _chi2_sf

    for df in (1, 2, 3, 5, 9, 19, 34, 100):
        for x in (0.0, 1e-6, 0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 400):
            want = chi2.sf(x, df)
            assert _chi2_sf(x, df) == pytest.approx(want, rel=1e-9, abs=1e-300), (x, df)
