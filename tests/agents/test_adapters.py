"""Low-rank members as PEFT LoRA adapter files (`copes.agents.adapters`): the layout vLLM's
multi-LoRA serving loads, checked here against PEFT itself, the format's own reader: a member
loaded with `peft.PeftModel.from_pretrained` computes what the member perturbed in place does."""

import json

import pytest
import torch

from copes.agents.adapters import (
    ADAPTER_CONFIG,
    AdapterTarget,
    adapter_targets,
    write_peft_adapter,
)
from copes.weights import Perturbation, Subspace, WeightSpace
from tests.optimizers.test_batched_population import _random_model, _tiny_config

peft = pytest.importorskip("peft", reason="peft (the [train] extra) reads the adapter files")


def _model(model_type: str) -> torch.nn.Module:
    """A random float64 model; "qwen2-tied" shares its embedding with the LM head (as the
    tiny agent and small Qwen checkpoints do)."""
    if model_type != "qwen2-tied":
        return _random_model(model_type)
    from transformers import AutoModelForCausalLM

    config = _tiny_config("qwen2")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _member(seed: int = 1234, sign: int = 1) -> Perturbation:
    return Perturbation(0, seed, Subspace(7, 2, 1), sign, 0.05, rank=4)


@pytest.mark.parametrize("model_type", ["qwen2-tied", "qwen2", "qwen3", "llama"])
@torch.no_grad()
def test_a_member_loaded_by_peft_computes_what_the_member_in_place_computes(tmp_path, model_type):
    """A tied head (one matrix, an embedding and a head adapter), Qwen2, Qwen3 and Llama
    (untied heads), in float64: logits agree to rounding, and differ from the base model's."""
    model = _model(model_type)
    weights = WeightSpace.from_module(model)
    weights.restore()
    member = _member(sign=-1)
    ids = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(2))
    base = model(input_ids=ids).logits
    weights.perturb(member)
    expected = model(input_ids=ids).logits
    weights.restore()
    folder = write_peft_adapter(
        tmp_path / "member", weights.low_rank_factors(member, full=True),
        adapter_targets(model), member.rank,
    )  # fmt: skip
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["r"] == config["lora_alpha"] == 4  # scale 1: the delta is A B^T
    served = peft.PeftModel.from_pretrained(model, str(folder))
    got = served(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert not torch.allclose(got, base, atol=1e-4)


def test_a_tied_head_is_a_second_target_on_the_embedding_matrix():
    model = _model("qwen2-tied")
    targets = adapter_targets(model)
    embedding = "model.embed_tokens.weight"
    assert AdapterTarget(embedding, "model.embed_tokens", "embedding") in targets
    assert AdapterTarget(embedding, "lm_head", "linear") in targets
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert {t.matrix for t in targets} == matrices  # every perturbed matrix is served
    untied = adapter_targets(_random_model("llama"))
    assert AdapterTarget("lm_head.weight", "lm_head", "linear") in untied


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("gemma3_text", "Gemma3TextScaledWordEmbedding"),
        ("qwen3_moe", "cannot serve model.layers.0.mlp"),
    ],
)
def test_matrices_no_plain_module_computes_with_are_refused(model_type, why):
    with pytest.raises(ValueError, match=why) as err:
        adapter_targets(_random_model(model_type))
    assert "--population-eval sequential" in str(err.value)


def test_factors_that_miss_a_target_are_refused(tmp_path):
    model = _random_model("llama")
    weights = WeightSpace.from_module(model)
    factors = weights.low_rank_factors(_member(), full=True)
    factors.pop("lm_head.weight")
    with pytest.raises(ValueError, match=r"no factors for lm_head\.weight"):
        write_peft_adapter(tmp_path, factors, adapter_targets(model), 4)
