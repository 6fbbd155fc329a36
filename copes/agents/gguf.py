"""GGUF files as model sources: de-quantized once into the cache as a Hugging Face folder.

transformers reads a GGUF file (`from_pretrained(folder, gguf_file=NAME)`, with the `gguf`
package) and de-quantizes its tensors, which takes seconds to minutes and cannot be saved
from the loaded model ("quantized with gguf and is not serializable"). So the first use of a
file builds a plain model from its config, copies the de-quantized float32 weights in and
saves that, with the tokenizer, chat template and generation config, as an ordinary folder
under ``$COPES_CACHE/gguf/<file stem>-<sha256 prefix>/``. Every backend then loads that
folder as it loads any other (vLLM included), so a GGUF model is trained, evaluated and
served like a hub model.

The folder is keyed by the file's sha256 and carries ``copes_gguf.json``: the file's digest
and size, and the digests of the weights and of every other file written. A later start
checks them and reuses the folder (about a second instead of the conversion); a folder that
does not match (damaged, edited, half-written by a killed run) is converted again. Converting
writes into a temporary folder that is renamed into place whole, under a file lock, so two
processes never read or write a half-built one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from copes.agents.model_files import default_cache_dir, files_digest, weights_digest

logger = logging.getLogger(__name__)

CONVERSION_FORMAT = 2  # bump when what a converted folder holds changes (2: no GGUF quantizer)
RECORD = "copes_gguf.json"
INSTALL_HINT = 'GGUF models need the gguf package: pip install "copes[gguf]" (or pip install gguf)'


class GGUFError(ValueError):
    """A file copes cannot use as a GGUF model (damaged, not GGUF, an architecture
    transformers does not de-quantize); the message is one line naming the fix."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return gguf


def gguf_architecture(path: str | Path) -> str:
    """The file's `general.architecture`, after checking that it is a readable GGUF file
    whose architecture transformers de-quantizes (GGUFError otherwise)."""
    gguf = _require_gguf()
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        architecture = str(field.contents())
    except KeyError:
        raise GGUFError(f"{path}: the GGUF file names no general.architecture") from None
    except Exception as exc:  # the reader raises ValueError, struct and numpy errors alike
        raise GGUFError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); the file is "
            "damaged or truncated: download or reinstall it"
        ) from None
    supported = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    if architecture not in supported:
        import transformers

        raise GGUFError(
            f"{path}: architecture {architecture!r} is not one transformers "
            f"{transformers.__version__} de-quantizes from GGUF ({', '.join(supported)}); "
            "convert the original Hugging Face model instead, or pass its folder"
        )
    return architecture


def gguf_config(path: str | Path) -> Any:
    """The transformers config of a GGUF file, from its metadata (no tensor is read): the
    converted folder's when there is one."""
    from transformers import AutoConfig

    path = Path(path)
    gguf_architecture(path)
    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise GGUFError(f"{path}: transformers cannot read its config ({exc})") from None


def cache_folder(path: str | Path, sha256: str, cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "gguf" / f"{Path(path).stem}-{sha256[:16]}"


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def check_folder(folder: Path, sha256: str) -> str | None:
    """None if `folder` holds a complete conversion of the GGUF file with this sha256;
    else what is wrong with it."""
    record = read_record(folder)
    if record is None:
        return "no conversion record"
    if record.get("format") != CONVERSION_FORMAT:
        return f"conversion format {record.get('format')}, now {CONVERSION_FORMAT}"
    if record.get("gguf", {}).get("sha256") != sha256:
        return "it was converted from another file"
    if files_digest(folder, exclude=(RECORD,)) != record.get("files_sha256"):
        return "its files do not match their recorded digest"
    return None


def converted_folder(
    path: str | Path, *, cache_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """The Hugging Face folder of GGUF file `path`: reused when a complete conversion of
    this very file is in the cache, converted (and recorded) otherwise."""
    import fcntl

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--model {path}: no such GGUF file")
    sha256 = file_sha256(path)
    target = cache_folder(path, sha256, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:  # one converter at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = check_folder(target, sha256) if target.exists() else "not converted yet"
        if problem is None:
            logger.info("GGUF %s: using its conversion in %s", path.name, target)
            return target
        if target.exists():
            logger.warning("GGUF %s: converting again into %s (%s)", path.name, target, problem)
        _convert(path, sha256, target, progress)
    return target


def _convert(path: Path, sha256: str, target: Path, progress: bool) -> None:
    """De-quantize `path` to float32 and save it, with its tokenizer, as `target`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    architecture = gguf_architecture(path)
    logger.info("GGUF %s (%s): de-quantizing into %s, once", path.name, architecture, target)
    start = time.perf_counter()
    folder, name = str(path.parent), path.name
    bars = transformers_logging.is_progress_bar_enabled()
    if not progress:
        transformers_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers' own messages name what it could not read
        raise GGUFError(f"{path}: transformers could not load it ({exc})") from None
    finally:
        if bars and not progress:
            transformers_logging.enable_progress_bar()
    # The loaded model is marked as quantized and refuses `save_pretrained`: a plain model
    # built from the same config, with the de-quantized weights copied in, saves normally.
    # The config must lose its GGUF `quantization_config` too: a folder that keeps it loads
    # with transformers' GGUF quantizer attached, which refuses every later save (no
    # checkpoint could be written) and warns of packed kernels on each load.
    config = loaded.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in result.missing_keys if not (tied and "lm_head" in k)]
    if missing or result.unexpected_keys:
        raise GGUFError(f"{path}: its tensors do not fill the model it describes ({result})")
    model.generation_config = loaded.generation_config
    del loaded
    scratch = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        gguf = _require_gguf()
        record = {
            "format": CONVERSION_FORMAT,
            "gguf": {"file": name, "sha256": sha256, "bytes": path.stat().st_size},
            "architecture": architecture,
            "model_type": config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": "float32",
            "weights_sha256": weights_digest(scratch),
            "files_sha256": files_digest(scratch),
            "transformers": transformers.__version__,
            "gguf_package": getattr(gguf, "__version__", None) or _version("gguf"),
            "convert_seconds": round(time.perf_counter() - start, 1),
        }
        (scratch / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info(
        "GGUF %s: converted in %.1f s (%d parameters)", name, record["convert_seconds"],
        record["parameters"],
    )  # fmt: skip


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
