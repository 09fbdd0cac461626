"""The coursework checkers accept the reference and reject typical wrong answers."""
import math

import torch

from minimoe.exercises import check_capacity, check_token_choice_allocation
from minimoe.ops import compute_capacity, token_choice_allocation
from reference import algorithm1_token_choice


def test_checkers_accept_correct_solutions(capsys):
    assert check_token_choice_allocation(lambda s, k, c: token_choice_allocation(s, k, c))
    # An independent correct solution: the literal loop, converted to a slot table.
    def loop_solution(scores, k, C):
        D = algorithm1_token_choice(scores, k, C)
        return torch.where(D.any(-1), D.argmax(-1), torch.full(D.shape[:2], -1))
    assert check_token_choice_allocation(loop_solution)
    assert check_capacity(lambda t, e, f: compute_capacity(t, e, f))
    assert "PASS" in capsys.readouterr().out


def test_checkers_reject_wrong_solutions(capsys):
    # Token-major order (a token's second choice before the next token's first) is the classic bug.
    def token_major(scores, k, C):
        T, E = scores.shape
        position = torch.full((T, E), -1)
        fill = [0] * E
        for t in range(T):
            for r in scores[t].topk(k).indices.tolist():
                if fill[r] < C:
                    position[t, r] = fill[r]
                    fill[r] += 1
        return position
    assert not check_token_choice_allocation(token_major)
    assert not check_token_choice_allocation(lambda s, k, c: torch.zeros(3))
    assert not check_capacity(lambda t, e, f: max(1, round(f * t / e)))  # banker's rounding, no error
    assert not check_capacity(lambda t, e, f: math.ceil(f * t / e))
    out = capsys.readouterr().out
    assert out.count("FAIL") == 4 and "round" in out
