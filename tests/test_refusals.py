"""Issue 20, item 7: small misuses end in one clear line (or succeed), never a traceback."""

from __future__ import annotations

import os

import pytest

from conftest import tiny_qwen2, train_steps
from logra import LoGRAConfig, LoGRAOptimizer
from logra.cli import main as logra_main
from logra.delta import PolicyDelta
from logra.errors import DeltaMismatchError


def _delta_bytes() -> bytes:
    model = tiny_qwen2()
    return train_steps(model, LoGRAOptimizer(model, LoGRAConfig(rank=4)), 1)[0].to_bytes()


def test_garbage_bytes_are_not_a_delta():
    data = _delta_bytes()
    assert PolicyDelta.from_bytes(data).step == 0
    other = data.replace(b'"logra"', b'"other"', 1)  # a safetensors file, but not a delta
    for garbage in (b"", b"garbage", os.urandom(256), data[: len(data) // 2], data[:-1], other):
        with pytest.raises(DeltaMismatchError, match=r"^these [\d,]+ bytes are not a serialised PolicyDelta") as e:
            PolicyDelta.from_bytes(garbage)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_succeeds(flag, capsys):
    assert logra_main(["bench", flag]) == 0
    assert "diagnostics" in capsys.readouterr().out


def test_unknown_benchmark_is_named(capsys):
    assert logra_main(["bench", "memroy"]) == 2
    assert "unknown benchmark 'memroy'" in capsys.readouterr().err


def test_estimate_refuses_a_rank_wider_than_the_model(capsys):
    assert logra_main(["estimate", "--model", "Qwen2.5-7B", "--rank", "5000"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("logra estimate: rank 5000 exceeds the input size 3584 of q_proj in Qwen2.5-7B: LoGRA's "
                           "rank is at most the narrowest target input (3584)")
    assert logra_main(["estimate", "--model", "Qwen2.5-7B", "--rank", "3584", "--json"]) == 0


@pytest.mark.parametrize("name, text, message", [
    ("bad.yaml", "updates: [1, 2\nkl: {budget: 1}\n", "cannot be read at line 2, column 3: expected ',' or ']'"),
    ("tab.yml", "updates:\n\t- 3\n", "cannot be read at line 2, column 1"),
    ("bad.toml", "updates = \n", "cannot be read: Invalid value"),
])
def test_malformed_config_file_is_one_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        logra_main(["train", "--config", str(tmp_path / name)])
    assert str(e.value).startswith(f"logra train: config file {tmp_path / name} {message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_config_pointing_at_a_folder_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^logra train: config file .* is a folder, not a YAML or TOML file$"):
        logra_main(["train", "--config", str(tmp_path)])
