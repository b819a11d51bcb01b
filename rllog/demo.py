"""``rllog demo``: a run written to the embedded default (parquet), read back and plotted.

By default it is a real tiny GRPO training with TRL (a tiny local Qwen2 model built on the spot, on the
CPU, no hub); ``simulated=True`` (``--simulate``) writes GRPO-shaped metrics without TRL. :func:`run_demo`
returns what it made (:class:`DemoResult`); the ``rllog demo`` command shows it.

The demo shows rllog, not its libraries: while it trains, transformers', TRL's and the hub's warnings and progress
bars are off and the trainer prints no log dicts (:func:`quiet_libraries`); one progress bar shows the steps, and
rllog's messages (health alerts) are printed above it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rllog
from rllog.summary import RunSummary, summarise


def simulate(run: rllog.Run, steps: int, seed: int = 0) -> None:
    """~30 GRPO-shaped metrics a step and a completions table every 10 steps."""
    rng = random.Random(seed)
    entropy = 2.2
    for step in range(steps):
        progress = step / max(1, steps - 1)
        reward = 0.15 + 0.6 * progress + rng.gauss(0, 0.04)
        entropy *= 0.985
        length = 60 + 40 * math.sin(progress * 3) + rng.gauss(0, 3)
        metrics = {
            "loss": rng.gauss(0.0, 0.02),
            "grad_norm": abs(rng.gauss(0.8, 0.2)),
            "learning_rate": 1e-6 * (1 - progress),
            "num_tokens": float((step + 1) * 4096),
            "reward": reward,
            "reward_std": abs(rng.gauss(0.3, 0.05)),
            "rewards/accuracy/mean": reward,
            "rewards/accuracy/std": abs(rng.gauss(0.3, 0.05)),
            "rewards/format/mean": min(1.0, 0.5 + progress),
            "rewards/format/std": 0.1,
            "frac_reward_zero_std": max(0.0, 0.3 - 0.25 * progress),
            "kl": 0.002 + 0.03 * progress,
            "entropy": entropy,
            "completions/mean_length": length,
            "completions/min_length": length - 30,
            "completions/max_length": length + 60,
            "completions/clipped_ratio": 0.05 + 0.05 * progress,
            "completions/mean_terminated_length": length - 5,
            "completions/min_terminated_length": length - 35,
            "completions/max_terminated_length": length + 40,
            "clip_ratio/low_mean": 0.01,
            "clip_ratio/high_mean": 0.02,
            "clip_ratio/region_mean": 0.03,
            "clip_ratio/low_min": 0.0,
            "clip_ratio/high_max": 0.05,
            "step_time": 0.5 + rng.random() * 0.1,
            "epoch": progress,
        }
        run.log(metrics, step=step)
        if step % 10 == 0:
            n = 4
            run.log_table(
                "completions",
                {
                    "prompt": [f"What is {step}+{i}?" for i in range(n)],
                    "completion": [f"{step + i}" if rng.random() < reward else "I am not sure" for i in range(n)],
                    "rewards/accuracy": [rng.random() for _ in range(n)],
                    "advantage": [rng.gauss(0, 1) for _ in range(n)],
                },
                step=step,
            )


@dataclass(frozen=True)
class DemoResult:
    """What a demo run made.

    Attributes:
        run_dir: the run directory.
        report: the delivery report of ``Run.finish`` (one entry per backend).
        summary: the run read back from its journal (metrics, tables, alerts, status).
        plot: the PNG of the run's crucial metrics.
    """

    run_dir: Path
    report: rllog.FinishReport
    summary: RunSummary
    plot: Path


def run_demo(
    steps: int = 40, run_dir: str | os.PathLike | None = None, report_to: str | None = None, simulated: bool = False
) -> DemoResult:
    """Log a demo run, read it back and plot it.

    Args:
        steps: training (or simulated) steps.
        run_dir: the run directory (default: rllog's, under ``RLLOG_DIR``).
        report_to: backends, comma-separated (default: parquet).
        simulated: GRPO-shaped simulated metrics instead of a real tiny TRL training.
    """
    from rllog.plot import plot_run

    if simulated:
        config = {"steps": steps, "simulated": True}
        run = rllog.init(report_to=report_to, project="rllog-demo", name="simulated-grpo", run_dir=run_dir, config=config)
        assert isinstance(run, rllog.Run)  # the demo is one process: rank 0
        simulate(run, steps)
        report, run_dir = run.finish(), run.run_dir
    else:
        with quiet_libraries(), progress_display() as progress:
            run_dir, report = train_tiny_grpo(steps=steps, report_to=report_to or "parquet", run_dir=run_dir, progress=progress)
    return DemoResult(Path(run_dir), report, summarise(run_dir), plot_run(run_dir))


# What the demo silences while it trains: each is printed every step (or once per run) by a library, and says
# nothing about rllog. The filters apply to the demo only; a user's own training keeps its warnings.
QUIET_WARNING_MODULES = r"(transformers|trl|accelerate|torch|datasets|huggingface_hub)(\.|$)"


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """transformers', TRL's and the hub's warnings, info lines and progress bars off, for the block."""
    import datasets
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "Comet API Key is not configured" and the like
    hf_logging.disable_progress_bar()  # loading and writing weights
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations repeated every step
            warnings.filterwarnings("ignore", category=UserWarning, module=QUIET_WARNING_MODULES)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
        datasets.enable_progress_bars()


@contextlib.contextmanager
def progress_display() -> Iterator[Any]:
    """One progress bar (rich, on stderr); rllog's log messages (health alerts, delivery warnings) are printed above
    it rather than into it."""
    from rich.logging import RichHandler
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False)
    logger = logging.getLogger("rllog")
    handler = RichHandler(console=progress.console, show_time=False, show_path=False, markup=False)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # the root logger's handler would print the same message into the bar
    try:
        with progress:
            yield progress
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# --- the real tiny GRPO run ---------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [f"What is {a} plus {b}?" for a in range(1, 9) for b in range(1, 5)]


def build_tiny_model(directory: str) -> str:
    """Build and save a tiny random Qwen2 model with a ByteLevel BPE tokenizer (no hub, a few seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = PROMPTS + ["The answer is 12.", "user", "assistant", "0123456789 plus minus equals"] * 4
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token=None, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    import torch

    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def reward_has_digit(completions, log_metric=None, log_extra=None, **kwargs):
    """1.0 for a completion with a digit in it; logs its own metric and an extra column."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    rewards = [1.0 if any(ch.isdigit() for ch in t) else 0.0 for t in texts]
    if log_metric is not None:
        log_metric("digits/fraction", sum(rewards) / len(rewards))
    if log_extra is not None:
        log_extra("n_chars", [len(t) for t in texts])
    return rewards


def reward_short(completions, **kwargs):
    """Prefers short completions."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 / (1.0 + len(t)) for t in texts]


def grpo_settings(output_dir: str, steps: int, report_to: Any, **overrides: Any) -> dict[str, Any]:
    """The tiny GRPO run's ``GRPOConfig`` arguments (CPU, batch 4, 4 generations, 8 new tokens, seeded); the demo,
    the tests' fixtures and the end-to-end benchmark all train with these."""
    settings = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=steps,
        logging_steps=1,
        report_to=report_to,
        log_completions=True,
        num_completions_to_print=0,
        beta=0.04,
        learning_rate=1e-3,
        save_strategy="no",
        seed=0,
        bf16=False,
        dataloader_num_workers=0,
    )
    return settings | overrides


def make_grpo_trainer(model_dir: str, output_dir: str, steps: int, report_to: Any, rllog_options: dict | None = None):
    """The demo's GRPOTrainer (with :class:`rllog.integrations.trl.RLLogMixin`) on the tiny model, CPU only."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rllog.integrations.trl import RLLogMixin

    class Trainer(RLLogMixin, GRPOTrainer):
        pass

    settings = grpo_settings(output_dir, steps, report_to)
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    return Trainer(
        model=model_dir,
        reward_funcs=[reward_has_digit, reward_short],
        args=GRPOConfig(**settings),
        train_dataset=dataset,
        rllog_options=rllog_options,
    )


def train_tiny_grpo(
    steps: int = 40, report_to: Any = "parquet", run_dir: str | os.PathLike | None = None, progress: Any = None
) -> tuple[Path, rllog.FinishReport]:
    """Train the tiny model with GRPO for ``steps`` steps, logging through rllog; returns (run_dir, report).

    Args:
        progress: a ``rich.progress.Progress`` to show the steps in, instead of the trainer's own bar and log dicts.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(f"{tmp}/model")
        names = [n for n in (report_to or "parquet").split(",") if n]
        options = {"project": "rllog-demo", "name": "tiny-grpo", "run_dir": run_dir}
        trainer = make_grpo_trainer(model_dir, f"{tmp}/out", steps, report_to=names, rllog_options=options)
        if progress is not None:
            _show_steps_in(trainer, progress, steps)
        trainer.train()
        report = trainer.rllog_run.finish()
        return trainer.rllog_run.run_dir, report


def _show_steps_in(trainer: Any, progress: Any, steps: int) -> None:
    """Replace the trainer's progress bar and its printed log dicts with a task of ``progress``."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    task = progress.add_task("training", total=steps)

    class StepProgress(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            progress.update(task, completed=state.global_step)

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepProgress())
