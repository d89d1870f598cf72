"""`jetrl compare` refusals before anything is written: a RUN_DIR that is a file, an ``-o`` that
holds an earlier summary (``--force``) or lies in a compared run, a run nothing could be read from."""

from __future__ import annotations

import warnings

import pytest
from test_compare import make_runs

from nemo_jetrl.cli import main
from nemo_jetrl.runs.logs import RunDataWarning


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        yield


def test_a_file_given_as_run_dir_is_said_to_be_a_file(tmp_path, capsys):
    """`compare runs/A afile`: "afile is a file", not "not found"; said with a missing one."""
    a, _ = make_runs(tmp_path)
    afile, nope, out = tmp_path / "afile", tmp_path / "nope", tmp_path / "o"
    afile.write_text("not a run\n")
    assert main(["compare", str(a), str(afile), str(nope), "-o", str(out)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.splitlines() == [
        f"jetrl compare: error: run directory not found: {nope}; {afile}: is a file, not a run "
        "directory; pass the directory the run logged into (its logger.log_dir)"
    ]
    assert not out.exists() and afile.read_text() == "not a run\n"


def test_an_earlier_summary_in_out_is_refused_unless_force(tmp_path, capsys):
    """A second compare into the same -o: exit 2 naming the files it would replace and
    ``--force`` (as `jetrl align -o`), every file as it was; ``--force`` overwrites them."""
    a, b = make_runs(tmp_path)
    out = tmp_path / "o"
    assert main(["compare", str(a), "-o", str(out), "--no-plots"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["summary.csv", "summary.json"]
    assert main(["compare", str(a), str(b), "-o", str(out), "--no-plots"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.splitlines() == [
        f"jetrl compare: error: -o {out}: {out / 'summary.json'}, {out / 'summary.csv'} exist "
        "(an earlier compare's output); pass --force to overwrite them, or choose another -o"
    ]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # a plot it would write is one too; a file it would not write (csv) is not named
    (out / "train_reward.png").write_bytes(b"old plot")
    assert main(["compare", str(a), "-o", str(out), "--format", "json", "--metric", "reward"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'summary.json'}, {out / 'train_reward.png'} exist" in err
    assert "summary.csv" not in err
    assert main(["compare", str(a), str(b), "-o", str(out), "--no-plots", "--force"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (out / "summary.json").read_bytes() != before["summary.json"]  # both runs now


@pytest.mark.parametrize("force", [False, True])
def test_a_directory_where_a_summary_goes_is_refused_even_with_force(tmp_path, capsys, force):
    """``-o`` holding a directory named as an output file: exit 2 naming it (no traceback
    from writing over it), ``--force`` or not; nothing in it is touched (review, session 43)."""
    a, _ = make_runs(tmp_path)
    out = tmp_path / "o"
    (out / "summary.json").mkdir(parents=True)
    (out / "summary.json" / "mine.txt").write_text("kept")
    argv = ["compare", str(a), "-o", str(out), "--no-plots", *(["--force"] if force else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out / 'summary.json'} is not a file" in err and "Traceback" not in err, err
    assert "an earlier compare's output" not in err, err
    assert (out / "summary.json" / "mine.txt").read_text() == "kept"
    assert not (out / "summary.csv").exists()  # nothing written beside it either


@pytest.mark.parametrize("inside", [False, True])
def test_out_in_a_compared_run_directory_is_refused_naming_it(
    tmp_path, capsys, monkeypatch, inside
):
    """``-o runs/A`` (or ``runs/A/cmp``) while comparing runs/A: its own logs would get our
    summary; refused, exit 2, naming the run directory, with or without --force."""
    a, b = make_runs(tmp_path)
    out = a / "cmp" if inside else a
    listing = sorted(p.relative_to(a) for p in a.rglob("*"))
    assert main(["compare", str(a), str(b), "-o", str(out), "--no-plots", "--force"]) == 2
    cap = capsys.readouterr()
    what = "lies inside" if inside else "is"
    assert cap.out == "" and cap.err.splitlines() == [
        f"jetrl compare: error: -o {out}: {what} the run directory {a} being compared; choose "
        "an -o outside the compared runs"
    ]
    assert sorted(p.relative_to(a) for p in a.rglob("*")) == listing
    # the same directory spelled otherwise (relative, with ..) is the same directory
    monkeypatch.chdir(tmp_path)
    other = f"{b.name}/../{a.name}"
    assert main(["compare", str(a), str(b), "-o", other, "--no-plots"]) == 2
    assert f"-o {other}: is the run directory {a} being compared" in capsys.readouterr().err


def test_a_run_with_no_readable_metric_is_refused_naming_its_files(tmp_path, capsys):
    """A run whose only data file is garbage (no events, a train_data jsonl of junk): exit 2
    naming the run and the file, nothing written; not a run of "missing" rows and exit 0."""
    a, _ = make_runs(tmp_path)
    bad = tmp_path / "B_bad3"
    bad.mkdir()
    junk = bad / "train_data_step1.jsonl"
    junk.write_text("{not json\n")
    out = tmp_path / "o"
    assert main(["compare", str(a), str(bad), "-o", str(out), "--no-plots"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "Traceback" not in cap.err
    (line,) = cap.err.splitlines()
    assert line.startswith(
        f"jetrl compare: error: {bad}: its train_data_step*.jsonl could not be read, so it has "
        f"no metric: {junk}: skipped 1 unreadable line(s)"
    ), line
    assert not out.exists()
    # junk events beside it: both kinds named
    (bad / "events.out.tfevents.123").write_bytes(b"not events")
    assert main(["compare", str(a), str(bad), "-o", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: its TensorBoard events and train_data_step*.jsonl could not be read" in err
    assert f"{bad / 'events.out.tfevents.123'}: truncated or corrupt" in err and str(junk) in err
    assert not out.exists()


def test_a_run_with_some_readable_metrics_is_kept_with_warnings(tmp_path, capsys):
    """A junk train_data jsonl beside a readable one: the metrics recomputed from the readable
    one are compared, exit 0, and the junk file is a warning."""
    from nemo_jetrl.runs.writer import RunWriter

    a, _ = make_runs(tmp_path)
    part = tmp_path / "part"
    with RunWriter(part) as w:
        w.log_train_data(
            1,
            [
                {
                    "generation_logprobs": [0.0, -0.5],
                    "prev_logprobs": [0.0, -0.5],
                    "token_loss_mask": [0, 1],
                    "sample_loss_mask": 1,
                    "rewards": 1.0,
                }
            ],
        )
    (part / "train_data_step2.jsonl").write_text("{not json\n")
    out = tmp_path / "o"
    assert main(["compare", str(a), str(part), "-o", str(out), "--no-plots"]) == 0
    cap = capsys.readouterr()
    assert "skipped 1 unreadable line(s)" in cap.err and (out / "summary.json").is_file()
