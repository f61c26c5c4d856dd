"""More bad input (issue 9), each stopped before any training with a message naming the key:
LoRA target names that match no module, prompts plus responses longer than the model's
positions, rewards of absurd magnitude, and unknown run-config keys (``flwr-verl check-config``,
since Flower itself answers those with only ``[code: 15] Invalid run configuration``)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
import torch
from flwr.common.config import flatten_dict

from flwr_verl.config import ConfigError, ModelConfig, parse_run_config
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import ModelLoadError, build_models, load_critic
from flwr_verl.engine.rewards import RewardError, checked
from flwr_verl.engine.trainer import LocalPPOTrainer
from flwr_verl.federation.client import VerlClient
from flwr_verl.tools.cli import main
from tests.flower_harness import REPO

LINEAR = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"  # the embedded model's


@pytest.fixture(scope="module")
def rows(tiny_config):
    config = tiny_config()
    return load_rows(config.data, "train", seed=0), load_rows(config.data, "val", seed=0)


@pytest.fixture()
def no_training(monkeypatch):
    """Fails the test if a trainer's fit starts."""
    def fit(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr("flwr_verl.engine.trainer.LocalPPOTrainer.fit", fit)


# ----------------------------------------------------------------------------- model.target_modules
def test_target_module_name_that_matches_nothing_is_an_error():
    with pytest.raises(ModelLoadError, match=rf"model\.target_modules='q_proj,nope': no module of this model "
                                             rf"matches 'nope'; its linear modules: {LINEAR} \(or 'all-linear'\)"):
        build_models(ModelConfig(target_modules="q_proj,nope"), with_critic=False)
    with pytest.raises(ModelLoadError, match=r"model\.target_modules='v_proj, qproj': no module of this model matches 'qproj';"):
        load_critic(ModelConfig(target_modules="v_proj, qproj"), torch.device("cpu"))


def test_target_modules_that_all_match_train_exactly_those():
    policy = build_models(ModelConfig(target_modules="q_proj, self_attn.v_proj"), with_critic=False).policy
    adapted = {name.split(".")[-4] for name, p in policy.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}


# ----------------------------------------------------------------------------- lengths
def _row(content: str) -> dict:
    return {"data_source": "flwr_verl/arithmetic", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 0}}


def test_prompt_longer_than_the_model_positions_is_an_error(tiny_config, no_training):
    long_prompt = "1+" * 5000 + "1="  # 10k characters against the embedded model's 64 positions
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length=256 \+ rollout\.response_length=6 do not fit "
                                          r"the model's max_position_embeddings=64: the longest prompt has \d+ "
                                          r"tokens, so a rollout needs 262 positions"):
        VerlClient(tiny_config(), [_row("1+1="), _row(long_prompt)], [])


def test_prompts_that_fit_pass_whatever_max_prompt_length_says(tiny_config, rows):
    # The default max_prompt_length=256 exceeds 64 positions, but the embedded task's prompts are
    # short; and a configured sum that fits passes even for a long prompt (cut from the left).
    VerlClient(tiny_config(), *rows)
    VerlClient(tiny_config(data={"max_prompt_length": 58}), [_row("1+" * 5000 + "1=")], [])


# ----------------------------------------------------------------------------- reward magnitude
HUGE = '''
def huge(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": -1e30, "note": 1.0}
'''


@pytest.fixture()
def huge_reward(tmp_path):
    path = tmp_path / "huge.py"
    path.write_text(HUGE)
    return {"path": str(path), "name": "huge"}


def test_reward_of_absurd_magnitude_is_an_error_without_clip(tiny_config, rows, huge_reward, no_training):
    with pytest.raises(RewardError, match=r"huge on prompt .* returned -1e\+30; \|score\| above 1e\+06 is refused: "
                                          r"rescale the function or set custom_reward_function\.clip > 0"):
        VerlClient(tiny_config(custom_reward_function=huge_reward), *rows)


def test_clip_bounds_every_score(tiny_config, rows, huge_reward):
    config = tiny_config(custom_reward_function={**huge_reward, "clip": 5.0})
    (metrics,) = LocalPPOTrainer(config, rows[0]).fit(1).metrics  # the trainer resolves the function itself
    assert metrics["reward_mean"] == -5.0
    bounded = checked(lambda **kwargs: 1e30, clip=2.0)
    assert bounded("toy", "x", "y") == 2.0
    assert checked(bounded) is bounded  # checking again keeps the bound


@pytest.mark.parametrize("clip", [-1.0, float("inf"), float("nan")])
def test_clip_out_of_range(clip):
    with pytest.raises(ConfigError, match=r"custom_reward_function\.clip=.* is invalid: must be a finite number >= 0"):
        parse_run_config({"custom_reward_function.clip": clip})


# ----------------------------------------------------------------------------- flwr-verl check-config
@pytest.fixture()
def profiles(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('num-server-rounds = 2\n[actor]\nlr = 1e-3\n[algorithm.kl_ctrl]\ntype = "fixed"\n')
    bad.write_text('num-server-rounds = 2\n"actor.lrr" = 1e-3\n')
    return good, bad


def test_check_config_accepts_a_good_profile(profiles, capsys):
    manifest = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert main(["check-config", str(profiles[0]), "--set", "algorithm.adv_estimator='rloo'"]) == 0
    assert capsys.readouterr().out == f"ok: {len(flatten_dict(manifest))} keys valid\n"


@pytest.mark.parametrize("args, message", [
    (["BAD"], "unknown config key 'actor.lrr'; allowed under 'actor.': clip_ratio, "),
    (["GOOD", "--set", "rollout.n=0"], "rollout.n=0 is invalid: must be >= 1"),
    (["GOOD", "--set", "algorithm.adv_estimator=rloo"], "--set 'algorithm.adv_estimator=rloo' is invalid"),
    (["missing.toml"], "No such file or directory: 'missing.toml'"),
])
def test_check_config_names_the_bad_key(profiles, capsys, args, message):
    args = [{"GOOD": str(profiles[0]), "BAD": str(profiles[1])}.get(arg, arg) for arg in args]
    assert main(["check-config", *args]) == 2
    assert message in capsys.readouterr().err


def test_check_config_refuses_keys_the_app_manifest_lacks(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text("[tool.flwr.app.config]\nnum-server-rounds = 8\n")
    assert main(["check-config", "--app", str(tmp_path), "--set", "proximal-mu=0.1"]) == 2
    assert "unknown config key 'proximal-mu': not in [tool.flwr.app.config]" in capsys.readouterr().err


def test_check_config_as_a_command(profiles):
    result = subprocess.run([sys.executable, "-m", "flwr_verl.tools.cli", "check-config", str(profiles[1])],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert "unknown config key 'actor.lrr'" in result.stderr


def test_flwr_verl_run_refuses_a_bad_config_before_submitting_anything(profiles, capsys, monkeypatch):
    import flwr_verl.tools.cli as cli

    def no_flwr(*args, **kwargs):
        raise AssertionError("flwr was called for an invalid config")

    monkeypatch.setattr(cli.subprocess, "Popen", no_flwr)
    assert main(["run", str(REPO), "some-superlink", "--run-config", str(profiles[1])]) == 2
    assert "unknown config key 'actor.lrr'" in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [[], ["actor.lr=0.002", "algorithm.adv_estimator='rloo'"]], ids=["file", "file+set"])
def test_flwr_verl_run_passes_flower_a_run_config_it_accepts(profiles, tmp_path, overrides):
    """Flower takes a TOML file or key=value pairs, not both: the file and the overrides reach it
    as one run config, parsed by Flower's own parser into what check-config validated."""
    from flwr.common.config import parse_config_args

    from flwr_verl.tools.config_files import read_run_config
    from flwr_verl.tools.cli import run_config_args

    args = run_config_args(str(profiles[0]), overrides, tmp_path)
    passed = parse_config_args(args[1::2])
    assert passed == read_run_config(str(profiles[0]), overrides)
    assert passed["actor.lr"] == (0.002 if overrides else 1e-3) and passed["algorithm.kl_ctrl.type"] == "fixed"
