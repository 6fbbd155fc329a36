"""What the vLLM backend sends to its engine, checked without vLLM: HF layout and state."""

import copy

import torch

from copes.agents.vllm.policy import hf_layout, hf_state_dict


def test_layout_is_the_hf_parameter_order_with_tied_weights_once(tiny_agent_dir, tiny_policy):
    layout = hf_layout(str(tiny_agent_dir))
    assert [n for n, _ in layout] == tiny_policy.weights().names
    shapes = dict(tiny_policy.model.named_parameters())
    assert all(tuple(shapes[n].shape) == shape for n, shape in layout)
    assert "lm_head.weight" not in dict(layout)  # tied to the embedding


def test_lora_state_is_the_merged_model_without_touching_it(tiny_policy):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        copy.deepcopy(tiny_policy.model),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init: make the adapter do something
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    before = {n: p.clone() for n, p in model.named_parameters()}
    state = hf_state_dict(model)
    merged = copy.deepcopy(model).merge_and_unload()
    expected = dict(merged.named_parameters())
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor.detach(), rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(state[q], dict(tiny_policy.model.named_parameters())[q])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
