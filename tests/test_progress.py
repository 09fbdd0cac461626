"""Progress output: a live bar only in a terminal; elsewhere at most one line per loop, no warning."""
import io
import warnings

import torch

from minimoe.progress import live_terminal, progress
from minimoe.train import train


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_outside_a_terminal_a_loop_prints_one_line(capsys):
    bar = progress(range(7), desc="demo")
    for i in bar:
        bar.set_postfix(loss=f"{i:.1f}")
    out = capsys.readouterr()
    assert out.err == ""
    assert out.out.count("\n") == 1 and out.out.startswith("demo: 7/7 in ") and "loss=6.0" in out.out


def test_inner_loops_and_disabled_bars_print_nothing(capsys):
    assert list(progress(range(3), desc="inner", leave=False)) == [0, 1, 2]
    assert list(progress(range(3), desc="off", enabled=False)) == [0, 1, 2]
    assert capsys.readouterr().out == ""


def test_resumed_loop_counts_from_its_start(capsys):
    list(progress(range(4, 10), desc="resumed", initial=4, total=10))
    assert capsys.readouterr().out.startswith("resumed: 10/10 in ")


def test_in_a_terminal_the_bar_is_tqdm():
    stream = FakeTerminal()
    assert live_terminal(stream) and not live_terminal(io.StringIO())
    assert list(progress(range(5), desc="live", file=stream)) == list(range(5))
    assert "live" in stream.getvalue() and "5/5" in stream.getvalue()


def test_training_in_a_notebook_prints_one_line_and_no_warning(capsys):
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, lambda step: (x, y), torch.nn.functional.mse_loss, steps=25, eval_every=0, desc="fit")
    out = capsys.readouterr()
    assert out.err == "" and out.out.count("\n") == 1 and out.out.startswith("fit: 25/25 in ")
