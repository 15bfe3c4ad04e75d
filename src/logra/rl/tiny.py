"""A tiny, self-contained policy for the embedded default run.

With no model hub reachable, ``logra train`` needs a policy it can build from
nothing: a small random-init Qwen2 model over a byte-level tokenizer, warm-started
by a short supervised phase (SFT) on task demonstrations so that RL starts from a
policy that is *partly* right. The warm-started weights are cached on disk, keyed
by the config, so only the first run pays for SFT.

The warm start of the embedded default (its config, the default task's demonstrations)
ships with logra instead of being trained: 300 SFT steps magnify the last bits in which
CPUs and thread counts differ into policies 0.26-0.39 apart in Pass@1, in fp64 as in fp32,
so a policy trained on each machine would make every machine's gains its own.

The defaults of :class:`TinyPolicyConfig` are a measured recipe (see the table in
the class docstring): after the warm start the model solves the task partly when
sampling at temperature 1.0 and noticeably better greedily, which is the gap RL
closes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ..delta import weights_checksum

__all__ = [
    "PAD_TOKEN",
    "EOS_TOKEN",
    "TinyPolicyConfig",
    "byte_tokenizer",
    "build_tiny_policy",
    "warm_start",
    "load_or_warm_start",
    "demonstrations_digest",
]

PAD_TOKEN: str = "<pad>"
EOS_TOKEN: str = "<eos>"

# Bumped whenever the training procedure changes in a way the config hash cannot
# see, so stale caches are not silently reused.
_CACHE_FORMAT_VERSION = 2
_INFO_FILE = "logra_tiny_info.json"
# Warm starts shipped with the package: NAME.safetensors beside NAME.json, its record
# (written by scripts/build_shipped_policy.py).
_SHIPPED_DIR = Path(__file__).with_name("shipped")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map.

    The ByteLevel pre-tokenizer rewrites each input byte as one of these
    characters, so the vocabulary must be spelled in the same alphabet.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer(padding_side: str = "left") -> PreTrainedTokenizerFast:
    """Build a lossless byte-level tokenizer: one token per UTF-8 byte.

    Token id ``i`` (0 <= i < 256) is byte value ``i``; ``<pad>`` is 256 and ``<eos>``
    is 257, so ``len(tokenizer) == 258``. No BOS is added and there are no merges,
    so any text round-trips exactly. Padding defaults to the left because the
    tokenizer's main consumer is batched generation.

    Args:
        padding_side: ``"left"`` (generation) or ``"right"``.

    Returns:
        A ``PreTrainedTokenizerFast`` that also survives ``save_pretrained`` /
        ``AutoTokenizer.from_pretrained``.
    """
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    # A merge-free BPE over the 256 byte symbols is exactly a byte tokenizer, and
    # keeps the whole thing inside the Rust `tokenizers` fast path.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: with no merges, word splitting cannot change the output.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD_TOKEN, EOS_TOKEN])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side=padding_side,
        model_max_length=1 << 16,
        clean_up_tokenization_spaces=False,
    )


@dataclass
class TinyPolicyConfig:
    """Architecture and warm-start recipe of the embedded default policy.

    Every field takes part in the cache key of :func:`load_or_warm_start`, so any
    change retrains.

    The defaults are the measured recipe for `logra train`'s default task (chain_sum,
    2-3 one-digit terms, prompt ``"3 + 4 - 2 ="``): a 0.82M-parameter model (128 wide,
    4 layers) trained for 300 steps of 64 (~30-60 s on one CPU thread). Measured on 500
    held-out problems: greedy 65%, sampled (T=1) Pass@1 34%; longer SFT closes the
    greedy/sampled gap that RL is meant to close (800 steps: 91% / 69%).

    Attributes:
        hidden_size: Model width.
        num_layers: Number of decoder layers.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads (grouped-query attention when < num_heads).
        intermediate_size: MLP hidden width.
        max_position_embeddings: Longest sequence (prompt + completion), in bytes.
        tie_word_embeddings: Share input and output embeddings.
        seed: Seed for model init, demonstration order and batching.
        sft_steps: Warm-start optimizer steps.
        sft_batch_size: Demonstrations per SFT step.
        sft_lr: Peak AdamW learning rate (linear warmup, cosine decay).
        sft_weight_decay: AdamW weight decay.
        sft_warmup_steps: Linear warmup steps.
        num_demonstrations: Size of the demonstration set drawn from the task.
        shipped: Load the warm start that ships with logra when this config and the
            demonstrations are exactly those it was built from (the embedded default),
            instead of training it here; ``False`` always trains.
    """

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 64
    tie_word_embeddings: bool = True
    seed: int = 0
    sft_steps: int = 300
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    sft_weight_decay: float = 0.01
    sft_warmup_steps: int = 50
    num_demonstrations: int = 20000
    shipped: bool = True

    def __post_init__(self) -> None:
        positive = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                    "max_position_embeddings", "sft_steps", "sft_batch_size", "num_demonstrations")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TinyPolicyConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("TinyPolicyConfig: hidden_size must divide by num_heads, num_heads by num_kv_heads")
        if not (0 < self.sft_lr < math.inf and 0 <= self.sft_weight_decay < math.inf) or self.sft_warmup_steps < 0:
            raise ValueError("TinyPolicyConfig: sft_lr must be > 0, sft_weight_decay and sft_warmup_steps >= 0")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view of the config (used for the cache key and info file)."""
        return dataclasses.asdict(self)

    def cache_key(self, data_key: str = "") -> str:
        """Short stable hash of the config, the demonstrations' identity (``data_key``)
        and the library versions that affect weights."""
        payload = {
            "config": self.to_dict(),
            "data": data_key,
            # full versions: a patch release may change kernels or initialisation
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "format": _CACHE_FORMAT_VERSION,
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def build_tiny_policy(config: TinyPolicyConfig) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """Random-init an fp32 ``Qwen2ForCausalLM`` sized by ``config`` with its byte tokenizer.

    Args:
        config: Architecture and seed.

    Returns:
        ``(model, tokenizer)``; ``model.config.vocab_size == len(tokenizer)``.
    """
    tokenizer = byte_tokenizer()
    qcfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    # Seeded so the same config always gives the same init (the cache relies on it).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(qcfg)
    model = model.float()
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.bos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _encode_demonstrations(
    tokenizer: PreTrainedTokenizerFast, demonstrations: list[tuple[str, str]], max_len: int
) -> tuple[list[list[int]], list[int]]:
    """Tokenize each demo as prompt+answer+eos; return ids and the prompt length (loss mask start).

    Demonstrations that do not fit ``max_len`` whole are dropped (a truncated one would
    teach a cut-off answer, or nothing at all); if none fits, that is an error.
    """
    prompts = tokenizer([p for p, _ in demonstrations], add_special_tokens=False)["input_ids"]
    answers = tokenizer([a for _, a in demonstrations], add_special_tokens=False)["input_ids"]
    seqs, starts = [], []
    for p, a in zip(prompts, answers, strict=True):
        ids = p + a + [tokenizer.eos_token_id]
        if len(ids) <= max_len:
            seqs.append(ids)
            starts.append(len(p))
    if not seqs:
        longest = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers, strict=True))
        raise ValueError(f"no demonstration fits the tiny policy's {max_len} positions (longest needs {longest}); "
                         "shorten the prompts (instruction, strip_prefix) or raise tiny.max_position_embeddings")
    return seqs, starts


def _collate(
    seqs: list[list[int]], starts: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad a batch; labels are -100 on prompt and padding so only answer+eos is learned."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, st) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, st : len(s)] = ids[i, st : len(s)]
    return ids, mask, labels


def warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    demonstrations: list[tuple[str, str]],
    config: TinyPolicyConfig,
    progress: bool = True,
) -> dict[str, float]:
    """Supervised warm start: next-token loss on answer tokens and ``<eos>`` only.

    AdamW with linear warmup and cosine decay for ``config.sft_steps`` steps of
    ``config.sft_batch_size`` demonstrations (shuffled epochs, seeded). The model
    is left in eval mode with no ``.grad`` on any parameter, exactly as a cached warm
    start loads.

    Args:
        model: Policy to train in place.
        tokenizer: Its tokenizer (must have ``eos_token_id``/``pad_token_id``).
        demonstrations: ``(prompt, answer)`` pairs; the answer is learned, then eos.
        config: Step count, batch size, learning rate, seed.
        progress: Show a tqdm bar.

    Returns:
        ``{"final_loss", "first_loss", "seconds", "steps", "num_demonstrations"}``;
        ``final_loss`` is the mean over the last 5% of steps (a single batch is noisy).
    """
    if not demonstrations:
        raise ValueError("warm_start needs at least one demonstration")
    seqs, starts = _encode_demonstrations(tokenizer, demonstrations, model.config.max_position_embeddings)

    params = [p for p in model.parameters() if p.requires_grad]
    # No weight decay on norms/biases: decaying RMSNorm gains toward 0 only hurts.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.sft_weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.sft_lr,
        betas=(0.9, 0.98),
    )
    steps = config.sft_steps
    warm = max(1, min(config.sft_warmup_steps, steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(1, steps - warm)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(config.seed)
    order: list[int] = []
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="warm start (SFT)", disable=not progress)
    for step in bar:
        batch_idx = []
        while len(batch_idx) < config.sft_batch_size:
            if not order:
                order = list(range(len(seqs)))
                rng.shuffle(order)
            batch_idx.append(order.pop())
        ids, mask, labels = _collate(
            [seqs[i] for i in batch_idx], [starts[i] for i in batch_idx], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"warm start diverged at step {step}: loss {loss.item()}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress and len(losses) % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / 20:.3f}")
    bar.close()
    # The last batch's gradients would otherwise stay on every parameter and reach whatever
    # trains this model next (RL's first update), while a cached warm start carries none.
    opt.zero_grad(set_to_none=True)
    model.eval()
    tail = losses[-max(1, len(losses) // 20) :]
    return {
        "final_loss": sum(tail) / len(tail),
        "first_loss": losses[0],
        "seconds": time.perf_counter() - t0,
        "steps": float(steps),
        "num_demonstrations": float(len(demonstrations)),
    }


def demonstrations_digest(demonstrations: list[tuple[str, str]]) -> str:
    """SHA-256 of the demonstrations, in order: what a shipped warm start was trained on."""
    return hashlib.sha256(json.dumps(demonstrations, ensure_ascii=False).encode()).hexdigest()


def _load_shipped(
    model: Qwen2ForCausalLM, config: TinyPolicyConfig, demonstrations: list[tuple[str, str]]
) -> dict[str, Any] | None:
    """Load into ``model`` the shipped warm start built from exactly ``config`` and
    ``demonstrations`` and return its record, or return ``None`` and leave ``model`` as it
    is. Matching on the demonstrations themselves (not on library versions) reuses it
    wherever the same policy would be trained."""
    if not config.shipped:
        return None
    wanted = {k: v for k, v in config.to_dict().items() if k != "shipped"}
    digest = None
    for record_path in sorted(_SHIPPED_DIR.glob("*.json")):
        record = json.loads(record_path.read_text())
        if record["config"] != wanted:
            continue
        digest = digest or demonstrations_digest(demonstrations)
        if record["demonstrations"] != digest:
            continue
        weights = record_path.with_suffix(".safetensors")
        load_model(model, weights)
        if weights_checksum(model) != record["checksum"]:
            raise RuntimeError(f"{weights} does not hold the weights its record names (checksum "
                               f"{record['checksum']}); the installation is damaged: reinstall logra")
        model.eval()
        return {**record, "file": str(weights)}
    return None


def load_or_warm_start(
    config: TinyPolicyConfig,
    cache_dir: str | Path,
    demonstrations_fn: Callable[[], list[tuple[str, str]]],
    data_key: str,
    progress: bool = True,
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict[str, Any]]:
    """Return the warm-started tiny policy, training it only on a cache miss.

    On a miss the shipped warm start is used when ``config`` and the demonstrations are
    those it was built from (``config.shipped`` allowing); otherwise SFT trains it.
    The cache entry is ``cache_dir/<config.cache_key(data_key)>/`` holding the model
    (``save_pretrained``, safetensors), the tokenizer and an info JSON. It is
    written to a temporary sibling and renamed into place, so an interrupted run
    never leaves a half-written entry that a later run would trust.

    Args:
        config: Architecture + recipe; its hash is the cache key.
        cache_dir: Root of the cache.
        demonstrations_fn: ``() -> [(prompt, response), ...]``; called only on a miss.
        data_key: identifies the demonstrations (task, its options, answer format), so
            another task never reuses this policy.
        progress: Show the SFT progress bar.

    Returns:
        ``(model, tokenizer, info)`` with the model in eval mode; ``info`` has
        ``cache_hit``, ``path``, ``key``, ``config`` and, after training, the
        :func:`warm_start` stats under ``"warm_start"`` (for a shipped one, those of
        its build, and its record under ``"shipped"``).
    """
    cache_dir = Path(cache_dir)
    key = config.cache_key(data_key)
    path = cache_dir / key
    info_path = path / _INFO_FILE
    if info_path.is_file():
        model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        model.eval()
        info = json.loads(info_path.read_text())
        info.update(cache_hit=True, path=str(path))
        return model, tokenizer, info

    model, tokenizer = build_tiny_policy(config)
    demos = demonstrations_fn()
    info: dict[str, Any] = {"key": key, "config": config.to_dict(), "data": data_key}
    record = _load_shipped(model, config, demos)
    if record is None:
        info["warm_start"] = warm_start(model, tokenizer, demos, config, progress=progress)
    else:
        info["warm_start"] = record["warm_start"]
        info["shipped"] = {k: record[k] for k in ("file", "checksum", "demonstrations", "built_with")}

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{key}.tmp-{time.time_ns()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / _INFO_FILE).write_text(json.dumps(info, indent=2, default=str))
    try:
        tmp.rename(path)
    except OSError:
        # Another process wrote the same entry first (same config, so equally
        # valid); the model trained here is still returned.
        shutil.rmtree(tmp, ignore_errors=True)
    info.update(cache_hit=False, path=str(path))
    return model, tokenizer, info
