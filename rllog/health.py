"""Health rules: watch metrics as a run logs them and raise alerts when they look wrong.

Pure Python and cheap to import. Each :class:`Rule` subclass watches some metrics over steps and
returns :class:`AlertDraft` s (``val/ratio`` far from 1, entropy collapse, sustained truncated
completions, negative or exploding KL, NaN/inf loss or reward, value-loss spikes, no learning
signal). A rule does not fire again for the same metric within ``cooldown`` steps.
:class:`HealthMonitor` is the set of rules a run applies (``rllog.init(health=...)``), individually
switchable and configurable. What the metrics mean and their healthy ranges are in :mod:`rllog.catalog`.

Example:
    >>> from rllog.health import HealthMonitor
    >>> monitor = HealthMonitor(disable=["kl_explosion"], overrides={"truncated_completions": {"threshold": 0.3}})
    >>> [a.rule for a in monitor.observe(10, {"loss": float("nan")})]
    ['non_finite']
"""

from __future__ import annotations

import fnmatch
import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, NamedTuple

from rllog.catalog import strip_prefix

log = logging.getLogger("rllog.health")


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

    def configure(self, **params: Any) -> Rule:
        """Change parameters (and ``enabled``); resets the rule's history."""
        if "enabled" in params:
            self.enabled = bool(params.pop("enabled"))
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"rule {self.name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters are: enabled, {', '.join(self.defaults)}"
            )
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
        self.generation = self.__dict__.get("generation", 0) + 1  # HealthMonitor's routing is redone when it changes

    def watches(self, key: str) -> bool:
        answer = self._watched.get(key)
        if answer is None:
            if len(self._watched) > 100_000:  # a run that invents new keys every step must not grow this forever
                self._watched.clear()
            bare = strip_prefix(key)
            answer = self._watched[key] = any(
                fnmatch.fnmatchcase(k, pattern) for pattern in self.params["metrics"] for k in {key, bare}
            )
        return answer

    def observe(self, step: int, values: Mapping[str, float]) -> list[AlertDraft]:
        if not self.enabled:
            return []
        return self.check_watched(step, {key: raw for key, raw in values.items() if self.watches(key)})

    def check_watched(self, step: int, values: Mapping[str, float]) -> list[AlertDraft]:
        """:meth:`observe` for values whose keys this rule is known to watch (:class:`HealthMonitor` routes them)."""
        out = []
        for key, raw in values.items():
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
    defaults = {
        "metrics": ("entropy", "objective/entropy", "policy/entropy_avg"),
        "min_fraction": 0.2,
        "warmup": 5,
        "cooldown": 50,
    }

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
    """NaN or inf in a loss or reward.

    NaN in one reward function's ``rewards/<fn>/...`` is not an alert: TRL logs it when the function returned
    ``None`` for every sample of the step, which a reward function does by design for samples it does not
    apply to (TRL's multi-task rewards). Its inf is, and so is NaN in ``reward`` or a loss.
    """

    name = "non_finite"
    level = "error"
    summary = "A loss or reward is NaN or inf: training has numerically broken down (or a reward function returned NaN/inf)."
    defaults = {
        "metrics": (
            "loss",
            "loss/*",
            "*_loss",
            "reward",
            "reward_std",
            "rewards/*",
            "objective/rlhf_reward",
            "objective/scores",
            "objective/non_score_reward",
        ),
        "cooldown": 50,
    }

    def check(self, key, value, step):
        if math.isfinite(value) or (math.isnan(value) and strip_prefix(key).startswith("rewards/")):
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


RULES: tuple[type[Rule], ...] = (
    RatioFarFromOne,
    EntropyCollapse,
    TruncatedCompletions,
    NegativeKL,
    ExplodingKL,
    NonFinite,
    ValueLossSpike,
    NoLearningSignal,
)


def observe_each(monitor: Any, logged: Iterable[tuple[int, Mapping[str, float]]]) -> list[AlertDraft]:
    """``monitor.observe`` (a monitor of the user's) for each record in order; a record it fails on is logged and
    skipped, and the alerts of the others are kept."""
    out: list[AlertDraft] = []
    for step, values in logged:
        try:
            out.extend(monitor.observe(step, values))
        except Exception:  # the user's monitor must never stop the journal, nor cost the batch its other alerts
            log.exception("rllog: the health monitor failed on step %d; its alerts for that record are skipped", step)
    return out


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

    def __init__(
        self,
        rules: Iterable[Rule] | None = None,
        disable: Iterable[str] | str = (),
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        self.rules: list[Rule] = list(rules) if rules is not None else default_rules()
        if isinstance(disable, str):
            disable = [d.strip() for d in disable.split(",") if d.strip()]
        for name in disable:
            self.rule(name).enabled = False
        for name, params in (overrides or {}).items():
            self.rule(name).configure(**dict(params))
        self._broken: set[str] = set()
        self._routes: dict[str, tuple[Rule, ...]] = {}  # key -> the rules that watch it
        self._routed_for: tuple = ()  # the rules (and their generations) _routes was made for

    default_rules = staticmethod(default_rules)

    def rule(self, name: str) -> Rule:
        """The rule called ``name`` (``ValueError`` naming the known rules otherwise)."""
        for r in self.rules:
            if r.name == name:
                return r
        raise ValueError(f"unknown health rule {name!r}; the rules are: {', '.join(r.name for r in self.rules)}")

    def observe(self, step: int, values: Mapping[str, float]) -> list[AlertDraft]:
        """Feed one logged step's values to every enabled rule; returns the alerts they raise."""
        return self._observe_all(((step, values),))

    def observe_many(self, logged: Iterable[tuple[int, Mapping[str, float]]]) -> list[AlertDraft]:
        """:meth:`observe` for several logged records in order (the journal writer's batch of them)."""
        if getattr(self.observe, "__func__", None) is not HealthMonitor.observe:  # an observe of its own sees each record
            return observe_each(self, logged)
        return self._observe_all(logged)

    def _observe_all(self, logged: Iterable[tuple[int, Mapping[str, float]]]) -> list[AlertDraft]:
        """Each rule sees only the keys it watches: which rules watch a key is worked out once per key (a step
        logs ~40 keys and a handful of rules watch a few of them; asking every rule about every key would take
        ~60% of the journal writer's time), and whether the rules changed, once per call (per record, that
        look cost more than a one-key record's routing: TRL logs eight one-key timings a step)."""
        routed_for = tuple((id(r), getattr(r, "generation", 0)) for r in self.rules)
        if routed_for != self._routed_for:
            self._routes, self._routed_for = {}, routed_for
        routes = self._routes
        own = {id(r) for r in self.rules if type(r).observe is not Rule.observe}  # may look at any key: sees every value
        out: list[AlertDraft] = []
        for step, values in logged:
            watched: dict[int, dict[str, float]] = {}
            for key, value in values.items():
                rules = routes.get(key)
                if rules is None:
                    if len(routes) > 100_000:  # a run that invents new keys every step must not grow this forever
                        routes.clear()
                    rules = routes[key] = tuple(r for r in self.rules if self._watches(r, key))
                for r in rules:
                    watched.setdefault(id(r), {})[key] = value
            if watched or own:
                out.extend(self._check(step, values, watched, own))
        return out

    def _check(
        self, step: int, values: Mapping[str, float], watched: dict[int, dict[str, float]], own: set[int]
    ) -> list[AlertDraft]:
        out: list[AlertDraft] = []
        for r in self.rules:
            if not r.enabled or not (id(r) in own or id(r) in watched):
                continue
            try:
                out.extend(r.observe(step, values) if id(r) in own else r.check_watched(step, watched[id(r)]))
            except Exception:  # a rule bug must never break logging
                self._report_failed(r)
        return out

    def _watches(self, rule: Rule, key: str) -> bool:
        try:
            return rule.watches(key)
        except Exception:  # a bad pattern: the rule fails (reported once) and sees none of the key's values
            self._report_failed(rule)
            return False

    def _report_failed(self, rule: Rule) -> None:
        if rule.name not in self._broken:
            self._broken.add(rule.name)
            log.exception("rllog: health rule %r failed; it is skipped for this step", rule.name)
