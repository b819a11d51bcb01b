"""Test fixtures for TRL: a GRPOTrainer with the rllog mixin on the tiny model, and reward functions whose outputs tests check.

The tiny model (and the prompts its tokenizer is trained on) is the demo's, :func:`rllog.demo.build_tiny_model`: one copy,
in the package, because ``rllog demo`` needs it; so are the GRPOConfig settings (:func:`rllog.demo.grpo_settings`),
which tests override per case. The reward functions here are the tests' own, so changing the demo's cannot change
what a test asserts (the ``digits/fraction`` metric, the ``n_chars`` column...).
"""

from __future__ import annotations

from typing import Any

from rllog.demo import PROMPTS, build_tiny_model, grpo_settings

__all__ = ["PROMPTS", "build_tiny_model", "grpo_dataset", "make_grpo_trainer", "reward_has_digit", "reward_short"]


def _texts(completions: list) -> list[str]:
    """Completion texts, whether TRL passes plain strings or conversations."""
    return [c if isinstance(c, str) else c[-1]["content"] for c in completions]


def reward_has_digit(completions, log_metric=None, log_extra=None, **kwargs) -> list[float]:
    """1.0 for a completion with a digit in it; logs ``digits/fraction`` and an ``n_chars`` column through the mixin."""
    texts = _texts(completions)
    rewards = [1.0 if any(ch.isdigit() for ch in t) else 0.0 for t in texts]
    if log_metric is not None:
        log_metric("digits/fraction", sum(rewards) / len(rewards))
    if log_extra is not None:
        log_extra("n_chars", [len(t) for t in texts])
    return rewards


def reward_short(completions, **kwargs) -> list[float]:
    """Prefers short completions."""
    return [1.0 / (1.0 + len(t)) for t in _texts(completions)]


def grpo_dataset(conversational: bool = False):
    """The prompts as a dataset: plain text, or one-message conversations (``[{"role": "user", "content": ...}]``)."""
    from datasets import Dataset

    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if conversational else PROMPTS
    return Dataset.from_dict({"prompt": prompts})


def make_grpo_trainer(
    model_dir: str,
    output_dir: str,
    steps: int,
    report_to: Any,
    rllog_options: dict | None = None,
    *,
    rllog_report_to: Any = None,
    mixin: bool = True,
    conversational: bool = False,
    eval_prompts: int = 0,
    trainer_class_name: str = "GRPOTrainer",
    callbacks: list | None = None,
    **config_overrides: Any,
):
    """A GRPOTrainer (with :class:`rllog.integrations.trl.RLLogMixin`, unless ``mixin=False``) on the tiny model, CPU only.

    4 completions a step, logged every step, rewarded by :func:`reward_has_digit` and :func:`reward_short`;
    ``eval_prompts`` of the prompts make the eval dataset; ``config_overrides`` go to ``GRPOConfig``.
    ``trainer_class_name`` names the mixin class (docs/trl.md's example names it ``Trainer``). rllog's health rules
    are off unless ``rllog_options`` says ``health``: a random tiny model trips them at every step.
    """
    from trl import GRPOConfig, GRPOTrainer

    settings = grpo_settings(output_dir, steps, report_to, **config_overrides)
    kwargs = dict(
        model=model_dir,
        reward_funcs=[reward_has_digit, reward_short],
        args=GRPOConfig(**settings),
        train_dataset=grpo_dataset(conversational),
        callbacks=callbacks,
    )
    if eval_prompts:
        kwargs["eval_dataset"] = grpo_dataset(conversational).select(range(eval_prompts))
    if not mixin:
        return GRPOTrainer(**kwargs)
    from rllog.integrations.trl import RLLogMixin

    trainer_class = type(trainer_class_name, (RLLogMixin, GRPOTrainer), {})
    rllog_options = {"health": False, **(rllog_options or {})}
    return trainer_class(**kwargs, rllog_options=rllog_options, rllog_report_to=rllog_report_to)
