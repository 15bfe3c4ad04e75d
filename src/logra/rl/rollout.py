"""Rollout: sample responses from the current policy and record their log-probabilities.

Generation uses transformers' ``generate`` with a KV cache. The result is re-laid out
right-padded (``[prompt][response][pad]``) so that a plain forward pass gives every
token the same position id it had during generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedTokenizerBase

from ..kl import hidden_and_head


@dataclass
class Rollout:
    """A batch of sampled responses, right-padded.

    Attributes:
        input_ids: ``[B, L]`` prompt + response tokens (pad after).
        attention_mask: ``[B, L]`` 1 on real tokens.
        response_mask: ``[B, L]`` 1 on response tokens (the final eos included).
        logprobs: ``[B, L]`` log-probability of each token under the rollout policy at
            the sampling temperature (0 outside responses).
        responses: decoded response texts (without the eos).
        truncated: ``[B]`` True where no eos was produced within ``max_new_tokens``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    responses: list[str]
    truncated: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice | list[int]) -> Rollout:
        """The sub-batch of ``rows`` (columns trimmed to the longest remaining sequence)."""
        idx = list(range(len(self)))[rows] if isinstance(rows, slice) else rows
        mask = self.attention_mask[idx]
        width = int(mask.sum(1).max())
        return Rollout(
            self.input_ids[idx, :width], mask[:, :width], self.response_mask[idx, :width],
            self.logprobs[idx, :width], [self.responses[i] for i in idx], self.truncated[idx],
        )


def token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    chunk: int = 1024,
) -> torch.Tensor:
    """``[B, L]`` log π(token_t | tokens_<t) at ``temperature`` (position 0 gets 0).

    The output head runs ``chunk`` positions at a time under activation checkpointing,
    so neither the forward nor the backward pass holds more than one chunk's
    ``[chunk, vocab]`` logits: at a 152k vocabulary and 16k response tokens the full fp32
    logits and their log-softmax would take about 20 GB.
    """
    hidden, head = hidden_and_head(model, input_ids, attention_mask)
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    pieces = []
    for start in range(0, states.shape[0], chunk):
        args = (states[start: start + chunk], targets[start: start + chunk], head, temperature)
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    picked = torch.cat(pieces).view(input_ids.shape[0], -1)
    return torch.nn.functional.pad(picked, (1, 0))


def _chunk_logprobs(states: torch.Tensor, targets: torch.Tensor, head: nn.Module, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(head(states).float() / temperature, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1)


@torch.no_grad()
def generate_rollouts(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> Rollout:
    """Sample one response per prompt (repeat prompts for groups), in batches.

    Log-probabilities are those of the full tempered distribution, as rollout engines
    such as vLLM report them; with ``top_p < 1`` sampling is truncated but the recorded
    log-probability is not, which the importance-sampling correction accounts for.
    """
    was_training = model.training
    model.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    device = next(model.parameters()).device
    rows: list[tuple[list[int], list[int], list[float], bool]] = []
    try:
        side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[start: start + batch_size], return_tensors="pt", padding=True).to(device)
            out = model.generate(
                **enc, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                output_logits=True, return_dict_in_generate=True,
            )
            width = enc["input_ids"].shape[1]
            new = out.sequences[:, width:]
            # One step at a time: stacking every step's logits, then tempering and normalising them,
            # holds three more `[batch, steps, vocab]` copies beside generate's own. At SmolLM2's 49k
            # vocabulary (64 responses of up to 24 tokens) that was the rollout's peak, 0.5 GiB above this.
            lp = torch.stack([torch.log_softmax(step.float() / temperature, -1).gather(-1, new[:, t, None])[:, 0]
                              for t, step in enumerate(out.logits)], dim=1)
            for i in range(new.shape[0]):
                prompt = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
                resp = new[i].tolist()
                ended = eos in resp
                n = resp.index(eos) + 1 if ended else len(resp)
                rows.append((prompt, resp[:n], lp[i, :n].tolist(), not ended))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return layout_rollouts(rows, tokenizer, device)


def layout_rollouts(
    rows: list[tuple[list[int], list[int], list[float], bool]], tokenizer: PreTrainedTokenizerBase,
    device: torch.device | str = "cpu",
) -> Rollout:
    """Right-padded `Rollout` from ``(prompt ids, response ids, response log-probs, truncated)`` rows,
    wherever they were sampled (here or on rollout workers)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    length = max(len(p) + len(r) for p, r, _, _ in rows)
    b = len(rows)
    ids = torch.full((b, length), pad, dtype=torch.long)
    attn = torch.zeros(b, length, dtype=torch.long)
    resp_mask = torch.zeros(b, length, dtype=torch.long)
    logprobs = torch.zeros(b, length)
    texts = []
    for i, (p, r, lp, _) in enumerate(rows):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        attn[i, :n] = 1
        resp_mask[i, len(p):n] = 1
        logprobs[i, len(p):n] = torch.tensor(lp)
        texts.append(tokenizer.decode([t for t in r if t != eos], skip_special_tokens=True))
    truncated = torch.tensor([t for *_, t in rows])
    return Rollout(ids.to(device), attn.to(device), resp_mask.to(device), logprobs.to(device), texts, truncated)
