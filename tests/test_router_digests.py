"""Every router computes what it computed when the digests were recorded: routing, output and
gradients in training and evaluation at two sizes, a few train() steps, and every study entry
through the study's runner on the toy tasks (``tests/router_digests.py`` says what is hashed).

Bits depend on the processor's vector instructions, so the digests are kept per processor signature
and compared where it matches; elsewhere the test is skipped (the oracle and property tests still
run everywhere). A failure means the arithmetic changed: a refactor that should have kept the bits
did not, or a change of what a router computes, which needs ``python tests/router_digests.py`` (and,
if the routers' results move, a rerun of the reference study) with the reason in its commit.
"""
import json

import pytest
import torch

import router_digests as rd


@pytest.fixture(scope="module")
def recorded():
    data = json.loads(rd.OUT.read_text())
    key = rd.signature_key()
    if key not in data:
        pytest.skip(f"no digests recorded for this processor ({key}; recorded: {sorted(data)}): "
                    "python tests/router_digests.py records them")
    if data[key]["torch"] != torch.__version__:
        pytest.skip(f"digests recorded with torch {data[key]['torch']}, here {torch.__version__}")
    return data[key]


@pytest.mark.parametrize("name", sorted(json.loads(rd.OUT.read_text()).popitem()[1]["routers"]))
def test_router_digests(recorded, name):
    torch.set_num_threads(1)
    for case, want in recorded["routers"][name].items():
        size, mode = case.split("/")
        assert rd.router_case(name, size, mode == "train") == want, f"{name} {case}"
    assert rd.train_case(name) == recorded["train"][name], f"{name}: train()"


def test_study_digests(recorded, tmp_path):
    torch.set_num_threads(1)
    got = rd.study_case(tmp_path / "study")
    changed = sorted(k for k in recorded["study"] if got.get(k) != recorded["study"][k])
    assert not changed and set(got) == set(recorded["study"]), changed[:10]
