"""Secrets never reach disk: credentials are redacted from the config (whatever their key's spelling or
their value's type) and from inside any value, while ordinary names holding "token" are kept.

The rule is in docs/decisions.md ("Secrets"). The end-to-end test reads back every byte a run wrote.
"""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

import rllog
from rllog import journal
from rllog.validate import REDACTED, flatten_config, is_secret_key, redact, redact_text

HF = "hf_" + "Zq8xW3vR5tY7uI9oP1aS2dF4gH6jK0lMnB"  # the shape of a Hugging Face token: hf_ + 34 letters and digits
OPENAI = "sk-proj-" + "T3stOnlyN0tAR3alK3y_abcdefghijklmnop"
GITHUB = "ghp_" + "R4nd0mT3stT0k3nF0rRllogAbCdEfGhIjKl"
SLACK = "xoxb-1234567890-0987654321-TestOnlyTokenValue"
PASSWORD = "hunter2-Very-Secret"


# -- which keys name a credential -----------------------------------------------------------------
SECRET_KEYS = [
    # api keys, every spelling
    "api-key",
    "api_key",
    "apiKey",
    "ApiKey",
    "APIKey",
    "API_KEY",
    "api.key",
    "api key",
    "apikey",
    "api_keys",
    "apiKeys",
    "x-api-key",
    "wandb_api_key",
    "WANDB_API_KEY",
    "openai.api_key",
    "api_key_2",
    # other keys
    "private_key",
    "privateKey",
    "private-key",
    "secret_key",
    "aws_secret_access_key",
    "access_key",
    "ssh_key",
    "signing_key",
    "client_key",
    # passwords and secrets
    "password",
    "Password",
    "db_password",
    "dbPassword",
    "passwd",
    "passphrase",
    "key_passphrase",
    "secret",
    "secrets",
    "client_secret",
    "clientSecret",
    "SECRET",
    # headers, credentials, cookies
    "Authorization",
    "authorization",
    "headers/Authorization",
    "Proxy-Authorization",
    "auth_header",
    "authHeader",
    "auth",
    "http_auth",
    "basic_auth",
    "credential",
    "credentials",
    "gcp_credentials",
    "cookie",
    "cookies",
    "Set-Cookie",
    "session_cookie",
    "sentry_dsn",
    "slack_webhook_url",
    # tokens
    "token",
    "TOKEN",
    "hub_token",
    "hubToken",
    "HubToken",
    "hub-token",
    "hub.token",
    "hub token",
    "hubtoken",
    "push_to_hub_token",
    "hf_token",
    "HF_TOKEN",
    "hfToken",
    "HFToken",
    "access_token",
    "accessToken",
    "access-token",
    "refresh_token",
    "refreshToken",
    "auth_token",
    "authToken",
    "use_auth_token",
    "x-auth-token",
    "X-Auth-Token",
    "bearer_token",
    "session_token",
    "id_token",
    "idToken",
    "github_token",
    "my_token",
    "api_token",
    "hf_tokens",
    "access_tokens",
    "api_token_2",
]
KEPT_KEYS = [
    # a tokenizer's vocabulary tokens and their ids
    "pad_token",
    "eos_token",
    "bos_token",
    "unk_token",
    "sep_token",
    "cls_token",
    "mask_token",
    "padToken",
    "PadToken",
    "pad-token",
    "image_token",
    "vision_start_token",
    "pad_token_id",
    "eos_token_id",
    "bos_token_id",
    "decoder_start_token_id",
    "padTokenId",
    "additional_special_tokens",
    # token counts
    "max_new_tokens",
    "max_tokens",
    "num_tokens",
    "maxNewTokens",
    "include_num_input_tokens_seen",
    "average_tokens_across_devices",
    "max_prompt_tokens",
    "tokens",
    # tokenizers
    "tokenizer",
    "tokenizer_name",
    "tokenizer_name_or_path",
    "tokenizerName",
    "tokenizer_kwargs",
    # ordinary names
    "learning_rate",
    "key",
    "keys",
    "metric_key",
    "dataset_key",
    "author",
    "authors",
    "monkey",
    "max_completion_length",
    "token_type_ids",
    "hub_model_id",
    "hub_strategy",
    "hub_private_repo",
    "report_to",
    "output_dir",
    "seed",
]


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_keys_that_name_a_credential(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", KEPT_KEYS)
def test_ordinary_keys_holding_token_are_kept(key):
    assert not is_secret_key(key)


# -- values of any type under such keys -----------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        PASSWORD,
        PASSWORD.encode(),
        [PASSWORD, "second"],
        ("a", PASSWORD),
        {PASSWORD},
        {"user": "bob", "pass": PASSWORD},
        123456,
        0.123456,
        bytearray(PASSWORD.encode()),
    ],
    ids=lambda v: type(v).__name__,
)
def test_values_of_every_type_under_a_secret_key_are_redacted(value):
    flat = flatten_config({"api-key": value, "nested": {"private_key": value}, "lr": 0.1})
    assert flat == {"api-key": REDACTED, "nested/private_key": REDACTED, "lr": 0.1}


def test_none_booleans_and_empty_values_under_a_secret_key_are_kept():
    """They hold no secret, and showing them helps: `use_auth_token=True`, `hub_token=None`."""
    flat = flatten_config({"use_auth_token": True, "hub_token": None, "password": "", "api_keys": []})
    assert flat == {"use_auth_token": True, "hub_token": None, "password": "", "api_keys": "[]"}


def test_a_grpo_config_keeps_its_token_counts_and_hides_its_hub_token():
    """The field names and defaults of TRL's GRPOConfig / transformers' TrainingArguments that hold "token"."""
    config = {
        "hub_token": HF,
        "push_to_hub_token": HF,
        "include_num_input_tokens_seen": "no",
        "average_tokens_across_devices": True,
        "max_completion_length": 256,
        "max_new_tokens": 64,
        "max_tokens": 512,
        "num_tokens": 9,
        "pad_token": "<|endoftext|>",
        "eos_token": "</s>",
        "bos_token": "<s>",
        "unk_token": "<unk>",
        "sep_token": "[SEP]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "pad_token_id": 0,
        "eos_token_id": [1, 2],
        "tokenizer_name": "Qwen/Qwen2.5-0.5B-Instruct",
        "tokenizer_kwargs": {"padding_side": "left"},
    }
    flat = flatten_config(config)
    assert flat["hub_token"] == flat["push_to_hub_token"] == REDACTED
    kept = {k: v for k, v in flat.items() if "hub_token" not in k}
    assert kept == {
        "include_num_input_tokens_seen": "no",
        "average_tokens_across_devices": True,
        "max_completion_length": 256,
        "max_new_tokens": 64,
        "max_tokens": 512,
        "num_tokens": 9,
        "pad_token": "<|endoftext|>",
        "eos_token": "</s>",
        "bos_token": "<s>",
        "unk_token": "<unk>",
        "sep_token": "[SEP]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "pad_token_id": 0,
        "eos_token_id": "[1, 2]",
        "tokenizer_name": "Qwen/Qwen2.5-0.5B-Instruct",
        "tokenizer_kwargs/padding_side": "left",
    }


def test_a_whole_subtree_under_a_secret_key_is_one_redacted_value():
    flat = flatten_config(
        {"credentials": {"user": "bob", "password": PASSWORD}, "headers": {"Authorization": f"Bearer {HF}", "Accept": "json"}}
    )
    assert flat == {"credentials": REDACTED, "headers/Authorization": REDACTED, "headers/Accept": "json"}


# -- credentials inside values, under any key -----------------------------------------------------
BASIC = base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
IN_VALUES = [
    (f"https://bob:{PASSWORD}@example.com/x", f"https://bob:{REDACTED}@example.com/x"),
    (
        f"postgresql://trainer:{PASSWORD}@db.internal:5432/runs?sslmode=require",
        f"postgresql://trainer:{REDACTED}@db.internal:5432/runs?sslmode=require",
    ),
    (f"redis://:{PASSWORD}@cache:6379/0", f"redis://:{REDACTED}@cache:6379/0"),
    (f"Bearer {HF}", f"Bearer {REDACTED}"),
    ("bearer abc.DEF-123_456", f"bearer {REDACTED}"),
    (f"Authorization: Basic {BASIC}", f"Authorization: Basic {REDACTED}"),
    (f"token is {HF}.", f"token is {REDACTED}."),
    (OPENAI, REDACTED),
    (f"key={GITHUB}", f"key={REDACTED}"),
    (f"notify {SLACK}", f"notify {REDACTED}"),
    ("AKIAIOSFODNN7EXAMPLE", REDACTED),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", REDACTED),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----", REDACTED),
    (f"https://hub.example/api?token={PASSWORD}&page=2", f"https://hub.example/api?token={REDACTED}&page=2"),
    (f"Server=db;User Id=bob;Password={PASSWORD};", f"Server=db;User Id=bob;Password={REDACTED};"),
    (
        f"train.py --hub_token {PASSWORD} --lr 0.1 --password={PASSWORD}",
        f"train.py --hub_token {REDACTED} --lr 0.1 --password={REDACTED}",
    ),
    (f"Settings(api_key='{PASSWORD}', project='p')", f"Settings(api_key='{REDACTED}', project='p')"),
    (
        f'{{"password": "{PASSWORD}", "api_keys": ["a", "b"], "lr": 0.1}}',
        f'{{"password": "{REDACTED}", "api_keys": "{REDACTED}", "lr": 0.1}}',
    ),
]


@pytest.mark.parametrize("text, expected", IN_VALUES, ids=[e for _, e in IN_VALUES])
def test_credentials_inside_values_are_replaced(text, expected):
    assert redact_text(text) == expected
    assert flatten_config({"anything": text})["anything"] == expected


NOT_CREDENTIALS = [
    "ssh://git@github.com/org/repo.git",  # a user without a password
    "http://localhost:8080/path@v2",
    "Basic training, then bearer of good news: Bearer authentication",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "<|endoftext|>",
    "/home/me/checkpoints/step-100",
    "9fceb02d0ae598e95dc970b74767f19372d61af8",
    "sk-learn",
    "max_tokens=512",
    "pad_token=<pad>",
    "--max_new_tokens 64",
    '{"pad_token": "<pad>", "eos_token_id": 2}',
]


@pytest.mark.parametrize("text", NOT_CREDENTIALS)
def test_ordinary_values_are_kept(text):
    assert redact_text(text) == text


def test_lists_of_dicts_and_objects_are_redacted_inside():
    @dataclasses.dataclass
    class Remote:
        url: str
        password: str
        port: int = 22

    flat = flatten_config(
        {
            "servers": [{"host": "a", "password": PASSWORD}],
            "remote": Remote("sftp://x", PASSWORD),
            "urls": (f"https://u:{PASSWORD}@h",),
        }
    )
    assert PASSWORD not in repr(flat)
    assert flat["servers"] == f"[{{'host': 'a', 'password': '{REDACTED}'}}]"
    # a dataclass is flattened like a dict (as Lightning's loggers do), its secret field redacted
    assert (flat["remote/url"], flat["remote/password"], flat["remote/port"]) == ("sftp://x", REDACTED, 22)
    assert flat["urls"] == f"['https://u:{REDACTED}@h']"


def test_redact_keeps_the_structure_of_backend_options():
    options = {
        "wandb": {
            "project": "p",
            "settings": {"api_key": HF, "base_url": f"https://bob:{PASSWORD}@wandb.internal"},
            "tags": ["a", OPENAI],
        },
        "mlflow": {
            "tracking_uri": f"http://bob:{PASSWORD}@mlflow:5000",
            "http_max_retries": 3,
            "headers": {"Authorization": f"Bearer {HF}"},
        },
        "comet_ml": {"api_key": b"bytes-secret", "online": False, "workspace": None},
    }
    assert redact(options) == {
        "wandb": {
            "project": "p",
            "settings": {"api_key": REDACTED, "base_url": f"https://bob:{REDACTED}@wandb.internal"},
            "tags": ["a", REDACTED],
        },
        "mlflow": {
            "tracking_uri": f"http://bob:{REDACTED}@mlflow:5000",
            "http_max_retries": 3,
            "headers": {"Authorization": REDACTED},
        },
        "comet_ml": {"api_key": REDACTED, "online": False, "workspace": None},
    }
    assert options["wandb"]["settings"]["api_key"] == HF  # a copy: the original still carries the secret to the sink
    json.dumps(redact(options))


# -- end to end: nothing under the run directory holds a secret -----------------------------------
CONFIG = {
    "api-key": PASSWORD + "-a",
    "apiKey": PASSWORD + "-b",
    "api_keys": [PASSWORD + "-c", PASSWORD + "-d"],
    "private_key": PASSWORD + "-e",
    "passphrase": PASSWORD + "-f",
    "hub_token": (PASSWORD + "-g").encode(),
    "headers": {"Authorization": f"Bearer {PASSWORD}-h"},
    "database": f"postgresql://trainer:{PASSWORD}-i@db:5432/runs",
    "credentials": {"user": "bob", "key": PASSWORD + "-j"},
    "pin_password": 918273645,
    "notes": f"pushed with {HF}",
    "client_secret": PASSWORD + "-k",
    "pad_token": "<|endoftext|>",
    "eos_token": "</s>",
    "max_new_tokens": 64,
    "include_num_input_tokens_seen": "no",
    "tokenizer_name": "Qwen/Qwen2.5-0.5B",
    "learning_rate": 1e-6,
}
SECRETS = [PASSWORD, HF, "918273645", base64.b64encode(PASSWORD.encode()).decode()]
KEPT = {
    "pad_token": "<|endoftext|>",
    "eos_token": "</s>",
    "max_new_tokens": 64,
    "include_num_input_tokens_seen": "no",
    "tokenizer_name": "Qwen/Qwen2.5-0.5B",
    "learning_rate": 1e-6,
    "database": f"postgresql://trainer:{REDACTED}@db:5432/runs",
    "notes": f"pushed with {REDACTED}",
    "credentials": REDACTED,
    "headers/Authorization": REDACTED,
}


def test_no_secret_reaches_any_file_of_the_run(tmp_path):
    run_dir = tmp_path / "run"
    run = rllog.init(report_to="parquet", run_dir=run_dir, config=CONFIG, health=False)
    for step in range(3):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run.log_table("completions", {"prompt": ["2+2="], "completion": ["4"]}, step=2)
    assert run.finish().ok

    stored = json.loads((run_dir / "parquet" / "meta.json").read_text())["config"]
    assert {k: stored[k] for k in KEPT} == KEPT  # what is no secret is kept as it was
    assert {k for k, v in stored.items() if v == REDACTED} >= {
        "api-key",
        "apiKey",
        "api_keys",
        "private_key",
        "passphrase",
        "hub_token",
        "headers/Authorization",
        "credentials",
        "pin_password",
        "client_secret",
    }
    assert rllog.read_metrics(run_dir).num_rows == 3 and rllog.read_table(run_dir, "completions").num_rows == 1
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(journal.journal_dir(run_dir) in p.parents for p in files), "the journal's segments are among the files read"
    for path in files:
        data = path.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret!r} reached {path.relative_to(run_dir)}"


def test_backend_options_reach_the_agent_while_run_json_holds_a_redacted_copy(tmp_path):
    """A secret in an option (here a token-shaped part of the parquet directory) is used by the sink in the
    delivery agent process, and appears in no file of the run directory."""
    elsewhere = tmp_path / f"parquet-{HF}"
    run_dir = tmp_path / "run"
    run = rllog.init(
        report_to="parquet", run_dir=run_dir, health=False, backend_options={"parquet": {"directory": str(elsewhere)}}
    )
    run.log({"loss": 0.5}, step=1)
    assert run.finish().ok
    assert (elsewhere / "metrics").is_dir()  # the agent built the sink from the real option
    stored = json.loads((run_dir / "run.json").read_text())
    assert stored["sinks"][0]["options"] == {"directory": str(tmp_path / f"parquet-{REDACTED}")}
    for path in (p for p in run_dir.rglob("*") if p.is_file()):
        assert HF.encode() not in path.read_bytes(), f"the option's secret reached {path.relative_to(run_dir)}"


ARGV_CHILD = r"""
import sys, rllog
with rllog.init(report_to="parquet", run_dir=sys.argv[1], config={"openai": {"api_key": "NESTEDKEYVALUE123"}}) as run:
    run.log({"x": 1.0}, step=0)
"""


def test_credentials_on_the_command_line_never_reach_disk(tmp_path):
    """The trainer's arguments went to run.json as given (``--hub_token VALUE`` is two arguments, which the text rule
    sees apart)."""
    import subprocess
    import sys

    run_dir = tmp_path / "r"
    secrets = ["abcdEFGH1234secret", "zzTOPSECRET99", "pw0rdXYZ", "NESTEDKEYVALUE123"]
    argv = [str(run_dir), "--hub_token", secrets[0], f"--api-key={secrets[1]}", "--password", secrets[2], "--lr", "0.1"]
    subprocess.run([sys.executable, "-c", ARGV_CHILD, *argv], check=True, timeout=120)
    stored = json.loads((run_dir / "run.json").read_text())
    assert stored["args"][1:] == ["--hub_token", REDACTED, f"--api-key={REDACTED}", "--password", REDACTED, "--lr", "0.1"]
    assert stored["config"]["openai/api_key"] == REDACTED
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets), path
