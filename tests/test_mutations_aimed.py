"""The mutation check's claims stay aimed: every mutant's text is found exactly once in its file (code that moved
makes a mutant stale, which only a full ``python -m tools.mutations`` run would otherwise show), and the tests it
names exist. Cheap enough for every run of the suite; the mutants themselves run on demand."""

from pathlib import Path

import pytest

from tools.mutations import MUTANTS, ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_is_aimed_at_the_code_as_it_is(mutant):
    text = (ROOT / mutant.file).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.file}: re-aim the mutant at the code as it is"
    assert mutant.new != mutant.old
    for test in mutant.tests:
        if test.startswith("-") or not test.startswith("tests/"):
            continue  # a pytest option (-k) and its expression
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), path
        function = name.split("[")[0]
        assert not function or f"def {function}(" in Path(ROOT / path).read_text(), test


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
