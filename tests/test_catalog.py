"""The metric catalog, the health rules (each on series that must and must not fire), docs/metrics.md
(scripts/gen_metrics_docs.py), ``rllog plot`` with healthy bands and alerts, and ``rllog show``'s health marks."""

from __future__ import annotations

import math
import os
import random
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import rllog
from rllog import catalog
from rllog import health as rules
from rllog.catalog import health, lookup
from rllog.health import AlertDraft, HealthMonitor, Rule, default_rules

ROOT = Path(__file__).resolve().parents[1]
GEN_METRICS_DOCS = ROOT / "scripts" / "gen_metrics_docs.py"
NAN, INF = float("nan"), float("inf")

PPO_METRICS = [
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "episode",
    "objective/kl_coef",
]
GRPO_METRICS = [
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "rewards/accuracy/mean",
    "rewards/accuracy/std",
    "rewards/format_reward/mean",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "clip_ratio",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
]
TRAINER_METRICS = ["loss", "grad_norm", "learning_rate"]


def feed(target, series):
    """Observe ``[(step, {key: value}), ...]`` with a rule or a monitor; every draft, in order."""
    out: list[AlertDraft] = []
    for step, values in series:
        out.extend(target.observe(step, values))
    return out


def const(key, value, steps):
    return [(s, {key: value}) for s in steps]


# ---- the catalog ---------------------------------------------------------------------------------


def test_docs_metrics_md_is_generated_from_the_catalog():
    text = (ROOT / "docs" / "metrics.md").read_text()
    markdown = runpy.run_path(str(GEN_METRICS_DOCS))["markdown"]
    assert text == markdown(), "docs/metrics.md is stale: run `python scripts/gen_metrics_docs.py > docs/metrics.md`"
    out = subprocess.run([sys.executable, str(GEN_METRICS_DOCS)], capture_output=True, text=True, check=True).stdout
    assert out == text
    assert subprocess.run([sys.executable, str(GEN_METRICS_DOCS), "--check"], capture_output=True).returncode == 0
    for cls in rules.RULES:
        assert f"`{cls.name}`" in text
    for name in ("val/ratio", "frac_reward_zero_std", "rewards/{name}/mean", "objective/rlhf_reward"):
        assert f"`{name}`" in text


@pytest.mark.parametrize("key", PPO_METRICS + GRPO_METRICS + TRAINER_METRICS)
def test_every_documented_metric_is_in_the_catalog(key):
    info = lookup(key)
    assert info is not None, key
    assert info.meaning and info.meaning[0].isupper()
    assert info.good in (None, "higher", "lower", "near 1", "stable")
    expected = "ppo" if key in PPO_METRICS else "both" if key in TRAINER_METRICS else "grpo"
    assert info.trainer == expected
    for prefix in ("train/", "eval/"):
        assert lookup(prefix + key) is info


def test_patterns_and_prefixes():
    assert lookup("rewards/accuracy/mean").pattern == "rewards/{name}/mean"
    assert lookup("train/rewards/my_custom_reward/std").pattern == "rewards/{name}/std"
    assert lookup("eval_loss").pattern == "loss"
    assert lookup("rewards/accuracy") is None
    assert lookup("rewards/accuracy/mean/x") is None
    assert lookup("my_metric") is None
    assert lookup("val/ratio").healthy == (0.8, 1.2) and lookup("val/ratio").good == "near 1"
    # crucial metrics, in catalog order; several reward functions all count
    assert catalog.crucial_keys(["grad_norm", "val/ratio", "rewards/b/mean", "rewards/a/mean", "reward", "lr", "foo"]) == [
        "reward",
        "rewards/a/mean",
        "rewards/b/mean",
        "grad_norm",
        "val/ratio",
    ]


def test_health():
    assert health("val/ratio", 1.05) == "ok"
    assert health("val/ratio", 1.6) == "unhealthy"
    assert health("train/val/ratio", 0.1) == "unhealthy"
    assert health("objective/kl", 3.0) == "ok"
    assert health("kl", -0.2) == "unhealthy"
    assert health("loss", NAN) == "unhealthy"  # NaN/inf is never healthy for a known metric
    assert health("rewards/accuracy/mean", -INF) == "unhealthy"
    assert health("reward", 0.3) is None  # no documented range
    assert health("unknown_metric", 1.0) is None
    assert "Healthy range: 0.8 to 1.2" in catalog.explain("val/ratio", 1.6)
    assert "float around 1.0" in catalog.explain("val/ratio", 1.6)


def test_importing_the_catalog_stays_light():
    code = "import sys, rllog, rllog.catalog, rllog.health; heavy = [m for m in ('torch', 'transformers', 'trl', 'wandb', 'mlflow', 'comet_ml', 'tensorboard', 'trackio', 'matplotlib', 'rich') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


# ---- rules: each must fire on a bad series and stay quiet on a healthy one -----------------------


def test_ratio_far_from_one():
    rule = rules.RatioFarFromOne()
    drafts = feed(rule, [*const("val/ratio", 1.0, range(10)), (10, {"val/ratio": 1.35})])
    assert [(d.step, d.metric, d.value, d.rule, d.level) for d in drafts] == [
        (10, "val/ratio", 1.35, "ratio_far_from_one", "warning")
    ]
    assert "1.35" in drafts[0].message and "1.0" in drafts[0].message
    low = feed(rules.RatioFarFromOne(), [(3, {"train/val/ratio": 0.7})])
    assert [(d.step, d.metric, d.value) for d in low] == [(3, "train/val/ratio", 0.7)]
    # must not fire: small wobble around 1, and GRPO runs (no val/ratio)
    wobble = [(s, {"val/ratio": 1.0 + 0.15 * math.sin(s)}) for s in range(200)]
    assert feed(rules.RatioFarFromOne(), wobble) == []
    assert feed(rules.RatioFarFromOne(), [(s, {"kl": 5.0, "clip_ratio/region_mean": 0.9}) for s in range(20)]) == []


def test_cooldown_one_alert_per_cooldown_not_per_step():
    rule = rules.RatioFarFromOne()  # cooldown 50
    drafts = feed(rule, const("val/ratio", 1.5, range(120)))
    assert [d.step for d in drafts] == [0, 50, 100]
    # per metric: another metric of the same rule has its own cooldown
    rule = rules.EntropyCollapse(cooldown=10)
    series = [(s, {"entropy": 2.0, "objective/entropy": 3.0}) for s in range(5)]
    series += [(s, {"entropy": 0.1, "objective/entropy": 3.0 if s < 8 else 0.1}) for s in range(5, 30)]
    drafts = feed(rule, series)
    assert [(d.step, d.metric) for d in drafts] == [
        (5, "entropy"),
        (8, "objective/entropy"),
        (15, "entropy"),
        (18, "objective/entropy"),
        (25, "entropy"),
        (28, "objective/entropy"),
    ]


def test_entropy_collapse():
    series = const("entropy", 2.0, range(5)) + const("entropy", 1.5, range(5, 10)) + [(10, {"entropy": 0.3})]
    drafts = feed(rules.EntropyCollapse(), series)
    assert [(d.step, d.metric, d.value, d.rule) for d in drafts] == [(10, "entropy", 0.3, "entropy_collapse")]
    assert "early level 2" in drafts[0].message
    # PPO's names, prefixed
    ppo = [*const("train/policy/entropy_avg", 1.0, range(5)), (5, {"train/policy/entropy_avg": 0.1})]
    assert [(d.step, d.metric, d.value) for d in feed(rules.EntropyCollapse(), ppo)] == [(5, "train/policy/entropy_avg", 0.1)]
    # must not fire: a gentle decline to 25% of the early level, or a low but stable entropy from the start
    decline = [(s, {"entropy": 2.0 - 1.5 * s / 199}) for s in range(200)]
    assert feed(rules.EntropyCollapse(), decline) == []
    assert feed(rules.EntropyCollapse(), const("entropy", 0.05, range(100))) == []
    # a long collapse fires once per cooldown
    long = const("entropy", 2.0, range(5)) + const("entropy", 0.1, range(5, 205))
    assert [d.step for d in feed(rules.EntropyCollapse(), long)] == [5, 55, 105, 155]


def test_truncated_completions_sustained():
    series = const("completions/clipped_ratio", 0.1, range(10)) + const("completions/clipped_ratio", 0.6, range(10, 13))
    drafts = feed(rules.TruncatedCompletions(), series)
    assert [(d.step, d.metric, d.value, d.rule) for d in drafts] == [
        (12, "completions/clipped_ratio", 0.6, "truncated_completions")
    ]
    # must not fire: isolated highs (the streak resets), two in a row, exactly at the threshold
    flicker = [(s, {"completions/clipped_ratio": 0.8 if s % 2 else 0.2}) for s in range(100)]
    assert feed(rules.TruncatedCompletions(), flicker) == []
    twice = [(s, {"completions/clipped_ratio": 0.9 if s % 3 else 0.1}) for s in range(100)]
    assert feed(rules.TruncatedCompletions(), twice) == []
    assert feed(rules.TruncatedCompletions(), const("completions/clipped_ratio", 0.5, range(50))) == []
    long = const("completions/clipped_ratio", 0.9, range(0, 300, 2))  # logged every 2 steps
    assert [d.step for d in feed(rules.TruncatedCompletions(), long)] == [4, 54, 104, 154, 204, 254]


def test_negative_kl():
    series = [*const("kl", 0.01, range(7)), (7, {"kl": -0.05})]
    drafts = feed(rules.NegativeKL(), series)
    assert [(d.step, d.metric, d.value, d.rule) for d in drafts] == [(7, "kl", -0.05, "kl_negative")]
    assert [(d.step, d.metric) for d in feed(rules.NegativeKL(), [(2, {"objective/kl": -3.0})])] == [(2, "objective/kl")]
    # must not fire: estimator noise just below 0, and zero (policy == reference at the start)
    assert feed(rules.NegativeKL(), [(s, {"kl": -0.005 if s % 2 else 0.0}) for s in range(100)]) == []


def test_exploding_kl():
    series = const("kl", 0.02, range(5)) + const("kl", 0.1, range(5, 10)) + [(10, {"kl": 0.6})]
    drafts = feed(rules.ExplodingKL(), series)  # early level max(0.02, floor 0.05) = 0.05; 0.6 > 10 x 0.05
    assert [(d.step, d.metric, d.value, d.rule) for d in drafts] == [(10, "kl", 0.6, "kl_explosion")]
    assert "12x its early level" in drafts[0].message
    relative = [*const("objective/kl", 2.0, range(5)), (5, {"objective/kl": 25.0})]
    assert [(d.step, d.value) for d in feed(rules.ExplodingKL(), relative)] == [(5, 25.0)]
    ceiling = [(0, {"objective/kl": 150.0})]  # above the ceiling before any early level exists
    assert [(d.step, d.metric, d.value) for d in feed(rules.ExplodingKL(), ceiling)] == [(0, "objective/kl", 150.0)]
    # must not fire: a run starting at KL 0 that grows slowly (the floor keeps 0 from being the early level)
    slow = [(s, {"kl": 0.3 * s / 299}) for s in range(300)]
    assert feed(rules.ExplodingKL(), slow) == []
    noisy = [(s, {"objective/kl": 3.0 + math.sin(s)}) for s in range(200)]
    assert feed(rules.ExplodingKL(), noisy) == []


def test_non_finite_loss_or_reward_is_an_error():
    series = [
        (1, {"loss": 0.3, "reward": 0.2}),
        (2, {"loss": NAN, "reward": 0.2}),
        (3, {"rewards/accuracy/mean": INF}),
        (4, {"loss/value_avg": -INF}),
        (5, {"eval_loss": NAN}),
        (6, {"objective/rlhf_reward": NAN}),
    ]
    drafts = feed(rules.NonFinite(), series)
    assert [(d.step, d.metric, d.level) for d in drafts] == [
        (2, "loss", "error"),
        (3, "rewards/accuracy/mean", "error"),
        (4, "loss/value_avg", "error"),
        (5, "eval_loss", "error"),
        (6, "objective/rlhf_reward", "error"),
    ]
    assert math.isnan(drafts[0].value) and drafts[1].value == INF
    # must not fire: finite values, and NaN in metrics that are no loss or reward (grad_norm is inf on
    # fp16 overflow steps the scaler skips); the whole default monitor stays quiet on them too
    assert feed(rules.NonFinite(), [(s, {"loss": 0.1 * s, "reward": -1.0}) for s in range(50)]) == []
    assert feed(HealthMonitor(), [(s, {"grad_norm": INF, "entropy": NAN, "kl": NAN, "val/ratio": NAN}) for s in range(20)]) == []
    # a NaN loss every step fires once per cooldown
    assert [d.step for d in feed(rules.NonFinite(), const("loss", NAN, range(100)))] == [0, 50]


def test_value_loss_spike():
    base = [(s, {"loss/value_avg": 1.0 + 0.05 * math.sin(s * 1.7)}) for s in range(30)]
    drafts = feed(rules.ValueLossSpike(), [*base, (30, {"loss/value_avg": 3.0})])
    assert [(d.step, d.metric, d.value, d.rule) for d in drafts] == [(30, "loss/value_avg", 3.0, "value_loss_spike")]
    # a spike over a constant history (MAD 0) fires through the ratio test
    flat = const("loss/value_avg", 0.5, range(10))
    assert [(d.step, d.value) for d in feed(rules.ValueLossSpike(), [*flat, (10, {"loss/value_avg": 6.0})])] == [(10, 6.0)]
    # must not fire: noise, a steady rise, a small step up from a constant history, too little history
    assert feed(rules.ValueLossSpike(), [*base, (30, {"loss/value_avg": 1.1})]) == []
    assert feed(rules.ValueLossSpike(), [(s, {"loss/value_avg": 1.0 + 0.01 * s}) for s in range(200)]) == []
    assert feed(rules.ValueLossSpike(), [*flat, (10, {"loss/value_avg": 0.6})]) == []
    assert feed(rules.ValueLossSpike(), [(0, {"loss/value_avg": 1.0}), (1, {"loss/value_avg": 50.0})]) == []
    # a NaN value loss is the non_finite rule's, not a spike, and does not poison the window
    assert feed(rules.ValueLossSpike(), [*base, (30, {"loss/value_avg": NAN}), (31, {"loss/value_avg": 1.02})]) == []


def test_no_learning_signal():
    series = (
        const("frac_reward_zero_std", 0.4, range(5))
        + const("frac_reward_zero_std", 0.95, range(5, 7))
        + [(7, {"frac_reward_zero_std": 1.0})]
    )
    drafts = feed(rules.NoLearningSignal(), series)
    assert [(d.step, d.metric, d.value, d.rule) for d in drafts] == [(7, "frac_reward_zero_std", 1.0, "no_learning_signal")]
    assert "no learning signal" in drafts[0].message
    # must not fire: high but below 0.9, or near 1 only twice in a row
    assert feed(rules.NoLearningSignal(), const("frac_reward_zero_std", 0.85, range(100))) == []
    blips = [(s, {"frac_reward_zero_std": 1.0 if s % 3 else 0.5}) for s in range(100)]
    assert feed(rules.NoLearningSignal(), blips) == []


# ---- the monitor: switching rules off, overriding parameters ----------------------------------------

COLLAPSE = [*const("entropy", 2.0, range(5)), (5, {"entropy": 0.1})]


def test_monitor_runs_every_rule_and_stays_quiet_on_a_healthy_run():
    healthy = [
        (
            s,
            {
                "reward": s / 100,
                "reward_std": 0.3,
                "kl": 0.001 * s / 10,
                "entropy": 1.0 - 0.002 * s,
                "completions/clipped_ratio": 0.05,
                "frac_reward_zero_std": 0.3,
                "loss": 0.01,
                "grad_norm": 0.5,
                "clip_ratio/region_mean": 0.0,
            },
        )
        for s in range(300)
    ]
    assert feed(HealthMonitor(), healthy) == []
    assert [r.name for r in HealthMonitor().rules] == [cls.name for cls in rules.RULES]
    assert [d.rule for d in feed(HealthMonitor(), COLLAPSE)] == ["entropy_collapse"]


def test_disable_and_override():
    assert feed(HealthMonitor(disable=["entropy_collapse"]), COLLAPSE) == []
    assert feed(HealthMonitor(disable="kl_negative, entropy_collapse"), COLLAPSE) == []
    assert feed(HealthMonitor(overrides={"entropy_collapse": {"enabled": False}}), COLLAPSE) == []
    # a looser threshold: 1.35 is fine, 1.6 is not
    loose = HealthMonitor(overrides={"ratio_far_from_one": {"max_deviation": 0.5}})
    assert feed(loose, [(1, {"val/ratio": 1.35})]) == []
    assert [(d.step, d.value) for d in feed(loose, [(2, {"val/ratio": 1.6})])] == [(2, 1.6)]
    # patience and cooldown
    quick = HealthMonitor(overrides={"truncated_completions": {"patience": 1, "cooldown": 10}})
    assert [d.step for d in feed(quick, const("completions/clipped_ratio", 0.7, range(25)))] == [0, 10, 20]
    # watching other metrics
    custom = HealthMonitor(overrides={"ratio_far_from_one": {"metrics": ["sampling/importance_sampling_ratio/mean"]}})
    assert [d.metric for d in feed(custom, [(0, {"val/ratio": 3.0, "sampling/importance_sampling_ratio/mean": 3.0})])] == [
        "sampling/importance_sampling_ratio/mean"
    ]
    with pytest.raises(ValueError, match=r"unknown health rule 'entropy'.*entropy_collapse"):
        HealthMonitor(disable=["entropy"])
    with pytest.raises(ValueError, match=r"no parameter 'treshold'.*threshold"):
        HealthMonitor(overrides={"no_learning_signal": {"treshold": 0.5}})


def test_monitor_with_own_rules_and_a_failing_rule():
    class Broken(Rule):
        name = "broken"
        defaults = {"metrics": ("*",), "cooldown": 1}

        def check(self, key, value, step):
            raise RuntimeError("bug in a rule")

    class Big(Rule):
        name = "big"
        defaults = {"metrics": ("x",), "limit": 5.0, "cooldown": 1}

        def check(self, key, value, step):
            return f"x is {value}" if value > self.limit else None

    monitor = HealthMonitor(rules=[Broken(), Big()], overrides={"big": {"limit": 7.0}})
    drafts = feed(monitor, [(1, {"x": 6.0}), (2, {"x": 8.0})])  # the broken rule is skipped, never raised
    assert drafts == [AlertDraft(2, "big", "x", 8.0, "x is 8.0", "warning")]
    assert [r.name for r in default_rules()] == [r.name for r in HealthMonitor.default_rules()]


def test_each_rule_is_asked_about_a_key_once_and_again_after_it_is_reconfigured():
    """The monitor routes each key to the rules that watch it, worked out once per key (the journal writer runs
    the rules on every step's ~40 keys); reconfiguring, disabling or replacing a rule takes effect at once."""
    asked = []

    class Big(Rule):
        name = "big"
        defaults = {"metrics": ("x",), "limit": 5.0, "cooldown": 1}

        def watches(self, key):
            asked.append(key)
            return super().watches(key)

        def check(self, key, value, step):
            return f"{key} is {value}" if value > self.limit else None

    big = Big()
    monitor = HealthMonitor(rules=[big])
    steps = [(step, {"x": 9.0, "y": 9.0, "z": 1.0}) for step in range(50)]
    assert [(d.step, d.metric) for d in feed(monitor, steps)] == [(step, "x") for step in range(50)]
    assert sorted(asked) == ["x", "y", "z"]  # once per key, not once per step
    big.configure(metrics=["y"])
    assert [d.metric for d in feed(monitor, [(50, {"x": 9.0, "y": 9.0})])] == ["y"]
    big.enabled = False
    assert feed(monitor, [(51, {"y": 9.0})]) == []
    monitor.rules = [Big(metrics=["z"], limit=0.5)]
    assert [d.metric for d in feed(monitor, [(52, {"x": 9.0, "z": 1.0})])] == ["z"]


def test_a_batch_of_records_raises_the_alerts_of_the_same_records_one_by_one():
    """The journal writer hands the monitor a batch (``observe_many``): the same alerts, in the same order, as
    feeding the records one at a time, one-key records (TRL's timings) and rules with their own ``observe``
    among them."""

    class Seen(Rule):  # looks at every key of a record itself
        name = "seen"
        defaults = {"metrics": (), "cooldown": 1}

        def observe(self, step, values):
            return [AlertDraft(step, self.name, "n", float(len(values)), f"{len(values)} keys")] if "odd" in values else []

    rng = random.Random(5)
    records = []
    for step in range(120):
        records.append(
            (
                step,
                {
                    "reward": math.nan if step % 37 == 5 else 0.5,
                    "kl": rng.choice([0.001, -0.5, 0.01, 200.0]),
                    "entropy": 2.0 if step < 60 else 0.1,
                    "completions/clipped_ratio": 0.9 if step % 20 < 8 else 0.1,
                    "val/ratio": rng.choice([1.0, 1.5]),
                },
            )
        )
        records += [(step, {f"profiling/Time taken: T.m{i}": 0.01}) for i in range(3)]
        if step % 9 == 0:
            records.append((step, {"odd": 1.0}))
    single, batched = HealthMonitor(rules=[*default_rules(), Seen()]), HealthMonitor(rules=[*default_rules(), Seen()])
    one_by_one = [d for step, values in records for d in single.observe(step, values)]
    in_batches = [d for i in range(0, len(records), 50) for d in batched.observe_many(records[i : i + 50])]
    assert in_batches == one_by_one
    assert {d.rule for d in one_by_one} == {
        "non_finite",
        "kl_negative",
        "kl_explosion",
        "entropy_collapse",
        "truncated_completions",
        "ratio_far_from_one",
        "seen",
    }


def test_a_monitor_with_its_own_observe_sees_every_record_of_a_batch():
    class Counting(HealthMonitor):
        def observe(self, step, values):
            self.seen = [*getattr(self, "seen", []), step]
            return [*super().observe(step, values), AlertDraft(step, "mine", "x", 0.0, "seen")]

    monitor = Counting()
    drafts = monitor.observe_many([(1, {"x": 1.0}), (2, {"loss": math.nan}), (3, {"x": 2.0})])
    assert monitor.seen == [1, 2, 3]
    assert [(d.step, d.rule) for d in drafts] == [(1, "mine"), (2, "non_finite"), (2, "mine"), (3, "mine")]

    def fails_on_two(step, values):  # replaced on the instance; fails on one record of the batch
        if step == 2:
            raise RuntimeError("bug in the user's monitor")
        return [AlertDraft(step, "patched", "x", 0.0, "seen")]

    patched = HealthMonitor()
    patched.observe = fails_on_two  # type: ignore[method-assign]
    drafts = patched.observe_many([(1, {"x": 1.0}), (2, {"x": 1.0}), (3, {"x": 1.0})])
    assert [(d.step, d.rule) for d in drafts] == [(1, "patched"), (3, "patched")]  # the others' alerts are kept


# ---- the plot and `rllog show` ---------------------------------------------------------------------


def make_unhealthy_run(run_dir: Path) -> Path:
    run = rllog.init(run_dir=run_dir, project="cat", name="unhealthy")
    for step in range(40):
        run.log(
            {
                "reward": step / 40,
                "kl": 0.002 * step,
                "entropy": 2.0 if step < 20 else 0.2,
                "completions/clipped_ratio": 0.1,
                "val/ratio": 1.0 if step < 30 else 1.7,
                "loss": NAN if step == 25 else 0.1,
            },
            step=step,
        )
    report = run.finish(timeout=60)
    assert report.ok, report
    return run_dir


def _colour_pixels(png: Path, rgb: tuple[float, float, float], tol: float = 0.03) -> int:
    import numpy as np
    from matplotlib import image

    img = image.imread(png)[..., :3]
    return int((np.abs(img - np.array(rgb)).max(axis=-1) < tol).sum())


def test_plot_shades_healthy_bands_and_marks_alerts(tmp_path):
    from rllog.plot import LEVEL_COLOUR, load_alerts, plot_run
    from rllog.summary import summarise

    run_dir = make_unhealthy_run(tmp_path / "run")
    alerts = load_alerts(run_dir, summarise(run_dir))
    assert {(a["rule"], a["metric"], a["step"]) for a in alerts} >= {
        ("entropy_collapse", "entropy", 20),
        ("ratio_far_from_one", "val/ratio", 30),
        ("non_finite", "loss", 25),
    }
    out = plot_run(run_dir, tmp_path / "plot.png")
    assert out == tmp_path / "plot.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000
    band = (
        1 - 0.12 + 0.12 * 0x2C / 255,
        1 - 0.12 + 0.12 * 0xA0 / 255,
        1 - 0.12 + 0.12 * 0x2C / 255,
    )  # green at alpha 0.12 on white
    assert _colour_pixels(out, band) > 2_000, "no healthy band shaded"
    red = tuple(int(LEVEL_COLOUR["error"][i : i + 2], 16) / 255 for i in (1, 3, 5))
    assert _colour_pixels(out, red, tol=0.15) > 50, "no error alert marked"
    # alerts passed explicitly, metrics chosen
    out2 = plot_run(
        run_dir,
        tmp_path / "two.png",
        metrics=["reward", "val/ratio"],
        alerts=[{"step": 5, "rule": "r", "metric": "reward", "value": 0.1, "level": "warning"}],
    )
    assert out2.stat().st_size > 10_000


def test_show_marks_unhealthy_metrics_and_explains_them(tmp_path):
    run_dir = make_unhealthy_run(tmp_path / "run")
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "rllog.cli", "show", str(run_dir)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 7}
    assert "UNHEALTHY" in rows["val/ratio"]
    assert "ok" in rows["kl"] and "UNHEALTHY" not in rows["kl"]
    assert "UNHEALTHY" not in rows["reward"] and "UNHEALTHY" not in rows["loss"]  # loss's last value is finite again
    assert "unhealthy val/ratio = 1.7 at step 39: Mean ratio of the current policy's token probabilities" in out
    assert "Should float around 1.0" in out and "Healthy range: 0.8 to 1.2; last value 1.7." in out
    assert "alerts: 3 (entropy_collapse x1, non_finite x1, ratio_far_from_one x1)" in out
    assert "step 30 WARNING [ratio_far_from_one] val/ratio=1.7" in out
