"""What TRL's PPO/GRPO metrics mean and which values are healthy: data and lookups.

Pure Python and cheap to import (no torch, numpy or tracker). :data:`CATALOG` holds every metric
TRL's logging guide documents for ``PPOTrainer`` and ``GRPOTrainer`` (plus the Hugging Face
Trainer's ``loss``, ``grad_norm``, ``learning_rate``, ``epoch``), each with its meaning in our words,
the direction that is good, the healthy range where TRL's guide gives one, and whether it is one of
the crucial metrics a plot or the console shows first. :func:`lookup` finds a key's entry
(``rewards/{name}/mean`` matches any reward function's name; a ``train/``, ``eval/`` or ``eval_``
prefix is ignored); :func:`health` says whether a value is in the healthy range.

The rules that raise alerts while a run logs are in :mod:`rllog.health`; ``docs/metrics.md`` is
generated from both by ``scripts/gen_metrics_docs.py``.

Example:
    >>> from rllog.catalog import health, lookup
    >>> lookup("train/rewards/accuracy/mean").pattern
    'rewards/{name}/mean'
    >>> health("val/ratio", 1.6)
    'unhealthy'
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

INF = math.inf
PREFIXES = ("train/", "eval/", "eval_")
SOURCE = "https://huggingface.co/docs/trl/logging"


@dataclass(frozen=True)
class MetricInfo:
    """One documented metric.

    Attributes:
        pattern: the metric name; ``{name}`` stands for any reward function name
            (``rewards/{name}/mean`` matches ``rewards/accuracy/mean``).
        meaning: what it measures and what a bad value signals, in our words.
        good: the direction that is good: ``"higher"``, ``"lower"``, ``"near 1"``, ``"stable"`` or None.
        healthy: ``(low, high)`` inclusive, where TRL's guide gives a range (an open end is +-inf);
            None otherwise.
        trainer: ``"grpo"``, ``"ppo"`` or ``"both"`` (logged by any Hugging Face Trainer).
        crucial: one of the metrics a plot / the console shows first (TRL's "crucial values").
    """

    pattern: str
    meaning: str
    good: str | None = None
    healthy: tuple[float, float] | None = None
    trainer: str = "grpo"
    crucial: bool = False

    def matches(self, key: str) -> bool:
        return _compiled(self.pattern).fullmatch(key) is not None


def _m(
    pattern: str,
    meaning: str,
    good: str | None = None,
    healthy: tuple[float, float] | None = None,
    trainer: str = "grpo",
    crucial: bool = False,
) -> MetricInfo:
    return MetricInfo(pattern, meaning, good, healthy, trainer, crucial)


# Order matters: crucial metrics are shown in this order (GRPO first, then PPO).
CATALOG: tuple[MetricInfo, ...] = (
    # ---- GRPO -------------------------------------------------------------------------------------
    _m(
        "reward",
        "Mean total reward of the sampled completions (the weighted sum over reward functions). The primary objective: it should rise while training works.",
        "higher",
        crucial=True,
    ),
    _m(
        "rewards/{name}/mean",
        "Mean reward from one reward function (named after it). With several reward functions, shows which part of the wanted behaviour is being learned and which is not.",
        "higher",
        crucial=True,
    ),
    _m("rewards/{name}/std", "Standard deviation of one reward function's rewards across the batch.", None),
    _m(
        "reward_std",
        "Standard deviation of the total reward (before the group-wise normalisation into advantages). GRPO learns from reward differences within a group, so a value near 0 means little to learn from.",
        None,
        crucial=True,
    ),
    _m(
        "frac_reward_zero_std",
        "Fraction of prompts whose completions all got the same reward (group std 0). Such groups have zero advantage and contribute no gradient; near 1 means no learning signal (every prompt too easy or too hard).",
        "lower",
        crucial=True,
    ),
    _m(
        "kl",
        "Mean per-token KL divergence between the policy and the reference model over the completions (logged only when beta > 0). Should stay small and positive; growing fast means the policy strays from the reference, which can lead to instability.",
        "lower",
        (0.0, INF),
        crucial=True,
    ),
    _m(
        "entropy",
        "Mean per-token entropy of the policy's next-token distribution over the completions. A collapse means the policy has become overconfident and nearly deterministic, which stalls learning by removing exploration.",
        "stable",
        crucial=True,
    ),
    _m(
        "completions/mean_length",
        "Mean length in tokens of all generated completions, truncated ones included.",
        None,
        crucial=True,
    ),
    _m("completions/min_length", "Shortest generated completion, in tokens.", None),
    _m("completions/max_length", "Longest generated completion, in tokens.", None),
    _m(
        "completions/clipped_ratio",
        "Fraction of completions cut off at max_completion_length before an end-of-sequence token. High: the model is not learning to stop, or max_completion_length is too short.",
        "lower",
        crucial=True,
    ),
    _m("completions/mean_terminated_length", "Mean length of the completions that ended with an end-of-sequence token.", None),
    _m("completions/min_terminated_length", "Shortest completion that ended with an end-of-sequence token.", None),
    _m("completions/max_terminated_length", "Longest completion that ended with an end-of-sequence token.", None),
    _m(
        "clip_ratio/region_mean",
        "Mean fraction of tokens whose probability ratio was clipped at either trust-region bound. Very high: the policy tries to change too drastically (large advantages, learning rate too high) or epsilon is too tight.",
        "lower",
        crucial=True,
    ),
    _m(
        "clip_ratio",
        "Fraction of token updates clipped by the trust region (logged instead of clip_ratio/* by the Liger GRPO loss). Very high values mean over-large updates or a too tight epsilon.",
        "lower",
        crucial=True,
    ),
    _m(
        "clip_ratio/low_mean",
        "Mean fraction of tokens clipped at the lower bound 1 - epsilon_low (negative advantage, ratio already below the bound).",
        "lower",
    ),
    _m("clip_ratio/low_min", "Smallest clip_ratio/low_mean across processes.", "lower"),
    _m(
        "clip_ratio/high_mean",
        "Mean fraction of tokens clipped at the upper bound 1 + epsilon_high (positive advantage, ratio already above the bound).",
        "lower",
    ),
    _m("clip_ratio/high_max", "Largest clip_ratio/high_mean across processes.", "lower"),
    _m("num_tokens", "Tokens (prompts and completions) processed so far.", None),
    # ---- any Hugging Face Trainer (GRPO logs these too) --------------------------------------------
    _m(
        "loss",
        "The loss the optimiser minimises. For GRPO it is the clipped surrogate plus beta times KL and can sit near zero or go negative, so it is no progress measure by itself; NaN or inf means training broke.",
        None,
        trainer="both",
        crucial=True,
    ),
    _m(
        "grad_norm",
        "Gradient norm before clipping. Sudden spikes signal unstable updates.",
        "stable",
        trainer="both",
        crucial=True,
    ),
    _m("learning_rate", "The optimiser's current learning rate (its schedule).", None, trainer="both"),
    _m("epoch", "Epochs completed so far (fractional).", None, trainer="both"),
    # ---- PPO --------------------------------------------------------------------------------------
    _m(
        "objective/rlhf_reward",
        "Score minus the KL penalty: the quantity PPO maximises and the ultimate objective of RLHF training. Should keep going up when training works.",
        "higher",
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "objective/scores",
        "Mean score the reward model or environment gives the sampled completions (before the KL penalty).",
        "higher",
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "objective/non_score_reward",
        "The KL-penalty part of the reward (minus beta times the summed per-token KL). More negative means the policy pays more for drifting from the reference.",
        "higher",
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "objective/kl",
        "Mean KL divergence between the current policy and the reference model, summed over a completion's tokens. Should stay positive and not too large, so the policy stays near the reference.",
        "lower",
        (0.0, INF),
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "objective/entropy",
        "Mean entropy of the policy over sampled completions: how random its choices are. Higher helps exploration; a collapse towards 0 means a deterministic policy that stops exploring.",
        "higher",
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "val/ratio",
        "Mean ratio of the current policy's token probabilities to the old (sampling) policy's. Should float around 1.0 (PPO clips it at 1 +- cliprange, 0.2 by default); values like 2, 1000 or 0.1 mean consecutive policies differ too much.",
        "near 1",
        (0.8, 1.2),
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "loss/value_avg",
        "Average value-function loss: how far the critic's predicted values are from the returns. It spikes or turns NaN when training is going wrong.",
        "stable",
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "policy/clipfrac_avg",
        "Average fraction of policy updates clipped by PPO's surrogate (ratio outside 1 +- cliprange). High together with a high val/ratio: updates are too large.",
        "lower",
        trainer="ppo",
        crucial=True,
    ),
    _m(
        "policy/approxkl_avg",
        "Average approximate KL between consecutive PPO policies (one optimisation step apart; not the KL to the reference, objective/kl). High together with a high val/ratio: updates are too large.",
        "lower",
        trainer="ppo",
        crucial=True,
    ),
    _m("loss/policy_avg", "Average PPO policy (clipped surrogate) loss.", None, trainer="ppo"),
    _m(
        "val/clipfrac_avg",
        "Average fraction of value-function updates clipped, like policy/clipfrac_avg for the value head.",
        "lower",
        trainer="ppo",
    ),
    _m(
        "policy/entropy_avg",
        "Average entropy of the policy during the PPO optimisation epochs: how diverse its token choices are. A collapse means it stopped exploring.",
        "higher",
        trainer="ppo",
    ),
    _m(
        "val/ratio_var",
        "Variance of the new-to-old probability ratio across tokens: how uneven the policy change is.",
        "lower",
        trainer="ppo",
    ),
    _m(
        "val/num_eos_tokens",
        "Number of end-of-sequence tokens generated: how many completions finished on their own.",
        "higher",
        trainer="ppo",
    ),
    _m(
        "objective/kl_coef",
        "The KL penalty coefficient (beta). With the adaptive KL controller it moves to keep KL near a target; it often climbs before numerical instabilities.",
        "stable",
        trainer="ppo",
    ),
    _m("eps", "Episodes (prompt and completion pairs) processed per second: throughput.", "higher", trainer="ppo"),
    _m("lr", "The optimiser's current learning rate.", None, trainer="ppo"),
    _m("episode", "Episodes (prompt and completion pairs) seen so far.", None, trainer="ppo"),
)

_PATTERN_CACHE: dict[str, re.Pattern] = {}


def _compiled(pattern: str) -> re.Pattern:
    rx = _PATTERN_CACHE.get(pattern)
    if rx is None:
        rx = _PATTERN_CACHE[pattern] = re.compile(re.escape(pattern).replace(re.escape("{name}"), ".+"))
    return rx


_EXACT = {m.pattern: m for m in CATALOG if "{" not in m.pattern}
_TEMPLATES = [m for m in CATALOG if "{" in m.pattern]


def strip_prefix(key: str) -> str:
    """``key`` without a leading ``train/``, ``eval/`` or ``eval_``."""
    for prefix in PREFIXES:
        if key.startswith(prefix) and len(key) > len(prefix):
            return key[len(prefix) :]
    return key


def lookup(key: str) -> MetricInfo | None:
    """The catalog entry for ``key`` (``rewards/accuracy/mean``, ``train/kl``, ...), or None."""
    for candidate in (key, strip_prefix(key)):
        info = _EXACT.get(candidate)
        if info is not None:
            return info
        for info in _TEMPLATES:
            if info.matches(candidate):
                return info
    return None


def health(key: str, value: float) -> str | None:
    """``"ok"`` or ``"unhealthy"`` for ``value`` of metric ``key``; None where nothing is known.

    NaN and inf are unhealthy for every catalogued metric. Otherwise a value is judged only against
    a documented healthy range (:attr:`MetricInfo.healthy`); metrics without one give None.
    """
    info = lookup(key)
    if info is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return "unhealthy"
    if info.healthy is None:
        return None
    low, high = info.healthy
    return "ok" if low <= value <= high else "unhealthy"


def explain(key: str, value: float | None = None) -> str | None:
    """A sentence for a user: the metric's meaning, and why ``value`` is outside its healthy range."""
    info = lookup(key)
    if info is None:
        return None
    parts = [info.meaning]
    if value is not None and health(key, value) == "unhealthy":
        if not math.isfinite(float(value)):
            parts.append(
                f"It is {value}: the numbers have broken down (check the learning rate, precision and the reward functions)."
            )
        elif info.healthy is not None:
            parts.append(f"Healthy range: {format_range(info.healthy)}; last value {value:.4g}.")
    return " ".join(parts)


def crucial_keys(keys: Iterable[str]) -> list[str]:
    """The crucial metrics among ``keys``, in catalog order (several reward functions keep their order)."""
    order = {id(m): i for i, m in enumerate(CATALOG)}
    found = []
    for key in keys:
        info = lookup(key)
        if info is not None and info.crucial:
            found.append((order[id(info)], key))
    return [k for _, k in sorted(found)]


def format_range(healthy: tuple[float, float] | None) -> str:
    """A healthy range for people: ``"0.8 to 1.2"``, ``">= 0"``, ``"<= 1"``; ``""`` for None."""
    if healthy is None:
        return ""
    low, high = healthy
    if high == INF:
        return f">= {low:g}"
    if low == -INF:
        return f"<= {high:g}"
    return f"{low:g} to {high:g}"
