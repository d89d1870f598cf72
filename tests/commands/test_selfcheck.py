"""`jetrl selfcheck` does real work: passes on the golden vectors, fails when one byte is off."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_jetrl.cli import main
from nemo_jetrl.commands import selfcheck


def _row(out: str, case: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(case + " "))


def test_selfcheck_passes_on_golden(golden_dir, capsys):
    assert main(["selfcheck", "--golden", str(golden_dir)]) == 0
    out = capsys.readouterr().out
    assert "TE bit-exact: OK; vLLM UE8M0 agreement: OK; vLLM emulation: OK" in out
    assert sum(line.startswith("te.") for line in out.splitlines()) == 18
    # the measured FP32 gap (DESIGN.md's table): case, values, bits_differ, dequantized_differ
    assert _row(out, "vllm.act.fp32")[1:] == ["262144", "75", "73332"]
    assert _row(out, "vllm.weight.fp32")[1:] == ["786432", "318", "183555"]


def _mini_golden(golden_dir, tmp_path, flip: bool):
    """A one-case copy of the golden set (fast), optionally with one FP8 byte flipped."""
    te = load_file(str(golden_dir / "te_golden_seed0.safetensors"))
    vl = load_file(str(golden_dir / "vllm_golden_seed0.safetensors"))
    te_meta = json.loads((golden_dir / "te_golden_seed0.json").read_text())
    vl_meta = json.loads((golden_dir / "vllm_golden_seed0.json").read_text())
    case, vcase = "te.weight_ragged.fp32", "vllm.weight_ragged.ue8m0"
    te_meta["cases"] = {case: te_meta["cases"][case]}
    mini = {k: te[k] for k in ("input.weight_ragged", f"{case}.q", f"{case}.scale_inv")}
    if flip:
        mini[f"{case}.q"][5, 7] ^= 1
    save_file(mini, str(tmp_path / "te_golden_seed0.safetensors"))
    save_file({k: vl[k] for k in (f"{vcase}.q", f"{vcase}.scale")},
              str(tmp_path / "vllm_golden_seed0.safetensors"))  # fmt: skip
    (tmp_path / "te_golden_seed0.json").write_text(json.dumps(te_meta))
    (tmp_path / "vllm_golden_seed0.json").write_text(json.dumps({vcase: vl_meta[vcase]}))
    return tmp_path


def test_selfcheck_fails_on_a_flipped_bit(golden_dir, tmp_path, capsys):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    _mini_golden(golden_dir, good, flip=False)
    assert main(["selfcheck", "--golden", str(good)]) == 0
    _mini_golden(golden_dir, bad, flip=True)
    capsys.readouterr()
    assert main(["selfcheck", "--golden", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "TE bit-exact: FAIL" in out
    assert _row(out, "te.weight_ragged.fp32")[2] == "1"


def test_selfcheck_missing_dir_is_a_user_error(tmp_path, capsys):
    assert main(["selfcheck", "--golden", str(tmp_path / "nope")]) == 2
    assert "--golden DIR" in capsys.readouterr().err


def _damage(golden_dir, tmp_path, name: str, data: bytes | None):
    """The mini golden set with file ``name`` truncated to half (``data`` None) or replaced."""
    d = _mini_golden(golden_dir, tmp_path, flip=False)
    f = d / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2] if data is None else data)
    return f


@pytest.mark.parametrize(
    "name, data, said",
    [
        ("te_golden_seed0.safetensors", None, "cannot be read as safetensors"),
        ("vllm_golden_seed0.safetensors", b"", "cannot be read as safetensors"),
        ("te_golden_seed0.json", b"{}", "holds no cases (expected a non-empty 'cases' mapping"),
        ("te_golden_seed0.json", None, "cannot be read as JSON"),
        ("vllm_golden_seed0.json", b"[]", "holds no cases (expected a non-empty mapping"),
        ("vllm_golden_seed0.json", b'{"vllm.x": {"input": "weight_ragged"}}',
         "case 'vllm.x' lacks ue8m0, source"),
    ],
)  # fmt: skip
def test_a_damaged_golden_file_is_a_user_error_naming_it(golden_dir, tmp_path, capsys, name,
                                                         data, said):  # fmt: skip
    """Exit 2 (not 1, which says "not bit-exact") naming the file and what is wrong with it."""
    f = _damage(golden_dir, tmp_path, name, data)
    assert main(["selfcheck", "--golden", str(tmp_path)]) == 2
    cap = capsys.readouterr()
    assert f"golden file {f}: {said}" in cap.err and "Traceback" not in cap.err, cap.err
    assert "bit-exact" not in cap.out


def test_a_tensor_the_cases_name_but_the_file_lacks_is_named(golden_dir, tmp_path, capsys):
    d = _mini_golden(golden_dir, tmp_path, flip=False)
    te = load_file(str(d / "te_golden_seed0.safetensors"))
    del te["te.weight_ragged.fp32.scale_inv"]
    save_file(te, str(d / "te_golden_seed0.safetensors"))
    assert main(["selfcheck", "--golden", str(d)]) == 2
    err = capsys.readouterr().err
    assert "has no tensor 'te.weight_ragged.fp32.scale_inv', which its JSON's cases name" in err


def _damaged_copy(golden_dir, tmp_path, te_edits=None, vl_edits=None):
    """The full golden set copied to ``tmp_path``, each ``*_edits`` key's tensor replaced by
    ``fn(tensor)`` (the JSON files unchanged)."""
    for name, edits in (("te_golden_seed0", te_edits), ("vllm_golden_seed0", vl_edits)):
        held = load_file(str(golden_dir / f"{name}.safetensors"))
        for key, fn in (edits or {}).items():
            held[key] = fn(held[key].clone())
        save_file(held, str(tmp_path / f"{name}.safetensors"))
        shutil.copy(golden_dir / f"{name}.json", tmp_path / f"{name}.json")
    return tmp_path


def _nan_at(t, *idx):
    t[idx] = float("nan")
    return t


def _no_quantizing(monkeypatch):
    """Damaged data must be refused before any quantization work."""

    def refuse(*a, **k):
        raise AssertionError("quantized damaged golden data")

    monkeypatch.setattr(selfcheck, "_te_rows", refuse)
    monkeypatch.setattr(selfcheck, "_vllm_rows", refuse)


TE, VL = "te_golden_seed0.safetensors", "vllm_golden_seed0.safetensors"


@pytest.mark.parametrize(
    "file, key, fn, said",
    [
        (TE, "input.act", lambda t: t.flatten(),
         "has shape (262144,); an input must be a non-empty 2-D [M, K] matrix"),
        (TE, "input.weight_ragged", lambda t: _nan_at(t, 3, 5),
         "has 1 non-finite value(s) (first: nan at [3, 5]); an input must be finite"),
        (TE, "input.edge", lambda t: t.to(torch.int32),
         "has dtype torch.int32; an input must be bfloat16, float16 or float32"),
        (TE, "te.act.pow2.colwise.scale_inv", lambda t: t[:, :1].clone(),
         "has shape (1024, 1); case 'te.act.pow2.colwise' (block 128x1, stored transposed, on "
         "'input.act' [256, 1024]) implies (1024, 2)"),
        (TE, "te.weight.fp32.scale_inv", lambda t: _nan_at(t, 1, 2),
         "has 1 non-finite or non-positive value(s) (first: nan at [1, 2])"),
        (TE, "te.edge.fp32.q", lambda t: t.to(torch.int16),
         "has dtype torch.int16; FP8 E4M3 data must be uint8 bits"),
        (VL, "vllm.act.ue8m0.q", lambda t: t[:100].clone(),
         "has shape (100, 1024); case 'vllm.act.ue8m0' (block 1x128, on 'input.act' "
         "[256, 1024]) implies (256, 1024)"),
        (VL, "vllm.weight.fp32.scale", lambda t: t.double(),
         "has dtype torch.float64; scales must be float32"),
    ],
)  # fmt: skip
def test_a_damaged_golden_tensor_is_a_user_error_naming_file_and_key(
    golden_dir, tmp_path, capsys, monkeypatch, file, key, fn, said
):
    """Exit 2 naming the file, the tensor and what is wrong: not a quantizer traceback, not a
    false FAIL (exit 1), and no quantization of the damaged data."""
    edits = {key: fn}
    d = _damaged_copy(golden_dir, tmp_path, *((edits, None) if file == TE else (None, edits)))
    with monkeypatch.context() as m:
        _no_quantizing(m)
        assert main(["selfcheck", "--golden", str(d)]) == 2
    cap = capsys.readouterr()
    assert f"golden file {d / file}: tensor {key!r} {said}" in cap.err, cap.err
    assert "restore it (from shared/golden or git)" in cap.err
    assert "Traceback" not in cap.err and "bit-exact" not in cap.out
    selfcheck.read_golden(golden_dir)  # the real golden files pass the same validation


def test_every_damaged_tensor_is_reported_together(golden_dir, tmp_path, capsys, monkeypatch):
    d = _damaged_copy(
        golden_dir,
        tmp_path,
        te_edits={"input.act": lambda t: t.flatten()},
        vl_edits={"vllm.weight_ragged.ue8m0.scale": lambda t: t[:1].clone()},
    )
    _no_quantizing(monkeypatch)
    assert main(["selfcheck", "--golden", str(d)]) == 2
    err = capsys.readouterr().err
    assert "2 problems in the golden files; restore them (from shared/golden or git):" in err
    assert f"  - golden file {d / TE}: tensor 'input.act' has shape (262144,)" in err
    assert (
        f"  - golden file {d / VL}: tensor 'vllm.weight_ragged.ue8m0.scale' has shape (1, 3); "
        "case 'vllm.weight_ragged.ue8m0' (block 128x128, on 'input.weight_ragged' [200, 320]) "
        "implies (2, 3)"
    ) in err


def test_bad_case_metadata_is_reported_together(golden_dir, tmp_path, capsys, monkeypatch):
    """Every case lacking or mistyping an entry, in both JSON files, in one error."""
    d = _damaged_copy(golden_dir, tmp_path)
    te_meta = json.loads((d / "te_golden_seed0.json").read_text())
    te_meta["cases"]["te.act.pow2"]["block"] = [64, 64]
    del te_meta["cases"]["te.edge.fp32"]["eps"]
    (d / "te_golden_seed0.json").write_text(json.dumps(te_meta))
    vl_meta = json.loads((d / "vllm_golden_seed0.json").read_text())
    vl_meta["vllm.act.ue8m0"]["ue8m0"] = "yes"
    vl_meta["vllm.weight.fp32"]["source"] = "somewhere else"
    (d / "vllm_golden_seed0.json").write_text(json.dumps(vl_meta))
    _no_quantizing(monkeypatch)
    assert main(["selfcheck", "--golden", str(d)]) == 2
    err = capsys.readouterr().err
    te_json, vl_json = d / "te_golden_seed0.json", d / "vllm_golden_seed0.json"
    assert "4 problems in the golden files" in err, err
    for line in (
        f"golden file {te_json}: case 'te.act.pow2' has block [64, 64]; it must be one of "
        "[1, 128], [128, 1], [128, 128]",
        f"golden file {te_json}: case 'te.edge.fp32' lacks eps",
        f"golden file {vl_json}: case 'vllm.act.ue8m0' has ue8m0 'yes'; it must be true or false",
        f"golden file {vl_json}: case 'vllm.weight.fp32' has source 'somewhere else'; it must be "
        "a string naming one of vLLM's QuantFP8 or per_block_cast_to_fp8",
    ):
        assert line in err, (line, err)


def test_fp8_typed_golden_bits_are_read_as_bytes(golden_dir, tmp_path, capsys):
    """FP8 data saved as float8_e4m3fn (the same bits) is accepted, and still bit-exact."""
    d = _mini_golden(golden_dir, tmp_path, flip=False)
    te = load_file(str(d / TE))
    te["te.weight_ragged.fp32.q"] = te["te.weight_ragged.fp32.q"].view(torch.float8_e4m3fn)
    save_file(te, str(d / TE))
    assert main(["selfcheck", "--golden", str(d)]) == 0
    assert "TE bit-exact: OK" in capsys.readouterr().out
