"""The comparisons of tests/reference.py fail where they must: a tree with a leaf missing, one too many or
in another order is an error, not a shorter comparison; a leaf off by more than the tolerance is named."""
import numpy as np
import pytest

from tests import reference as ref

WANT = {"a": np.ones(3), "b": {"c": np.zeros(2), "d": np.arange(4.0)}}


@pytest.mark.parametrize("got,match", [
    ({"a": np.ones(3), "b": {"c": np.zeros(2)}}, r"missing \[\"\['b'\]\['d'\]\"\]"),
    ({**WANT, "e": np.ones(1)}, r"extra \[\"\['e'\]\"\]"),
    ([np.ones(3), np.zeros(2), np.arange(4.0)], "missing"),
])
def test_trees_with_other_leaves_are_refused(got, match):
    with pytest.raises(AssertionError, match=match):
        ref.close(got, WANT, 1e-6, "x")
    with pytest.raises(AssertionError, match=match):
        ref.leaf_errors(got, WANT)


def test_a_leaf_beyond_the_tolerance_is_named():
    ref.close(WANT, WANT, 0.0, "x")
    bad = {"a": np.ones(3), "b": {"c": np.zeros(2), "d": np.arange(4.0) + [0, 0, 0, 1e-3]}}
    with pytest.raises(AssertionError, match=r"x\['b'\]\['d'\]: max error 0.001"):
        ref.close(bad, WANT, 1e-4, "x")
    ref.close(bad, WANT, 4e-4, "x")   # 4e-4 of the leaf's largest (3): within
