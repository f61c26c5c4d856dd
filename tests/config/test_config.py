"""Bad configuration fails fast, before any model is loaded, naming key, value and what is allowed."""

from __future__ import annotations

import json

import pytest

from flwr_verl.config import ConfigError, ModelConfig, engine_config, parse_run_config


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"model": {"path": "/no/such/model"}},
         "model.path='/no/such/model' is invalid: must be an existing local model directory"),
        ({"algorithm": {"adv_estimator": "ppo2"}},
         "algorithm.adv_estimator='ppo2' is invalid: allowed: gae, grpo, rloo, reinforce_plus_plus, remax"),
        ({"model": {"lora_rank": 0}}, "model.lora_rank=0 is invalid: must be > 0"),
        ({"model": {"lora_rank": -4}}, "model.lora_rank=-4 is invalid: must be > 0"),
        ({"actor": {"clip_ratio": 0.0}}, "actor.clip_ratio=0.0 is invalid: must be > 0"),
        ({"actor": {"clip_ratio_high": -0.1}}, "actor.clip_ratio_high=-0.1 is invalid: must be > 0"),
        ({"data": {"train_batch_size": 32}, "actor": {"ppo_mini_batch_size": 12}},
         "actor.ppo_mini_batch_size=12 is invalid: must divide data.train_batch_size=32"),
        ({"algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 1}},
         "rollout.n=1 is invalid: must be >= 2 for algorithm.adv_estimator='grpo'"),
        ({"algorithm": {"adv_estimator": "rloo"}, "rollout": {"n": 1}},
         "rollout.n=1 is invalid: must be >= 2 for algorithm.adv_estimator='rloo'"),
        ({"actor": {"lr": "fast"}}, "actor.lr='fast' is invalid: must be a number"),
        ({"rollout": {"n": 2.5}}, "rollout.n=2.5 is invalid: must be an integer"),
        ({"trainer": {"local_iterations": 0}}, "trainer.local_iterations=0 is invalid: must be >= 1"),
        ({"trainer": {"num_threads": 0}}, "trainer.num_threads=0 is invalid: must be >= 1"),
        ({"privacy": {"enabled": True, "noise_multiplier": 0.0}},
         "privacy.noise_multiplier=0.0 is invalid: must be > 0 under privacy.enabled=true"),
        ({"privacy": {"enabled": True}, "algorithm": {"adv_estimator": "gae"}},
         "algorithm.adv_estimator='gae' is invalid: under privacy.enabled=true allowed: grpo, rloo, remax"),
    ],
)
def test_bad_value_names_key_value_and_allowed(sections, expected):
    with pytest.raises(ConfigError) as error:
        engine_config(**sections)
    assert expected in str(error.value)


def test_unknown_key_names_it_and_the_allowed_keys():
    with pytest.raises(ConfigError) as error:
        engine_config(actor={"learning_rate": 1e-3})
    message = str(error.value)
    assert "unknown config key 'actor.learning_rate'" in message and "lr" in message and "clip_ratio" in message
    with pytest.raises(ConfigError, match="unknown config key 'modle.path'"):
        parse_run_config({"modle.path": ""})


def test_n_of_one_is_fine_without_a_group_estimator():
    assert engine_config(algorithm={"adv_estimator": "remax"}, rollout={"n": 1}).rollout.n == 1


def test_directory_that_is_not_a_causal_lm_is_a_model_load_error(tmp_path):
    from flwr_verl.engine.models import ModelLoadError, build_models

    empty = tmp_path / "empty"
    empty.mkdir()
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "vit"}))
    for directory in (empty, vision):
        with pytest.raises(ModelLoadError, match=f"model.path='{directory}'"):
            build_models(ModelConfig(path=str(directory)), with_critic=False)


# ----------------------------------------------------------------------------- the baseline's run config
def test_baseline_reads_flat_nested_and_pyproject_toml(tmp_path):
    from flwr_verl.tools.config_files import read_run_config

    nested = tmp_path / "nested.toml"
    nested.write_text('num-server-rounds = 2\n[actor]\nlr = 5e-4\n[algorithm.kl_ctrl]\ntype = "fixed"\n')
    assert read_run_config(str(nested), []) == {
        "num-server-rounds": 2, "actor.lr": 5e-4, "algorithm.kl_ctrl.type": "fixed"}
    flat = tmp_path / "flat.toml"
    flat.write_text('"actor.lr" = 5e-4\n')
    assert read_run_config(str(flat), []) == {"actor.lr": 5e-4}
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n[tool.flwr.app.config]\n"rollout.n" = 8\n')
    assert read_run_config(str(pyproject), []) == {"rollout.n": 8}


def test_baseline_overrides_are_toml_literals():
    from flwr_verl.tools.config_files import read_run_config

    values = read_run_config(None, ["rollout.n=8", "actor.lr=1e-4", "privacy.enabled=false",
                                    "algorithm.adv_estimator='rloo'", 'model.path="/models/x y"'])
    assert values == {"rollout.n": 8, "actor.lr": 1e-4, "privacy.enabled": False, "algorithm.adv_estimator": "rloo",
                      "model.path": "/models/x y"}
    for item in ("rollout.n", "data.task = 'arithmetic'"):
        with pytest.raises(ConfigError, match="expected key=value"):
            read_run_config(None, [item])
    with pytest.raises(ConfigError, match=r"'data\.task=arithmetic' is invalid: the value must be a TOML literal"):
        read_run_config(None, ["data.task=arithmetic"])  # as in `flwr run --run-config`: strings are quoted


def test_baseline_command_rejects_bad_config_before_loading(capsys):
    from flwr_verl.tools.baseline import main

    with pytest.raises(SystemExit) as exit_:
        main(["--set", "algorithm.adv_estimator='ppo2'"])
    assert exit_.value.code == 2
    assert "algorithm.adv_estimator='ppo2' is invalid" in capsys.readouterr().err
