"""The mutants of CI's own scripts: the disk a full run writes (docs/ci_times.md, session 30)."""

from __future__ import annotations

from mutation_check import Mutant

# ---- CI's disk (docs/ci_times.md, session 30): the second torch-2.11 env's torch by hard links
# (scripts/link_packages.py) and a full disk named in the summary (scripts/tier.sh)
T_LINK = "tests/test_link_packages.py::"
MUTANTS = [
    Mutant(
        "link_packages leaves what it linked when it refuses half-way",
        "scripts/link_packages.py",
        "path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)",
        "None",
        (
            T_LINK + "test_a_source_that_cannot_serve_is_refused_and_nothing_stays_linked"
            "[a file in the way-alpha==1.0-exists and is not]",
        ),
    ),
    Mutant(
        "link_packages ignores the extras a requirement asks for (their dependencies never linked)",
        "scripts/link_packages.py",
        'wanted = [{"extra": e} for e in ("", *extras)]',
        'wanted = [{"extra": ""}]',
        (T_LINK + "test_the_closure_is_linked_file_by_file_and_the_scripts_are_the_targets_own",),
    ),
    Mutant(
        "a setup log saying 'No space left on device' is reported as a plain setup failure",
        "scripts/tier.sh",
        'if grep -q "No space left on device" "$1" 2>/dev/null; then',
        "if false; then",
        (
            "tests/test_test_sh_environments.py::"
            "test_a_full_disk_is_named_in_the_summary_and_free_space_follows_each_tier",
        ),
    ),
]
