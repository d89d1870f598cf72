"""Every path a NeMo-RL run's config names, made absolute before any Ray actor starts.

NeMo-RL opens its paths relative to the current directory (its examples run from its checkout):
``data.default.prompt_file: examples/prompts/cot.txt`` in its ``grpo_math_1B.yaml`` is found
only from NeMo-RL's own tree. ``jetrl train`` runs from anywhere (the user's checkout under
SLURM, ``/opt/nemo-jetrl`` in the image), and checkpoints are written by workers on other nodes
whose working directory is not the driver's. So the launch resolves, once, in the driver:

- input files (prompt / system-prompt files, local dataset files): a path our config names is
  looked up in the working directory first, then in NeMo-RL's tree; a path that only NeMo-RL's
  defaults name, in NeMo-RL's tree first. Missing everywhere: a UserError naming the YAML key;
- a ``.jinja`` chat template (``policy.tokenizer.chat_template``): as an input file;
- a model / tokenizer directory relative to the working directory: made absolute (a name that
  is no directory there is a HuggingFace hub name and stays);
- output directories (``logger.log_dir``, ``checkpointing.checkpoint_dir``): absolute against the
  working directory (an existing file there is refused by key).

A ``data_path`` without a local-file suffix that exists nowhere is a HuggingFace dataset name and
is left as it is (NeMo-RL's ``load_dataset_from_path`` reads it from the hub).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

# NeMo-RL's load_dataset_from_path: these suffixes are read as local files, never from the hub.
LOCAL_DATA_SUFFIXES = (".arrow", ".csv", ".json", ".jsonl", ".parquet", ".txt")
INPUT_FILE_KEYS = ("prompt_file", "system_prompt_file")
OUTPUT_DIR_KEYS = ("logger.log_dir", "checkpointing.checkpoint_dir")
# A local model/tokenizer directory given relative to the launch directory (else a hub name).
MODEL_KEYS = ("policy.model_name", "policy.tokenizer.name")


class PathProblem(ValueError):
    """A path the config names does not exist (the message names the YAML key)."""


def _select(cfg: Mapping[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _dataset_entries(data: Mapping[str, Any]) -> Iterator[tuple[str, MutableMapping[str, Any]]]:
    """(key prefix, dataset dict) for data.default, data.train and data.validation (dict or list)."""
    for section in ("default", "train", "validation"):
        node = data.get(section)
        if isinstance(node, MutableMapping):
            yield f"data.{section}", node
        elif isinstance(node, list):
            for i, item in enumerate(node):
                if isinstance(item, MutableMapping):
                    yield f"data.{section}.{i}", item


def _find(value: str, bases: list[Path]) -> Path | None:
    p = Path(value).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for base in bases:
        if (base / p).exists():
            return (base / p).resolve()
    return None


def resolve_config_paths(
    merged: MutableMapping[str, Any],
    ours: Mapping[str, Any],
    nemo_rl_dir: Path,
    cwd: Path | None = None,
) -> list[str]:
    """Make every path in ``merged`` (NeMo-RL's defaults + our config) absolute, in place.

    ``ours`` is our config before the merge: it tells which paths the user named. Returns one
    line per changed path (for the log). Raises PathProblem naming the key of a missing input.
    """
    cwd = (cwd or Path.cwd()).resolve()
    changed: list[str] = []
    problems: list[str] = []

    def bases(key: str) -> list[Path]:
        return [cwd, nemo_rl_dir] if _select(ours, key) is not None else [nemo_rl_dir, cwd]

    def set_path(node: MutableMapping[str, Any], field: str, key: str, path: Path) -> None:
        if str(path) != str(node[field]):
            changed.append(f"{key}: {node[field]} -> {path}")
        node[field] = str(path)

    data = merged.get("data")
    if isinstance(data, Mapping):
        for prefix, node in _dataset_entries(data):
            for field in (*INPUT_FILE_KEYS, "data_path"):
                value = node.get(field)
                if not isinstance(value, str) or not value:
                    continue
                key = f"{prefix}.{field}"
                found = _find(value, bases(key))
                if found is not None:
                    set_path(node, field, key, found)
                elif field != "data_path" or value.endswith(LOCAL_DATA_SUFFIXES):
                    where = (
                        " or ".join(str(b) for b in bases(key))
                        if not Path(value).is_absolute()
                        else "/"
                    )
                    problems.append(
                        f"{key}: {value!r} does not exist (looked in {where}); "
                        "give an absolute path or one relative to the launch directory"
                    )
    tokenizer = _select(merged, "policy.tokenizer")
    template = tokenizer.get("chat_template") if isinstance(tokenizer, Mapping) else None
    if isinstance(template, str) and template.endswith(".jinja"):  # NeMo-RL reads it as a file
        key = "policy.tokenizer.chat_template"
        found = _find(template, bases(key))
        if found is None:
            problems.append(f"{key}: {template!r} does not exist")
        else:
            set_path(tokenizer, "chat_template", key, found)  # type: ignore[arg-type]
    for key in MODEL_KEYS:
        parent, field = key.rsplit(".", 1)
        node = _select(merged, parent)
        value = node.get(field) if isinstance(node, MutableMapping) else None
        relative = isinstance(value, str) and value and not Path(value).is_absolute()
        if relative and (cwd / value).is_dir():
            set_path(node, field, key, (cwd / value).resolve())  # type: ignore[arg-type]
    for key in OUTPUT_DIR_KEYS:
        section, field = key.split(".")
        node = merged.get(section)
        if not isinstance(node, MutableMapping) or not isinstance(node.get(field), str):
            continue
        path = (cwd / Path(node[field]).expanduser()).resolve()
        if path.exists() and not path.is_dir():
            problems.append(f"{key}: {path} exists and is not a directory")
            continue
        set_path(node, field, key, path)
    if problems:
        raise PathProblem("paths in the config do not exist:\n  " + "\n  ".join(problems))
    return changed
