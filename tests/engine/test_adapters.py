"""Adapter weights as the arrays federated learning exchanges: round trips, files, order, shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from flwr_verl.config import ModelConfig
from flwr_verl.engine.models import AdapterShapeError, build_models, load_adapter_into


@pytest.fixture(scope="module")
def source():
    """Policy and critic whose adapters are far from the fresh (zero-effect) LoRA init."""
    models = build_models(ModelConfig(), with_critic=True, seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in models.adapters.parameters:
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return models


@pytest.fixture(scope="module")
def probe(source):
    tokenizer = source.tokenizer
    return tokenizer(["<s>12+30=", "<s>7+8=4", "<s>49+49=98"], return_tensors="pt", padding=True,
                     add_special_tokens=False)


def outputs(model, probe) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**probe).logits


def fresh():
    return build_models(ModelConfig(), with_critic=True, seed=1)


def test_get_then_set_arrays_reproduces_the_logits(source, probe):
    target = fresh()
    assert not torch.allclose(outputs(target.policy, probe), outputs(source.policy, probe))
    arrays = source.adapters.get_arrays()
    assert all(a.dtype == np.float32 for a in arrays)
    target.adapters.set_arrays(arrays)
    assert torch.equal(outputs(target.policy, probe), outputs(source.policy, probe))
    assert torch.equal(outputs(target.critic, probe), outputs(source.critic, probe))
    # get_arrays returns copies; float64 arrays (an aggregated mean) are accepted and cast back.
    arrays[0] += 1.0
    assert not np.array_equal(arrays[0], source.adapters.get_arrays()[0])
    target.adapters.set_arrays([a.astype(np.float64) for a in source.adapters.get_arrays()])
    assert torch.equal(outputs(target.policy, probe), outputs(source.policy, probe))


def test_saved_adapters_load_with_plain_peft(source, probe, tmp_path, model_path):
    source.adapters.save(tmp_path)
    assert json.loads((tmp_path / "adapter_order.json").read_text()) == source.adapters.names

    base = AutoModelForCausalLM.from_pretrained(model_path)
    policy = PeftModel.from_pretrained(base, tmp_path / "policy")
    assert torch.equal(outputs(policy, probe), outputs(source.policy, probe))

    critic_base = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1)
    critic = PeftModel.from_pretrained(critic_base, tmp_path / "critic")
    assert torch.equal(outputs(critic, probe), outputs(source.critic, probe))

    target = fresh()
    load_adapter_into(target.policy, tmp_path / "policy")
    assert torch.equal(outputs(target.policy, probe), outputs(source.policy, probe))


def test_adapter_order_and_init_are_the_same_in_another_process():
    listing = ("import json; from flwr_verl.config import ModelConfig; from flwr_verl.engine.models import build_models; "
               "a = build_models(ModelConfig(), with_critic=True, seed=7).adapters; "
               "print('ADAPTERS' + json.dumps([[n, list(p.shape), float(p.double().sum())] "
               "for n, p in a.named_parameters()]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different hash seed than this process
    output = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, env=env, timeout=120,
                            check=True).stdout
    theirs = json.loads(next(line for line in output.splitlines() if line.startswith("ADAPTERS"))[len("ADAPTERS"):])
    adapters = build_models(ModelConfig(), with_critic=True, seed=7).adapters
    ours = [[n, list(p.shape), float(p.detach().double().sum())] for n, p in adapters.named_parameters()]
    assert [row[:2] for row in theirs] == [row[:2] for row in ours]
    assert theirs == ours  # seeded: the same fresh adapters in every process
    assert ours[0][0].startswith("policy/") and ours[-1][0].startswith("critic/")


def test_wrong_number_of_arrays_is_rejected(source):
    arrays = source.adapters.get_arrays()
    target = fresh()
    with pytest.raises(AdapterShapeError) as error:
        target.adapters.set_arrays(arrays[:-1])
    message = str(error.value)
    assert f"expected {len(arrays)} adapter arrays" in message and f"received {len(arrays) - 1}" in message
    assert str(arrays[0].shape) in message  # expected and received shapes are named


def test_wrong_shape_is_rejected_naming_both_shapes_and_nothing_is_applied(source):
    arrays = source.adapters.get_arrays()
    index = next(i for i, a in enumerate(arrays) if a.ndim == 2 and a.shape[0] != a.shape[1])
    expected = arrays[index].shape
    arrays[index] = arrays[index].T
    target = fresh()
    before = target.adapters.get_arrays()
    with pytest.raises(AdapterShapeError) as error:
        target.adapters.set_arrays(arrays)
    message = str(error.value)
    assert source.adapters.names[index] in message
    assert f"expected shape {expected}" in message and f"received {expected[::-1]}" in message
    assert all(np.array_equal(a, b) for a, b in zip(before, target.adapters.get_arrays()))
