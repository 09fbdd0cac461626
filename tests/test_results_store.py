"""The study's results folder as a store: concurrent writers lose nothing, a damaged file is named (or its
damaged run retrained), a folder is resumed only with what it was made with, and ``show`` does not
average what it cannot average honestly. The concurrency case runs two real CLI processes on tiny runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minimoe.experiments import read_results, run
from minimoe.experiments.runner import DamagedResults, complete_runs

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(scale="toy", seeds=1, steps=2, progress=False, threads=1)


def _cli(*args, timeout=300):
    return subprocess.Popen([sys.executable, "-m", "minimoe.experiments", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_commands_on_one_folder_side_by_side_lose_no_row(tmp_path):
    out = tmp_path / "zoo"
    common = ["run", "--task", "clustered", "--scale", "toy", "--seeds", "2", "--steps", "3", "--threads", "1",
              "--no-progress", "--out", str(out)]
    procs = [_cli(*common, "--routers", routers) for routers in ("softmax_topk,expert_choice", "loss_free,usmoe")]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    rows = read_results(out)
    assert {(r["router"], r["seed"]) for r in rows} == {(r, s) for r in ("softmax_topk", "expert_choice", "loss_free",
                                                                          "usmoe") for s in (0, 1)}
    assert complete_runs(rows) == {("clustered", r, s) for r, s in {(r["router"], r["seed"]) for r in rows}}
    provenance = json.loads((out / "provenance.json").read_text())
    assert {"softmax_topk", "usmoe"} <= set(provenance["router_options"]["clustered"])


def test_a_run_with_lost_rows_is_trained_again(tmp_path):
    out = tmp_path / "zoo"
    path = run("clustered", "softmax_topk,expert_choice", out=out, **TINY)
    full = read_results(path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-3]) + "\n")  # the last run's last three metrics gone
    damaged = read_results(path)
    assert ("clustered", "expert_choice", 0) not in complete_runs(damaged)
    run("clustered", "softmax_topk,expert_choice", out=out, **TINY)
    again = read_results(path)
    assert len(again) == len(full) and complete_runs(again) == complete_runs(full)


def test_a_folder_without_its_provenance_is_refused(tmp_path):
    out = tmp_path / "zoo"
    run("clustered", "softmax_topk", out=out, **TINY)
    (out / "provenance.json").unlink()
    with pytest.raises(ValueError, match="no provenance.json.*--fresh"):
        run("clustered", "softmax_topk", out=out, **{**TINY, "steps": 4})
    (out / "provenance.json").write_text("{not json")
    with pytest.raises(ValueError, match="provenance.json is damaged.*--fresh"):
        run("clustered", "softmax_topk", out=out, **TINY)


@pytest.mark.parametrize("damage, match", [
    (lambda text: text.rsplit("\n", 2)[0][:-7] + "\n", "line .*truncated or damaged row"),
    (lambda text: text.replace("wall_time_s", "wall"), "lacks the column"),
    (lambda text: text + text.split("\n", 1)[1], "a second row for"),
    (None, "not a text results file"),
])
def test_a_damaged_results_file_is_named_with_the_fix(tmp_path, damage, match):
    out = tmp_path / "zoo"
    path = run("clustered", "softmax_topk", out=out, **TINY)
    if damage is None:
        path.write_bytes(b"\x80\x81\xff" * 20)
    else:
        path.write_text(damage(path.read_text()))
    with pytest.raises(DamagedResults, match=f"{path}.*{match}.*--fresh"):
        read_results(path)
    proc = _cli("show", str(out))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and str(path) in err and "Traceback" not in err


def test_show_refuses_an_empty_file_and_warns_of_uneven_seeds(tmp_path):
    from minimoe.experiments.__main__ import show

    out = tmp_path / "zoo"
    path = run("clustered", "softmax_topk", out=out, **{**TINY, "seeds": 2})
    header, *rows = path.read_text().splitlines()
    kept = [line for line in rows if not (line.split(",")[3] == "1" and ",val_r2," in line)]
    path.write_text("\n".join([header, *kept]) + "\n")
    assert "val_r2 is missing for seeds [1]" in show(out)
    path.write_text(header + "\n")
    with pytest.raises(ValueError, match="holds no results"):
        show(out)


def test_show_of_a_folder_still_being_filled_names_the_routers_it_cannot_pair_yet(tmp_path):
    """While another command is still training, a router may have one seed: show pairs the others and
    says which it left out (it raised, failing the first command's final print)."""
    from minimoe.experiments.__main__ import show

    out = tmp_path / "zoo"
    run("clustered", "softmax_topk,expert_choice", out=out, **{**TINY, "seeds": 2})
    path = out / "results.csv"
    header, *rows = path.read_text().splitlines()
    path.write_text("\n".join([header, *[r for r in rows if not (",expert_choice,1," in r)]]) + "\n")
    text = show(out)
    assert "not compared yet, fewer than two seeds: expert_choice" in text
