"""The tuner's options are checked once, when it is built: bad values are clear errors.

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import pytest

import disttune


@pytest.mark.parametrize("options, message", [
    ({"n_repeat": 0}, "n_repeat must be an integer >= 1"),
    ({"n_warmup": -1}, "n_warmup must be an integer >= 0"),
    ({"n_repeat": 2.5}, "n_repeat must be an integer"),
    ({"reduce": "median"}, "unknown reduce 'median'"),
    ({"statistic": "p99"}, "unknown statistic 'p99'"),
    ({"timeout_s": 0}, "timeout_s must be a positive"),
    ({"timer": object()}, "timer must have a .time"),
])
def test_bad_arguments_are_clear_errors(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        disttune.contextual_autotune(**options)(lambda: None)


def test_unknown_keyword_is_rejected():
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_repeats'"):
        disttune.contextual_autotune(n_repeats=3)(lambda: None)


def test_is_dist_without_a_process_group_says_what_to_do():
    step = disttune.contextual_autotune(is_dist=True)(lambda: None)
    with pytest.raises(RuntimeError, match=r"disttune\.dist\.init\(\)"):
        step()


def test_check_off_reads_the_same_whether_none_or_false():
    """Ranks that leave check= at its default and ranks that pass False set the same option."""
    def agreed(**options):
        return disttune.contextual_autotune(**options)(lambda: None).options.agreed()

    assert agreed(check=None) == agreed(check=False) != agreed(check=True)
    assert agreed(check=len) != agreed(check=True)
    function_checks = [disttune.autotune([{"a": 1}], key_fn=lambda: 0, check=c)(lambda *, a: a).check
                       for c in (None, False, True)]
    assert function_checks == [False, False, True]
