"""The mutant runner (tests/python/support/mutants.py, docs/notes/test-mutations.md) stays usable as
the code changes: every mutant's text occurs exactly once in the file it edits, its replacement
differs, and the tests it names exist. A mutant whose text the code no longer has would stop the
runner ("occurs 0 times") long after the change that made it stale; here it fails with the change."""
import os

import pytest

from support import mutants

ROOT = mutants.ROOT


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m["name"])
def test_each_mutant_still_applies(m):
    with open(os.path.join(ROOT, m["path"])) as f:
        text = f.read()
    assert text.count(m["old"]) == 1, f"{m['name']}: its text occurs {text.count(m['old'])} times in {m['path']}"
    assert m["new"] != m["old"]
    for t in m["tests"]:
        if t == "ctest" or t.startswith("ctest-guard:"):
            continue
        assert os.path.exists(os.path.join(ROOT, t)), t


def test_names_are_unique():
    names = [m["name"] for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
