"""`jetrl compare`: real TensorBoard run dirs (one truncated), table values, JSON/CSV, PNG plots."""

from __future__ import annotations

import csv
import json
import math
import statistics
import warnings
from pathlib import Path

import pytest

from nemo_jetrl.cli import main
from nemo_jetrl.runs.logs import RunDataWarning, find_event_files
from nemo_jetrl.runs.report import DEFAULT_METRICS, compare_runs, format_table, resolve_tag
from nemo_jetrl.runs.writer import RunWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        yield


# values exactly representable in float32 (TensorBoard stores simple_value as float32)
A_TMPE = [1.25, 1.5, 1.125, 2.0]  # steps 1..4
A_REWARD = [0.25, 0.5, 0.75, 0.5]
A_ACC = {2: 0.5, 4: 0.75}
B_TMPE = [1.0, 1.0625, 1.03125, 1.0, 1.015625, 1.0]  # steps 1..6
B_REWARD = [0.125, 0.25, 0.5, 0.5, 0.625, 0.75]


def make_runs(root: Path) -> tuple[Path, Path]:
    a, b = root / "run_a", root / "run_b"
    with RunWriter(a, config={"jetrl": {"recipe": "fp8_rollout"}}) as w:
        for s, (t, r) in enumerate(zip(A_TMPE, A_REWARD, strict=True), 1):
            w.log_scalars(
                s,
                {"token_mult_prob_error": t, "gen_kl_error": (t - 1) / 10, "reward": r},
                prefix="train",
            )
            if s in A_ACC:
                w.log_scalars(s, {"accuracy": A_ACC[s]}, prefix="validation")
    with RunWriter(b) as w:  # no config: labelled by the directory name
        for s, (t, r) in enumerate(zip(B_TMPE, B_REWARD, strict=True), 1):
            w.log_scalars(s, {"token_mult_prob_error": t, "reward": r}, prefix="train")
        w.log_scalars(6, {"total_step_time": 3.0}, prefix="timing/train")
        # a step 7 that gets truncated away below
        w.log_scalars(7, {"token_mult_prob_error": 9.0}, prefix="train")
    (ev,) = find_event_files(b)
    ev.write_bytes(ev.read_bytes()[:-5])
    return a, b


def test_cli_table_json_csv_and_plots(tmp_path, capsys):
    a, b = make_runs(tmp_path)
    out = tmp_path / "cmp"
    rc = main(["compare", str(a), str(b), "-o", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    summ = json.loads((out / "summary.json").read_text())
    rows = {(s["label"], s["metric"]): s for s in summ["summaries"]}
    ta = rows[("fp8_rollout", "train/token_mult_prob_error")]
    # run A: last 2.0, mean (1.25+1.5+1.125+2)/4 = 1.46875, median (1.25+1.5)/2 = 1.375, max 2.0
    assert (ta["last"], ta["mean"], ta["median"], ta["max"]) == (2.0, 1.46875, 1.375, 2.0)
    assert (ta["steps"], ta["first_step"], ta["last_step"]) == (4, 1, 4)
    tb = rows[("run_b", "train/token_mult_prob_error")]
    # run B: step 7 (value 9.0) was in the truncated record: 6 steps, max 1.0625
    assert tb["steps"] == 6 and tb["last_step"] == 6 and tb["max"] == 1.0625
    assert tb["mean"] == pytest.approx(statistics.fmean(B_TMPE))
    assert tb["median"] == pytest.approx(statistics.median(B_TMPE))  # (1.0 + 1.015625) / 2
    acc = rows[("fp8_rollout", "validation/accuracy")]
    assert (acc["steps"], acc["last"], acc["mean"]) == (2, 0.75, 0.625)
    gkl_b = rows[("run_b", "train/gen_kl_error")]
    assert gkl_b["tag"] is None and gkl_b["steps"] == 0 and gkl_b["mean"] is None
    w = "\n".join(summ["warnings"])
    assert "truncated or corrupt" in w and "no metric 'train/gen_kl_error'" in w
    assert "different lengths" in w
    # table on stdout: one row per run and metric, values formatted
    assert "fp8_rollout  train/token_mult_prob_error" in cap.out
    assert "1.46875" in cap.out and "1.375" in cap.out and "missing" in cap.out
    assert "warning:" in cap.err and "truncated" in cap.err
    # CSV mirrors JSON
    with (out / "summary.csv").open() as f:
        crow = list(csv.DictReader(f))
    assert len(crow) == 2 * len(DEFAULT_METRICS)  # incl. jetrl/mismatch/*, missing here
    c = next(r for r in crow if r["label"] == "run_b" and r["metric"] == "train/reward")
    assert float(c["last"]) == 0.75 and int(c["steps"]) == 6
    # plots: one PNG per default metric some run has (no run has jetrl/mismatch/*), decodable
    from matplotlib.image import imread

    names = sorted(p.name for p in out.glob("*.png"))
    assert names == [
        "train_gen_kl_error.png",
        "train_reward.png",
        "train_token_mult_prob_error.png",
        "validation_accuracy.png",
    ]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == PNG_MAGIC
        img = imread(p)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
        assert img[..., :3].std() > 0.01  # not blank


def test_plot_has_one_labelled_line_per_run(tmp_path, monkeypatch):
    a, b = make_runs(tmp_path)
    res = compare_runs([a, b], tmp_path / "o", metrics=["reward"], formats=("json",))
    assert [p.name for p in res.plots] == ["train_reward.png"]
    assert [f.name for f in res.files] == ["summary.json"]
    # draw the same plot again, recording the lines of the figure as it is saved
    from matplotlib.figure import Figure

    from nemo_jetrl.runs.report import plot_metric

    lines = {}
    orig = Figure.savefig

    def recording_savefig(self, *args, **kwargs):
        ax = self.axes[0]
        assert ax.get_title() == "train/reward" and ax.get_xlabel() == "step"
        for line in ax.get_lines():
            lines[line.get_label()] = (list(line.get_xdata()), list(line.get_ydata()))
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    plot_metric(res.runs, "reward", tmp_path / "x.png")
    assert lines == {
        "fp8_rollout": ([1, 2, 3, 4], A_REWARD),
        "run_b": ([1, 2, 3, 4, 5, 6], B_REWARD),
    }


def test_metric_names_aliases_and_comma_list(tmp_path, capsys):
    a, _ = make_runs(tmp_path)
    rc = main(
        [
            "compare",
            str(a),
            "-o",
            str(tmp_path / "o"),
            "--metric",
            "reward,accuracy",
            "--format",
            "csv",
            "--no-plots",
        ]
    )
    assert rc == 0
    with (tmp_path / "o" / "summary.csv").open() as f:
        tags = [r["tag"] for r in csv.DictReader(f)]
    assert tags == ["train/reward", "validation/accuracy"]
    assert not list((tmp_path / "o").glob("*.png"))
    tags_a = ["train/reward", "timing/train/total_step_time", "jetrl/mismatch/chi2_token"]
    assert resolve_tag("total_step_time", tags_a) == "timing/train/total_step_time"
    assert resolve_tag("chi2_token", tags_a) == "jetrl/mismatch/chi2_token"
    assert resolve_tag("nope", tags_a) is None


def test_user_errors_exit_2_without_traceback(tmp_path, capsys):
    a, _ = make_runs(tmp_path)
    assert main(["compare", str(a), str(tmp_path / "missing_run")]) == 2
    err = capsys.readouterr().err
    assert "run directory not found" in err and "missing_run" in err and "Traceback" not in err
    assert main(["compare", str(a), "-o", str(tmp_path / "o"), "--metric", "no_such_metric"]) == 2
    err = capsys.readouterr().err
    # nothing close to it: the tags the runs do have are listed
    assert "no run has metric 'no_such_metric'" in err and "train/reward" in err
    assert not (tmp_path / "o" / "summary.json").exists()


def test_short_aliases_of_the_readme_and_progress_bar(tmp_path, capsys):
    a, _ = make_runs(tmp_path)
    assert resolve_tag("tmpe", ["train/token_mult_prob_error"]) == "train/token_mult_prob_error"
    assert resolve_tag("gen_kl", ["train/gen_kl_error"]) == "train/gen_kl_error"
    out = tmp_path / "o"
    rc = main(["compare", str(a), "-o", str(out), "--metric", "tmpe,gen_kl,accuracy",
               "--no-plots"])  # fmt: skip
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    summ = json.loads((out / "summary.json").read_text())["summaries"]
    assert [(s["metric"], s["tag"], s["last"]) for s in summ] == [
        ("tmpe", "train/token_mult_prob_error", 2.0),
        ("gen_kl", "train/gen_kl_error", pytest.approx(0.1)),  # (2 - 1) / 10 as float32
        ("accuracy", "validation/accuracy", 0.75),
    ]
    assert "missing" not in cap.out and "no metric" not in cap.err


def test_a_metric_no_run_has_is_exit_2_naming_it_and_close_tags(tmp_path, capsys):
    """`--metric tmep,accuracy`: a typo, not a row of dashes and exit 0; nothing is written."""
    a, b = make_runs(tmp_path)
    out = tmp_path / "o"
    rc = main(["compare", str(a), str(b), "-o", str(out), "--metric", "tmep,accuracy,gen_kl_eror"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and "Traceback" not in cap.err
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jetrl compare: error: "), cap.err
    assert "no run has metric 'tmep' (close: train/token_mult_prob_error)" in err[0]
    assert "'gen_kl_eror' (close: train/gen_kl_error)" in err[0]
    assert "accuracy" not in err[0].split("(close")[0]  # found: not named
    assert not list(out.glob("*"))  # checked before any summary or plot is written


def test_a_metric_missing_in_some_runs_only_is_a_row(tmp_path, capsys):
    a, b = make_runs(tmp_path)  # only run_a logs gen_kl_error
    out = tmp_path / "o"
    rc = main(["compare", str(a), str(b), "-o", str(out), "--metric", "gen_kl", "--no-plots"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    summ = json.loads((out / "summary.json").read_text())["summaries"]
    assert [(s["label"], s["tag"]) for s in summ] == [
        ("fp8_rollout", "train/gen_kl_error"),
        ("run_b", None),
    ]
    assert "missing" in cap.out and "run_b: no metric 'gen_kl'" in cap.err


def test_not_a_run_directory_is_said_first_without_a_flood(tmp_path, capsys):
    a, _ = make_runs(tmp_path)
    notrun = tmp_path / "notrun"
    (notrun / "sub" / "deeper").mkdir(parents=True)
    (notrun / "sub" / "notes.txt").write_text("not a run\n")
    (notrun / "events.txt").write_text("not an events file either\n")
    out = tmp_path / "o"
    for dirs in ([notrun], [a, notrun]):
        rc = main(["compare", *map(str, dirs), "-o", str(out)])
        cap = capsys.readouterr()
        assert rc == 2 and cap.out == ""
        assert cap.err.splitlines() == [
            f"jetrl compare: error: not a run directory: {notrun} (no TensorBoard events or "
            "train_data_step*.jsonl under it)"
        ]
        assert not out.exists()  # refused before -o is created


def test_jsonl_only_in_a_subdirectory_points_at_it(tmp_path, capsys):
    with RunWriter(tmp_path / "parent" / "run") as w:  # TensorBoard off: train data only
        w.log_train_data(1, [{"rewards": 1.0}])
    for ev in find_event_files(tmp_path / "parent"):
        ev.unlink()
    assert main(["compare", str(tmp_path / "parent"), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"not a run directory: {tmp_path / 'parent'} (no TensorBoard events under it" in err
    assert f"train_data_step*.jsonl only in {tmp_path / 'parent' / 'run'}" in err


def test_runs_without_any_default_metric_exit_2_with_read_warnings_only(tmp_path, capsys):
    with RunWriter(tmp_path / "r") as w:
        w.log_scalars(1, {"total_step_time": 3.0}, prefix="timing/train")
    assert main(["compare", str(tmp_path / "r"), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "none of the default metrics" in err and "timing/train/total_step_time" in err
    assert "no metric" not in err and "no plot" not in err  # not one warning per metric
    assert not (tmp_path / "o" / "summary.json").exists()


def test_duplicate_labels_are_disambiguated(tmp_path):
    runs = []
    for name in ("x1", "x2"):
        with RunWriter(tmp_path / name, recipe="jetrl") as w:
            w.log_scalars(1, {"reward": 1.0}, prefix="train")
        runs.append(tmp_path / name)
    res = compare_runs(runs, None, metrics=["reward"])
    assert [s.label for s in res.summaries] == ["jetrl (x1)", "jetrl (x2)"]
    assert "jetrl (x1)" in format_table(res.summaries)


def test_compare_recomputes_from_jsonl_when_scalar_missing(tmp_path):
    # a run with only train_data jsonl (e.g. TensorBoard disabled): token_mult_prob_error is
    # recomputed. valid tokens (position 0 ignored): d = ln 2 and 0 -> (2 + 1) / 2 = 1.5
    run = tmp_path / "jsonl_only"
    with RunWriter(run) as w:
        w.log_train_data(
            1,
            [
                {
                    "generation_logprobs": [0.0, -math.log(2), -1.0],
                    "prev_logprobs": [0.0, 0.0, -1.0],
                    "token_loss_mask": [0, 1, 1],
                    "sample_loss_mask": 1,
                    "rewards": 1.0,
                }
            ],
        )
    res = compare_runs([run], None, metrics=["token_mult_prob_error", "reward", "chi2_token"])
    t, r, c = res.summaries
    assert t.last == pytest.approx(1.5, rel=1e-14) and t.source == "jsonl"
    assert r.last == 1.0
    # a jetrl-only metric by its short name: rho = 2 and 1 -> (4 + 1) / 2 - 1 = 1.5
    assert c.tag == "jetrl/mismatch/chi2_token" and c.last == pytest.approx(1.5, rel=1e-14)


def test_a_refused_metric_creates_no_output_dir(tmp_path, capsys):
    """`--metric nope -o new/x`: refused (exit 2) before `new/x` or any parent of it is made."""
    a, _ = make_runs(tmp_path)
    out = tmp_path / "new" / "x"
    assert main(["compare", str(a), "-o", str(out), "--metric", "nope"]) == 2
    assert "no run has metric 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_corrupt_events_file_is_said_unreadable(tmp_path, capsys):
    """An events file of garbage: exit 2 saying it could not be read, not "no events found"."""
    run = tmp_path / "garbage"
    run.mkdir()
    (run / "events.out.tfevents.123").write_bytes(b"not events")
    assert main(["compare", str(run), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{run}: its TensorBoard events could not be read" in err
    assert f"{run / 'events.out.tfevents.123'}: truncated or corrupt events file" in err
    assert "no TensorBoard events" not in err and "none of the default metrics" not in err
    assert not (tmp_path / "o").exists()
