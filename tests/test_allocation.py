"""Token-choice and expert-choice allocation against literal transcriptions of Alg. 1 and 2."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minimoe.ops import expert_choice_allocation, token_choice_allocation, top_k
from reference import algorithm1_token_choice, algorithm2_expert_choice, position_to_dispatch


def random_instance(gen, ties):
    T = int(torch.randint(1, 40, (1,), generator=gen))
    E = int(torch.randint(1, 10, (1,), generator=gen))
    k = int(torch.randint(1, E + 1, (1,), generator=gen))
    if ties:  # few distinct values: many exact ties within and across rows
        P = torch.randint(0, 3, (T, E), generator=gen).double()
    else:
        P = torch.rand(T, E, generator=gen, dtype=torch.float64)
    return P, k


def test_token_choice_equals_algorithm1_on_200_instances():
    gen = torch.Generator().manual_seed(1234)
    checked = 0
    for i in range(200):
        P, k = random_instance(gen, ties=(i % 2 == 0))
        T = P.shape[0]
        C = [None, 1, max(1, T // 3), T][i % 4]
        bpr = i % 3 == 0
        position = token_choice_allocation(P, k, C, batch_priority=bpr)
        slots = T if C is None else C
        want = algorithm1_token_choice(P, k, C, batch_priority=bpr)
        assert torch.equal(position_to_dispatch(position, slots), want), (i, T, k, C, bpr)
        checked += 1
    assert checked == 200


def test_token_choice_batched_equals_per_group():
    gen = torch.Generator().manual_seed(0)
    P = torch.rand(3, 5, 17, 6, generator=gen)
    batched = token_choice_allocation(P, 2, 4, batch_priority=True)
    for a in range(3):
        for b in range(5):
            assert torch.equal(batched[a, b], token_choice_allocation(P[a, b], 2, 4, batch_priority=True))


def test_first_choices_before_second_choices():
    # Token 0's second choice and token 1's first choice both want expert 1, which has one slot.
    P = torch.tensor([[0.6, 0.4, 0.0], [0.1, 0.8, 0.1]])
    position = token_choice_allocation(P, 2, 1)
    assert position[1, 1] == 0  # the later token's *first* choice wins the slot
    assert position[0, 1] == -1  # the earlier token's second choice is dropped
    assert position[0, 0] == 0


def test_batch_priority_drops_the_least_confident_token():
    # Both tokens want expert 0 (one slot); token 1 is more confident.
    P = torch.tensor([[0.55, 0.45], [0.9, 0.1]])
    assert token_choice_allocation(P, 1, 1)[:, 0].tolist() == [0, -1]  # token order: token 0 wins
    assert token_choice_allocation(P, 1, 1, batch_priority=True)[:, 0].tolist() == [-1, 0]


def test_batch_priority_is_permutation_equivariant():
    gen = torch.Generator().manual_seed(3)
    P = torch.softmax(torch.randn(50, 8, generator=gen) * 2, -1)
    perm = torch.randperm(50, generator=gen)
    a = token_choice_allocation(P, 2, 5, batch_priority=True) >= 0
    b = token_choice_allocation(P[perm], 2, 5, batch_priority=True) >= 0
    assert torch.equal(a[perm], b)
    # Token order is not equivariant on the same instance: the permuted order drops other tokens.
    c = token_choice_allocation(P, 2, 5) >= 0
    d = token_choice_allocation(P[perm], 2, 5) >= 0
    assert not torch.equal(c[perm], d)


def test_expert_choice_equals_algorithm2():
    gen = torch.Generator().manual_seed(99)
    for i in range(100):
        T = int(torch.randint(1, 30, (1,), generator=gen))
        E = int(torch.randint(1, 8, (1,), generator=gen))
        C = int(torch.randint(1, T + 1, (1,), generator=gen))
        P = torch.rand(T, E, generator=gen, dtype=torch.float64)  # continuous: no ties
        assert torch.equal(position_to_dispatch(expert_choice_allocation(P, C), C), algorithm2_expert_choice(P, C))


def test_expert_choice_with_ties_takes_a_top_c_set():
    gen = torch.Generator().manual_seed(5)
    P = torch.randint(0, 3, (20, 4), generator=gen).float()
    position = expert_choice_allocation(P, 7)
    for e in range(4):
        taken = P[position[:, e] >= 0, e].sort(descending=True).values
        assert torch.equal(taken, P[:, e].sort(descending=True).values[:7])
        assert sorted(position[position[:, e] >= 0, e].tolist()) == list(range(7))


def test_top_k_renormalisation():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    values, indices = top_k(probs, 2)
    assert torch.allclose(values, torch.tensor([[0.5, 0.3]])) and indices.tolist() == [[0, 1]]
    values, _ = top_k(probs, 2, renormalize=True)
    assert torch.allclose(values, torch.tensor([[0.625, 0.375]]))


@settings(max_examples=150, deadline=None)
@given(
    T=st.integers(1, 24), E=st.integers(1, 8), k_frac=st.floats(0, 1), c_frac=st.floats(0, 1),
    bpr=st.booleans(), seed=st.integers(0, 2**31 - 1), G=st.integers(1, 3),
)
def test_token_choice_properties(T, E, k_frac, c_frac, bpr, seed, G):
    k = 1 + int(k_frac * (E - 1))
    C = 1 + int(c_frac * (T - 1))
    P = torch.rand(G, T, E, generator=torch.Generator().manual_seed(seed))
    position = token_choice_allocation(P, k, C, batch_priority=bpr)
    mask = position >= 0
    assert position.shape == (G, T, E)
    assert (mask.sum(-1) <= k).all()  # at most k experts per token
    load = mask.sum(-2)
    assert (load <= C).all()  # capacity never exceeded
    # Slots fill contiguously from 0: expert e's slots are exactly {0, ..., load_e - 1}.
    for g in range(G):
        for e in range(E):
            assert sorted(position[g, mask[g, :, e], e].tolist()) == list(range(int(load[g, e])))
    # Only top-k choices are ever dispatched.
    chosen = torch.zeros_like(mask).scatter(-1, P.topk(k, -1).indices, True)
    assert not (mask & ~chosen).any()
    # A choice is dropped only if its expert is full.
    dropped = chosen & ~mask
    assert (load.unsqueeze(-2).expand_as(dropped)[dropped] == C).all()
    # Dropless keeps every choice.
    assert torch.equal(token_choice_allocation(P, k, None, batch_priority=bpr) >= 0, chosen)


@settings(max_examples=100, deadline=None)
@given(T=st.integers(1, 24), E=st.integers(1, 8), c_frac=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_expert_choice_properties(T, E, c_frac, seed):
    C = 1 + int(c_frac * (T - 1))
    P = torch.rand(2, T, E, generator=torch.Generator().manual_seed(seed))
    position = expert_choice_allocation(P, C)
    mask = position >= 0
    assert (mask.sum(-2) == C).all()  # every expert exactly full
    # The taken tokens are the column's top C: every taken score >= every untaken score.
    taken_min = torch.where(mask, P, torch.full_like(P, float("inf"))).amin(-2)
    untaken_max = torch.where(~mask, P, torch.full_like(P, -float("inf"))).amax(-2)
    assert (taken_min >= untaken_max).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 300), st.sampled_from([1, 3, 64, 2**16 - 1, 2**16]), st.integers(0, 2**31))
def test_stable_argsort_ids_is_torchs_stable_sort(rows, n, high, seed):
    """The CPU's radix sort (numpy, 16-bit keys) and torch.sort(stable=True) give the same permutation,
    ties (many: few distinct ids) kept in order; above 2**16 - 1 the torch branch runs."""
    from minimoe.ops.allocation import stable_argsort_ids

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, high + 1, (rows, n), generator=gen)
    order = stable_argsort_ids(ids, high)
    assert order.dtype == torch.long
    assert torch.equal(order, torch.sort(ids, dim=-1, stable=True).indices)
    assert torch.equal(stable_argsort_ids(ids[0], high), torch.sort(ids[0], stable=True).indices)  # one row


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 30), st.integers(1, 7), st.integers(0, 2**31))
def test_dropless_choice_slots_are_dropless_positions(groups, T, E, seed):
    """The slots of each token's kept choices are the slot table of their mask (each expert's tokens in
    token order), read at the choices; -1 for a choice not kept."""
    from minimoe.ops.allocation import dropless_choice_slots, dropless_positions

    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, E + 1, (1,), generator=gen))
    expert = torch.rand(groups, T, E, generator=gen).argsort(-1)[..., :k]  # k distinct experts per token
    kept = torch.rand(groups, T, k, generator=gen) < 0.7
    slots = dropless_choice_slots(expert, kept, E)
    mask = torch.zeros(groups, T, E, dtype=torch.bool).scatter_(-1, expert, kept)
    want = dropless_positions(mask).gather(-1, expert)
    assert torch.equal(slots, torch.where(kept, want, -1))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 9), st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_dropless_positions_number_each_experts_tokens_in_token_order(groups, T, E, density, seed):
    """Oracle: a loop over the tokens. Token t's slot in expert e is the number of tokens before t that
    e also took; -1 where e did not take t. Densities 0 and 1 included (empty and full experts)."""
    from minimoe.ops.allocation import dropless_positions

    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(groups, T, E, generator=gen) < density
    position = dropless_positions(mask)
    assert position.dtype == torch.long and position.shape == mask.shape
    want = torch.full(mask.shape, -1, dtype=torch.long)
    for g in range(groups):
        for e in range(E):
            taken = 0
            for t in range(T):
                if mask[g, t, e]:
                    want[g, t, e] = taken
                    taken += 1
    assert torch.equal(position, want)
    assert torch.equal(dropless_positions(mask[0]), want[0])  # one group, no batch dim


def test_largest_equals_topk_without_ties_and_takes_the_first_of_tied_maxima():
    from minimoe.ops.allocation import largest

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 50, 7, generator=gen)
    for k in (1, 2, 7):
        got, want = largest(x, k), x.topk(k, dim=-1)
        assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    tied = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    assert largest(tied, 1).indices.tolist() == [[1], [0]]
