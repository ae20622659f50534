"""Tied input/output embeddings, handled in one place.

With `tie_word_embeddings` the output head *is* the input embedding, so Tether publishes,
checkpoints and exports it once, as `model.embed_tokens.weight`, and never as
`lm_head.weight`. Whoever loads such a state dict ties the head back (`load_state`), and an
engine that keeps its own copy of the head (vLLM's CPU backend) gets it filled in (`with_head`).

A LoRA adapter on the head (`learner.lora.targets` with `lm_head`) unties them: the adapted head
is E + s B A while the embedding stays E. The learner's peft model keeps the base tied (the
adapter only adds to the head's output, and the frozen E gets no update); a merged state dict
carries its own `lm_head.weight` (models/lora.py `merge`), and a tied model that loads one is
untied first (`untie`), as is an exported merged model (`tie_word_embeddings: false`).
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


def load_state(model, state: dict, what: str, assign: bool = False) -> None:
    """Load `state` into an HF model (the head may be missing: tied models re-tie it); any
    other missing or unexpected key is a ValueError naming `what`. `assign`: the parameters
    become `state`'s tensors themselves (no copy)."""
    missing, unexpected = model.load_state_dict(state, strict=False, assign=assign)
    loaded(model, missing, unexpected, what)


def loaded(model, missing: list[str], unexpected: list[str], what: str) -> None:
    """After a load: re-tie the head, or a ValueError naming `what` if any key but a tied
    head was missing, or any was unexpected (bucket-by-bucket loads check once at the end)."""
    tied = model.config.tie_word_embeddings
    if unexpected or [k for k in missing if not (tied and k == HEAD)]:
        raise ValueError(f"{what} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()


def untie(model) -> None:
    """Give a tied HF model its own head: a copy of the embedding, `tie_word_embeddings` off
    (so neither `tie_weights` nor a save ties them again). Nothing happens when untied. The
    model may be a peft model's base (the head is then a LoRA layer: its `base_layer` is
    untied, and a merge goes into that copy)."""
    import torch

    if not model.config.tie_word_embeddings:
        return
    head = model.get_output_embeddings()
    head = getattr(head, "base_layer", head)
    head.weight = torch.nn.Parameter(head.weight.detach().clone(),
                                     requires_grad=head.weight.requires_grad)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def with_head(state: dict) -> dict:
    """`state` with the head filled in from the embedding when it was left out as tied."""
    if HEAD not in state and EMBED in state:
        state[HEAD] = state[EMBED]
    return state
