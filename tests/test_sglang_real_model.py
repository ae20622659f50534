"""SGLang on the real pretrained model (SmolLM2-135M-Instruct, float32, converted by
`models.fetch`), in the SGLang lane: its behavior logprobs equal the learner's recomputation
before and after a real optimizer step, and the smollm2_add preset runs a few steps end to end
with an SGLang actor (the same checks as tests/test_real_model.py does for vLLM)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang is tested in its own lane (scripts/env_sglang.sh)")

import engine_refs as refs  # noqa: E402

pytestmark = pytest.mark.sglang

KV_TOKENS = 4096
"""SGLang's KV cache for these tests (tokens): a few dozen short requests."""


def test_logprobs_match_learner_before_and_after_one_update(smollm2_dir):
    from actors.engines.sglang.engine import SGLangEngine

    worst = refs.real_model_gaps(lambda: SGLangEngine(smollm2_dir, "keep", 0, KV_TOKENS, 0.0),
                                 smollm2_dir)
    print(f"max |SGLang - learner| logprob: v0 {worst[0]:.2e}, v1 {worst[1]:.2e}")
    assert worst[0] < 1e-3 and worst[1] < 1e-3, worst


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_preset_runs_end_to_end_on_sglang(tmp_path, smollm2_dir):
    _, rows, log = refs.smollm2_preset_run(tmp_path, smollm2_dir, "actors.engine=sglang",
                                           f"actors.engine.max_total_tokens={KV_TOKENS}")
    assert "SGLangEngine" in log
    # step 1 trains on version-0 samples with the version-0 weights: the learner's recomputed
    # logprobs equal SGLang's, so every importance weight is 1 up to float error
    assert abs(rows[0]["is_weight_max"] - 1) < 1e-2 and abs(rows[0]["kl_behavior_prox_k3"]) < 1e-4, rows[0]
