"""scripts/mutation_check.py's verdict: the summary line, the JSON of every outcome, and the
exit status (0 all killed or documented equivalent, 1 a survivor, 2 an error, a mutant not run in
CI, or a planted control the harness judged wrongly). The standard library only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def report(outcomes: list[Any], seconds: float, json_out: Path | None) -> int:
    """Print the verdict (`Outcome`s of mutation_check.py) and return the exit status."""
    real = [o for o in outcomes if not o.mutant.planted]
    count = {v: sum(o.verdict == v for o in real) for v in ("KILLED", "EQUIVALENT", "SURVIVED")}
    errors = [o.mutant.name for o in real if o.verdict == "ERROR"]
    not_run = [o.mutant.name for o in real if o.verdict == "NOT RUN"]
    if not_run:
        print(f"not run (environment missing): {not_run}")
        if os.environ.get("CI") == "true":  # in CI a mutant that cannot run is a failure
            errors += not_run
    bad_controls = [
        o.mutant.name
        for o in outcomes
        if o.mutant.planted and o.verdict not in ("SURVIVED", "EQUIVALENT")
    ]
    survivors = [o.mutant.name for o in real if o.verdict == "SURVIVED"]
    if json_out:
        rows = [
            {"name": o.mutant.name, "file": o.mutant.file, "verdict": o.verdict}
            | {"seconds": round(o.seconds, 1), "failed": o.failed, "detail": o.detail[:500]}
            for o in outcomes
        ]
        json_out.write_text(json.dumps(rows, indent=1) + "\n")
    if survivors:
        print(f"survivors (real bugs the tests let through): {survivors}")
    if errors or bad_controls:
        print(f"errors: {errors}; planted controls not reported as survivors: {bad_controls}")
    controls = ", ".join(f"{o.mutant.name}: {o.verdict}" for o in outcomes if o.mutant.planted)
    print(
        f"{count['KILLED']} killed, {count['EQUIVALENT']} equivalent, {count['SURVIVED']} survived,"
        f" {len(errors)} errors, {len(not_run)} not run of {len(real)} mutants in {seconds:.0f} s (controls: {controls})"
    )
    if errors or bad_controls:
        return 2
    return 1 if survivors else 0
