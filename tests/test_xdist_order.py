"""The order pytest-xdist hands test files to its workers (tests/conftest.py
`costliest_files_first`): the files marked ``file_cost`` first, costliest first, then by test
count; and the scripts that run xdist keep that order (``--no-loadscope-reorder``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import costliest_files_first

REPO = Path(__file__).resolve().parents[1]


@dataclass
class _Item:
    """A collected test as the hook reads it: its node id and its markers."""

    nodeid: str
    marks: list[pytest.MarkDecorator] = field(default_factory=list)

    def iter_markers(self, name: str):
        return (m.mark for m in self.marks if m.mark.name == name)


def _file(name: str, n: int, cost: float | None = None) -> list[_Item]:
    marks = [pytest.mark.file_cost(cost)] if cost is not None else []
    return [_Item(f"tests/{name}.py::t{i}", marks) for i in range(n)]


def test_costly_files_go_first_then_the_rest_by_count_each_files_tests_in_order() -> None:
    items = [
        *_file("few", 2),
        *_file("demo", 1, cost=416),
        *_file("many", 5),
        *_file("census", 3, cost=147),
        *_file("some", 3),
    ]
    costliest_files_first(items)
    ids = [i.nodeid for i in items]
    order = list(dict.fromkeys(n.split("::")[0] for n in ids))
    assert order == [
        "tests/demo.py", "tests/census.py", "tests/many.py", "tests/some.py", "tests/few.py",
    ]  # fmt: skip
    assert ids[-2:] == ["tests/few.py::t0", "tests/few.py::t1"]


def test_the_marked_files_exist_and_every_xdist_run_of_the_scripts_keeps_the_order() -> None:
    marked = [
        p for p in (REPO / "tests").rglob("test_*.py") if "pytest.mark.file_cost(" in p.read_text()
    ]
    assert len(marked) >= 3, marked  # the demo's claims, the census, the GPU session
    for script in ("scripts/test.sh", "scripts/test_vllm.sh"):
        text = (REPO / script).read_text()
        runs = re.findall(r"-n \"\$workers\" --dist loadfile[^\n]*", text)  # not the comments
        assert runs, script
        assert all("--no-loadscope-reorder" in r for r in runs), (script, runs)
