"""Tied input/output embeddings, handled in one place.

With `tie_word_embeddings` the output head *is* the input embedding, so Tether publishes,
checkpoints and exports it once, as `model.embed_tokens.weight`, and never as
`lm_head.weight`. Whoever loads such a state dict ties the head back (`load_state`), and an
engine that keeps its own copy of the head (vLLM's CPU backend) gets it filled in (`with_head`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def without_tied(named: Iterable[tuple[str, object]], tied: bool) -> Iterator[tuple[str, object]]:
    """`named` without the head when it is tied to the embedding."""
    for name, t in named:
        if not (tied and name == HEAD):
            yield name, t


def load_state(model, state: dict, what: str) -> None:
    """Load `state` into an HF model (the head may be missing: tied models re-tie it); any
    other missing or unexpected key is a ValueError naming `what`."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = model.config.tie_word_embeddings
    if unexpected or [k for k in missing if not (tied and k == HEAD)]:
        raise ValueError(f"{what} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()


def with_head(state: dict) -> dict:
    """`state` with the head filled in from the embedding when it was left out as tied."""
    if HEAD not in state and EMBED in state:
        state[HEAD] = state[EMBED]
    return state
