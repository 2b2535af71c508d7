"""The AReaL admission gate floor((N_r - 1)/B) <= i + eta as pure functions."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relayrl.plan.staleness import (
    admission_allowed,
    batch_index,
    batch_range,
    max_admitted_groups,
    min_version_to_admit,
    token_staleness,
)


def test_lecture19_exercise2_b512_eta2_i5():
    # floor((N_r - 1)/512) <= 7  ->  N_r - 1 <= 4095  ->  N_r <= 4096
    assert max_admitted_groups(5, 2, 512) == 4096
    assert admission_allowed(4096, 5, 2, 512)
    assert not admission_allowed(4097, 5, 2, 512)
    # the 8th batch (1-based) is trajectories 3585..4096 and may be submitted ...
    assert batch_range(7, 512) == (3585, 4096)
    assert all(admission_allowed(n, 5, 2, 512) for n in (3585, 4000, 4096))
    # ... the 9th must wait for the 6th training step
    assert batch_range(8, 512)[0] == 4097
    assert min_version_to_admit(4097, 2, 512) == 6
    assert admission_allowed(4097, 6, 2, 512)


def test_unbounded_eta_admits_everything():
    assert max_admitted_groups(0, None, 4) is None
    assert admission_allowed(10**9, 0, None, 4)
    assert min_version_to_admit(10**9, None, 4) == 0


@given(
    i=st.integers(0, 50),
    eta=st.integers(0, 10),
    b=st.integers(1, 64),
    n=st.integers(1, 5000),
)
def test_gate_equals_closed_form(i, eta, b, n):
    cap = max_admitted_groups(i, eta, b)
    assert admission_allowed(n, i, eta, b) == (n <= cap)
    assert admission_allowed(n, i, eta, b) == ((n - 1) // b <= i + eta)
    assert admission_allowed(n, min_version_to_admit(n, eta, b), eta, b)
    v = min_version_to_admit(n, eta, b)
    if v > 0:
        assert not admission_allowed(n, v - 1, eta, b)


@given(i=st.integers(0, 30), b=st.integers(1, 32))
def test_eta0_admits_exactly_one_step_of_groups(i, b):
    admitted = [n for n in range(1, (i + 3) * b + 1) if admission_allowed(n, i, 0, b)]
    assert admitted == list(range(1, (i + 1) * b + 1))
    new_at_i = [n for n in admitted if not admission_allowed(n, i - 1, 0, b)] if i else admitted
    assert len(new_at_i) == b
    assert {batch_index(n, b) for n in new_at_i} == {i}


def test_token_staleness_and_errors():
    assert token_staleness(7, 3) == 4
    with pytest.raises(ValueError, match="newer"):
        token_staleness(2, 3)
    for bad in (
        lambda: admission_allowed(0, 0, 0, 1),
        lambda: admission_allowed(1, -1, 0, 1),
        lambda: admission_allowed(1, 0, -1, 1),
        lambda: max_admitted_groups(0, 0, 0),
        lambda: batch_range(-1, 4),
    ):
        with pytest.raises(ValueError):
            bad()


def test_module_is_dependency_free():
    import ast
    import pathlib

    import relayrl.plan.staleness as mod

    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__"}
