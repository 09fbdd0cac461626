"""minimoe.hf: minimoe's routers inside tiny Hugging Face MoE models built from configs (no download).

``swap_router(model)`` (router=None) must reproduce each family's own router exactly, in eval and in
training, DeepSeek-V3's group-limited, bias-corrected, scaled router included; every registered
router but Soft MoE must then train a few steps with a finite loss and a gradient on the gate (Soft
MoE, which has no gate and replaces the block's routing: tests/test_hf_soft_moe.py); a router's own
gradient rule (DenseMixer's dense backward, Kool's REINFORCE term) must reach the gate;
a checkpoint of the unswapped model must load into the swapped one; bad input gets a clear error.
"""
import subprocess
import sys

import pytest

import minimoe
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", minversion="5.0")

from minimoe import hf  # noqa: E402
from minimoe.routers import available  # noqa: E402

VOCAB = 64
FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def tiny(family: str, seed: int = 0):
    """A two-layer model of the family with 4 experts (8 in 4 groups for DeepSeek-V3), top-2."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0))
    elif family == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False))
    elif family == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            norm_topk_prob=False))
    elif family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=0,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            norm_topk_prob=True))
        for module in model.modules():   # HF initialises the router at 0: give it something to route
            if type(module).__name__ == "DeepseekV3TopkRouter":
                torch.nn.init.normal_(module.weight, std=0.5)
                module.e_score_correction_bias.normal_(0, 0.1)
    return model


def gate_weights(model):
    return [gate.weight for gate in hf.swapped_gates(model)]


@pytest.mark.parametrize("family", FAMILIES)
def test_router_none_reproduces_the_familys_own_router(family):
    model = tiny(family)
    ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    reference = {}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        torch.manual_seed(2)
        out = model(ids, labels=ids)
        out.loss.backward()
        reference[mode] = (out.logits.detach(), [p.grad.clone() for n, p in model.named_parameters() if ".gate." in n
                                                  or n.endswith("mlp.gate.weight")])
        model.zero_grad()
    gates = hf.swap_router(model)
    assert len(gates) == 2
    for mode in ("eval", "train"):
        getattr(model, mode)()
        torch.manual_seed(2)
        out = model(ids, labels=ids)
        out.loss.backward()
        torch.testing.assert_close(out.logits, reference[mode][0], rtol=0, atol=1e-5)
        for got, want in zip([p.grad for p in gate_weights(model)], reference[mode][1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        model.zero_grad()


def train_steps(model, gates, steps=3):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (8, 12), generator=generator)
        logits = model(ids).logits
        per_token = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                    reduction="none").view(8, 11)
        per_token = torch.cat([per_token, per_token.new_zeros(8, 1)], 1)   # the last position predicts nothing
        loss = per_token.mean() + hf.router_losses(model, per_token)
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        grads.append(sum(float(g.weight.grad.abs().sum()) for g in gates))
        optimizer.step()
    return grads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("router", [r for r in available() if r != "soft_moe"])   # no gate: test_hf_soft_moe.py
def test_every_router_trains_inside_the_model(family, router):
    model = tiny(family).train()
    gates = hf.swap_router(model, router)
    grads = train_steps(model, gates)
    assert all(g > 0 for g in grads), f"{router} in {family}: no gradient reached the gate ({grads})"


def test_densemixer_brings_its_dense_backward():
    """The same forward value as softmax top-k, but a different gradient for the gate: that of the dense
    mixture of every expert, run through the block's own experts by the router's adjust_output."""
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(3))
    results = {}
    for router in ("softmax_topk", "densemixer"):
        model = tiny("mixtral").train()
        hf.swap_router(model, router, k=2, capacity_factor=None)
        out = model(ids, labels=ids)
        out.loss.backward()
        results[router] = (out.logits.detach(), gate_weights(model)[0].grad.clone())
    torch.testing.assert_close(results["densemixer"][0], results["softmax_topk"][0], rtol=0, atol=1e-6)
    assert (results["densemixer"][1] - results["softmax_topk"][1]).abs().max() > 1e-6


def test_kool_routers_learn_only_through_their_reinforce_term():
    model = tiny("mixtral").train()
    gates = hf.swap_router(model, "kool_skip")
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(4))
    logits = model(ids).logits
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1), reduction="none").view(8, 12)
    per_token.mean().backward(retain_graph=True)
    pathwise = sum(float(g.weight.grad.abs().sum()) for g in gates if g.weight.grad is not None)
    model.zero_grad()
    (per_token.mean() + hf.router_losses(model, per_token)).backward()
    assert pathwise == 0 and sum(float(g.weight.grad.abs().sum()) for g in gates) > 0


def test_a_checkpoint_of_the_unswapped_model_loads_into_the_swapped_one(tmp_path):
    for family in ("mixtral", "deepseek_v3"):
        original = tiny(family, seed=5).eval()
        torch.save(original.state_dict(), tmp_path / f"{family}.pt")
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            want = original(ids).logits
        fresh = tiny(family, seed=7).eval()
        hf.swap_router(fresh)
        hf.load_hf_state_dict(fresh, torch.load(tmp_path / f"{family}.pt"))
        with torch.no_grad():
            torch.testing.assert_close(fresh(ids).logits, want, rtol=0, atol=1e-5)


def test_position_groups_keep_a_comparing_router_causal():
    """Expert choice routed by position (the default) does not let a later token change an earlier
    output; routed by sequence it does."""
    ids = torch.randint(3, VOCAB, (8, 10), generator=torch.Generator().manual_seed(8))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    leaks = {}
    for grouping in ("position", "sequence"):
        model = tiny("mixtral").eval()
        hf.swap_router(model, "expert_choice", grouping=grouping)
        with torch.no_grad():
            leaks[grouping] = (model(ids).logits - model(changed).logits)[:, :-1].abs().max().item()
    assert leaks["position"] < 1e-5 < leaks["sequence"]


def test_group_limited_selection_reaches_at_most_topk_group_groups():
    from minimoe.routers import router_class
    router = router_class("loss_free")(16, 8, k=3, score="sigmoid", bias_on="scores", n_group=4, topk_group=2).eval()
    routing = router(torch.randn(1, 64, 16))
    groups = routing.choice_expert[0] // 2
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    with pytest.raises(ValueError, match="n_group"):
        router_class("loss_free")(16, 8, n_group=3)
    with pytest.raises(ValueError, match="fewer than k"):
        router_class("loss_free")(16, 8, k=3, n_group=4, topk_group=1)


def test_bad_input_gets_a_clear_error():
    model = tiny("mixtral")
    with pytest.raises(TypeError, match="'soft_moe' does not take these options"):
        hf.swap_router(model, "soft_moe", k=2)
    with pytest.raises(TypeError, match="does not take"):
        hf.swap_router(model, "softmax_topk", no_such_option=1)
    with pytest.raises(ValueError, match="takes no router_options"):
        hf.swap_router(model, None, k=2)
    with pytest.raises(ValueError, match="grouping"):
        hf.swap_router(model, "softmax_topk", grouping="batch")
    for baseline in minimoe.routers.baselines():  # study controls, not routers to install
        with pytest.raises(ValueError, match="baselines that do not learn"):
            hf.swap_router(model, baseline)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                                                   num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="model types"):
        hf.swap_router(llama)
    with pytest.raises(ValueError, match="swap_router first"):
        hf.router_losses(tiny("olmoe"))


def test_the_core_package_does_not_import_transformers():
    code = "import minimoe, minimoe.experiments, minimoe.parallel, sys; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
