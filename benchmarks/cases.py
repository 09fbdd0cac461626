"""One benchmark case per function. Each runs in a process of its own so that its peak memory is its
own: a fresh one (``python -m benchmarks.cases NAME JSON``, which prints one JSON line), or with
``--quick`` one forked from a server that has imported torch and minimoe (:func:`run_to_pipe`). The
result: median milliseconds and the peak memory above the process's baseline just before the first
call.

Notation: T tokens in one routing group, E experts, d model width, h expert hidden width, k experts
per token, C = capacity (slots per expert).
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _reset_peak_rss() -> bool:
    """Set this process's peak resident size (VmHWM) to its present size (Linux >= 4.0); False where
    not allowed. Without it the peak is the process's lifetime VmHWM, which includes the case's setup
    (VmHWM starts afresh at exec; ``ru_maxrss`` does not: a case launched from a process whose peak was
    600 MB reported about 400 MB for a 1 MB copy in ``ru_maxrss``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    """The peak resident size (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _measure(fn, repeats: int, device: str, budget_s: float | None = None, min_repeats: int = 3,
             warmup: bool = True) -> dict:
    """Median wall time of ``fn()`` over ``repeats`` calls after a warm-up, and the peak memory above
    the baseline. With ``budget_s``, stop early once ``min_repeats`` calls have run and the timed calls
    took longer than ``budget_s`` (slow cases); ``warmup=False`` skips the warm-up (calls of many
    seconds, where first-call costs do not matter). On the CPU, ``faults_per_call`` counts the minor
    page faults of the timed calls (pages the kernel had to map and zero), per call. Also returns the
    last output, for the quality check."""
    # The baseline is taken before the first call: the peak is a lifetime peak unless it can be reset.
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        peak_was_reset = _reset_peak_rss()
        base = _rss_mb()
    warm = time.perf_counter()
    for i in range(1000 if warmup else 0):  # warm-up: thread pools, allocator caches, first-call dispatch
        fn()
        elapsed = time.perf_counter() - warm
        if (i >= 2 and elapsed > 0.3) or elapsed > 1.0:  # slow cases: one warm-up call is enough
            break
    times, output = [], None
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        output = None  # free the previous call's output first: the peak is one call's
        t0 = time.perf_counter()
        output = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if budget_s is not None and len(times) >= min_repeats and sum(times) > budget_s * 1e3:
            break
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:  # since just before the first call where the reset was allowed, else the lifetime peak
        peak = max(_peak_rss_mb() - base, 0.0)
    result = {"median_ms": statistics.median(times), "peak_mb": peak, "repeats": len(times), "output": output}
    if device != "cuda":
        result["faults_per_call"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / len(times)
        result["peak_reset"] = peak_was_reset
    return result


def _after_training_step(p) -> None:
    """With ``p["after_training_step"]``, first run one forward and backward pass of a MoE layer
    (softmax_topk, d_hidden = 2d) on T tokens, as every call of a router in a training loop follows
    one. It matters through glibc's allocator: freeing a block it had mapped (up to 32 MiB) raises its
    mmap threshold to that block's size and its trim threshold to twice that, so after a training
    step a router's MB-sized temporaries are reused from the heap. In a process that has done nothing
    else the thresholds stay low, and whether those temporaries go back to the kernel at the end of
    each call, to be faulted in again on the next, depends on where they land in the heap: it
    differs between two fresh processes of the same case (performance appendix, "Routing overhead").
    The case's ``peak_mb`` starts just before the router's first call (``_measure`` resets the peak
    there), so the layer's step is not in it; where the reset is refused (``peak_reset`` False) it
    is, and only the case's time is the router's."""
    if not p.get("after_training_step"):
        return
    from minimoe import MoELayer

    torch.manual_seed(1)
    layer = MoELayer(p["d"], 2 * p["d"], p["E"], "softmax_topk").to(p["device"]).train()
    x = torch.randn(1, p["T"], p["d"], device=p["device"], requires_grad=True)
    layer(x).square().mean().backward()


def _setup_layer(p):
    """A softmax_topk layer and its routing of T random tokens. ``capacity_factor`` (default 1) may be
    None (dropless); ``skew`` > 0 adds ``skew * (1, 1 - 1/E, ..., 1/E)`` to the logits, so the first
    experts take more tokens (the loads of a dropless routing then grow unequal)."""
    from minimoe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(p["d"], p["h"], p["E"], "softmax_topk",
                     router_options={"k": p["k"], "capacity_factor": p.get("capacity_factor", 1.0)}).to(p["device"])
    x = torch.randn(1, p["T"], p["d"], device=p["device"], requires_grad=True)
    with torch.no_grad():
        logits = layer.router.gate(x)
        if p.get("skew"):
            logits = logits + p["skew"] * torch.linspace(1, 1 / p["E"], p["E"], device=p["device"])
        routing = layer.router.route(logits)
    return layer, x, routing


def layer_path(p):
    """MoELayer forward + backward along one path, routing precomputed; quality: the largest expert
    load over the mean load (1 = balanced)."""
    layer, x, routing = _setup_layer(p)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer.apply_routing(x, routing, p["path"]).sum().backward()
    loads = routing.tokens_per_expert().double()
    return step, lambda _: float(loads.max() / loads.mean())


def expert_floor(p):
    """The floor: the expert matmuls alone (forward + backward) on tokens already in their slots."""
    layer, x, routing = _setup_layer(p)
    E, C, d = p["E"], routing.num_slots, p["d"]
    with torch.no_grad():
        buffer = torch.zeros(E, C, d, device=p["device"])
        g, t, e = (routing.position >= 0).nonzero(as_tuple=True)
        buffer[e, routing.position[g, t, e]] = x[g, t]
    buffer.requires_grad_(True)

    def step():
        layer.zero_grad(set_to_none=True)
        buffer.grad = None
        layer.experts(buffer).sum().backward()
    return step


def routing_softmax_topk(p):
    """The softmax_topk router from logits (forward, no grad): softmax, Alg. 1 allocation, combine."""
    from minimoe.routers import build

    router = build("softmax_topk", 8, p["E"], k=p["k"], capacity_factor=p["capacity_factor"]).to(p["device"]).eval()
    logits = torch.randn(1, p["T"], p["E"], device=p["device"])

    def step():
        with torch.no_grad():
            router.route(logits)
    return step


def routing_floor(p):
    """The floor of any top-k router: softmax, then torch.topk."""
    logits = torch.randn(1, p["T"], p["E"], device=p["device"])

    def step():
        with torch.no_grad():
            torch.softmax(logits, -1).topk(p["k"], dim=-1)
    return step


def _zoo_router(p):
    """A registered router at the zoo's options (one expert per token, minimoe.experiments.configs),
    in training mode; ``p["options"]`` overrides them (e.g. ``{"p": 1.0}`` for SSR's Sinkhorn branch)."""
    from minimoe.routers import build, router_class

    name, T, E = p["router"], p["T"], p["E"]
    # (Soft MoE: E * S slots = T tokens; USMoE: one group of unordered tokens competing with each other)
    options = router_class(name).study_options(group_size=T, n_experts=E)
    options.update(p.get("options", {}))
    return build(name, p["d"], E, **options).to(p["device"]).train()


def router_overhead(p):
    """One router's forward in training mode, gate included: ``router(x)`` on one group of T tokens
    (x ~ N(0, 1), autograd recording as in training). Soft MoE has no gate; its slot logits take the
    gate's place, so the gate is part of every router's time and of the floor's."""
    _after_training_step(p)
    torch.manual_seed(0)
    router = _zoo_router(p)
    x = torch.randn(1, p["T"], p["d"], device=p["device"])
    step, compile_s = _maybe_compiled(lambda: router(x), p)
    if compile_s is None:
        return step, lambda routing: float(routing.mask.sum(-1).double().mean())  # experts per token
    return step, lambda routing: {"experts_per_token": float(routing.mask.sum(-1).double().mean()),
                                  "compile_s": compile_s}


def _maybe_compiled(step, p):
    """``step`` as it is, or with ``p["compiled"]`` compiled as one graph (``torch.compile(fullgraph=True)``,
    inductor) and called once: ``(step, seconds of that first call, compilation included)``."""
    if not p.get("compiled"):
        return step, None
    import os
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="minimoe-inductor-")  # a cold compilation
    torch._inductor.config.fx_graph_cache = False
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    compiled()
    return compiled, time.perf_counter() - start


def router_floor(p):
    """The floor of a top-1 router in training mode: gate matmul, softmax, ``torch.topk``."""
    _after_training_step(p)
    torch.manual_seed(0)
    gate = torch.nn.Linear(p["d"], p["E"], bias=False).to(p["device"])
    x = torch.randn(1, p["T"], p["d"], device=p["device"])
    step, compile_s = _maybe_compiled(lambda: torch.softmax(gate(x), -1).topk(p.get("k", 1), dim=-1), p)
    return step if compile_s is None else (step, lambda _: {"compile_s": compile_s})


def soft_moe_floor(p):
    """Soft MoE's own floor: its slot logits alone, ``x (T, d) @ Phi (d, E * S)`` with S = T/E slots per
    expert (autograd recording), the T x T matmul every Soft MoE router must do."""
    _after_training_step(p)
    torch.manual_seed(0)
    S = max(1, p["T"] // p["E"])
    phi = torch.randn(p["d"], p["E"] * S, device=p["device"], requires_grad=True)
    x = torch.randn(1, p["T"], p["d"], device=p["device"])
    return lambda: x @ phi


def copy_bandwidth(p):
    """A device copy ``dst.copy_(src)`` of ``p["mb"]`` MiB of float32, which reads and writes every
    byte once: ``2 * bytes / median`` estimates the memory bandwidth (the dispatch's bound uses it)."""
    src = torch.randn(int(p["mb"] * 2**20) // 4, device=p["device"])
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _ot_problem(p):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(p["T"], p["E"], generator=gen).to(p["device"])  # float32 router logits
    return scores


def _relative_marginal_error(plan, T, E) -> float:
    plan = torch.as_tensor(plan).double()
    rows = (plan.sum(1) - 1).abs().max()
    cols = ((plan.sum(0) - T / E).abs() / (T / E)).max()
    return float(torch.maximum(rows, cols))


def sinkhorn_minimoe(p):
    """minimoe.ops.sinkhorn, float32, to a relative marginal error of p["tol"]."""
    import warnings

    from minimoe.ops import sinkhorn

    scores = _ot_problem(p)

    def step():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sinkhorn(scores, p["eps"], tol=p["tol"], max_iter=p["max_iter"], method=p["method"])
    return step, lambda plan: _relative_marginal_error(plan, p["T"], p["E"])


def sinkhorn_pot(p):
    """POT's ot.sinkhorn (method p["method"]), float32, torch or numpy backend. POT minimises
    <P, M> - eps H(P), so M = -scores; it stops when the 2-norm of the column-marginal error is below
    stopThr, and we set stopThr = tol * T / E so that the relative max error is at most tol too."""
    import warnings

    import ot

    scores = _ot_problem(p)
    T, E = p["T"], p["E"]
    a, b, M = torch.ones(T, device=scores.device), torch.full((E,), T / E, device=scores.device), -scores
    if p["backend"] == "numpy":
        a, b, M = a.cpu().numpy(), b.cpu().numpy(), M.cpu().numpy()

    def step():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ot.sinkhorn(a, b, M, p["eps"], method=p["method"], numItermax=p["max_iter"],
                               stopThr=p["tol"] * T / E)
    return step, lambda plan: _relative_marginal_error(plan, T, E)


def assignment_minimoe(p):
    """minimoe.ops.linear_assignment (method p["method"]) at T tokens, E experts, capacity T/E."""
    from minimoe.ops import linear_assignment

    scores = _ot_problem(p)
    step = lambda: linear_assignment(scores, p["T"] // p["E"], method=p["method"])  # noqa: E731
    return step, lambda experts: float(scores.gather(1, experts[:, None]).sum())


def assignment_scipy(p):
    """scipy.optimize.linear_sum_assignment on the (T, E * capacity) matrix, from a torch tensor."""
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    scores = _ot_problem(p)
    capacity = p["T"] // p["E"]

    def step():
        slots = np.repeat(scores.cpu().numpy(), capacity, axis=1)
        rows, cols = linear_sum_assignment(slots, maximize=True)
        return torch.from_numpy(cols // capacity)
    return step, lambda experts: float(scores.gather(1, experts[:, None]).sum())


def _subset_problem(p):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(p["T"], p["E"], generator=gen, dtype=getattr(torch, p["dtype"])).to(p["device"])


def _loop_dp_marginals(logits, k, create_graph=False):
    """The authors' way (ProbMoE Alg. 2 and Eq. 6): the log-space chain DP over the experts,
    ``alpha[c] <- logaddexp(alpha[c], alpha[c-1] + r_i)``, then the marginals as the autograd
    gradient of ``log e_k``. A finite -1e30 marks "impossible" (-inf would give NaN gradients)."""
    r = logits.detach().requires_grad_(True)
    T = r.shape[0]
    neg = r.new_full((T, 1), -1e30)
    alpha = torch.cat([r.new_zeros(T, 1), neg.expand(T, k)], 1)
    for i in range(r.shape[1]):
        take = torch.cat([neg, alpha[:, :-1]], 1) + r[:, i:i + 1]
        alpha = torch.logaddexp(alpha, take)
    return torch.autograd.grad(alpha[:, k].sum(), r, create_graph=create_graph)[0]


def ksubset_minimoe(p):
    """minimoe.ops.ksubset_marginals (forward-backward over the DP tables) at T x E, size k."""
    from minimoe.ops import ksubset_marginals

    logits = _subset_problem(p)
    step = lambda: ksubset_marginals(logits, p["k"])  # noqa: E731

    def quality(marginals):
        m = marginals.double()
        return {"vs_loop": float((m - _loop_dp_marginals(logits, p["k"]).double()).abs().max()),
                "vs_f64": float((m - _loop_dp_marginals(logits.double(), p["k"])).abs().max())}
    return step, quality


def ksubset_autograd_loop(p):
    """Marginals by torch.autograd.grad through the log-space loop DP (see _loop_dp_marginals);
    ``create_graph=True`` is what training needs (the marginals must be differentiable)."""
    logits = _subset_problem(p)
    step = lambda: _loop_dp_marginals(logits, p["k"], p.get("create_graph", False))  # noqa: E731
    return step, lambda marginals: {"vs_f64": float((marginals.double() - _loop_dp_marginals(logits.double(), p["k"]))
                                          .abs().max())}


def ksubset_sample_minimoe(p):
    """minimoe.ops.ksubset_sample: one exact k-subset per row (quality: share of rows with k experts)."""
    from minimoe.ops import ksubset_sample

    logits = _subset_problem(p)
    gen = torch.Generator(device=logits.device).manual_seed(0)
    step = lambda: ksubset_sample(logits, p["k"], generator=gen)  # noqa: E731
    return step, lambda subsets: float((subsets.sum(-1) == p["k"]).double().mean())


def gumbel_topk_sample(p):
    """Gumbel-top-k, a k-subset sampler of a *different* law (Plackett-Luce without replacement):
    the cheapest way to draw k experts, as a floor for ksubset_sample."""
    logits = _subset_problem(p)
    gen = torch.Generator(device=logits.device).manual_seed(0)

    def step():
        u = torch.rand(logits.shape, generator=gen, device=logits.device, dtype=logits.dtype)
        top = (logits - torch.log(-torch.log(u))).topk(p["k"], dim=-1).indices
        return torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(-1, top, True)
    return step, lambda subsets: float((subsets.sum(-1) == p["k"]).double().mean())


def gumbel_matching_minimoe(p):
    """minimoe.ops.gumbel_matching_sample (method p["method"]) at T tokens, E experts, capacity T/E, on
    fixed Gumbel noise (quality: the total perturbed score, equal for every exact method)."""
    from minimoe.ops import gumbel_matching_sample, sample_gumbel

    logits = _ot_problem(p)
    gumbels = sample_gumbel(logits.shape, generator=torch.Generator().manual_seed(1)).to(logits.device)
    step = lambda: gumbel_matching_sample(logits, p["T"] // p["E"], gumbels=gumbels, method=p["method"])  # noqa: E731
    return step, lambda experts: float((logits.double() + gumbels).gather(1, experts[:, None]).sum())


def optimizer_step(p):
    """Gradient clipping and one AdamW step on the parameters of the notebooks' toy language model
    (notebook 04's CPU scale: d = 32, two blocks of four heads, E = 8 experts of width 64; 31 tensors),
    the part of a training step that ``foreach`` changes: AdamW in torch's per-parameter loop (False,
    its CPU default) or in its multi-tensor form (True, what both training loops use on a CPU; the
    same bits). The clipping is the same in both (torch's default, already multi-tensor on a CPU).
    The gradients come from one forward and backward pass before the timing. Quality: the sum of
    all parameters after the last step (float64); with ``warmup=False`` and a fixed ``repeats`` both
    forms take the same steps and must give the same sum."""
    import torch.nn.functional as F

    from minimoe.data import load_char_corpus
    from minimoe.models import TinyLM

    corpus = load_char_corpus()
    torch.manual_seed(0)
    model = TinyLM(corpus.vocab_size, d_model=32, n_layers=2, n_heads=4, block_size=64, n_experts=8, d_hidden=64,
                   router="softmax_topk", router_options={"k": 2, "capacity_factor": None}).to(p["device"])
    foreach = p["foreach"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=foreach)
    inputs, targets = (t.to(p["device"]) for t in corpus.batch("train", 8, 64, torch.Generator().manual_seed(0)))
    (F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()) + model.aux_loss()).backward()

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step, lambda _: float(sum(parameter.detach().double().sum() for parameter in model.parameters()))


CASES = {f.__name__: f for f in (layer_path, expert_floor, routing_softmax_topk, routing_floor, router_overhead,
                                 router_floor, soft_moe_floor, copy_bandwidth, sinkhorn_minimoe, sinkhorn_pot,
                                 assignment_minimoe, assignment_scipy, ksubset_minimoe, ksubset_autograd_loop,
                                 ksubset_sample_minimoe, gumbel_topk_sample, gumbel_matching_minimoe, optimizer_step)}


def run(name: str, params: dict) -> dict:
    """Run one case in this process: ``median_ms``, ``peak_mb``, ``repeats`` and, where the case has
    one, ``quality`` (the marginal error reached, the total score, ...). ``python -m benchmarks.cases``
    calls it in a fresh process; the unit tests call it directly at tiny sizes."""
    case = CASES[name](params)
    step, quality = case if isinstance(case, tuple) else (case, None)
    result = _measure(step, params["repeats"], params["device"], params.get("budget_s"),
                      params.get("min_repeats", 3), params.get("warmup", True))
    output = result.pop("output")
    if quality is not None:  # computed on the last timed call's output: no extra call
        result["quality"] = quality(output)
    return result


def run_to_pipe(connection, name: str, params: dict) -> None:
    """:func:`run` in a forked child (``benchmarks.__main__.ForkedCases``): sends ``(True, result)``,
    or ``(False, traceback)`` when the case raises."""
    try:
        torch.set_num_threads(params.get("threads", torch.get_num_threads()))
        message = (True, run(name, params))
    except Exception:  # noqa: BLE001 -- the parent raises it, with the traceback
        import traceback

        message = (False, traceback.format_exc())
    connection.send(message)
    connection.close()


if __name__ == "__main__":
    name, params = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(params.get("threads", torch.get_num_threads()))
    print(json.dumps(run(name, params)))
