"""Literal, loop-by-loop transcriptions of the paper's algorithms: the oracles of the tests.

Written for clarity, not speed; they work on one group (T, E) at a time and return the dispatch
tensor D (T, E, C) as nested loops would fill it.
"""
import torch



def algorithm1_token_choice(P, k, C, batch_priority=False):
    """Liu et al. Algorithm 1 (token choice), transcribed. ``C=None`` means unlimited buffers.

    A token's single choice (k = 1) is its first largest entry, the rule the package states; for
    k > 1 the ranking is taken from torch.topk, whose order among ties the package keeps. Everything
    else (queue order, buffers, drops) is the loop.
    """
    T, E = P.shape
    slots = T if C is None else C
    D = torch.zeros(T, E, slots, dtype=torch.long)
    fill = [0] * E
    if k == 1:  # Python's max returns the first of equal maxima
        ranked = [[max(range(E), key=lambda e: float(P[t, e]))] for t in range(T)]
    else:
        ranked = [P[t].topk(k).indices.tolist() for t in range(T)]
    tokens = list(range(T))
    if batch_priority:
        tokens = sorted(tokens, key=lambda t: -float(P[t].max()))  # stable: ties keep token order
    for i in range(k):  # all first choices before any second choice
        for t in tokens:
            r = ranked[t][i]
            if fill[r] < slots:
                D[t, r, fill[r]] = 1
                fill[r] += 1
    return D


def algorithm2_expert_choice(P, C):
    """Liu et al. Algorithm 2 (expert choice), transcribed: expert r's slot c holds its c-th best token."""
    T, E = P.shape
    D = torch.zeros(T, E, C, dtype=torch.long)
    for r in range(E):
        column = sorted(range(T), key=lambda t: -float(P[t, r]))
        for c in range(C):
            D[column[c], r, c] = 1
    return D


def position_to_dispatch(position, C):
    """The slot table of minimoe as a dense (T, E, C) 0/1 tensor."""
    T, E = position.shape
    D = torch.zeros(T, E, C, dtype=torch.long)
    for t in range(T):
        for e in range(E):
            if position[t, e] >= 0:
                D[t, e, position[t, e]] = 1
    return D


def moe_per_token(layer, x, gates):
    """Eq. (1) token by token: ``out[t] = sum_r gates[t, r] * MLP_r(x[t])`` (x: (T, d))."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for r in range(gates.shape[1]):
            if gates[t, r] != 0:
                out[t] += gates[t, r] * layer.experts.forward_one(r, x[t:t + 1])[0]
    return out
