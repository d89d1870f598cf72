"""`jetrl train CFG --device gpu`: the error names the flag the user typed, not the override
``--device`` becomes inside (``++jetrl.local.device=gpu``, which nobody typed)."""

from __future__ import annotations

from local_configs import EXAMPLES

from nemo_jetrl.cli import main


def test_a_bad_device_flag_is_blamed_on_the_flag(tmp_path, capsys):
    log_dir = tmp_path / "run"
    argv = ["train", str(EXAMPLES / "jetrl.yaml"), f"logger.log_dir={log_dir}",
            "policy.generation.temperature=-1", "--device", "gpu", "--backend", "local",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "  - jetrl.local.device: got 'gpu'; expected cpu, cuda or cuda:N" in err, err
    assert "(N a GPU index) (set by --device gpu)\n" in err, err
    assert "++jetrl.local.device" not in err, err
    # the override the user did type is still named as one, in the same message
    assert "(set by override 'policy.generation.temperature=-1')" in err, err
    assert not log_dir.exists()  # before any work


def test_a_bad_device_flag_is_named_when_the_config_file_is_missing(tmp_path, capsys):
    """The validator never reaches ``jetrl.local.device`` without a file: the flag is named
    beside the missing file, once (review, session 43)."""
    missing = tmp_path / "nope.yaml"
    argv = ["train", str(missing), "--device", "gpu", "--backend", "local", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "config file not found" in err and str(missing) in err, err
    assert "--device 'gpu': expected cpu, cuda or cuda:N" in err, err
    assert err.count("'gpu'") == 1, err
    # control: where the validator reaches the key, the flag is still named once
    argv = ["train", str(EXAMPLES / "jetrl.yaml"), f"logger.log_dir={tmp_path / 'run'}",
            "--device", "gpu", "--backend", "local", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("'gpu'") == 1 and "(set by --device gpu)" in err, err
