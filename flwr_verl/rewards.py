"""Rewards through verl's contract and verl's ``NaiveRewardManager``.

A reward function is ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
returning a float or a dict with a ``"score"`` float, exactly as in verl. It is chosen as in
verl's ``custom_reward_function``: a ``path`` to a Python file and a function ``name``; without
one, the task generator's scorer, else verl's ``default_compute_score``.

Scores are checked: a function that raises, or returns NaN, infinity or a non-number, stops the
run with a ``RewardError`` naming the function and the prompt. It is never turned into 0.
Scores are also bounded: with ``custom_reward_function.clip`` > 0 every score is clipped to
[-clip, clip]; with clip 0 (the default) a score of magnitude above ``MAX_UNCLIPPED_SCORE`` (1e6)
stops the run, since it is almost surely a bug (a sentinel such as 1e30) that would swamp the
advantages, the critic's targets and any KL term in float32.
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
from typing import Any, Callable

from flwr_verl._verl import NaiveRewardManager, default_compute_score, load_extern_object
from flwr_verl.config import DataConfig, FlwrVerlError, RewardConfig
from flwr_verl.data import task_compute_score

ComputeScore = Callable[..., Any]
PROMPT_KEY = "prompt_text"  # extra_info key that carries the decoded prompt, for error messages
MAX_UNCLIPPED_SCORE = 1e6  # without custom_reward_function.clip, a larger |score| is an error
_BOUND = "flwr_verl_reward_clip"  # attribute that marks a checked function (its clip)


class RewardError(FlwrVerlError, RuntimeError):
    """A reward function failed or returned something that is not a finite number."""


def load_function(path: str, name: str) -> ComputeScore:
    """``name`` from the Python file at ``path``, loaded by verl's ``load_extern_object`` (what verl's
    own ``custom_reward_function`` uses), its errors restated with the config key that caused them."""
    try:
        function = load_extern_object(path, name)
    except FileNotFoundError as error:
        raise RewardError(f"custom_reward_function.path={path!r}: file not found") from error
    except AttributeError as error:  # raised only by the lookup: verl wraps errors of the import itself
        raise RewardError(f"custom_reward_function.name={name!r}: no such function in {path}") from error
    except Exception as error:  # verl raises RuntimeError from the file's own exception
        raise RewardError(f"custom_reward_function.path={path!r} failed to import: {error.__cause__ or error!r}"
                          ) from error
    if not callable(function):
        raise RewardError(f"custom_reward_function.name={name!r}: {type(function).__name__} in {path}, not a function")
    return function


def resolve_compute_score(reward: RewardConfig, data: DataConfig) -> ComputeScore:
    """The configured reward function, already ``checked`` with ``reward.clip``: whoever scores
    with it (a client, the trainer, the baseline) gets the configured bound."""
    if reward.path:
        function = load_function(reward.path, reward.name)
    elif not data.train_files:
        function = task_compute_score(data.task)
    else:
        function = default_compute_score
    return checked(function, reward.clip)


def _label(function: ComputeScore) -> str:
    """``module.name``; a function loaded from a file (a module not in ``sys.modules``) is ``file:name``."""
    module, name = getattr(function, "__module__", "?"), getattr(function, "__qualname__", repr(function))
    file = getattr(getattr(function, "__code__", None), "co_filename", None)
    return f"{module}.{name}" if module in sys.modules or file is None else f"{file}:{name}"


def checked(compute_score: ComputeScore, clip: float = 0.0) -> ComputeScore:
    """Wrap ``compute_score`` so that failures and non-numbers raise a clear ``RewardError``, and
    its scores are bounded: clipped to [-clip, clip] when ``clip`` > 0, else an error beyond
    +-``MAX_UNCLIPPED_SCORE``. A function that is already checked is returned as it is, so the
    bound chosen from the config survives the later ``checked`` calls on the way to verl's
    reward manager."""
    if hasattr(compute_score, _BOUND):
        return compute_score
    label = _label(compute_score)

    @functools.wraps(compute_score)
    def checked_compute_score(data_source, solution_str, ground_truth, extra_info=None):
        extra_info = extra_info or {}
        where = f"reward function {label} on prompt {extra_info.get(PROMPT_KEY, '?')!r} (data_source={data_source!r})"
        try:
            result = compute_score(
                data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                extra_info={k: v for k, v in extra_info.items() if k != PROMPT_KEY},
            )
        except Exception as error:
            raise RewardError(f"{where} raised {error!r}") from error
        score = result.get("score") if isinstance(result, dict) else result
        if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(float(score)):
            raise RewardError(f"{where} returned {result!r}; expected a finite float or a dict with a 'score' float")
        score = _bounded(float(score), clip, where)
        return {**result, "score": score} if isinstance(result, dict) else score

    setattr(checked_compute_score, _BOUND, clip)
    return checked_compute_score


def _bounded(score: float, clip: float, where: str) -> float:
    if clip > 0:
        return min(max(score, -clip), clip)
    if abs(score) > MAX_UNCLIPPED_SCORE:
        raise RewardError(f"{where} returned {score!r}; |score| above {MAX_UNCLIPPED_SCORE:g} is refused: "
                          "rescale the function or set custom_reward_function.clip > 0 to clip scores")
    return score


def make_reward_manager(tokenizer, compute_score: ComputeScore, clip: float = 0.0) -> NaiveRewardManager:
    """verl's reward manager around a checked ``compute_score``: DataProto in, token-level scores out.
    A function that is not yet checked gets the bound ``clip`` (see ``checked``)."""
    return NaiveRewardManager(tokenizer=tokenizer, num_examine=0, compute_score=checked(compute_score, clip))
