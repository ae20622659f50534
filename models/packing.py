"""Whether a model keeps packed rows apart (`learner.pack_rows`, learner/algo/microbatch.py).

Packed rows are one sequence whose position ids restart at 0 at each row, with no attention
mask. transformers reads the row boundaries from the position ids and masks
attention across them (masking_utils.find_packed_sequence_indices) for the models that build
their mask with `create_causal_mask` and the mask-based attention implementations (eager,
sdpa, flex; flash attention goes by the position ids too). A model that does not would let
each row attend to the rows before it, silently: the learner checks every model it trains
with at start-up instead of trusting a list (`require_rows_apart`).

    two packs that differ only in their first row: [A, B] and [A', B], positions 0.. per row
    -> B's final hidden states must not move; measured against the same two sequences with
    positions that do not restart (plain causal attention: B sees A), which must move them
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FIRST = ([3, 4, 5, 6, 7], [7, 6, 5, 4, 3])
"""The probe's two first rows (token ids below 8: every vocabulary has them)."""
SECOND = [5, 4, 6, 3]
"""The probe's second row."""
LEAK_FRACTION = 1e-3
"""B may move by at most this fraction of what plain causal attention moves it (rounding of
different kernels; a mask that works moves it by exactly 0 on CPU)."""


def require_rows_apart(name: str, model: torch.nn.Module,
                       run: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
    """Raise ValueError naming `name` unless `model` keeps packed rows apart (module docstring).
    `run(input_ids, position_ids)` runs it the way the trainer does (its backend: FSDP2's
    hooks, autocast; on every rank together); the hidden states are caught from its decoder
    (`.model` of the HF causal LM, of a peft model's base, or of the critic)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    caught: list[torch.Tensor] = []
    hook = base.model.register_forward_hook(
        lambda module, args, out: caught.append(out.last_hidden_state[0, -len(SECOND):].float()))
    device = next(model.parameters()).device
    training = model.training
    model.eval()  # dropout would move B by itself
    try:
        with torch.no_grad():
            for restart in (0, len(FIRST[0])):  # B's positions from 0 (packed), or after A's
                for first in FIRST:
                    pos = [*range(len(first)), *range(restart, restart + len(SECOND))]
                    run(torch.tensor([first + SECOND], device=device),
                        torch.tensor([pos], device=device))
    finally:
        hook.remove()
        model.train(training)
    packed = (caught[0] - caught[1]).abs().max()
    causal = (caught[2] - caught[3]).abs().max()
    if packed > LEAK_FRACTION * causal:
        attn = base.config._attn_implementation
        raise ValueError(
            f"learner.pack_rows: {name} lets packed rows attend to each other (a row's hidden "
            f"states moved by {float(packed):.3g} when the row before it changed; plain causal "
            f"attention: {float(causal):.3g}; attention implementation {attn!r}); this model "
            "cannot pack rows: set learner.pack_rows=false")
