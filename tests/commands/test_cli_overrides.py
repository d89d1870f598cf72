"""`jetrl train CFG --backend nemo-rl k=v`: overrides after an option (argparse before Python
3.12.7 / 3.13.1 leaves them "unrecognized"), and `jetrl --version` with the build's commit."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_jetrl import build_info
from nemo_jetrl.cli import build_parser, main, parse

REPO = Path(__file__).resolve().parents[2]
FAILING = ["train", "c.yaml", "--backend", "nemo-rl", "k=v", "a.b=2"]


def test_overrides_after_an_option_reach_the_train_command():
    args = parse(build_parser(), FAILING)
    assert args.command == "train" and args.config == "c.yaml"
    assert args.backend == "nemo-rl" and args.overrides == ["k=v", "a.b=2"]
    # Interleaved: order kept, every override kept.
    args = parse(build_parser(), ["train", "c.yaml", "x=1", "--resume", "y=2", "+z=3", "~w"])
    assert args.overrides == ["x=1", "y=2", "+z=3", "~w"] and args.resume


def test_unknown_options_and_stray_words_are_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse(build_parser(), [*FAILING, "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: " in capsys.readouterr().err
    # `check` has no overrides positional after its options: a stray word stays an error.
    with pytest.raises(SystemExit) as e:
        parse(build_parser(), ["compare", "--bogus-flag"])
    assert e.value.code == 2


def test_an_unknown_option_shows_the_subcommands_usage_and_names_it(capsys):
    """`jetrl train CFG --steps 3`: train's usage and error, naming --steps, not `jetrl`'s."""
    for argv in (["train", "c.yaml", "--steps", "3"], ["train", "c.yaml", "k=v", "--bogus"]):
        with pytest.raises(SystemExit) as e:
            parse(build_parser(), argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("usage: jetrl train "), err
        flag = " ".join(argv[2:]).removeprefix("k=v ")
        assert f"jetrl train: error: unrecognized arguments: {flag} (set a config key" in err
        assert "COMMAND" not in err
    with pytest.raises(SystemExit):  # no subcommand: the top level's
        parse(build_parser(), ["--bogus"])
    assert "jetrl: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_typo_of_a_real_option_names_that_option_not_overrides(capsys):
    """`jetrl check CFG --jsn`: did you mean --json (review, session 43: the KEY=VALUE hint was
    given for any unknown option); a config key typed as an option keeps that hint."""
    with pytest.raises(SystemExit) as e:
        parse(build_parser(), ["check", "c.yaml", "--jsn"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "(did you mean: --jsn -> --json?)" in err, err
    assert "KEY=VALUE" not in err, err
    with pytest.raises(SystemExit):
        parse(build_parser(), ["check", "c.yaml", "--grpo.seed=3"])
    err = capsys.readouterr().err
    assert "(set a config key as a KEY=VALUE override" in err and "did you mean" not in err, err


@pytest.mark.parametrize("command", ["align", "check", "rehearse", "train"])
def test_overrides_are_optional_in_every_command_that_takes_them(capsys, command):
    """`jetrl check` alone names the config as required, not the optional overrides."""
    with pytest.raises(SystemExit) as e:
        parse(build_parser(), [command])
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert e.value.code == 2 and "the following arguments are required: " in line, err
    required = line.split("required: ")[1].split(", ")
    assert required[0] in ("config", "CONFIG") and "overrides" not in required, line
    assert "KEY=VALUE" not in required, line
    argv = [command, "c.yaml"] + (["-o", "x.yaml"] if command == "align" else [])
    assert parse(build_parser(), argv).overrides == []


def test_train_with_overrides_after_backend_runs_the_backend(monkeypatch):
    """The whole CLI: the failing pattern reaches the nemo-rl backend with both overrides."""
    from nemo_jetrl.backends.nemo_rl import launch

    seen = {}

    def fake_run(cfg, overrides):  # stands in for the NeMo-RL launch (needs GPUs)
        seen.update(cfg=cfg, overrides=list(overrides))
        return 0

    monkeypatch.setattr(launch, "run_nemo_rl", fake_run)
    assert main(FAILING) == 0
    assert seen == {"cfg": "c.yaml", "overrides": ["k=v", "a.b=2"]}


# The same parser shape on other interpreters (the image's and a login node's Python): plain
# parse_args fails there on the pattern; ours does not. Runs on every interpreter found.
_PROBE = """
import argparse, sys
sys.path.insert(0, sys.argv[1])
from nemo_jetrl.cli import parse
p = argparse.ArgumentParser(prog="jetrl")
sub = p.add_subparsers(dest="command")
t = sub.add_parser("train")
t.add_argument("config"); t.add_argument("overrides", nargs="*", default=[])
t.add_argument("--backend")
argv = ["train", "c.yaml", "--backend", "nemo-rl", "k=v"]
try:
    plain = p.parse_known_args(argv)[1] == []
except SystemExit:
    plain = False
print("plain", plain, "ours", parse(p, argv).overrides)
"""


def _interpreters() -> list[str]:
    found = {sys.executable}
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for v in ("3.10", "3.11", "3.12", "3.13"):
        found.update(glob.glob(f"{root}/versions/{v}.*/bin/python{v}"))
    return sorted(found)


@pytest.mark.parametrize("python", _interpreters())
def test_pattern_on_each_interpreter(python):
    out = subprocess.run(
        [python, "-c", _PROBE, str(REPO)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ours ['k=v']"), out.stdout


def test_version_names_the_commit(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(build_info.COMMIT_ENV, "abc1234")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "nemo_jetrl 0.1.0 (commit abc1234)"
    # The image: the COMMIT file the Dockerfile writes from its JETRL_COMMIT build argument.
    monkeypatch.delenv(build_info.COMMIT_ENV)
    (tmp_path / "COMMIT").write_text("deadbeef\n")
    assert build_info.commit({}, source=tmp_path) == "deadbeef"
    assert build_info.commit({"JETRL_DIR": str(tmp_path / "x")}, source=tmp_path / "y") == "unknown"
