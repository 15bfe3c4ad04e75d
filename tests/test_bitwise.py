"""Results stay bitwise: weight digests after 10 updates for every option and non-target mode.

Refactors of the core must not change a single bit of what the optimizer computes. The
digests in ``bitwise_hashes.json`` were recorded with the code as it was before the
functional core (issue 19) and are checked against the code as it is now. Float results
depend on the kernels torch picks for this CPU and on transformers' model code, so the
digests are keyed by platform (torch, transformers and reasoning-gym versions, CPU
capability and vendor); on a platform with no record the test skips, saying how to record one
(``python tests/test_bitwise.py --record``, on code known to be right: a commit before
the change under test).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_qwen2, token_batch  # noqa: E402
from logra import KLController, LoGRAConfig, LoGRAOptimizer, apply_delta, weights_checksum  # noqa: E402
from logra.optimizer import DenseRowAdam  # noqa: E402

HASHES = Path(__file__).with_name("bitwise_hashes.json")
UPDATES = 10

#: One configuration per row; together they exercise every option and non-target mode.
CONFIGS: dict[str, dict] = {
    "paper": dict(rank=8),
    "gaussian-adamw-clip": dict(rank=8, distribution="gaussian", non_target="adamw", max_grad_norm=0.05,
                                non_target_lr=1e-3),
    "orthogonal-fixed-sgd-lr-wd": dict(rank=8, distribution="orthogonal", refresh=False, optimizer="sgd",
                                       update_ratio=None, lr=0.3, weight_decay=0.1),
    "adam-beta1-element-bf16": dict(rank=8, refresh=False, optimizer="adam", beta1=0.9, trust_ratio="element",
                                    moment_dtype="bfloat16"),
    "rowadam-beta1-transfer-momentum-layer": dict(rank=8, beta1=0.9, refresh_every=3, second_moment="momentum",
                                                  trust_ratio="layer"),
    "rowadam-beta1-reset-sketch-fp32": dict(rank=8, beta1=0.8, refresh_every=2, momentum_refresh="reset",
                                            non_target="sketch", factor_dtype="float32", non_target_lr=1e-3),
    "shared-column-scale": dict(rank=8, share_projections=True, column_scale="input", refresh_every=4),
    "adam-window-sketch-clip-shared": dict(rank=8, optimizer="adam", refresh_every=5, non_target="sketch",
                                           max_grad_norm=0.05, share_projections=True, beta1=0.9),
    "lr-adamw-wd-gaussian-fixed": dict(rank=8, update_ratio=None, lr=0.05, weight_decay=0.2, refresh=False,
                                       distribution="gaussian", non_target="adamw", beta1=0.9,
                                       momentum_refresh="transfer"),
    "adam-column-scale-layer-bf16": dict(rank=8, optimizer="adam", column_scale="input", refresh_every=3,
                                         trust_ratio="layer", beta1=0.9, moment_dtype="bfloat16"),
}
DENSE_CONFIGS: dict[str, dict] = {
    "dense-row-adam-beta1-layer-adamw": dict(rank=8, beta1=0.9, trust_ratio="layer", non_target="adamw",
                                             update_ratio=1e-3, non_target_lr=1e-3),
    "dense-row-adam-global-sketch": dict(rank=8, non_target="sketch", update_ratio=1e-3),
}


def _cpu_vendor() -> str:
    """The CPU's vendor: MKL picks its kernels by vendor as well as by instruction set (an AMD Zen 4
    and an Intel Xeon, both AVX-512 to torch, give different bits)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _platform() -> str:
    """What the bits depend on: torch's kernels for this CPU (its instruction set, the vendor MKL
    dispatches on, and the variables that cap MKL's and oneDNN's instruction sets), transformers'
    model code and initialisation, and reasoning-gym's problems (the `logra train` row)."""
    import importlib.metadata

    import transformers

    caps = "".join(f"-{v}={os.environ[v]}" for v in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
                   if v in os.environ)
    return (f"torch-{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}-{_cpu_vendor()}{caps}-"
            f"transformers-{transformers.__version__}-reasoning-gym-{importlib.metadata.version('reasoning-gym')}")


def logra_digest(options: dict) -> str:
    """10 LoGRA updates (half of them KL-scaled by a fixed α), then the digest of every
    parameter, of every delta and of a receiver that replayed the deltas."""
    torch.manual_seed(0)
    config = LoGRAConfig(**options)
    model = tiny_qwen2(tie=options.get("non_target") == "sketch")
    receiver = tiny_qwen2(tie=options.get("non_target") == "sketch")
    opt = LoGRAOptimizer(model, config)
    digests = []
    for i in range(UPDATES):
        model(**token_batch(model.config.vocab_size, seed=i)).loss.backward()
        proposal = opt.propose()
        digests.append(f"{proposal.sketch_norm!r}:{proposal.update_norm!r}")
        delta = opt.apply(proposal, alpha=0.5 if i % 2 else 1.0)
        digests.append(_delta_digest(delta))
        apply_delta(receiver, delta, config)
        opt.zero_grad()
    targets = opt.targets
    digests.append(weights_checksum(receiver, targets))
    digests.append(weights_checksum(model))
    return weights_checksum_of(digests)


def _delta_digest(delta) -> str:
    """The numbers a delta carries (its step, projection index, decay, factors, column
    scales), not its serialised header, which may gain fields without changing a result."""
    h = hashlib.blake2b(f"{delta.step}:{delta.projection_index}:{delta.decay!r}".encode(), digest_size=16)
    for group in (delta.factors, delta.column_scales):
        for name in sorted(group):
            h.update(name.encode())
            h.update(group[name].detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def dense_digest(options: dict) -> str:
    """10 `DenseRowAdam` updates, then the digest of every parameter."""
    torch.manual_seed(0)
    model = tiny_qwen2(tie=options.get("non_target") == "sketch")
    opt = DenseRowAdam(model, LoGRAConfig(**options))
    for i in range(UPDATES):
        model(**token_batch(model.config.vocab_size, seed=i)).loss.backward()
        opt.step()
        opt.zero_grad()
    return weights_checksum(model)


def kl_controlled_digest() -> str:
    """`KLControlledLoGRA` (predicted KL → α → apply) for 6 updates."""
    from logra.integrations import KLControlledLoGRA

    torch.manual_seed(0)
    model = tiny_qwen2()
    opt = KLControlledLoGRA(model, LoGRAConfig(rank=8, update_ratio=1e-2), KLController(budget=1e-3, budget_final=1e-4))
    for i in range(6):
        batch = token_batch(model.config.vocab_size, seed=i)
        model(**batch).loss.backward()
        opt.set_probe(batch["input_ids"], batch["attention_mask"], batch["attention_mask"])
        opt.step()
        opt.zero_grad()
    return weights_checksum(model)


def train_digest(tmp: Path) -> str:
    """A short `logra train` on the embedded tiny policy (GRPO, LoGRA, KL control): the
    digest of its final checkpointed weights."""
    from logra.rl.cli import main as train_main

    argv = ["--updates", "3", "--algorithm", "grpo", "--prompts_per_update", "2", "--responses_per_prompt", "2",
            "--eval_problems", "2",
            "--eval_every", "0", "--checkpoint_every", "0", "--kl.probe_responses", "2", "--logra.rank", "4",
            "--kl.budget", "1e-3", "--kl.budget_final", "1e-4",  # the embedded default's when digests were recorded
            "--train_pool", "0",  # likewise its pool: max(2000, 4 x prompts)
            "--logra.non_target", "freeze", "--tiny.sft_steps", "2", "--tiny.sft_batch_size", "2",
            "--tiny.num_demonstrations", "8", "--max_new_tokens", "6", "--quiet",
            "--run_dir", str(tmp / "run"), "--cache_dir", str(tmp / "cache")]
    assert train_main(argv) == 0
    return weights_checksum_of([(tmp / "run" / "checkpoint" / "model.safetensors").read_bytes().hex()])


def weights_checksum_of(parts: list[str]) -> str:
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def all_digests() -> dict[str, str]:
    out = {name: logra_digest(options) for name, options in CONFIGS.items()}
    out.update({name: dense_digest(options) for name, options in DENSE_CONFIGS.items()})
    out["kl-controlled"] = kl_controlled_digest()
    with tempfile.TemporaryDirectory() as tmp:
        out["logra-train"] = train_digest(Path(tmp))
    return out


def _recorded() -> dict[str, str]:
    records = json.loads(HASHES.read_text()) if HASHES.exists() else {}
    if _platform() not in records:
        pytest.skip(f"no bitwise digests recorded for {_platform()}: run `python tests/test_bitwise.py --record` "
                    "on a commit known to be right")
    return records[_platform()]


@pytest.mark.parametrize("name", [*CONFIGS, *DENSE_CONFIGS, "kl-controlled", "logra-train"])
def test_results_are_bitwise_those_recorded(name, tmp_path, monkeypatch):
    expected = _recorded()[name]
    if name in CONFIGS:
        got = logra_digest(CONFIGS[name])
    elif name in DENSE_CONFIGS:
        got = dense_digest(DENSE_CONFIGS[name])
    elif name == "kl-controlled":
        got = kl_controlled_digest()
    else:
        monkeypatch.chdir(tmp_path)  # reasoning-gym may write scratch files
        got = train_digest(tmp_path)
    assert got == expected, f"{name}: results changed bitwise"


if __name__ == "__main__":
    if "--record" not in sys.argv:
        sys.exit("usage: python tests/test_bitwise.py --record   (writes this platform's digests)")
    torch.set_num_threads(2)
    records = json.loads(HASHES.read_text()) if HASHES.exists() else {}
    records[_platform()] = all_digests()
    HASHES.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    print(json.dumps(records[_platform()], indent=1))
