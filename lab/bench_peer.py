"""The synchronous peer: TRL's GRPOTrainer on Tether's toy task, for `lab/bench.py --only peer`.

Runs in the bench-only venv (.venv-bench, lab/env_bench.sh: Tether + trl), never in
Tether's own environment. Same starting model (the preset's warm-started tiny Qwen2), task,
prompts per step, group size, lr, clip, temperature, loss aggregation and optimizer as
`configs/toy_reverse.yaml`; TRL generates with HF `generate` and trains in this one process.

    .venv-bench/bin/python lab/bench_peer.py --model runs/bench/model --steps 300 --seed 0 \
        --out runs/bench/peer_s0.json

Writes one JSON: wall time after each optimizer step (from `train()`'s start) and the batch's
mean sampled reward, the same quantities the learner writes to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs.loader import load_config  # noqa: E402
from models.tiny import load_tokenizer  # noqa: E402
from tasks.reverse import ReverseTask  # noqa: E402

PRESET = ROOT / "configs" / "toy_reverse.yaml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the warm-started toy model directory")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the peer is one process)")
    p.add_argument("--out", required=True)
    ns = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(ns.threads)
    cfg = load_config(PRESET, [f"learner.seed={ns.seed}"])
    lc, tc = cfg.learner, cfg.task
    tokenizer = load_tokenizer(ns.model)
    task = ReverseTask(tokenizer, num_digits=tc.num_digits, seed=ns.seed)
    prompts = [task.train_prompt(i) for i in range(ns.steps * lc.prompts_per_step)]
    data = Dataset.from_dict({
        "prompt": [" ".join(tokenizer.convert_ids_to_tokens(p.token_ids.tolist())) for p in prompts],
        "target": [p.meta["target"] for p in prompts]})

    def reward(completion_ids: list[list[int]], target: list[str], **_) -> list[float]:
        return [task.reward({"target": t}, ids) for ids, t in zip(completion_ids, target)]

    args = GRPOConfig(
        output_dir=str(Path(ns.out).parent / f"trl_s{ns.seed}"), seed=ns.seed, use_cpu=True,
        max_steps=ns.steps, learning_rate=lc.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=lc.weight_decay, max_grad_norm=lc.max_grad_norm,
        per_device_train_batch_size=lc.prompts_per_step * lc.group_size,
        num_generations=lc.group_size, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=lc.epochs, max_completion_length=tc.max_new_tokens,
        temperature=tc.temperature, top_p=1.0, top_k=0, epsilon=lc.clip_low,
        epsilon_high=lc.clip_high, beta=0.0, loss_type="dapo",  # dapo = Tether's token_mean
        scale_rewards="group", shuffle_dataset=False, logging_steps=1, report_to="none",
        save_strategy="no", dataloader_num_workers=0, bf16=False, disable_tqdm=True,
        log_level="warning")

    rows: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **k):
            if logs and "reward" in logs:
                rows.append({"step": state.global_step, "time_s": time.perf_counter() - self.t0,
                             "reward_mean": logs["reward"]})

    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    Path(ns.out).write_text(json.dumps({"trl": __import__("trl").__version__, "seed": ns.seed,
                                        "threads": ns.threads, "rows": rows}))


if __name__ == "__main__":
    main()
