"""What a user sees of a run: the lines ``init`` and ``finish`` print, reprs, a notebook's second ``init``, a run sent
to a spawn worker, and the messages of ``init`` for common mistakes; and that :class:`NullRun` mirrors :class:`Run`."""

from __future__ import annotations

import inspect
import multiprocessing
import warnings

import pytest
from sinks import MemorySink

import rllog
from rllog.errors import ForkedChild, InvalidKey, InvalidTable, RllogError, RunDirError, UnknownArgument
from rllog.run import NullRun, Run


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_nullrun_has_the_public_methods_of_run_with_the_same_signatures():
    """Rank > 0 code calls what rank 0 calls: a method or a parameter missing on NullRun fails only on other ranks."""
    run_methods, null_methods = _public_methods(Run), _public_methods(NullRun)
    assert (
        set(run_methods)
        == set(null_methods)
        == {"log", "log_table", "update_config", "flush", "request_flush", "finish", "before_flush"}
    )
    assert {n: str(s) for n, s in null_methods.items()} == {n: str(s) for n, s in run_methods.items()}


@pytest.fixture
def printed(monkeypatch):
    """Lines rllog prints (the test suite runs with RLLOG_QUIET=1 otherwise)."""
    monkeypatch.delenv("RLLOG_QUIET", raising=False)


def test_init_names_the_run_directory_and_finish_says_where_each_trackers_data_is(tmp_path, printed, capfd):
    run_dir = tmp_path / "r"
    with rllog.init(report_to="parquet,tensorboard", name="demo", run_dir=run_dir, delivery="thread", health=False) as run:
        opened = capfd.readouterr()
        run.log({"reward": 0.5}, step=1)
        run.log({"reward": 0.7}, step=2)
    out, err = capfd.readouterr()
    logdir = (run_dir / "trackers" / "tensorboard.json").read_text().split('"logdir": "')[1].split('"')[0]
    assert opened.out == "" and opened.err == f"rllog: run 'demo' logs to {run_dir} (trackers: parquet, tensorboard)\n"
    assert out == ""
    assert err.splitlines() == [
        "rllog: run 'demo' finished: 2 records, all records delivered",
        f"rllog:   parquet: delivered (2 delivered, 0 pending) -> {run_dir}/parquet",
        f"rllog:   tensorboard: delivered (2 delivered, 0 pending) -> logdir={logdir}",
    ]
    assert repr(run.finish()) == "<FinishReport ok=True records=2 parquet=delivered, tensorboard=delivered>"
    assert capfd.readouterr().err == ""  # a second finish returns the report, and prints nothing again


def test_quiet_and_rllog_quiet_print_nothing(tmp_path, printed, monkeypatch, capfd):
    with rllog.init(report_to=[MemorySink("m")], run_dir=tmp_path / "a", quiet=True) as run:
        run.log({"x": 1.0})
    monkeypatch.setenv("RLLOG_QUIET", "1")
    with rllog.init(report_to=[MemorySink("m")], run_dir=tmp_path / "b") as run:
        run.log({"x": 1.0})
    assert capfd.readouterr() == ("", "")


def test_reprs_name_the_run_and_the_report_its_trackers(tmp_path):
    run = rllog.init(report_to=[MemorySink("mem")], name="grpo", run_dir=tmp_path / "r", health=False)
    run.log({"x": 1.0}, step=3)
    assert repr(run) == f"<rllog.Run 'grpo' id={run.run_id} step=3 live trackers=[mem] dir={tmp_path / 'r'}>"
    assert "<td>grpo</td>" in run._repr_html_() and "<td>live</td>" in run._repr_html_()
    report = run.finish()
    assert repr(run).endswith(f"step=3 finished, all delivered trackers=[mem] dir={tmp_path / 'r'}>")
    assert repr(report["mem"]) == "<SinkReport mem: delivered (1 delivered, 0 pending)>"
    assert "<th style='text-align:left'>mem</th><td>delivered (1 delivered, 0 pending)</td>" in report._repr_html_()
    assert repr(NullRun()) == "<rllog.NullRun step=-1>"


def test_a_second_init_finishes_the_previous_run_and_says_so_unless_asked_to_keep_it(tmp_path, printed, capfd):
    first = rllog.init(report_to=[MemorySink("m")], name="one", run_dir=tmp_path / "1")
    capfd.readouterr()
    second = rllog.init(report_to=[MemorySink("m")], name="two", run_dir=tmp_path / "2")
    assert first.finished and not second.finished
    assert capfd.readouterr().err.splitlines() == [
        "rllog: finishing the previous run 'one' first (rllog.init(reinit='create_new') keeps it open)",
        "rllog: run 'one' finished: 0 records, all records delivered",
        "rllog:   m: delivered (0 delivered, 0 pending)",
        f"rllog: run 'two' logs to {tmp_path / '2'} (trackers: m)",
    ]
    third = rllog.init(report_to=[MemorySink("m")], run_dir=tmp_path / "3", reinit="create_new", quiet=True)
    assert not second.finished and rllog.current_run() is third
    second.finish(), third.finish()


def _log_without_a_run() -> str:
    try:
        rllog.log({"x": 1.0})
    except RllogError as exc:
        return str(exc)
    return "no error"


def _step_of(run) -> int:  # pragma: no cover - never runs: the run cannot be sent
    return run.step


def test_a_spawn_worker_gets_clear_errors_for_a_run_sent_to_it_and_for_logging_without_one(tmp_path):
    run = rllog.init(report_to=[MemorySink("m")], name="main", run_dir=tmp_path / "r", health=False)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        with pytest.raises(ForkedChild, match=r"run 'main' cannot be sent to another process .*docs/workers\.md"):
            pool.apply(_step_of, (run,))
        message = pool.apply(_log_without_a_run)
    assert message.startswith("no run in this process (") and "multiprocessing worker" in message
    assert "return the values from the worker and log them there (docs/workers.md)" in message
    assert run.finish().ok


def test_run_dir_that_is_a_file_is_named_as_such(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("x")
    with pytest.raises(RunDirError, match=r"notes\.txt is a file, not a directory") as raised:
        rllog.init(report_to="none", run_dir=path)
    assert "already holds" not in str(raised.value)


def test_two_open_runs_of_one_process_on_one_dir_are_not_called_another_process(tmp_path):
    first = rllog.init(report_to="none", run_dir=tmp_path / "r")
    with pytest.raises(RunDirError, match="a run of this process has it open; finish that run first") as raised:
        rllog.init(report_to="none", run_dir=tmp_path / "r", resume="allow", reinit="create_new")
    assert "another live process" not in str(raised.value)
    first.finish()


def test_backend_options_for_a_backend_not_selected_warn_and_name_it(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", backend_options={"wandb": {"entity": "me"}})
    run.finish()
    assert [str(w.message) for w in caught if "backend_options" in str(w.message)] == [
        "rllog: backend_options for wandb are not used: report_to selects parquet"
    ]
    assert caught[0].filename == __file__  # points at the user's init call


@pytest.mark.parametrize(
    "argument, suggestion",
    [
        ("projct", " (did you mean 'project'?)"),
        ("entity", " (a tracker's own option: backend_options={'wandb': {'entity': ...}})"),
        ("run_directory", " (did you mean 'run_dir'?)"),
    ],
)
def test_an_unknown_init_argument_names_the_closest_one_and_those_that_exist(tmp_path, argument, suggestion):
    with pytest.raises(UnknownArgument) as raised:
        rllog.init(report_to="none", run_dir=tmp_path / "r", **{argument: "x"})
    message = str(raised.value)
    assert message.startswith(f"rllog.init() got an unknown argument {argument!r}{suggestion}; it takes report_to, project,")
    assert "backend_options" in message and "resume" in message and isinstance(raised.value, TypeError)
    assert not (tmp_path / "r").exists()  # refused before anything was created


class _RefusesWideTables(MemorySink):
    """A store that holds at most two columns, and says so."""

    @staticmethod
    def check_table(name, table):
        if table.num_columns > 2:
            raise InvalidTable(f"table {name!r}: at most 2 columns here")


EMPTY_STRUCT_COLUMN = {"cell": [{}, {}]}  # Arrow takes a struct with no field; Parquet cannot write one


def test_log_table_asks_the_selected_sinks_only_what_they_can_store(tmp_path):
    wide = {"a": [1], "b": [2], "c": [3]}
    run = rllog.init(report_to=[_RefusesWideTables("narrow")], run_dir=tmp_path / "r", delivery="thread", health=False)
    with pytest.raises(InvalidTable, match="at most 2 columns here"):
        run.log_table("t", wide)
    run.log_table("t", EMPTY_STRUCT_COLUMN)  # parquet is not selected: its limits are not this run's
    assert run.finish().ok
    with rllog.init(report_to=[MemorySink("m")], run_dir=tmp_path / "m", health=False) as run:
        run.log_table("t", wide)
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "p", delivery="thread", health=False)
    with pytest.raises(InvalidTable, match="has a column type parquet cannot store"):
        run.log_table("t", EMPTY_STRUCT_COLUMN)
    with pytest.raises(InvalidKey, match="too long for the parquet backend"):
        run.log_table("x" * 300, {"a": [1]})
    assert run.finish().ok
