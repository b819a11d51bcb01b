"""TRL GRPO/RLOO with the rllog mixin, and the HF Trainer callback: a real tiny model trained on the CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("trl")

from sinks import wait_until
from tiny_grpo import PROMPTS, build_tiny_model, make_grpo_trainer, reward_has_digit

import rllog

GRPO_KEYS = {
    "train/" + k
    for k in (
        "loss",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "rewards/reward_has_digit/mean",
        "rewards/reward_has_digit/std",
        "rewards/reward_short/mean",
        "rewards/reward_short/std",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "entropy",
        "kl",
        "clip_ratio/region_mean",
        "step_time",
        "epoch",
    )
}
PROFILED = "profiling/Time taken: GRPOTrainer."  # TRL's timings, named after the trainer class (tiny_grpo names it GRPOTrainer)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def metric_series(run_dir):
    out = {}
    for row in rllog.read_metrics(run_dir).to_pylist():
        out.setdefault(row["key"], []).append((row["step"], row["value"]))
    return out


def test_grpo_with_mixin_logs_metrics_custom_metric_completions_and_profiling(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=3, report_to=["parquet"], rllog_options={"run_dir": str(run_dir)}
    )
    assert trainer.args.report_to == []  # TRL's own table/profiling paths see no tracker
    assert trainer.rllog_run is None and not run_dir.exists()  # no run (and no agent) until training starts
    trainer.train()
    assert trainer.rllog_run.finish().ok
    series = metric_series(run_dir)
    assert GRPO_KEYS <= set(series)
    assert [s for s, _ in series["train/reward"]] == [1, 2, 3]
    # the values are TRL's own: compare with the trainer's log history
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert [v for _, v in series["train/reward"]] == [h["reward"] for h in history]
    assert [v for _, v in series["train/digits/fraction"]] == [h["digits/fraction"] for h in history]  # log_metric
    assert series["train/train_runtime"] == [(3, trainer.state.log_history[-1]["train_runtime"])]  # the summary, once
    # TRL's profiling timings, at the step being trained: generation, the reward functions
    profiled = {k[len(PROFILED) :]: [s for s, _ in v] for k, v in series.items() if k.startswith(PROFILED)}
    assert {"reward_has_digit", "reward_short", "transformers.generate"} <= set(profiled), sorted(profiled)
    assert sorted(set(profiled["reward_has_digit"])) == [1, 2, 3]
    assert all(v > 0 for k, vs in series.items() if k.startswith(PROFILED) for _, v in vs)
    table = rllog.read_table(run_dir, "completions")
    assert sorted(set(table.column("_step").to_pylist())) == [1, 2, 3]
    assert table.column_names[2:5] == ["step", "prompt", "completion"]  # after rllog's _step, _seq: TRL's column order
    assert {"reward_has_digit", "reward_short", "n_chars", "advantage"} <= set(table.column_names)
    rows = [r for r in table.to_pylist() if r["_step"] == 3]
    assert len(rows) == 4 and all(r["step"] == 3 for r in rows)
    assert all(r["n_chars"] == len(r["completion"]) for r in rows)  # log_extra column lines up
    assert all(r["reward_has_digit"] == (1.0 if any(c.isdigit() for c in r["completion"]) else 0.0) for r in rows)


def test_mixin_removes_transformers_callbacks_for_the_names_it_serves(tiny_model, tmp_path):
    from transformers.integrations import TensorBoardCallback

    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=1, report_to=["tensorboard"], rllog_options={"run_dir": str(tmp_path / "run")}
    )
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert "TensorBoardCallback" not in names and "RLLogCallback" in names
    assert not any(isinstance(cb, TensorBoardCallback) for cb in trainer.callback_handler.callbacks)
    assert trainer.rllog_callback.report_to == ["tensorboard"] and trainer.rllog_run is None


def test_conversations_stay_messages_and_log_unique_prompts_keeps_one_row_per_prompt(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model,
        str(tmp_path / "out"),
        steps=2,
        report_to=["parquet"],
        rllog_options={"run_dir": str(run_dir)},
        conversational=True,
        log_unique_prompts=True,
    )
    trainer.train()
    assert trainer.rllog_run.finish().ok
    rows = rllog.read_table(run_dir, "completions").to_pylist()
    assert [r["step"] for r in rows] == [1, 2]  # 4 completions of one prompt a step: one row each
    for row in rows:
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"] in PROMPTS
        assert [m["role"] for m in row["completion"]] == ["assistant"] and isinstance(row["completion"][0]["content"], str)
        assert row["n_chars"] == len(row["completion"][0]["content"])


def test_eval_metrics_are_prefixed_and_none_becomes_nan(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from rllog.integrations.transformers import RLLogCallback

    cb = RLLogCallback(run_dir=str(tmp_path / "run"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    state = TrainerState()
    state.global_step = 7
    cb.on_log(args, state, TrainerControl(), logs={"loss": 0.5, "eval_loss": 0.25, "eval_reward": None, "note": "text"})
    assert cb.finish().ok
    series = metric_series(tmp_path / "run")
    assert series["train/loss"] == [(7, 0.5)] and series["eval/loss"] == [(7, 0.25)]
    assert math.isnan(series["eval/reward"][0][1]) and "note" not in series and "train/note" not in series


def test_train_returns_without_waiting_for_a_tracker_and_asks_every_tracker_to_flush_at_once(tiny_model, tmp_path, caplog):
    """The end of train() does not wait for the trackers (it waited up to ``flush_timeout`` for each one, ~3% of a
    60-step train()): a tracker stuck in a write leaves train() alone, and with a minute between the trackers' own
    flushes, Parquet holds every step soon after train() returns, because train()'s end asked for a flush at once.
    ``wait_for_trackers()`` waits for that."""
    import logging

    from sinks import BlockingSink

    from rllog.delivery import read_flush_request

    stuck = BlockingSink("stuck")
    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=3, report_to=["parquet"], rllog_report_to=["parquet", stuck],
        rllog_options={"run_dir": str(run_dir), "flush_interval": 60, "health": False},
    )  # fmt: skip
    trainer.rllog_callback.flush_timeout = 5  # the wait it had at the end of train(), shortened
    with caplog.at_level(logging.WARNING, logger="rllog"):
        trainer.train()
    assert "not every tracker holds every record" not in caplog.text  # nothing waited for the stuck tracker
    assert stuck.metrics == [] and wait_until(stuck.entered.is_set, timeout=30)
    run = trainer.rllog_run
    _, seq, soon = read_flush_request(run_dir)
    assert (seq, soon) == (run._seq, False)  # everything, at once
    assert wait_until(lambda: [s for s, _ in metric_series(run_dir).get("train/reward", [])] == [1, 2, 3], timeout=30)
    stuck.release.set()
    assert trainer.rllog_callback.wait_for_trackers().ok
    assert sorted({r.step for r in stuck.metrics}) == [1, 2, 3]
    assert run.finish().ok


def test_train_prefix_can_be_dropped(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from rllog.integrations.transformers import RLLogCallback

    cb = RLLogCallback(run_dir=str(tmp_path / "run"), train_prefix="")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    state = TrainerState()
    state.global_step = 2
    cb.on_log(args, state, TrainerControl(), logs={"loss": 0.5, "eval_loss": 0.25, "test_acc": 1.0})
    state.global_step = 3
    cb.on_log(args, state, TrainerControl(), logs={"loss": 0.75})  # a name renamed before
    cb.train_prefix = "rl/"  # the callback's names follow a prefix changed later
    state.global_step = 4
    cb.on_log(args, state, TrainerControl(), logs={"loss": 1.0, "eval_loss": 0.5})
    cb.finish()
    series = metric_series(tmp_path / "run")
    assert series == {
        "loss": [(2, 0.5), (3, 0.75)],
        "eval/loss": [(2, 0.25), (4, 0.5)],
        "test/acc": [(2, 1.0)],
        "rl/loss": [(4, 1.0)],
    }


def test_callback_flattens_nested_values_whether_or_not_another_value_is_text(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from rllog.integrations.transformers import RLLogCallback

    cb = RLLogCallback(run_dir=str(tmp_path / "run"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    state = TrainerState()
    state.global_step = 3
    cb.on_log(args, state, TrainerControl(), logs={"rewards": {"acc": 0.5}, "loss": 1.0})
    state.global_step = 4
    cb.on_log(args, state, TrainerControl(), logs={"rewards": {"acc": 0.75}, "loss": 2.0, "note": "text"})
    assert cb.finish().ok
    series = metric_series(tmp_path / "run")
    assert series["train/rewards/acc"] == [(3, 0.5), (4, 0.75)] and series["train/loss"] == [(3, 1.0), (4, 2.0)]
    assert "train/note" not in series


def test_user_code_logs_at_the_trainers_step_and_completions_callback(tiny_model, tmp_path):
    from datasets import Dataset

    from rllog.integrations.trl import RLLogCompletionsCallback

    def reward_logging_itself(completions, **kwargs):
        rllog.log({"custom/from_reward_fn": float(len(completions))})  # no step, no trainer reference
        return [0.0] * len(completions)

    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model,
        str(tmp_path / "out"),
        steps=3,
        report_to=["parquet"],
        rllog_options={"run_dir": str(run_dir)},
        eval_strategy="no",
    )
    trainer.reward_funcs.append(reward_logging_itself)
    trainer.reward_func_names.append("reward_logging_itself")
    trainer.reward_weights = __import__("torch").ones(3)
    trainer.reward_processing_classes.append(None)
    trainer.eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:3]})
    trainer.add_callback(RLLogCompletionsCallback(trainer, num_prompts=2, freq=2, name="eval_completions"))
    trainer.train()
    assert trainer.rllog_run.finish().ok
    series = metric_series(run_dir)
    assert [s for s, _ in series["custom/from_reward_fn"]] == [s for s, _ in series["train/reward"]] == [1, 2, 3]
    table = rllog.read_table(run_dir, "eval_completions").to_pylist()
    assert [r["_step"] for r in table] == [2, 2] and [r["step"] for r in table] == [2, 2]
    assert [r["prompt"] for r in table] == [
        f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in PROMPTS[:2]
    ] or all(PROMPTS[i] in table[i]["prompt"] for i in range(2))
    assert all(isinstance(r["completion"], str) for r in table)


ALL_TRACKERS = ["parquet", "wandb", "trackio", "tensorboard", "mlflow", "comet_ml"]


def test_grpo_end_to_end_reaches_every_tracker(tiny_model, tmp_path, tracker_dirs):
    import json

    from readers import read_back

    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model,
        str(tmp_path / "out"),
        steps=2,
        report_to=ALL_TRACKERS,
        rllog_options={"run_dir": str(run_dir), "project": "e2e", "health": False},
        conversational=True,
    )
    trainer.train()
    assert sorted(trainer.rllog_run.sink_names) == sorted(ALL_TRACKERS)
    report = trainer.rllog_run.finish(timeout=180)
    assert report.ok, str(report)
    history = [h for h in trainer.state.log_history if "reward" in h]
    for backend in ALL_TRACKERS:
        got = read_back(backend, tracker_dirs, trainer.rllog_run.info)
        assert GRPO_KEYS <= set(got.metrics), (backend, GRPO_KEYS - set(got.metrics))
        assert [s for s, _ in sorted(got.metrics["train/digits/fraction"])] == [1, 2], backend  # reward fn's log_metric
        assert [v for _, v in sorted(got.metrics["train/reward"])] == pytest.approx([h["reward"] for h in history], rel=1e-6), (
            backend
        )
        assert any(k.startswith(PROFILED) for k in got.metrics), backend
        report_to = got.config["args|report_to" if backend == "comet_ml" else "report_to"]  # Comet: its callback's layout
        assert "'comet_ml'" in str(report_to), backend  # the user's report_to, not what TRL is left with
        assert float(got.config["model/num_parameters"]) == trainer.model.num_parameters(), backend
        steps = [s for s, _ in got.tables["completions"]]
        assert steps == [1, 2], backend
        rows = got.tables["completions"][-1][1]
        assert len(rows) == 4 and {"step", "prompt", "completion", "reward_has_digit", "n_chars", "advantage"} <= set(rows[0]), (
            backend
        )
        for row in rows:  # conversations arrive as messages (TensorBoard's Markdown table shows them as JSON)
            prompt, completion = (
                (json.loads(row["prompt"]), json.loads(row["completion"]))
                if backend == "tensorboard"
                else (row["prompt"], row["completion"])
            )
            assert prompt[0]["role"] == "user" and prompt[0]["content"] in PROMPTS, backend
            assert str(row["n_chars"]) == str(len(completion[0]["content"])) and str(row["step"]) == "2", backend


TORCHRUN_GRPO = r"""
import json, os, sys
import torch
import rllog
from tiny_grpo import make_grpo_trainer
model_dir, out, results = sys.argv[1], sys.argv[2], sys.argv[3]
logged = []

def reward_logging_itself(completions, **kwargs):  # GRPO computes rewards on every rank: this runs on rank 1 too
    rllog.log({"custom/from_reward_fn": float(len(completions))})
    logged.append(type(rllog.current_run()).__name__)
    return [0.0] * len(completions)

trainer = make_grpo_trainer(model_dir, os.path.join(out, "trainer"), steps=2, report_to=["parquet", "tensorboard"],
                            rllog_options={"run_dir": os.path.join(out, "run"), "health": False})
trainer.reward_funcs.append(reward_logging_itself)
trainer.reward_func_names.append("reward_logging_itself")
trainer.reward_weights = torch.ones(3)
trainer.reward_processing_classes.append(None)
trainer.train()
run = trainer.rllog_run
report = run.finish() if run is not None else {}
with open(os.path.join(results, "rank%s.json" % os.environ["RANK"]), "w") as f:  # not stdout: ranks' lines can interleave
    json.dump({"rank": int(os.environ["RANK"]), "run": type(run).__name__, "ok": getattr(report, "ok", None),
               "current": rllog.current_run() is run, "logged_into": logged}, f)
"""


def test_two_process_torchrun_grpo_logs_from_rank_zero_only_and_user_code_logs_on_every_rank(tiny_model, tmp_path, tracker_dirs):
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_GRPO)
    out, results_dir = tmp_path / "out", tmp_path / "results"
    results_dir.mkdir()
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    pythonpath = os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])  # the script imports tiny_grpo
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            tiny_model,
            str(out),
            str(results_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = sorted((json.loads(p.read_text()) for p in results_dir.glob("rank*.json")), key=lambda r: r["rank"])
    # rllog.log() in a reward function works on every rank; rank 1's NullRun takes it and writes nothing
    assert results == [
        {"rank": 0, "run": "Run", "ok": True, "current": True, "logged_into": ["Run", "Run"]},
        {"rank": 1, "run": "NullRun", "ok": True, "current": True, "logged_into": ["NullRun", "NullRun"]},
    ]
    series = metric_series(out / "run")
    assert [s for s, _ in series["train/reward"]] == [s for s, _ in series["custom/from_reward_fn"]] == [1, 2]
    table = rllog.read_table(out / "run", "completions")
    assert sorted(set(table.column("_step").to_pylist())) == [1, 2]
    # one run directory, one journal writer, one TensorBoard run: nothing from rank 1
    assert sorted(p.name for p in out.iterdir()) == ["run", "trainer"]
    assert len(list((out / "run" / "journal").glob("*.rlj"))) == 1
    tb_runs = [p for p in __import__("pathlib").Path(tracker_dirs["TENSORBOARD_LOGGING_DIR"]).rglob("events.out.tfevents.*")]
    assert len({p.parent for p in tb_runs}) == 1, tb_runs


def test_rloo_with_mixin(tiny_model, tmp_path):
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    from rllog.integrations.trl import RLLogMixin

    class Trainer(RLLogMixin, RLOOTrainer):
        pass

    args = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        report_to=["parquet"],
        log_completions=True,
        num_completions_to_print=0,
        save_strategy="no",
    )
    trainer = Trainer(
        model=tiny_model,
        reward_funcs=[reward_has_digit],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        rllog_options={"run_dir": str(tmp_path / "run")},
    )
    trainer.train()
    assert trainer.rllog_run.finish().ok
    series = metric_series(tmp_path / "run")
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert [v for _, v in series["train/reward"]] == [h["reward"] for h in history] and [
        s for s, _ in series["train/reward"]
    ] == [1, 2]
    assert [s for s, _ in series["train/digits/fraction"]] == [1, 2]
    table = rllog.read_table(tmp_path / "run", "completions")
    assert sorted(set(table.column("_step").to_pylist())) == [1, 2] and "n_chars" in table.column_names


def test_push_to_hub_waits_for_the_trackers_first(tiny_model, tmp_path, monkeypatch):
    """train() does not wait for the trackers; the mixin's push_to_hub does, before transformers' push uploads
    output_dir (where TensorBoard writes): a tracker stuck until 0.5 s after the call holds every record when the
    upload starts. The upload itself is replaced (no network here)."""
    import threading

    import transformers
    from sinks import BlockingSink

    stuck = BlockingSink("stuck")
    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=2, report_to=["parquet"], rllog_report_to=["parquet", stuck],
        rllog_options={"run_dir": str(tmp_path / "run"), "health": False},
    )  # fmt: skip
    held_at_upload: list[list[int]] = []

    def upload(self, *args, **kwargs):
        held_at_upload.append([r.seq for r in stuck.metrics + stuck.tables])

    monkeypatch.setattr(transformers.Trainer, "push_to_hub", upload)
    trainer.train()
    journaled = trainer.rllog_run._seq
    assert stuck.metrics == []
    threading.Timer(0.5, stuck.release.set).start()
    trainer.push_to_hub(commit_message="done")
    assert len(held_at_upload) == 1 and max(held_at_upload[0]) == journaled
    assert sorted(held_at_upload[0]) == sorted(r.seq for r in stuck.metrics + stuck.tables)
    assert trainer.rllog_run.finish().ok


def test_every_tracker_holds_every_step_once_waited_for_after_train_and_evaluate(tiny_model, tmp_path, tracker_dirs, monkeypatch):
    """``wait_for_trackers()`` after train() and evaluate(), read from the trackers' own files before the run is
    finished; and where they are."""
    from readers.tensorboard import read_back
    from tiny_grpo import grpo_dataset

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")  # where transformers' users look: <output_dir>/runs/<time>_<host>
    out = tmp_path / "out"
    trainer = make_grpo_trainer(
        tiny_model, str(out), steps=3, report_to=["tensorboard", "parquet"], project="my-project", run_name="flush-check"
    )
    trainer.train()
    assert trainer.rllog_callback.wait_for_trackers().ok
    run = trainer.rllog_run
    assert (run.info.project, run.info.name) == ("my-project", "flush-check")  # TrainingArguments.project and run_name
    assert run.run_dir.name.endswith(f"-flush-check-{run.run_id}")
    (logdir,) = (out / "runs").iterdir()
    assert str(logdir) == trainer.rllog_callback.tensorboard_logdir
    tensorboard = read_back(tracker_dirs, run.info, logdir=str(logdir))
    assert [s for s, _ in tensorboard.metrics["train/reward"]] == [1, 2, 3]
    assert [s for s, _ in tensorboard.tables["completions"]] == [1, 2, 3]
    assert [s for s, _ in metric_series(run.run_dir)["train/reward"]] == [1, 2, 3]
    assert sorted(set(rllog.read_table(run.run_dir, "completions").column("_step").to_pylist())) == [1, 2, 3]

    metrics = trainer.evaluate(eval_dataset=grpo_dataset().select(range(2)))
    assert trainer.rllog_callback.wait_for_trackers().ok
    tensorboard = read_back(tracker_dirs, run.info, logdir=str(logdir))
    assert tensorboard.metrics["eval/reward"] == [(3, pytest.approx(metrics["eval_reward"], rel=1e-6))]
    assert [s for s, _ in tensorboard.tables["eval/completions"]] == [3]
    assert metric_series(run.run_dir)["eval/reward"] == [(3, metrics["eval_reward"])]
    assert not run.finished
    assert run.finish().ok


def _agents() -> list:
    """This process's live delivery agents."""
    import psutil

    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "rllog.agent" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


# Enough replacements for a standby agent left behind by each to add up (at most one may live at a time).
TRAINERS_REPLACED = 8


@pytest.mark.slow
def test_trainers_built_and_replaced_in_one_process_keep_at_most_one_agent(tiny_model, tmp_path, tracker_dirs):
    """A sweep, a notebook or a test suite: each trainer trains, then the next one replaces it."""
    import gc
    import time
    from pathlib import Path

    from readers import read_back

    assert _agents() == []
    infos, most_alive = [], 0
    for i in range(TRAINERS_REPLACED):
        trainer = make_grpo_trainer(
            tiny_model,
            str(tmp_path / f"out{i}"),
            steps=1,
            report_to=["parquet"],
            rllog_options={"health": False},
            log_completions=False,
        )
        assert trainer.rllog_run is None and len(_agents()) <= 1  # building one starts no run (a standby agent at most)
        trainer.train()
        infos.append(trainer.rllog_run.info)
        most_alive = max(most_alive, len(_agents()))
    assert most_alive == 1
    last = trainer.rllog_run
    del trainer
    gc.collect()  # the last trainer goes too: its run is finished, its agent exits
    deadline = time.monotonic() + 60
    while (_agents() or not last.finished) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _agents() == [] and last.finished
    for info in infos:  # each run finished with a status, everything delivered
        got = read_back("parquet", tracker_dirs, info)
        assert got.status == "finished" and [s for s, _ in got.metrics["train/reward"]] == [1], info.run_dir
        assert Path(info.run_dir).name.count(info.run_id) == 1  # run_name unset: the id once in the directory name


def test_a_trainer_built_prepares_an_agent_that_its_training_takes_and_that_goes_with_an_untrained_trainer(
    tiny_model, tmp_path, tracker_dirs
):
    """Built: the agent starts (the trackers import while the model loads), with no run and no tracker files;
    trained: the run's agent is that process; built and dropped without training: the agent exits."""
    import gc
    import time
    from pathlib import Path

    from rllog import agent

    agent.discard_standby()
    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=2, report_to=["parquet", "tensorboard"], log_completions=False
    )
    (prepared,) = _agents()
    assert "--standby" in prepared.cmdline() and trainer.rllog_run is None
    assert (
        list(Path(tracker_dirs["RLLOG_DIR"]).iterdir()) == []
        and list(Path(tracker_dirs["TENSORBOARD_LOGGING_DIR"]).iterdir()) == []
    )
    trainer.train()
    assert trainer.rllog_run._agent.pid == prepared.pid
    assert trainer.rllog_callback.wait_for_trackers().ok
    assert [s for s, _ in metric_series(trainer.rllog_run.run_dir)["train/reward"]] == [1, 2]
    assert trainer.rllog_run.finish().ok

    dropped = make_grpo_trainer(tiny_model, str(tmp_path / "out2"), steps=2, report_to=["parquet"], log_completions=False)
    (waiting,) = _agents()
    del dropped
    gc.collect()
    deadline = time.monotonic() + 120  # the standby exits once its imports, at idle priority, are done
    while _agents() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _agents() == [] and not waiting.is_running()


RESUMABLE_GRPO = r'''
import os, signal, sys, time
from transformers import TrainerCallback
from tiny_grpo import make_grpo_trainer

model_dir, out, trackers, kill_at = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])


class KillAfterLogging(TrainerCallback):
    """SIGKILL (preemption) right after step kill_at is logged: the step after the last checkpoint."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == kill_at and "loss" in logs:
            time.sleep(2)  # the step's records reach the journal (within flush_interval) and the agent delivers them
            os.kill(os.getpid(), signal.SIGKILL)


trainer = make_grpo_trainer(model_dir, out, steps=4, report_to=trackers, save_strategy="steps", save_steps=2,
                            log_completions=False, rllog_options={"health": False})
if kill_at:
    trainer.add_callback(KillAfterLogging())
trainer.train(resume_from_checkpoint=not kill_at)
run = trainer.rllog_run
print(run.run_id, run.attempt, run.finish(timeout=120).ok, flush=True)
'''


@pytest.mark.slow
def test_grpo_killed_after_a_checkpoint_and_resumed_is_one_run_in_every_tracker(tiny_model, tmp_path, tracker_dirs, monkeypatch):
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import readers.mlflow
    from readers import read_back

    from rllog.run import load_run_info

    script, out, trackers = tmp_path / "train.py", tmp_path / "out", "parquet,mlflow,tensorboard"
    script.write_text(RESUMABLE_GRPO)
    readers.mlflow.prepare(monkeypatch, tracker_dirs)  # a migrated database: no schema migration in each process
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}

    def train(kill_at: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), tiny_model, str(out), trackers, str(kill_at)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=tmp_path,
        )

    killed = train(kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    resumed = train(kill_at=0)  # train(resume_from_checkpoint=True): from checkpoint-2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_id, attempt, ok = resumed.stdout.strip().splitlines()[-1].split()
    assert (attempt, ok) == ("2", "True")

    (run_dir,) = Path(tracker_dirs["RLLOG_DIR"]).iterdir()  # one rllog run
    info = load_run_info(run_dir)[0]
    assert info.run_id == run_id
    assert [a["attempt"] for a in json.loads((run_dir / "run.json").read_text())["attempts"]] == [1, 2]
    latest = metric_series(run_dir)
    assert [s for s, _ in latest["train/reward"]] == [1, 2, 3, 4]  # each step once
    every = [r["step"] for r in rllog.read_metrics(run_dir, attempts="all").to_pylist() if r["key"] == "train/reward"]
    assert sorted(every) == [1, 2, 3, 3, 4]  # step 3 was logged by the killed attempt, then superseded
    assert len(readers.mlflow.run_ids(tracker_dirs, info)) == 1  # one MLflow run, finished, with every step
    mlflow = read_back("mlflow", tracker_dirs, info)
    assert mlflow.status == "finished" and sorted({s for s, _ in mlflow.metrics["train/reward"]}) == [1, 2, 3, 4]
    tensorboard = read_back("tensorboard", tracker_dirs, info)  # the same log directory both times, no superseded point
    assert [s for s, _ in tensorboard.metrics["train/reward"]] == [1, 2, 3, 4]
    assert [v for _, v in tensorboard.metrics["train/reward"]] == pytest.approx([v for _, v in latest["train/reward"]], rel=1e-6)


def test_completions_callback_leaves_the_tokenizer_as_it_found_it(tiny_model, tmp_path):
    """The data collator pads with the tokenizer too: generating must not change how training pads."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from rllog.integrations.transformers import RLLogCallback, finish_run
    from rllog.integrations.trl import RLLogCompletionsCallback

    def train(with_completions: bool) -> tuple[list[dict], str]:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model, padding_side="right")
        texts = [f"{p} The answer is {'12 ' * (i % 5)}." for i, p in enumerate(PROMPTS)]  # lengths differ: batches are padded
        data = Dataset.from_dict({"prompt": PROMPTS, "input_ids": [tokenizer(t)["input_ids"] for t in texts]})
        args = TrainingArguments(
            output_dir=str(tmp_path / f"out{with_completions}"),
            use_cpu=True,
            max_steps=3,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=1,
            report_to="none",
            save_strategy="no",
            learning_rate=1e-3,
            seed=0,
        )
        trainer = Trainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model),
            args=args,
            train_dataset=data,
            eval_dataset=data.select(range(8)),
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            processing_class=tokenizer,
            callbacks=[RLLogCallback(run_dir=str(tmp_path / f"run{with_completions}"), health=False)],
        )
        if with_completions:
            trainer.add_callback(RLLogCompletionsCallback(trainer, num_prompts=2, freq=1))
        trainer.train()
        assert finish_run(trainer).ok
        timings = ("runtime", "per_second")
        return [
            {k: v for k, v in h.items() if not any(t in k for t in timings)} for h in trainer.state.log_history
        ], tokenizer.padding_side

    without, with_ = train(False), train(True)
    assert [h["eval_loss"] for h in with_[0] if "eval_loss" in h] == [h["eval_loss"] for h in without[0] if "eval_loss" in h]
    assert with_ == without and with_[1] == "right"
    assert [r["_step"] for r in rllog.read_table(tmp_path / "runTrue", "completions").to_pylist()] == [1, 1, 2, 2, 3, 3]


def test_a_reward_function_returning_none_by_design_raises_no_alert(tiny_model, tmp_path):
    """TRL: a reward function returns None for the samples it does not apply to; TRL logs NaN for it then."""
    from rllog.health import HealthMonitor

    def reward_for_other_tasks(completions, **kwargs):
        return [None] * len(completions)

    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model,
        str(tmp_path / "out"),
        steps=2,
        report_to=["parquet"],
        rllog_options={"run_dir": str(run_dir), "health": True},
        log_completions=False,
    )
    trainer.reward_funcs.append(reward_for_other_tasks)
    trainer.reward_func_names.append("reward_for_other_tasks")
    trainer.reward_weights = __import__("torch").ones(3)
    trainer.reward_processing_classes.append(None)
    trainer.train()
    assert trainer.rllog_run.finish().ok
    series = metric_series(run_dir)
    assert all(math.isnan(v) for _, v in series["train/rewards/reward_for_other_tasks/mean"])
    assert rllog.read_alerts(run_dir).num_rows == 0
    # the rule still fires on what is broken: inf in a reward function's mean, NaN in the reward or the loss
    fired = HealthMonitor().observe(
        5,
        {
            "train/rewards/f/mean": math.inf,
            "train/reward": math.nan,
            "eval/loss": math.nan,
            "train/rewards/g/mean": math.nan,
            "eval/rewards/g/std": math.nan,
        },
    )
    assert sorted(a.metric for a in fired if a.rule == "non_finite") == ["eval/loss", "train/reward", "train/rewards/f/mean"]


def test_trls_warnings_from_the_trainers_init_point_at_the_users_line(tiny_model, tmp_path, monkeypatch):
    """TRL warns with stacklevel=2: the mixin's __init__ must not become where warnings are shown (and deduplicated)."""
    import inspect
    import warnings

    from tiny_grpo import grpo_dataset
    from trl import GRPOConfig, GRPOTrainer

    from rllog.integrations.trl import RLLogMixin

    class Trainer(RLLogMixin, GRPOTrainer):
        pass

    monkeypatch.delenv("TRL_EXPERIMENTAL_SILENCE", raising=False)

    def build(trainer_class):
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=4,
            num_generations=4,
            report_to=["parquet"] if trainer_class is Trainer else "none",
        )
        return dict(
            model=tiny_model,
            reward_funcs=[reward_has_digit],
            args=args,
            train_dataset=grpo_dataset(),
            rollout_func=lambda *a, **k: None,
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default for UserWarning: once per line of code
        line = inspect.currentframe().f_lineno
        for trainer_class in (GRPOTrainer, GRPOTrainer, Trainer, Trainer):
            trainer_class(**build(trainer_class))  # line + 2: shown once for this line
        Trainer(**build(Trainer))  # line + 3: another line, shown again
    shown = [(w.filename, w.lineno) for w in caught if "rollout_func" in str(w.message)]
    assert shown == [(__file__, line + 2), (__file__, line + 3)]


def _reward_failing_in_training_at_call(trainer_box: list, fail_at: int, calls: list):
    """A reward function that logs through rllog.log (no step) and raises at its ``fail_at``-th training call,
    before it logs: a crash in the middle of a step, which transformers reports to no callback."""

    def reward_logging_itself(completions, **kwargs):
        training = trainer_box[0].model.training
        calls.append(training)
        if training and calls.count(True) == fail_at:
            raise RuntimeError("the reward server is down")
        rllog.log({("custom/train_n" if training else "custom/eval_n"): float(len(completions))})
        return [0.0] * len(completions)

    return reward_logging_itself


def _add_reward(trainer, reward) -> None:
    trainer.reward_funcs.append(reward)
    trainer.reward_func_names.append(reward.__name__)
    trainer.reward_weights = __import__("torch").ones(len(trainer.reward_funcs))
    trainer.reward_processing_classes.append(None)


def test_evaluate_after_a_train_that_raised_flushes_and_user_code_logs_at_the_trainers_step(tiny_model, tmp_path):
    """transformers calls no on_train_end when train() raises: evaluate() afterwards is not one of training's."""
    from tiny_grpo import grpo_dataset

    run_dir, box, calls = tmp_path / "run", [], []
    # a minute between the trackers' own flushes: only the flush evaluate() asks for at its end puts its rows in
    # Parquet within the next 30 s
    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=3, report_to=["parquet"],
        rllog_options={"run_dir": str(run_dir), "flush_interval": 60, "health": False},
    )  # fmt: skip
    box.append(trainer)
    _add_reward(trainer, _reward_failing_in_training_at_call(box, fail_at=2, calls=calls))
    with pytest.raises(RuntimeError, match="reward server"):
        trainer.train()
    assert trainer.state.global_step == 1
    metrics = trainer.evaluate(eval_dataset=grpo_dataset().select(range(2)))
    assert wait_until(lambda: "eval/reward" in metric_series(run_dir), timeout=30)  # before finish()
    series = metric_series(run_dir)
    assert series["eval/reward"] == [(1, metrics["eval_reward"])]
    assert [s for s, _ in series["custom/eval_n"]] == [1]  # the trainer's step, not the failed one (2)
    assert [s for s, _ in series["custom/train_n"]] == [s for s, _ in series["train/reward"]] == [1]
    assert trainer.rllog_run.finish().ok


def test_train_resumed_in_the_same_process_after_a_failure_is_a_new_attempt_of_the_run(tiny_model, tmp_path):
    run_dir, box, calls = tmp_path / "run", [], []
    out = tmp_path / "out"
    trainer = make_grpo_trainer(
        tiny_model, str(out), steps=3, report_to=["parquet"], save_strategy="steps", save_steps=1,
        log_completions=False, rllog_options={"run_dir": str(run_dir), "health": False},
    )  # fmt: skip
    box.append(trainer)
    _add_reward(trainer, _reward_failing_in_training_at_call(box, fail_at=3, calls=calls))
    with pytest.raises(RuntimeError, match="reward server"):
        trainer.train()  # steps 1 and 2 logged, checkpoints at both
    first = trainer.rllog_run
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))  # steps 2 and 3 again
    run = trainer.rllog_run
    assert (run.run_id, run.run_dir, first.finished) == (first.run_id, first.run_dir, True)
    assert run.attempt == 2 and run.finish().ok
    assert [s for s, _ in metric_series(run_dir)["train/reward"]] == [1, 2, 3]  # step 2 once: attempt 2's
    every = [r["step"] for r in rllog.read_metrics(run_dir, attempts="all").to_pylist() if r["key"] == "train/reward"]
    assert sorted(every) == [1, 2, 2, 3]
    attempts = __import__("json").loads((run_dir / "run.json").read_text())["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2]


def test_evaluate_before_a_resume_in_a_new_trainer_leaves_the_checkpoints_run_to_continue(tiny_model, tmp_path, monkeypatch):
    from pathlib import Path

    from tiny_grpo import grpo_dataset

    monkeypatch.setenv("RLLOG_DIR", str(tmp_path / "runs"))
    out = tmp_path / "out"

    def build():  # no run_dir option: the checkpoint names the run
        return make_grpo_trainer(
            tiny_model, str(out), steps=3, report_to=["parquet"], save_strategy="steps", save_steps=1,
            log_completions=False, rllog_options={"health": False},
        )  # fmt: skip

    first = build()
    first.train()
    killed = first.rllog_run
    killed.finish("killed")  # the process that trained is gone
    second = build()  # a new process: evaluates the checkpoint's model first, then resumes from it
    metrics = second.evaluate(eval_dataset=grpo_dataset().select(range(2)))
    evaluation = second.rllog_run
    second.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    run = second.rllog_run
    assert (run.run_id, Path(run.run_dir), run.attempt) == (killed.run_id, Path(killed.run_dir), 2)
    assert run.finish().ok and evaluation.finished and evaluation.run_id != run.run_id
    assert [s for s, _ in metric_series(run.run_dir)["train/reward"]] == [1, 2, 3]
    assert "eval/reward" not in metric_series(run.run_dir)
    assert metric_series(evaluation.run_dir)["eval/reward"] == [(0, metrics["eval_reward"])]  # a run of its own


def test_a_plain_trainers_evaluate_after_a_train_that_raised_flushes_and_logs_at_the_trainers_step(tiny_model, tmp_path):
    """The callback alone (no mixin to see the exception): evaluate() finds no training loop on the stack."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from rllog.integrations.transformers import RLLogCallback

    class FailInStep2(TrainerCallback):  # after the RLLogCallback: the step has begun when it raises
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise RuntimeError("out of memory")

    def compute_metrics(prediction):
        rllog.log({"custom/eval_batches": 1.0})  # no step, no trainer reference
        return {"seen": float(len(prediction.label_ids))}

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer(PROMPTS[:4], padding="max_length", max_length=8, truncation=True)["input_ids"]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    run_dir, callback = tmp_path / "run", RLLogCallback(run_dir=str(tmp_path / "run"), flush_interval=60, health=False)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, logging_steps=1, per_device_train_batch_size=2,
        report_to="none", use_cpu=True, save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model), args=args, train_dataset=data, eval_dataset=data,
        callbacks=[callback, FailInStep2()], compute_metrics=compute_metrics,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    metrics = trainer.evaluate()
    # a minute between the trackers' own flushes: the flush evaluate() asks for at its end puts the rows in Parquet
    assert wait_until(lambda: "custom/eval_batches" in metric_series(run_dir), timeout=30)  # before finish()
    series = metric_series(run_dir)
    assert series["eval/loss"] == [(1, pytest.approx(metrics["eval_loss"], rel=1e-6))]
    assert series["custom/eval_batches"] == [(1, 1.0)]  # the trainer's step, not the failed one (2)
    assert callback.finish().ok


def test_each_trial_of_a_hyperparameter_search_is_a_run_of_its_own(tiny_model, tmp_path, monkeypatch):
    """train(trial=...) is what Trainer.hyperparameter_search calls per trial (a dict trial needs no search backend)."""
    from pathlib import Path

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from rllog.integrations.transformers import RLLogCallback
    from rllog.run import load_run_info

    monkeypatch.setenv("RLLOG_DIR", str(tmp_path / "runs"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer(PROMPTS[:4], padding="max_length", max_length=8, truncation=True)["input_ids"]
    callback = RLLogCallback(health=False)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
        report_to="none", use_cpu=True, save_strategy="no", run_name="search",
    )  # fmt: skip
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model), args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}), callbacks=[callback],
    )  # fmt: skip
    trainer.hp_name = lambda trial: f"trial-{trial['n']}"
    runs = []
    for n in (0, 1):
        trainer.train(trial={"n": n})
        runs.append(callback.run)
    assert callback.finish().ok and runs[0].finished and runs[0].run_id != runs[1].run_id
    assert len(list(Path(tmp_path / "runs").iterdir())) == 2
    for n, run in enumerate(runs):
        info = load_run_info(run.run_dir)[0]
        assert info.name == f"trial-{n}" and info.config["trial/n"] == n
        assert [s for s, _ in metric_series(run.run_dir)["train/loss"]] == [1, 2]  # its own steps, not over another's


def test_evaluate_after_finish_continues_the_run_and_hides_none_of_the_training(tiny_model, tmp_path):
    """``finish()`` then ``evaluate()`` reopens the run; as a restart, its first record (``eval/...`` at the last
    training step) hid that step's training rows from ``read_metrics``."""
    from tiny_grpo import grpo_dataset

    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=2, report_to=["parquet"], log_completions=False,
        rllog_options={"run_dir": str(run_dir), "health": False},
    )  # fmt: skip
    trainer.train()
    assert trainer.rllog_run.finish().ok
    trainer.evaluate(eval_dataset=grpo_dataset().select(range(2)))
    assert trainer.rllog_run.finish().ok

    def rows(attempts):
        table = rllog.read_metrics(run_dir, attempts=attempts)
        return sorted(zip(table.column("key").to_pylist(), table.column("step").to_pylist(), strict=True))

    assert ("train/reward", 2) in rows("latest") and any(k.startswith("eval/") for k, _ in rows("latest"))
    assert rows("latest") == rows("all")


# -- switching from transformers' own callbacks (issue 36) ---------------------------------------------
def test_report_to_none_with_the_mixin_writes_no_run_and_no_file_as_transformers(
    tiny_model, tmp_path, tracker_dirs, monkeypatch, caplog
):
    """transformers' "none" (its default): no tracker, no files, no alert lines; rllog.log in user code still works."""
    workdir = tmp_path / "workdir"  # where rllog_runs/ would appear without RLLOG_DIR
    workdir.mkdir()
    monkeypatch.chdir(workdir)

    def reward_logging_itself(completions, **kwargs):
        rllog.log({"mine": 1.0})
        return [0.0] * len(completions)

    trainer = make_grpo_trainer(tiny_model, str(tmp_path / "out"), steps=1, report_to="none", rllog_options={"health": True})
    trainer.reward_funcs.append(reward_logging_itself)
    trainer.reward_func_names.append("reward_logging_itself")
    trainer.reward_weights = __import__("torch").ones(3)
    trainer.reward_processing_classes.append(None)
    trainer.train()
    assert isinstance(trainer.rllog_run, rllog.NullRun) and trainer.rllog_run.finish() is not None
    assert not any(Path(tracker_dirs["RLLOG_DIR"]).iterdir()) and not any(workdir.iterdir())
    assert not [r for r in caplog.records if r.name.startswith("rllog")], [r.getMessage() for r in caplog.records]


def test_report_to_all_and_every_tracker_rllog_has_a_backend_for_go_through_rllog(tiny_model, tmp_path):
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    from rllog.integrations.transformers import split_report_to

    assert split_report_to(["wandb", "dvclive", "clearml", "swanlab", "neptune", "parquet"]) == (
        ["wandb", "dvclive", "clearml", "swanlab", "parquet"],
        ["neptune"],
    )
    trainer = make_grpo_trainer(tiny_model, str(tmp_path / "out"), steps=1, report_to="all")
    installed = get_available_reporting_integrations()
    assert trainer.rllog_callback.report_to == [n for n in installed if n in split_report_to(installed)[0]]
    tracker_callbacks = tuple(INTEGRATION_TO_CALLBACK.values())
    assert not [type(c).__name__ for c in trainer.callback_handler.callbacks if isinstance(c, tracker_callbacks)]


def test_a_wandbcallback_subclass_beside_the_mixin_gets_one_warning_naming_rllog_log(tiny_model, tmp_path, caplog):
    """The pattern of a popular how-to (subclass WandbCallback, log an extra key in on_log) opens a second wandb run."""
    from transformers.integrations import WandbCallback

    class ExtraKeyCallback(WandbCallback):
        def on_log(self, args, state, control, model=None, logs=None, **kwargs):
            super().on_log(args, state, control, model=model, logs=logs, **kwargs)
            self._wandb.log({"extra": 1.0})

    make_grpo_trainer(tiny_model, str(tmp_path / "out"), steps=1, report_to=["wandb"], callbacks=[ExtraKeyCallback()])
    warned = [r.getMessage() for r in caplog.records if r.name == "rllog.integrations" and r.levelname == "WARNING"]
    assert len(warned) == 1 and "rllog.log(" in warned[0] and "ExtraKeyCallback (a WandbCallback)" in warned[0], warned


def test_a_tracker_run_of_the_training_process_beside_the_plain_callback_gets_one_warning(tmp_path, caplog, monkeypatch):
    """A tracker run the training process opened itself (wandb.init) for a tracker rllog delivers to, found at the
    first log, once."""
    import wandb

    from rllog.integrations import transformers as integration

    monkeypatch.setattr(integration, "prepare_agent", lambda *a, **k: None)  # no standby agent: nothing is delivered here
    callback = integration.RLLogCallback(report_to="wandb,parquet")
    callback._warn_other_runs()
    assert not caplog.records  # no wandb run in this process yet
    callback._other_runs_checked = False
    run = wandb.init(mode="disabled")  # the user's own run: wandb.run is set as by any wandb.init
    try:
        callback._warn_other_runs()
        callback._warn_other_runs()
    finally:
        run.finish()
    warned = [r.getMessage() for r in caplog.records if r.name == "rllog.integrations"]
    assert len(warned) == 1 and "a wandb run of its own" in warned[0] and "rllog.log(" in warned[0], warned


def test_the_plain_callback_records_the_report_to_it_was_given(monkeypatch, tmp_path):
    from transformers import TrainingArguments

    from rllog.integrations import transformers as integration

    monkeypatch.setattr(integration, "prepare_agent", lambda *a, **k: None)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    callback = integration.RLLogCallback(report_to="mlflow,parquet")
    assert integration.trainer_config(args, None, callback._given_report_to(args))["report_to"] == ["mlflow", "parquet"]


def test_profiling_timings_land_one_record_a_step_each_at_the_step_it_was_taken(tiny_model, tmp_path, monkeypatch):
    """TRL's ~8 timings a step are held and logged as one record (docs/decisions.md): every timing TRL produced lands
    with its exact value at the step it was taken, in the record the holding rule gives (a new one when the step
    changes or a name repeats), before the step's metrics; evaluate()'s timings too."""
    from tiny_grpo import grpo_dataset

    from rllog.integrations.trl import HeldTimings

    taken: list[tuple[int, str, float] | None] = []  # what TRL timed, in order, at the trainer's step then; None: a log
    add, log_held = HeldTimings.add, HeldTimings.log_held

    def spy_add(self, run, name, duration):
        step = run.step_source()
        add(self, run, name, duration)  # what it logs first (another step's timings) is marked first
        taken.append((step, name, duration))

    def spy_log_held(self):
        if self.held is not None:
            taken.append(None)
        log_held(self)

    monkeypatch.setattr(HeldTimings, "add", spy_add)
    monkeypatch.setattr(HeldTimings, "log_held", spy_log_held)
    run_dir = tmp_path / "run"
    trainer = make_grpo_trainer(
        tiny_model, str(tmp_path / "out"), steps=3, report_to=["parquet"], rllog_options={"run_dir": str(run_dir)}
    )
    trainer.train()
    trainer.evaluate(eval_dataset=grpo_dataset().select(range(2)))
    assert trainer.rllog_run.finish().ok

    expected: list[tuple[int, dict[str, float]]] = []  # the records the holding rule makes of them
    logged = True
    for timing in taken:
        if timing is None:
            logged = True
            continue
        step, name, duration = timing
        if logged or expected[-1][0] != step or name in expected[-1][1]:
            expected.append((step, {}))
            logged = False
        expected[-1][1][name] = duration
    rows = rllog.read_metrics(run_dir).to_pylist()
    records: dict[int, tuple[int, dict[str, float]]] = {}
    for row in rows:
        if row["key"].startswith("profiling/"):
            records.setdefault(row["seq"], (row["step"], {}))[1][row["key"]] = row["value"]
    assert [records[seq] for seq in sorted(records)] == expected
    # a step's 8 timings in two records (the second starts where _get_per_token_logps_and_entropies is timed again),
    # not eight; then evaluate()'s, at the step trained last
    assert [step for step, _ in expected] == [1, 1, 2, 2, 3, 3, 3, 3]
    assert [len(values) for _, values in expected[:6]] == [6, 2] * 3
    # each training step's timings come before that step's metrics, as when each timing was its own log()
    reward_seq = {r["step"]: r["seq"] for r in rows if r["key"] == "train/reward"}
    assert all(min(seq for seq, (at, _) in records.items() if at == step) < reward_seq[step] for step in (1, 2, 3))


HELD_AT_SIGTERM = r"""
import os, signal, sys, time
import rllog
from rllog.integrations.trl import HeldTimings

run = rllog.init(report_to="parquet", run_dir=sys.argv[1], health=False)
run.step_source = lambda: 7  # as the trainer integration sets it: the step being trained
held = HeldTimings()
held.add(run, "profiling/Time taken: GRPOTrainer._prepare_inputs", 0.25)
held.add(run, "profiling/Time taken: GRPOTrainer.reward_short", 0.125)
os.kill(os.getpid(), signal.SIGTERM)  # mid-step: both timings are still held
time.sleep(60)
"""


def test_timings_held_when_a_sigterm_comes_are_logged_before_the_run_is_finished_killed(tmp_path):
    import signal
    import subprocess
    import sys

    from rllog.read import run_status

    run_dir = tmp_path / "run"
    script = tmp_path / "held.py"
    script.write_text(HELD_AT_SIGTERM)
    done = subprocess.run([sys.executable, str(script), str(run_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    rows = [(r["step"], r["key"], r["value"]) for r in rllog.read_metrics(run_dir).to_pylist()]
    assert rows == [
        (7, "profiling/Time taken: GRPOTrainer._prepare_inputs", 0.25),
        (7, "profiling/Time taken: GRPOTrainer.reward_short", 0.125),
    ]
    assert run_status(run_dir) == "killed"


def test_a_flush_logs_the_timings_held_and_waits_for_them(tmp_path):
    from rllog.integrations.trl import HeldTimings

    run = rllog.init(report_to="parquet", run_dir=tmp_path / "run", health=False)
    run.step_source = lambda: 4
    held = HeldTimings()
    held.add(run, "profiling/a", 0.5)
    held.add(run, "profiling/a", 0.75)  # the same name again: a new record
    assert run.flush().ok
    rows = rllog.read_metrics(run.run_dir).to_pylist()
    assert [(r["step"], r["key"], r["value"]) for r in rows] == [(4, "profiling/a", 0.5), (4, "profiling/a", 0.75)]
    assert rows[0]["seq"] < rows[1]["seq"]
    assert run.finish().ok


def test_a_flush_landing_inside_add_loses_none_of_the_timings(tmp_path):
    """The holder has no lock (a SIGTERM's finish must never wait for the main thread), so a flush on another thread
    can land between ``add`` reading what is held and storing the new timing. Here it lands there every time (the
    step's comparison runs it): a timing may be logged twice, but every one lands."""
    from rllog.integrations.trl import HeldTimings

    held = HeldTimings()

    class Step(int):
        def __ne__(self, other):
            held.log_held()  # another thread's flush, right after add read what is held
            return int(self) != int(other)

    run = rllog.init(report_to="parquet", run_dir=tmp_path / "run", health=False)
    run.step_source = lambda: Step(1)
    for i in range(50):
        held.add(run, f"profiling/t{i}", float(i))
    assert run.finish().ok
    rows = rllog.read_metrics(run.run_dir).to_pylist()
    assert {(r["step"], r["key"], r["value"]) for r in rows} == {(1, f"profiling/t{i}", float(i)) for i in range(50)}
