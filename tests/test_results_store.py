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


def _summary(stdout: str) -> tuple[int, int]:
    """(runs this command trained, runs in all) from the CLI's last line."""
    import re

    found = re.search(r"this command trained (\d+) of (\d+) runs", stdout)
    assert found, stdout[-500:]
    return int(found.group(1)), int(found.group(2))


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_two_commands_with_the_same_runs_train_each_run_once(tmp_path):
    """Two identical commands on one folder, side by side: each run is claimed by one of them, so the
    runs are trained once in all (they used to be trained by both), and both end with every row."""
    out = tmp_path / "zoo"
    command = ["run", "--task", "clustered", "--routers", "softmax_topk,expert_choice", "--seeds", "2",
               "--steps", "300", "--threads", "1", "--no-progress", "--out", str(out)]
    procs = [_cli(*command) for _ in range(2)]
    outputs = []
    for proc in procs:
        stdout, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outputs.append(stdout)
    trained = [_summary(stdout) for stdout in outputs]
    print("runs trained by each command:", trained)
    assert sum(n for n, _ in trained) == 4 and all(total == 4 for _, total in trained), trained
    rows = read_results(out)
    assert complete_runs(rows) == {("clustered", r, s) for r in ("softmax_topk", "expert_choice") for s in (0, 1)}
    assert _leftovers(out) == []  # no checkpoint, no claim


def test_a_command_waits_for_a_run_another_process_holds_then_trains_it_when_that_one_is_gone(tmp_path):
    """The test holds a run's claim as a live command would: the command trains the other run, says
    it is waiting, and trains the held run once the holder lets go (as the kernel does for a killed one)."""
    import fcntl
    import time

    out = tmp_path / "zoo"
    (out / "checkpoints").mkdir(parents=True)
    claim = out / "checkpoints" / "clustered-softmax_topk-seed0.claim"
    holder = open(claim, "a+")
    fcntl.flock(holder, fcntl.LOCK_EX)
    holder.write("pid 4242 on elsewhere since then\n")
    holder.flush()
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "minimoe.experiments", "run", "--task", "clustered",
                                 "--routers", "softmax_topk", "--seeds", "2", "--steps", "3", "--threads", "1",
                                 "--no-progress", "--out", str(out)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                stderr=err_file, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + 120
            while "waiting for" not in err_path.read_text():
                assert proc.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline, "the command never said it was waiting"
                time.sleep(0.2)
            assert "clustered/softmax_topk/0" in err_path.read_text() and "pid 4242" in err_path.read_text()
            assert {r["seed"] for r in read_results(out)} == {1}  # the free run was trained meanwhile
            fcntl.flock(holder, fcntl.LOCK_UN)
            holder.close()
            stdout, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err_path.read_text()
    assert _summary(stdout) == (2, 2)
    assert complete_runs(read_results(out)) == {("clustered", "softmax_topk", s) for s in (0, 1)}
    assert _leftovers(out) == []


def test_the_claim_of_a_killed_command_is_not_stale(tmp_path):
    """SIGKILL a command mid-run: its claim file stays but its lock dies with it, so the next command
    takes the run over at once and resumes from the checkpoint, to the bits of an uninterrupted run."""
    import signal
    import time

    out = tmp_path / "zoo"
    command = ["run", "--task", "clustered", "--routers", "softmax_topk", "--seeds", "1", "--steps", "1500",
               "--checkpoint-every", "5", "--threads", "1", "--no-progress", "--out", str(out)]
    proc = _cli(*command)
    checkpoint = out / "checkpoints" / "clustered-softmax_topk-seed0.pt"
    deadline = time.monotonic() + 120
    try:
        while not checkpoint.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert (out / "checkpoints" / "clustered-softmax_topk-seed0.claim").exists()
    again = _cli(*command)
    stdout, err = again.communicate(timeout=300)
    assert again.returncode == 0 and "waiting" not in err, err
    assert _summary(stdout) == (1, 1)
    reference = run("clustered", "softmax_topk", out=tmp_path / "reference", **{**TINY, "steps": 1500})
    values = {r["metric"]: r["value"] for r in read_results(out) if r["metric"] != "ms_per_step"}
    assert values == {r["metric"]: r["value"] for r in read_results(reference) if r["metric"] != "ms_per_step"}
    assert _leftovers(out) == []


def test_a_checkpoint_write_leaves_no_temporary_file_and_two_writers_do_not_share_one(tmp_path):
    from minimoe.train import atomic_write

    path = tmp_path / "state.pt"
    atomic_write(path, b"one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two" and sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
    mask = os.umask(0o022)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600
    # two writers at once (threads: file writes release the GIL), each writing whole payloads: every
    # read finds one payload whole, and neither writer fails. Writers sharing one temporary name
    # interleave their bytes in it, or one renames it away under the other (FileNotFoundError).
    import threading
    payloads = [bytes([i]) * (1 << 21) for i in (1, 2)]
    errors, seen = [], set()

    def write(data):
        try:
            for _ in range(25):
                atomic_write(path, data)
                seen.add(path.read_bytes() in payloads)
        except Exception as error:  # noqa: BLE001 -- collected and asserted below
            errors.append(error)
    threads = [threading.Thread(target=write, args=(data,)) for data in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and seen == {True} and path.read_bytes() in payloads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


def test_a_killed_writes_temporary_checkpoint_is_removed_by_the_next_command(tmp_path):
    """A SIGKILL during train.py's atomic checkpoint write leaves ``.<name>.<random>.tmp`` behind; the
    command that takes the run over removes it (and only the files of its own run)."""
    out = tmp_path / "zoo"
    (out / "checkpoints").mkdir(parents=True)
    mine = out / "checkpoints" / ".clustered-softmax_topk-seed0.pt.abc123.tmp"
    other = out / "checkpoints" / ".clustered-expert_choice-seed0.pt.def456.tmp"
    mine.write_bytes(b"half a checkpoint")
    other.write_bytes(b"another run's")
    run("clustered", "softmax_topk", out=out, **TINY)
    assert not mine.exists()
    assert other.exists()  # not this command's run: left to the command that takes that run over
