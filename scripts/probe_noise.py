"""How well the KL probe's first k responses estimate a proposal's predicted KL over a whole batch.

The controller sizes each step from the predicted KL on a probe of ``kl.probe_responses``
responses. After each update's backward pass this script takes the proposal the update is
about to use (`LoGRAOptimizer.propose` changes nothing), samples a fresh batch of responses
from the current policy, and prints, for each probe size k, the ratio of the predicted KL on
the batch's first k responses to that on the whole batch: its median, and the standard
deviation of its log (half of it is the relative spread of ``α = sqrt(B / KL)``).

    python scripts/probe_noise.py --updates 30 --batch 256 --sizes 8 16 32 64
"""

from __future__ import annotations

import argparse
import math
import statistics

from logra.kl import predicted_kl
from logra.rl import RLTrainer, recipe_config
from logra.rl.rollout import generate_rollouts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=30, help="updates to measure (the embedded default run's first)")
    p.add_argument("--batch", type=int, default=256, help="responses the whole-batch prediction uses")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64], help="probe sizes k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache_dir", default="~/.cache/logra")
    args = p.parse_args()
    config = recipe_config("embedded", updates=args.updates, eval_every=0, checkpoint_every=0, seed=args.seed,
                           threads=args.threads, cache_dir=args.cache_dir, run_dir="runs/probe-noise")
    trainer = RLTrainer(config, progress=False)
    ratios: dict[int, list[float]] = {k: [] for k in args.sizes}

    def measure(t: RLTrainer) -> None:
        proposal = t.updater.propose()
        problems = t.task.problems("train", args.batch, seed=10_000 + t.num_updates)
        batch = generate_rollouts(t.model, t.tokenizer, [q.prompt for q in problems], temperature=config.temperature,
                                  max_new_tokens=config.max_new_tokens, batch_size=args.batch)

        def kl(rows: slice) -> float:
            part = batch.select(rows)
            return predicted_kl(t.model, proposal, part.input_ids, part.attention_mask, part.response_mask,
                                temperature=config.temperature, max_tokens=config.kl.probe_max_tokens)

        whole = kl(slice(None))
        for k in args.sizes:
            ratios[k].append(kl(slice(0, k)) / whole)

    trainer.add_gradient_hook(measure)
    for _ in range(args.updates):
        trainer.train_step()
    print(f"| probe responses k | median KL(first k) / KL(all {args.batch}) | sd of its log | spread of α "
          "| smallest | largest |")
    print("|---|---|---|---|---|---|")
    for k, r in ratios.items():
        sd = statistics.stdev(math.log(x) for x in r)
        print(f"| {k} | {statistics.median(r):.2f} | {sd:.2f} | ±{sd / 2:.0%} | {min(r):.2f} | {max(r):.2f} |")
    print(f"\n{args.updates} updates of the embedded default run (seed {args.seed}), one fresh batch each")


if __name__ == "__main__":
    main()
