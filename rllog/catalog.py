"""What TRL's PPO/GRPO metrics mean, which values are healthy, and rules that raise alerts.

Pure Python and cheap to import (no torch, numpy or tracker). Three parts:

* :data:`CATALOG`: every metric TRL's logging guide documents for ``PPOTrainer`` and ``GRPOTrainer``
  (plus the Hugging Face Trainer's ``loss``, ``grad_norm``, ``learning_rate``, ``epoch``), each with
  its meaning in our words, the direction that is good, the healthy range where TRL's guide gives
  one, and whether it is one of the crucial metrics a plot or the console shows first.
  :func:`lookup` finds a key's entry (``rewards/{name}/mean`` matches any reward function's name;
  a ``train/``, ``eval/`` or ``eval_`` prefix is ignored); :func:`health` says whether a value is in
  the healthy range.
* Rules (:class:`Rule` subclasses): each watches some metrics over steps and returns
  :class:`AlertDraft` s when they look wrong (``val/ratio`` far from 1, entropy collapse,
  sustained truncated completions, negative or exploding KL, NaN/inf loss or reward, value-loss
  spikes, no learning signal). A rule does not fire again for the same metric within ``cooldown``
  steps.
* :class:`HealthMonitor`: the set of rules a run applies (``rllog.init(health=...)``), individually
  switchable and configurable.

``python -m rllog.catalog --markdown`` prints ``docs/metrics.md``.

Example:
    >>> from rllog.catalog import HealthMonitor, health, lookup
    >>> lookup("train/rewards/accuracy/mean").pattern
    'rewards/{name}/mean'
    >>> health("val/ratio", 1.6)
    'unhealthy'
    >>> monitor = HealthMonitor(disable=["kl_explosion"], overrides={"truncated_completions": {"threshold": 0.3}})
    >>> [a.rule for a in monitor.observe(10, {"loss": float("nan")})]
    ['non_finite']
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
import statistics
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, NamedTuple

log = logging.getLogger("rllog.catalog")

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


def _m(pattern: str, meaning: str, good: str | None = None, healthy: tuple[float, float] | None = None, trainer: str = "grpo", crucial: bool = False) -> MetricInfo:
    return MetricInfo(pattern, meaning, good, healthy, trainer, crucial)


# Order matters: crucial metrics are shown in this order (GRPO first, then PPO).
CATALOG: tuple[MetricInfo, ...] = (
    # ---- GRPO -------------------------------------------------------------------------------------
    _m("reward", "Mean total reward of the sampled completions (the weighted sum over reward functions). The primary objective: it should rise while training works.", "higher", crucial=True),
    _m("rewards/{name}/mean", "Mean reward from one reward function (named after it). With several reward functions, shows which part of the wanted behaviour is being learned and which is not.", "higher", crucial=True),
    _m("rewards/{name}/std", "Standard deviation of one reward function's rewards across the batch.", None),
    _m("reward_std", "Standard deviation of the total reward (before the group-wise normalisation into advantages). GRPO learns from reward differences within a group, so a value near 0 means little to learn from.", None, crucial=True),
    _m("frac_reward_zero_std", "Fraction of prompts whose completions all got the same reward (group std 0). Such groups have zero advantage and contribute no gradient; near 1 means no learning signal (every prompt too easy or too hard).", "lower", crucial=True),
    _m("kl", "Mean per-token KL divergence between the policy and the reference model over the completions (logged only when beta > 0). Should stay small and positive; growing fast means the policy strays from the reference, which can lead to instability.", "lower", (0.0, INF), crucial=True),
    _m("entropy", "Mean per-token entropy of the policy's next-token distribution over the completions. A collapse means the policy has become overconfident and nearly deterministic, which stalls learning by removing exploration.", "stable", crucial=True),
    _m("completions/mean_length", "Mean length in tokens of all generated completions, truncated ones included.", None, crucial=True),
    _m("completions/min_length", "Shortest generated completion, in tokens.", None),
    _m("completions/max_length", "Longest generated completion, in tokens.", None),
    _m("completions/clipped_ratio", "Fraction of completions cut off at max_completion_length before an end-of-sequence token. High: the model is not learning to stop, or max_completion_length is too short.", "lower", crucial=True),
    _m("completions/mean_terminated_length", "Mean length of the completions that ended with an end-of-sequence token.", None),
    _m("completions/min_terminated_length", "Shortest completion that ended with an end-of-sequence token.", None),
    _m("completions/max_terminated_length", "Longest completion that ended with an end-of-sequence token.", None),
    _m("clip_ratio/region_mean", "Mean fraction of tokens whose probability ratio was clipped at either trust-region bound. Very high: the policy tries to change too drastically (large advantages, learning rate too high) or epsilon is too tight.", "lower", crucial=True),
    _m("clip_ratio", "Fraction of token updates clipped by the trust region (logged instead of clip_ratio/* by the Liger GRPO loss). Very high values mean over-large updates or a too tight epsilon.", "lower", crucial=True),
    _m("clip_ratio/low_mean", "Mean fraction of tokens clipped at the lower bound 1 - epsilon_low (negative advantage, ratio already below the bound).", "lower"),
    _m("clip_ratio/low_min", "Smallest clip_ratio/low_mean across processes.", "lower"),
    _m("clip_ratio/high_mean", "Mean fraction of tokens clipped at the upper bound 1 + epsilon_high (positive advantage, ratio already above the bound).", "lower"),
    _m("clip_ratio/high_max", "Largest clip_ratio/high_mean across processes.", "lower"),
    _m("num_tokens", "Tokens (prompts and completions) processed so far.", None),
    # ---- any Hugging Face Trainer (GRPO logs these too) --------------------------------------------
    _m("loss", "The loss the optimiser minimises. For GRPO it is the clipped surrogate plus beta times KL and can sit near zero or go negative, so it is no progress measure by itself; NaN or inf means training broke.", None, trainer="both", crucial=True),
    _m("grad_norm", "Gradient norm before clipping. Sudden spikes signal unstable updates.", "stable", trainer="both", crucial=True),
    _m("learning_rate", "The optimiser's current learning rate (its schedule).", None, trainer="both"),
    _m("epoch", "Epochs completed so far (fractional).", None, trainer="both"),
    # ---- PPO --------------------------------------------------------------------------------------
    _m("objective/rlhf_reward", "Score minus the KL penalty: the quantity PPO maximises and the ultimate objective of RLHF training. Should keep going up when training works.", "higher", trainer="ppo", crucial=True),
    _m("objective/scores", "Mean score the reward model or environment gives the sampled completions (before the KL penalty).", "higher", trainer="ppo", crucial=True),
    _m("objective/non_score_reward", "The KL-penalty part of the reward (minus beta times the summed per-token KL). More negative means the policy pays more for drifting from the reference.", "higher", trainer="ppo", crucial=True),
    _m("objective/kl", "Mean KL divergence between the current policy and the reference model, summed over a completion's tokens. Should stay positive and not too large, so the policy stays near the reference.", "lower", (0.0, INF), trainer="ppo", crucial=True),
    _m("objective/entropy", "Mean entropy of the policy over sampled completions: how random its choices are. Higher helps exploration; a collapse towards 0 means a deterministic policy that stops exploring.", "higher", trainer="ppo", crucial=True),
    _m("val/ratio", "Mean ratio of the current policy's token probabilities to the old (sampling) policy's. Should float around 1.0 (PPO clips it at 1 +- cliprange, 0.2 by default); values like 2, 1000 or 0.1 mean consecutive policies differ too much.", "near 1", (0.8, 1.2), trainer="ppo", crucial=True),
    _m("loss/value_avg", "Average value-function loss: how far the critic's predicted values are from the returns. It spikes or turns NaN when training is going wrong.", "stable", trainer="ppo", crucial=True),
    _m("policy/clipfrac_avg", "Average fraction of policy updates clipped by PPO's surrogate (ratio outside 1 +- cliprange). High together with a high val/ratio: updates are too large.", "lower", trainer="ppo", crucial=True),
    _m("policy/approxkl_avg", "Average approximate KL between consecutive PPO policies (one optimisation step apart; not the KL to the reference, objective/kl). High together with a high val/ratio: updates are too large.", "lower", trainer="ppo", crucial=True),
    _m("loss/policy_avg", "Average PPO policy (clipped surrogate) loss.", None, trainer="ppo"),
    _m("val/clipfrac_avg", "Average fraction of value-function updates clipped, like policy/clipfrac_avg for the value head.", "lower", trainer="ppo"),
    _m("policy/entropy_avg", "Average entropy of the policy during the PPO optimisation epochs: how diverse its token choices are. A collapse means it stopped exploring.", "higher", trainer="ppo"),
    _m("val/ratio_var", "Variance of the new-to-old probability ratio across tokens: how uneven the policy change is.", "lower", trainer="ppo"),
    _m("val/num_eos_tokens", "Number of end-of-sequence tokens generated: how many completions finished on their own.", "higher", trainer="ppo"),
    _m("objective/kl_coef", "The KL penalty coefficient (beta). With the adaptive KL controller it moves to keep KL near a target; it often climbs before numerical instabilities.", "stable", trainer="ppo"),
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
            return key[len(prefix):]
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
            parts.append(f"It is {value}: the numbers have broken down (check the learning rate, precision and the reward functions).")
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
    if healthy is None:
        return ""
    low, high = healthy
    if high == INF:
        return f">= {low:g}"
    if low == -INF:
        return f"<= {high:g}"
    return f"{low:g} to {high:g}"


# ---- health rules ------------------------------------------------------------------------------


class AlertDraft(NamedTuple):
    """An alert before the run stamps its sequence number and time (then it becomes an AlertRecord)."""

    step: int
    rule: str
    metric: str
    value: float
    message: str
    level: str = "warning"


def _float(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v


class Rule:
    """A health rule: watches ``metrics`` over steps and returns alerts.

    Subclasses set ``name``, ``summary`` (for the docs), ``level``, ``defaults`` (every configurable
    parameter, ``metrics`` and ``cooldown`` included) and implement :meth:`check`, which updates the
    rule's state for one value and returns a message when the value is a problem.

    Args:
        enabled: a disabled rule observes nothing and fires nothing.
        **params: overrides of ``defaults`` (an unknown name is a ``ValueError`` naming the known ones).
    """

    name: ClassVar[str] = "rule"
    summary: ClassVar[str] = ""
    level: ClassVar[str] = "warning"
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, enabled: bool = True, **params: Any):
        self.enabled = bool(enabled)
        self.params: dict[str, Any] = dict(self.defaults)
        self.configure(**params)

    def configure(self, **params: Any) -> "Rule":
        """Change parameters (and ``enabled``); resets the rule's history."""
        if "enabled" in params:
            self.enabled = bool(params.pop("enabled"))
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(f"rule {self.name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters are: enabled, {', '.join(self.defaults)}")
        if "metrics" in params:
            params["metrics"] = (params["metrics"],) if isinstance(params["metrics"], str) else tuple(params["metrics"])
        self.params.update(params)
        self.reset()
        return self

    def __getattr__(self, item: str) -> Any:
        params = self.__dict__.get("params")
        if params is not None and item in params:
            return params[item]
        raise AttributeError(item)

    def reset(self) -> None:
        self._last_fired: dict[str, int] = {}
        self._state: dict[str, Any] = {}
        self._watched: dict[str, bool] = {}  # key -> answer of watches(); the same key is logged every step

    def watches(self, key: str) -> bool:
        answer = self._watched.get(key)
        if answer is None:
            if len(self._watched) > 100_000:  # a run that invents new keys every step must not grow this forever
                self._watched.clear()
            bare = strip_prefix(key)
            answer = self._watched[key] = any(fnmatch.fnmatchcase(k, pattern) for pattern in self.params["metrics"] for k in {key, bare})
        return answer

    def observe(self, step: int, values: Mapping[str, float]) -> list[AlertDraft]:
        if not self.enabled:
            return []
        out = []
        for key, raw in values.items():
            if not self.watches(key):
                continue
            value = _float(raw)
            if value is None:
                continue
            message = self.check(key, value, step)
            if message and self._cooled(key, step):
                out.append(AlertDraft(step, self.name, key, value, message, self.level))
        return out

    def check(self, key: str, value: float, step: int) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _cooled(self, key: str, step: int) -> bool:
        last = self._last_fired.get(key)
        if last is None or step - last >= self.params["cooldown"] or step < last:
            self._last_fired[key] = step
            return True
        return False

    def state(self, key: str, factory):
        s = self._state.get(key)
        if s is None:
            s = self._state[key] = factory()
        return s

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}(enabled={self.enabled}, {params})"


class RatioFarFromOne(Rule):
    """PPO's ``val/ratio`` (new / old policy probability) further than ``max_deviation`` from 1."""

    name = "ratio_far_from_one"
    summary = "val/ratio is further than max_deviation from 1.0: consecutive policies differ too much (TRL: it should float around 1.0)."
    defaults = {"metrics": ("val/ratio",), "max_deviation": 0.2, "cooldown": 50}

    def check(self, key, value, step):
        if math.isfinite(value) and abs(value - 1.0) > self.max_deviation:
            return f"{key} is {value:.4g}, more than {self.max_deviation:g} away from 1.0: the updates between consecutive policies are too drastic (lower the learning rate or the cliprange)"
        return None


class _Baseline:
    """The mean of a metric's first ``n`` finite observations."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, value: float, n: int) -> float | None:
        """Feed one value; returns the baseline once it is complete and ``value`` came after it."""
        if len(self.values) < n:
            if math.isfinite(value):
                self.values.append(value)
            return None
        return sum(self.values) / len(self.values)


class EntropyCollapse(Rule):
    """Entropy below ``min_fraction`` of the mean of its first ``warmup`` observations."""

    name = "entropy_collapse"
    summary = "Entropy fell below min_fraction of its early level (the mean of its first warmup observations): the policy is becoming deterministic and stops exploring."
    defaults = {"metrics": ("entropy", "objective/entropy", "policy/entropy_avg"), "min_fraction": 0.2, "warmup": 5, "cooldown": 50}

    def check(self, key, value, step):
        baseline = self.state(key, _Baseline).add(value, self.warmup)
        if baseline is None or baseline <= 0 or not math.isfinite(value):
            return None
        if value < self.min_fraction * baseline:
            return f"{key} collapsed to {value:.4g}, {value / baseline:.0%} of its early level {baseline:.4g}: the policy is becoming overconfident and deterministic, which stalls learning (try a higher temperature, a lower learning rate or a KL/entropy term)"
        return None


class _Streak(Rule):
    """Fires when the condition holds for ``patience`` consecutive observations."""

    def condition(self, value: float) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def check(self, key, value, step):
        streak = self._state.get(key, 0) + 1 if math.isfinite(value) and self.condition(value) else 0
        self._state[key] = streak
        return self.describe(key, value, streak) if streak >= self.patience else None


class TruncatedCompletions(_Streak):
    """``completions/clipped_ratio`` above ``threshold`` for ``patience`` observations in a row."""

    name = "truncated_completions"
    summary = "completions/clipped_ratio stayed above threshold for patience consecutive observations: most completions hit max_completion_length without ending."
    defaults = {"metrics": ("completions/clipped_ratio",), "threshold": 0.5, "patience": 3, "cooldown": 50}

    def condition(self, value):
        return value > self.threshold

    def describe(self, key, value, streak):
        return f"{key} is {value:.3g} (above {self.threshold:g} for {streak} logged steps in a row): completions are being cut off at max_completion_length; the model is not learning to stop, or max_completion_length is too short"


class NoLearningSignal(_Streak):
    """``frac_reward_zero_std`` at or above ``threshold`` for ``patience`` observations in a row."""

    name = "no_learning_signal"
    summary = "frac_reward_zero_std stayed at or above threshold for patience consecutive observations: nearly every group's completions got the same reward, so advantages are zero and nothing is learned."
    defaults = {"metrics": ("frac_reward_zero_std",), "threshold": 0.9, "patience": 3, "cooldown": 50}

    def condition(self, value):
        return value >= self.threshold

    def describe(self, key, value, streak):
        return f"{key} is {value:.3g} (at or above {self.threshold:g} for {streak} logged steps in a row): almost every prompt's completions got the same reward, so there is no learning signal (prompts too easy or too hard for the model, or a reward function that returns a constant)"


class NegativeKL(Rule):
    """A KL estimate below ``threshold`` (slightly negative values are estimator noise)."""

    name = "kl_negative"
    summary = "KL to the reference fell below threshold: a KL divergence cannot be negative, so the estimate is broken (TRL: it should stay positive)."
    defaults = {"metrics": ("kl", "objective/kl"), "threshold": -0.01, "cooldown": 50}

    def check(self, key, value, step):
        if math.isfinite(value) and value < self.threshold:
            return f"{key} is {value:.4g}, below {self.threshold:g}: a KL divergence should stay positive; the policy is being pushed where the estimate is unreliable (check the sampling settings, e.g. temperature, against the reference model's)"
        return None


class ExplodingKL(Rule):
    """KL above ``factor`` times its early level, or above ``ceiling``.

    The early level is the mean of the first ``warmup`` observations, but at least ``floor``: a run
    that starts with the policy equal to the reference (KL 0) does not alert on its first small KL.
    """

    name = "kl_explosion"
    summary = "KL to the reference rose above factor times its early level (the mean of its first warmup observations, at least floor) or above ceiling: the policy is drifting away from the reference, which often precedes instability. PPO's objective/kl is summed over tokens and is much larger than GRPO's per-token kl: raise ceiling and factor for it if needed."
    defaults = {"metrics": ("kl", "objective/kl"), "factor": 10.0, "warmup": 5, "floor": 0.05, "ceiling": 100.0, "cooldown": 50}

    def check(self, key, value, step):
        if not math.isfinite(value):
            return None
        baseline = self.state(key, _Baseline).add(value, self.warmup)
        if self.ceiling is not None and value > self.ceiling:
            return f"{key} is {value:.4g}, above the ceiling {self.ceiling:g}: the policy has moved far from the reference model (raise beta / the KL coefficient, or lower the learning rate)"
        if baseline is not None:
            early = max(baseline, self.floor)
            if value > self.factor * early:
                return f"{key} is {value:.4g}, {value / early:.0f}x its early level {early:.4g}: the policy is drifting away from the reference model, which often precedes instability (raise beta / the KL coefficient, or lower the learning rate)"
        return None


class NonFinite(Rule):
    """NaN or inf in a loss or reward."""

    name = "non_finite"
    level = "error"
    summary = "A loss or reward is NaN or inf: training has numerically broken down (or a reward function returned NaN/inf)."
    defaults = {
        "metrics": ("loss", "loss/*", "*_loss", "reward", "reward_std", "rewards/*", "objective/rlhf_reward", "objective/scores", "objective/non_score_reward"),
        "cooldown": 50,
    }

    def check(self, key, value, step):
        if math.isfinite(value):
            return None
        what = "loss" if "loss" in key else "reward"
        return f"{key} is {value}: the {what} is no longer a finite number; training has broken down numerically (check the learning rate, mixed precision, and the reward functions' outputs)"


class ValueLossSpike(Rule):
    """``loss/value_avg`` above median + ``k`` x MAD of the last ``window`` values, or above ``ratio`` x median."""

    name = "value_loss_spike"
    summary = "loss/value_avg jumped above the median of its last window values plus k times their median absolute deviation, or above ratio times that median (after min_history values): the value function is diverging (TRL: it spikes / NaNs when training is not going well)."
    defaults = {"metrics": ("loss/value_avg",), "window": 20, "k": 6.0, "ratio": 10.0, "min_history": 5, "cooldown": 50}

    def check(self, key, value, step):
        if not math.isfinite(value):
            return None  # the non_finite rule reports it
        history = self.state(key, lambda: deque(maxlen=int(self.window)))
        message = None
        if len(history) >= self.min_history:
            median = statistics.median(history)
            mad = statistics.median(abs(v - median) for v in history)
            if (mad > 0 and value > median + self.k * mad) or (median > 0 and value > self.ratio * median):
                message = f"{key} spiked to {value:.4g} (median of the last {len(history)} values {median:.4g}, MAD {mad:.3g}): the value function is diverging (lower the learning rate or the value-loss coefficient; check the reward scale)"
        history.append(value)
        return message


RULES: tuple[type[Rule], ...] = (RatioFarFromOne, EntropyCollapse, TruncatedCompletions, NegativeKL, ExplodingKL, NonFinite, ValueLossSpike, NoLearningSignal)


def default_rules() -> list[Rule]:
    """A fresh instance of every built-in rule, with its default parameters."""
    return [cls() for cls in RULES]


class HealthMonitor:
    """The health rules a run applies to every logged step.

    Args:
        rules: the rules (default: :func:`default_rules`).
        disable: names of rules to switch off (a list, or a comma-separated string).
        overrides: ``{rule_name: {param: value}}``, e.g. ``{"entropy_collapse": {"min_fraction": 0.1}}``;
            ``{"rule": {"enabled": False}}`` also disables.

    Used as ``rllog.init(health={"disable": [...], "overrides": {...}})``; ``health=False`` turns the
    monitor off. :meth:`observe` never raises: a rule that fails is logged and skipped.
    """

    def __init__(self, rules: Iterable[Rule] | None = None, disable: Iterable[str] | str = (), overrides: Mapping[str, Mapping[str, Any]] | None = None):
        self.rules: list[Rule] = list(rules) if rules is not None else default_rules()
        if isinstance(disable, str):
            disable = [d.strip() for d in disable.split(",") if d.strip()]
        for name in disable:
            self.rule(name).enabled = False
        for name, params in (overrides or {}).items():
            self.rule(name).configure(**dict(params))
        self._broken: set[str] = set()

    default_rules = staticmethod(default_rules)

    def rule(self, name: str) -> Rule:
        """The rule called ``name`` (``ValueError`` naming the known rules otherwise)."""
        for r in self.rules:
            if r.name == name:
                return r
        raise ValueError(f"unknown health rule {name!r}; the rules are: {', '.join(r.name for r in self.rules)}")

    def observe(self, step: int, values: Mapping[str, float]) -> list[AlertDraft]:
        """Feed one logged step's values to every enabled rule; returns the alerts they raise."""
        out: list[AlertDraft] = []
        for r in self.rules:
            if not r.enabled:
                continue
            try:
                out.extend(r.observe(step, values))
            except Exception:  # a rule bug must never break logging
                if r.name not in self._broken:
                    self._broken.add(r.name)
                    log.exception("rllog: health rule %r failed; it is skipped for this step", r.name)
        return out


# ---- docs/metrics.md ---------------------------------------------------------------------------

_TRAINERS = (
    ("grpo", "GRPO (`GRPOTrainer`)"),
    ("ppo", "PPO (`PPOTrainer`)"),
    ("both", "Any Hugging Face Trainer (GRPO logs these too)"),
)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _param(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def markdown() -> str:
    """The text of ``docs/metrics.md``."""
    lines = [
        "# Metric catalog and health alerts",
        "",
        "<!-- Generated by `python -m rllog.catalog --markdown > docs/metrics.md`; edit rllog/catalog.py, not this file. -->",
        "",
        "rllog knows the metrics TRL's trainers log (from TRL's logging guide, " + SOURCE + ", in our own words): what each",
        "one measures, which direction is good, and the healthy range where TRL's guide gives one. `rllog show` marks",
        "metrics whose last value is unhealthy and explains them, `rllog plot` shades the healthy band and marks",
        "alerts, and the `console` backend colours values by health. Names match with a `train/`, `eval/` or `eval_`",
        "prefix too, and `{name}` stands for any reward function's name (`rewards/accuracy/mean`).",
        "",
        "**Crucial** metrics (TRL's \"crucial values\") are the ones plots and the console show first.",
        "",
    ]
    for trainer, title in _TRAINERS:
        lines += [f"## {title}", "", "| metric | meaning | good | healthy range | crucial |", "|---|---|---|---|---|"]
        for m in CATALOG:
            if m.trainer == trainer:
                lines.append(f"| `{m.pattern}` | {_cell(m.meaning)} | {m.good or ''} | {format_range(m.healthy)} | {'yes' if m.crucial else ''} |")
        lines.append("")
    lines += [
        "## Health rules",
        "",
        "Each rule watches some metrics as they are logged (on the journal writer thread, never on the caller's)",
        "and raises an alert: a record of its own (step, rule, metric, value, message, level) that is journalled,",
        "delivered to every sink that takes alerts, and logged with Python `logging` (logger `rllog`). A rule does",
        "not fire again for the same metric within `cooldown` steps, so a long unhealthy stretch gives one alert",
        "per cooldown, not one per step. Metric patterns use shell-style wildcards (`loss/*`).",
        "",
        "| rule | level | fires when | parameters (defaults) |",
        "|---|---|---|---|",
    ]
    for cls in RULES:
        params = "; ".join(f"{k}={_param(v)}" for k, v in cls.defaults.items())
        lines.append(f"| `{cls.name}` | {cls.level} | {_cell(cls.summary)} | {_cell(params)} |")
    lines += [
        "",
        "Configure them when starting a run:",
        "",
        "```python",
        "run = rllog.init(",
        "    health={",
        "        \"disable\": [\"kl_explosion\"],                                  # switch rules off by name",
        "        \"overrides\": {\"truncated_completions\": {\"threshold\": 0.3, \"patience\": 5},",
        "                      \"entropy_collapse\": {\"min_fraction\": 0.1, \"cooldown\": 200}},",
        "    },",
        ")",
        "rllog.init(health=False)                                           # no health rules at all",
        "```",
        "",
        "or build a `rllog.catalog.HealthMonitor(rules=[...], disable=..., overrides=...)` with rules of your own",
        "(subclasses of `rllog.catalog.Rule`) and pass it as `health=`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rllog.catalog", description="rllog's metric catalog and health rules")
    parser.add_argument("--markdown", action="store_true", help="print docs/metrics.md")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    for m in CATALOG:
        print(f"{m.trainer:5} {m.pattern:38} good={m.good or '-':7} healthy={format_range(m.healthy) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
