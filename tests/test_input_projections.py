"""``distribution='inputs'``: projections fitted to the layers' inputs, carried by the delta and the state."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import tiny_qwen2, token_batch, train_steps
from logra import DeltaMismatchError, LoGRAConfig, LoGRAOptimizer, PolicyDelta, apply_delta
from logra.delta import keep_projections, set_policy_step
from logra.parallel.publisher import PolicyPublisher
from logra.projection import InputMoment, build_projection, projection_key

RANK = 8


def _config(**kw) -> LoGRAConfig:
    return LoGRAConfig(rank=RANK, update_ratio=1e-2, distribution="inputs", refresh=False, **kw)


def _fit_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    """Two ragged batches (padded tokens at the end of a row), as ``model(**batch)`` takes them."""
    out = []
    for seed in (100, 101):
        b = token_batch(vocab, batch=4, length=10, seed=seed)
        out.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})
    return out


def _fitted(cfg: LoGRAConfig | None = None, model=None) -> tuple[torch.nn.Module, LoGRAOptimizer]:
    model = model if model is not None else tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg or _config())
    opt.fit_projections(_fit_batches(model.config.vocab_size))
    return model, opt


def test_fitted_projections_span_the_top_eigenvectors_of_each_layers_unpadded_inputs():
    """Against a float64 numpy reference built from the inputs recorded here, padding excluded."""
    model = tiny_qwen2()
    linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    seen: dict[str, list[np.ndarray]] = {n: [] for n in linears}
    batches = _fit_batches(model.config.vocab_size)
    for batch in batches:
        keep = batch["attention_mask"].bool()
        hooks = [m.register_forward_hook(
            lambda m, args, out, n=n, keep=keep: seen[n].append(args[0][keep].double().numpy()))
            for n, m in linears.items()]
        with torch.no_grad():
            model(**batch)
        for h in hooks:
            h.remove()
    _, opt = _fitted(_config(non_target="sketch"), model)
    for name in opt.targets:
        if name not in linears:
            continue
        a = opt.projection(name).double()
        x = np.concatenate(seen[name])
        q = np.linalg.eigh(x.T @ x)[1][:, -RANK:]
        in_features = a.shape[1]
        assert torch.allclose(a @ a.T, torch.eye(RANK, dtype=torch.float64) * in_features / RANK, atol=1e-5), name
        # same subspace: the projectors onto the row space of A and onto the top eigenvectors agree
        assert np.abs(a.T.numpy() @ a.numpy() * RANK / in_features - q @ q.T).max() < 1e-5, name
    embed = "model.embed_tokens.weight"  # not an nn.Linear: the seeded Rademacher projection
    assert torch.equal(opt.projection(embed), build_projection(opt.config, embed, 0, 32))


def test_nystrom_sketch_finds_the_exact_subspace_when_inputs_span_at_most_2r_directions(monkeypatch):
    """Wider than `EXACT_MOMENT_MAX`, the moment is kept as ``Σ x xᵀ Ω``: exact for inputs of rank ≤ 2r."""
    monkeypatch.setattr("logra.projection.EXACT_MOMENT_MAX", 0)
    g = torch.Generator().manual_seed(0)
    in_features, rank, span = 60, 4, 7
    basis = torch.linalg.qr(torch.randn(in_features, span, generator=g, dtype=torch.float64))[0]
    x = torch.randn(500, span, generator=g, dtype=torch.float64) * torch.tensor([9.0, 7, 5, 4, 1, 0.5, 0.2])
    x = x @ basis.T
    moment = InputMoment(in_features, rank, seed=3)
    assert moment.moment.shape == (in_features, 2 * rank)  # in·2r values kept, not in²
    for chunk in x.split(128):
        moment.add(chunk.float())
    got = moment.top_subspace()
    want = np.linalg.eigh((x.float().double().T @ x.float().double()).numpy())[1][:, -rank:]
    assert np.abs(got.numpy() @ got.numpy().T - want @ want.T).max() < 1e-8


def test_a_fit_in_several_passes_gives_the_bits_of_one(monkeypatch):
    """With `FIT_MOMENT_BYTES` below one moment each layer input gets a pass of its own (over
    batches given as a one-shot iterator)."""
    _, whole = _fitted()
    monkeypatch.setattr("logra.projection.FIT_MOMENT_BYTES", 1)
    calls = []
    model = tiny_qwen2()
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    split = LoGRAOptimizer(model, _config())
    split.fit_projections(iter(_fit_batches(model.config.vocab_size)))
    assert len(calls) == 2 * len(whole.projector.fitted)  # two batches per input group
    assert whole.projector.fitted.keys() == split.projector.fitted.keys()
    assert all(torch.equal(a, split.projector.fitted[g]) for g, a in whole.projector.fitted.items())


def test_deltas_carry_the_fitted_projections_once_and_receivers_replay_bitwise():
    cfg = _config(non_target="sketch")
    trainer, receiver = tiny_qwen2(), tiny_qwen2()
    late = copy.deepcopy(receiver)
    _, opt = _fitted(cfg, trainer)
    deltas = [PolicyDelta.from_bytes(d.to_bytes()) for d in train_steps(trainer, opt, 6)]
    linear = [n for n in opt.targets if n != "model.embed_tokens.weight"]
    assert sorted(linear) == sorted(deltas[3].fitted)
    # one projection per input: q/k/v read one tensor, gate/up another (and with one fitted tensor)
    groups = {projection_key(n, True): n for n in linear}
    assert sorted(deltas[0].projections) == sorted(groups) and len(groups) == len(linear) - 3 * 2
    assert all(not d.projections for d in deltas[1:])
    assert deltas[0].nbytes - deltas[1].nbytes == sum(RANK * opt.projection(n).shape[1] * 4 for n in groups.values())
    q, k = opt.sketch_target(linear[0]), opt.sketch_target(linear[1])
    assert "q_proj" in q.name and "k_proj" in k.name and q.stored_projection is k.stored_projection
    for d in deltas:
        apply_delta(receiver, d, cfg)
    for (n, a), b in zip(trainer.state_dict().items(), receiver.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    # a receiver that joins after the first delta has no way to rebuild the fitted projections
    apply_delta(late, deltas[0], cfg)
    fresh = copy.deepcopy(late)
    del fresh._logra_fitted_projections
    set_policy_step(fresh, 1)
    before = {n: p.clone() for n, p in fresh.named_parameters()}
    with pytest.raises(DeltaMismatchError, match="first delta of the stream"):
        apply_delta(fresh, deltas[1], cfg)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())  # nothing changed
    bad = dict(deltas[0].projections)
    bad[projection_key(linear[0], True)] = bad[projection_key(linear[0], True)][:, :-1]
    with pytest.raises(DeltaMismatchError, match="fitted projection"):
        apply_delta(tiny_qwen2(), PolicyDelta(**{**deltas[0].__dict__, "projections": bad}), cfg)


def test_a_receiver_resynced_for_another_run_keeps_none_of_the_last_runs_projections():
    """A full resync is the whole policy state: a receiver that followed run A and is resynced
    to run B's weights without projections (B's trainer sent none) must refuse B's next delta,
    not merge it with A's projections; with B's projections it follows B bitwise."""
    cfg = _config()
    run_a, receiver = tiny_qwen2(), tiny_qwen2()
    _, opt_a = _fitted(cfg, run_a)
    for d in train_steps(run_a, opt_a, 2):
        apply_delta(receiver, d, cfg)
    run_b = tiny_qwen2()
    opt_b = LoGRAOptimizer(run_b, cfg)
    opt_b.fit_projections([{"input_ids": b["input_ids"]} for b in _fit_batches(run_b.config.vocab_size)[::-1]])
    train_steps(run_b, opt_b, 2, seed0=10)
    assert any(not torch.equal(a, opt_b.fitted_projections()[g]) for g, a in opt_a.fitted_projections().items())

    weights, step = copy.deepcopy(run_b.state_dict()), opt_b.num_updates

    def resync(projections):  # what a rollout worker does with a full-weight message
        receiver.load_state_dict(weights)
        keep_projections(receiver, projections)
        set_policy_step(receiver, step)

    resync({})
    (delta,) = train_steps(run_b, opt_b, 1, seed0=12)
    with pytest.raises(DeltaMismatchError, match="first delta of the stream"):
        apply_delta(receiver, delta, cfg)
    resync(opt_b.fitted_projections())
    apply_delta(receiver, delta, cfg)
    for (n, a), b in zip(run_b.state_dict().items(), receiver.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_a_publisher_without_the_optimizer_is_refused():
    """Its full resyncs could not send the fitted projections (refused before any handshake)."""
    with pytest.raises(ValueError, match="needs the trainer's optimizer"):
        PolicyPublisher(tiny_qwen2(), _config(), [1])


def test_the_fitted_projections_handed_out_are_copies():
    """What a delta carries or a resync sends is kept by receivers, also in this process: a
    receiver that changed it in place must not change the trainer's projections."""
    _, opt = _fitted()
    handed = opt.fitted_projections()
    name = next(n for n in opt.targets if projection_key(n, True) in handed)
    before = opt.projection(name).clone()
    handed[projection_key(name, True)].zero_()
    assert torch.equal(opt.projection(name), before)


def test_resume_restores_the_fitted_projections_bitwise(tmp_path):
    model, opt = _fitted()
    train_steps(model, opt, 3)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    tail = train_steps(model, opt, 3, seed0=3)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = tiny_qwen2(seed=123)
    fresh.load_state_dict(state["model"])
    opt2 = LoGRAOptimizer(fresh, _config())
    assert opt2.needs_fit
    opt2.load_state_dict(state["opt"])
    assert not opt2.needs_fit
    tail2 = train_steps(fresh, opt2, 3, seed0=3)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert tail2[0].projections and not tail[0].projections  # the resumed stream carries them again
    del state["opt"]["fitted_projections"]
    with pytest.raises(ValueError, match="no fitted projections"):
        LoGRAOptimizer(tiny_qwen2(), _config()).load_state_dict(state["opt"])


def test_unfitted_or_misused_input_projections_are_refused():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, _config())
    with pytest.raises(RuntimeError, match="fit_projections"):
        model(**token_batch(model.config.vocab_size)).loss.backward()
    with torch.no_grad():  # generation without gradients needs no projection
        model(**token_batch(model.config.vocab_size))
    opt.zero_grad()
    opt.fit_projections(_fit_batches(model.config.vocab_size))
    train_steps(model, opt, 1)
    with pytest.raises(ValueError, match="before the first update"):
        opt.fit_projections(_fit_batches(model.config.vocab_size))
    with pytest.raises(ValueError, match="distribution='inputs'"):
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=RANK)).fit_projections([])
    with pytest.raises(ValueError, match="refresh=False"):
        LoGRAConfig(rank=RANK, distribution="inputs")
    with pytest.raises(ValueError, match="saw no input tokens"):
        LoGRAOptimizer(tiny_qwen2(), _config()).fit_projections([])


class _Block(torch.nn.Module):
    """One attention block's q/k/v. With ``cross`` k and v read an encoder's states, as in
    cross-attention; without it each reads its own copy of the block's input."""

    def __init__(self, cross: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.self_attn = torch.nn.ModuleDict({n: torch.nn.Linear(16, 16, bias=False)
                                              for n in ("q_proj", "k_proj", "v_proj")})
        self.cross = cross

    def forward(self, x: torch.Tensor, encoder: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn
        kv = encoder if self.cross else x.clone()
        return (attn["q_proj"](x) @ attn["k_proj"](kv).T) @ attn["v_proj"](kv.clone())


@pytest.mark.parametrize("cross", [False, True])
def test_a_group_whose_layers_read_different_inputs_is_refused(cross):
    """q/k/v share one fitted projection, which only holds when they read one input: with
    cross-attention, k_proj fitted to q_proj's inputs would see none of its own directions."""
    model = _Block(cross)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4, update_ratio=1e-2, distribution="inputs", refresh=False,
                                            target_modules=("q_proj", "k_proj", "v_proj")))
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(12, 16, generator=gen), "encoder": torch.randn(12, 16, generator=gen) * 3}]
    if cross:
        with pytest.raises(ValueError, match="self_attn.k_proj reads another input than self_attn.q_proj"):
            opt.fit_projections(batches)
    else:  # copies of one input are the same input
        assert opt.fit_projections(batches) == 12


def test_a_fit_on_fewer_tokens_than_the_rank_warns():
    """Rows past the tokens' span hold directions no input showed: said, not silent."""
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=16, update_ratio=1e-2, distribution="inputs", refresh=False))
    few = {"input_ids": torch.tensor([[3, 5, 7, 9]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    with pytest.warns(UserWarning, match=r"fitted on fewer input tokens than the rank 16 \(first: .*, 3 tokens\)"):
        assert opt.fit_projections([few]) == 3
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fitted(_config(), tiny_qwen2())  # 2 × 4 rows of up to 10 tokens: more than the rank 8


@pytest.mark.parametrize("case", ["k_v_not_called", "nan_in_padding"])
def test_inputs_that_are_not_another_input_are_not_refused(case):
    """KV-shared layers skip k_proj/v_proj when a cache exists (no input is no other input);
    a NaN in a padded token, which the moment leaves out, is the same input in q, k and v."""
    model = _Block(cross=False)
    attn = model.self_attn
    if case == "k_v_not_called":
        model.forward = lambda x, encoder, attention_mask=None: attn["q_proj"](x)
    else:
        model.forward = lambda x, encoder, attention_mask=None: sum(attn[n](x) for n in ("q_proj", "k_proj", "v_proj"))
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4, update_ratio=1e-2, distribution="inputs", refresh=False,
                                            target_modules=("q_proj", "k_proj", "v_proj")))
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    x[11] = float("nan")
    mask = torch.ones(12, dtype=torch.long)
    mask[11] = 0
    assert opt.fit_projections([{"x": x, "encoder": x, "attention_mask": mask}]) == 11


# ----------------------------------------------------------------------------- refresh windows
def _windows(**kw) -> LoGRAConfig:
    return LoGRAConfig(rank=RANK, update_ratio=1e-2, distribution="inputs", refresh=True, refresh_every=2,
                       beta1=0.9, **kw)


def _windowed_steps(model, opt, steps: int, seed0: int = 0, alpha: float = 1.0) -> list[PolicyDelta]:
    """``steps`` updates, fitting where the optimizer awaits it on that update's own batch."""
    deltas = []
    for i in range(seed0, seed0 + steps):
        if opt.needs_fit:
            b = token_batch(model.config.vocab_size, batch=4, seed=500 + i)
            opt.fit_projections([{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}])
        model(**token_batch(model.config.vocab_size, seed=i)).loss.backward()
        deltas.append(opt.apply(opt.propose(), alpha))
        opt.zero_grad()
    return deltas


def test_a_window_refits_to_the_policys_inputs_then_and_its_first_moment_follows():
    """At a window's first update the fitted targets have no projection until `fit_projections`;
    the new ones span the top eigenvectors of the inputs then, and the first moment is the
    least-squares re-expression of the gradient estimate it held (float64 pinv reference)."""
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, _windows())
    _windowed_steps(model, opt, 1)
    old_a = {g: a.double() for g, a in opt.fitted_projections().items()}
    _windowed_steps(model, opt, 1, seed0=1)
    assert opt.needs_fit and not opt.fitted_projections()  # none in force until the fit
    with pytest.raises(RuntimeError, match="fit_projections"):
        model(**token_batch(model.config.vocab_size)).loss.backward()
    with pytest.raises(RuntimeError, match="await fit_projections"):
        opt.propose()
    opt.zero_grad()
    linear = [n for n in opt.targets if n != "model.embed_tokens.weight"]
    assert all(opt.projection(n) is None for n in linear)
    old_m = {n: m.double().clone() for n, m in opt.momenta().items()}
    batches = _fit_batches(model.config.vocab_size)
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in linear}
    modules = {n: opt.sketch_target(n).modules[0] for n in linear}
    for batch in batches:
        keep = batch["attention_mask"].bool()
        hooks = [m.register_forward_hook(lambda m, args, out, n=n, keep=keep: inputs[n].append(args[0][keep].double()))
                 for n, m in modules.items()]
        with torch.no_grad():
            model(**batch)
        for h in hooks:
            h.remove()
    opt.fit_projections(batches)
    assert not opt.needs_fit and opt.projector.fitted_index == 2
    for name in linear:
        a = opt.projection(name).double()
        x = torch.cat(inputs[name]).numpy()
        q = np.linalg.eigh(x.T @ x)[1][:, -RANK:]
        assert np.abs(a.T.numpy() @ a.numpy() * RANK / a.shape[1] - q @ q.T).max() < 1e-5, name
        old = old_a[projection_key(name, True)].numpy()
        estimate = old_m[name].numpy() @ np.linalg.pinv(old.T)  # min-norm G with G A_oldᵀ = m
        assert np.allclose(opt.momenta()[name].double().numpy(), estimate @ a.numpy().T, atol=1e-5), name


def test_a_refit_to_the_same_subspace_leaves_the_first_moment_as_it_was():
    """Unchanged weights and the same fit batch: the window's projections are the last one's
    bit for bit, and the transferred first moment is the one held (seeded projections' Flora
    transfer ``m·A_old·A_newᵀ`` would scale it by in/r)."""
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, _windows())
    opt.fit_projections(_fit_batches(model.config.vocab_size))
    fitted = opt.fitted_projections()
    for i in range(2):  # α = 0: the moments move, the weights do not
        model(**token_batch(model.config.vocab_size, seed=i)).loss.backward()
        opt.apply(opt.propose(), 0.0)
        opt.zero_grad()
    held = {n: m.clone() for n, m in opt.momenta().items()}
    opt.fit_projections(_fit_batches(model.config.vocab_size))
    assert all(torch.equal(a, opt.fitted_projections()[g]) for g, a in fitted.items())
    for name, m in opt.momenta().items():
        if name != "model.embed_tokens.weight":  # its seeded projection was redrawn
            assert torch.allclose(m, held[name], rtol=1e-4, atol=1e-7), name


def test_refits_travel_with_the_delta_and_resume_at_a_window_start_replays_bitwise(tmp_path):
    """Each window's first delta carries its fitted projections (the others none); a receiver
    that replays the deltas ends on the trainer's bits; a state saved after a window's last
    update, before its fit, resumes into the same fit and the same bits."""
    cfg = _windows(non_target="sketch", optimizer="adam")
    model, receiver = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    deltas = _windowed_steps(model, opt, 4)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    deltas += _windowed_steps(model, opt, 3, seed0=4)
    assert [bool(d.projections) for d in deltas] == [True, False] * 3 + [True]
    assert not torch.equal(*(d.projections[projection_key(deltas[0].fitted[0], True)] for d in deltas[::2][:2]))
    for d in deltas:
        apply_delta(receiver, PolicyDelta.from_bytes(d.to_bytes()), cfg)
    for (n, a), b in zip(model.state_dict().items(), receiver.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = tiny_qwen2(seed=123)
    fresh.load_state_dict(state["model"])
    opt2 = LoGRAOptimizer(fresh, cfg)
    opt2.load_state_dict(state["opt"])
    assert opt2.needs_fit
    tail = _windowed_steps(fresh, opt2, 3, seed0=4)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert all(torch.equal(a, b) for a, b in zip(deltas[-1].factors.values(), tail[-1].factors.values(), strict=True))
    with pytest.raises(ValueError, match="refresh window"):
        opt2.fit_projections(_fit_batches(fresh.config.vocab_size))
    with pytest.raises(ValueError, match="refresh_every >= 2"):
        LoGRAConfig(rank=RANK, distribution="inputs", refresh=True, refresh_every=1)
