"""`learner.backend`: the training backend's kind and its settings (one section per kind).

    learner:
      backend: {kind: megatron, tp: 2}     # or only `backend: fsdp2`
"""

from __future__ import annotations

from typing import Literal

from configs.base import Count, Kind


class _HFBackend(Kind):
    """What the backends that train the HF model itself (single, fsdp2) share."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights, gradients and AdamW moments; bfloat16 halves their bytes
    (stochastic rounding, learner/backends/optim.py; needs model.dtype bfloat16)."""


class SingleBackendConfig(_HFBackend, tag="single"):
    """One process."""


class FSDP2BackendConfig(_HFBackend, tag="fsdp2"):
    """torch FSDP2 over torchrun ranks (docs/backends/fsdp2.md)."""


class MegatronBackendConfig(Kind, tag="megatron"):
    """Megatron-core tensor / pipeline parallel over torchrun ranks (`pip install -e .[megatron]`)."""

    tp: Count = 1
    """Tensor-parallel size (ranks that split each layer); must divide heads, KV heads, MLP and vocab."""
    pp: Count = 1
    """Pipeline-parallel size (stages of consecutive layers); the data-parallel size is torchrun
    ranks / (tp * pp)."""


BackendConfig = SingleBackendConfig | FSDP2BackendConfig | MegatronBackendConfig
"""The learner backend's section: one of the kinds above, chosen by `kind`."""
