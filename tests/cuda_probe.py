"""Run by tests/test_no_cuda_init.py (and scripts/device_check.py's fork probe) in a fresh
process: an actor's start-up path up to its engine's construction, with every entry into the
CUDA runtime turned into an error.

    python tests/cuda_probe.py MODEL_DIR [--real-gpu] [--control] ENGINE...

Without --real-gpu, NVML is made to report two GPUs (so the GPU branches run: vLLM and SGLang on
CUDA, `model.dtype: auto` -> bfloat16) and a CPU-only torch says it is a CUDA build. The
path is the one `python -m actors` takes: the actor's module imports, `Actor(...)`, its Hello
(the dtype it announces) and `_build` with a Welcome carrying MODEL_DIR's files (the only fake:
no learner is needed for the start-up path). The engine class is replaced by a recorder that
stops the path where the engine would start. Prints one JSON line: the engine's arguments, or
the CUDA call that happened first.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CUDA_ENTRIES = ("is_available", "init", "_lazy_init", "current_device", "set_device",
                "synchronize", "get_device_name", "get_device_properties", "mem_get_info")
"""torch.cuda calls that initialise CUDA (is_available: cudaGetDeviceCount, which runs cuInit)."""
C_ENTRIES = ("_cuda_init", "_cuda_getDeviceCount", "_cuda_setDevice", "_cuda_getDevice")
"""The torch._C functions beneath them."""


class CudaCalled(Exception):
    pass


class EngineReached(Exception):
    pass


def forbid_cuda() -> list[str]:
    """Make every CUDA entry raise CudaCalled naming itself; returns what was patched."""
    patched = []

    def trap(name):
        def call(*args, **kwargs):
            raise CudaCalled(name)
        return call

    for name in CUDA_ENTRIES:
        setattr(torch.cuda, name, trap(f"torch.cuda.{name}"))
        patched.append(f"torch.cuda.{name}")
    for name in C_ENTRIES:  # set also where a CPU-only torch has none: a call is still caught
        setattr(torch._C, name, trap(f"torch._C.{name}"))
        patched.append(f"torch._C.{name}")
    return patched


def recorder(engine: str):
    def record(*args, **kwargs):
        raise EngineReached(json.dumps({"engine": engine, "args": [str(a) for a in args],
                                        "kwargs": {k: str(v) for k, v in kwargs.items()}}))
    return record


def probe(engine: str, model_dir: Path) -> dict:
    """The start-up path of an actor with `engine`, up to the engine's construction."""
    from actors.actor import Actor
    from configs.loader import load_config
    from learner.server import _model_files
    from transport import messages as m

    overrides = [f"actors.engine={engine}", f"model.path={model_dir}"]
    if engine == "hf":
        overrides.append("actors.engine.device=cuda")
    cfg = load_config(ROOT / "configs" / "toy_reverse.yaml", overrides)
    out: dict = {"engine": engine}
    try:
        actor = Actor(cfg, "tcp://127.0.0.1:1", "probe", Path(tempfile.mkdtemp()))
        actor.incarnation, actor.held = "probe", {}  # what Actor.run sets before its Hello
        out["hello_dtype"] = m.Decoders().from_actor.decode(actor._hello()).dtype
        welcome = m.Welcome(protocol_version=m.PROTOCOL_VERSION, actor_id="probe",
                            trajectory_endpoint="", weights_endpoint="", latest_version=0,
                            heartbeat_s=1.0, peer_timeout_s=10.0,
                            model_files=_model_files(model_dir), run_id="probe")
        actor._build(welcome)
        out["result"] = "engine never reached"
    except CudaCalled as e:
        out["result"] = f"CUDA called before the engine: {e}"
    except EngineReached as e:
        out["result"] = "engine reached"
        out["call"] = json.loads(str(e))
    return out


def main() -> int:
    """python tests/cuda_probe.py MODEL_DIR [--real-gpu] [--control] ENGINE...: one JSON line
    per engine. --control: afterwards, the vllm path again with models.devices.cuda_count
    asking torch.cuda.is_available (as it once did): the trap must catch it."""
    model_dir = Path(sys.argv[1])
    flags = {a for a in sys.argv[2:] if a.startswith("--")}
    engines = [a for a in sys.argv[2:] if not a.startswith("--")]
    if "--real-gpu" not in flags:
        # transformers picks CUDA-only imports where torch says it is a CUDA build: import
        # what the path uses first (imports are not CUDA calls), then make torch say so
        import transformers.generation.utils  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        torch.backends.cuda.is_built = lambda: True  # a CUDA build of torch
        torch.cuda._device_count_nvml = lambda: 2  # NVML's answer on a 2-GPU node
    patched = forbid_cuda()
    print(json.dumps({"patched": patched}))

    import actors.__main__  # noqa: F401  (the entry point's imports)
    import actors.engines.hf
    import actors.engines.sglang.engine
    import actors.engines.vllm.engine

    actors.engines.vllm.engine.VLLMEngine = recorder("vllm")
    actors.engines.sglang.engine.SGLangEngine = recorder("sglang")
    actors.engines.hf.HFEngine = recorder("hf")
    for engine in engines:
        print(json.dumps(probe(engine, model_dir)), flush=True)
    if "--control" in flags:
        from models import devices

        devices.cuda_count = lambda: int(torch.cuda.is_available())
        print(json.dumps({**probe("vllm", model_dir), "engine": "control"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
