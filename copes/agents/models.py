"""Where a model's files come from: the agent that ships with copes, a folder, a hub id.

`tiny` names the embedded agent (`copes/agents/tiny_agent/`, made by the recipe in
`copes.agents.tiny`), checked against its recorded digests before any backend loads it;
a folder must be a Hugging Face model folder; anything else is a hub id for the backend.
Backend-free, so both backends and the CLIs resolve names alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHIPPED_DIR = Path(__file__).parent / "tiny_agent"
# The agent's identity: every tensor's name and bytes (what a rebuild is compared with).
SHIPPED_WEIGHTS_SHA256 = "777dc484acd0fd932d75f1ca74bb3b292c962c5241b3ae7e8311783d3524517b"
# Every shipped file (weights, config, tokenizer, build report): a damaged copy is refused.
SHIPPED_FILES_SHA256 = "0a6cdbb9f3ba96fcdfeb9569fbc13e3e4d1498cb0c2afbf1a27be59b19dfb924"


def weights_digest(folder: str | Path) -> str:
    """sha256 over the tensors of `folder/model.safetensors` (names sorted, raw bytes)."""
    import hashlib

    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def files_digest(folder: str | Path) -> str:
    """sha256 over every file of `folder` (relative names sorted, contents)."""
    import hashlib

    root = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


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


def resolve_model_path(name_or_path: str | Path) -> str:
    """`tiny` -> the shipped agent's folder (digest-checked); paths and hub ids as given."""
    if str(name_or_path) == "tiny":
        return str(shipped_tiny_agent())
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {str(name_or_path)!r} has no config.json: not a Hugging Face model "
            "folder (it needs config.json, the weights and the tokenizer files; "
            "save_pretrained writes them)"
        )
    return str(name_or_path)
