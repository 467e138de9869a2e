"""Both tuners' options are one dataclass, checked once when a tuner is built: each bad value is a clear error.

Every error of :class:`disttune.options.Options` has a row here, run against both tuners: the function
tuner raises the same error for an option it shares, and names an option it does not take
(``contextual_autotune``'s alone) as such.
"""

from __future__ import annotations

import pytest

import disttune
from disttune.options import AGREED, FUNCTION_OPTIONS, Options

NOT_A_DIRECTORY = object()  # replaced by the path of an existing file


def contextual(**options):
    return disttune.contextual_autotune(**options)(lambda: None)


def function(**options):
    return disttune.autotune([{"a": 1}], key_fn=lambda: 0, **options)(lambda *, a: a)


TUNERS = {"contextual": contextual, "function": function}

ERRORS = [
    ({"n_repeat": 0}, "n_repeat must be an integer >= 1"),
    ({"n_warmup": -1}, "n_warmup must be an integer >= 0"),
    ({"n_repeat": 2.5}, "n_repeat must be an integer"),
    ({"reduce": "median"}, "reduce must be one of 'max', 'mean', 'min', got 'median'"),
    ({"statistic": "p99"}, "unknown statistic 'p99'"),
    ({"timer": object()}, "timer must have a .time"),
    ({"timeout_s": 0}, "timeout_s must be a positive"),
    ({"on_new_key": "sometimes"}, "on_new_key must be one of 'tune', 'nearest', 'error', got 'sometimes'"),
    ({"agree_every": 0}, "agree_every must be an integer >= 1"),
    ({"search": "random"}, "search must be one of"),
    ({"objective": "fastest"}, "objective must be one of"),
    ({"objective": disttune.pareto("time_ms", "energy_mj"), "search": "screen"}, "scores every config's full timing"),
    ({"objective": "step", "split": True}, "objective='step' times whole runs"),
    ({"check": "yes"}, "check must be True, False or a callable"),
    ({"cache_dir": 5}, "cache_dir must be a path"),
    ({"pinned": 5}, "pinned must be a path"),
    ({"group": "world"}, "group= was given but is_dist=False"),
    ({"early_stop": True, "search": "model"}, "early_stop=True is search='screen'"),
    ({"store_check": "loose"}, "store_check must be one of 'strict', 'warn', got 'loose'"),
    ({"store_writer": "rank0"}, "store_writer must be one of 'global', 'node', got 'rank0'"),
    ({"compile_threads": -1}, "compile_threads must be an integer >= 0"),
    ({"log_dir": NOT_A_DIRECTORY}, "log_dir .* is an existing file, not a directory"),
]


@pytest.mark.parametrize("tuner", TUNERS)
@pytest.mark.parametrize("options, message", ERRORS, ids=["-".join(o) for o, _ in ERRORS])
def test_each_bad_option_is_one_clear_error_from_both_tuners(tuner, options, message, tmp_path):
    if options.get("log_dir") is NOT_A_DIRECTORY:
        (tmp_path / "file").write_text("")
        options = {"log_dir": tmp_path / "file"}
    foreign = sorted(set(options) - set(FUNCTION_OPTIONS))
    if tuner == "function" and foreign:  # contextual_autotune's alone: the function tuner names it
        message = f"no option {foreign[0]}="
    if tuner == "function" and "group" in options:  # its group is read at call time (autotune_pg= may replace it)
        message = "torch.distributed is not initialised"
        with pytest.raises(RuntimeError, match=message):
            TUNERS[tuner](**options)()
        return
    with pytest.raises((ValueError, TypeError), match=message):
        TUNERS[tuner](**options)


def test_the_function_tuner_splits_all_or_nothing():
    with pytest.raises(TypeError, match="split must be True or False"):
        function(split="add_block")
    contextual(split="add_block")  # the contextual tuner splits the sites it names


@pytest.mark.parametrize("tuner", TUNERS)
def test_an_unknown_keyword_is_rejected(tuner):
    with pytest.raises(TypeError, match="n_repeats"):
        TUNERS[tuner](n_repeats=3)


def test_is_dist_without_a_process_group_says_what_to_do():
    step = disttune.contextual_autotune(is_dist=True)(lambda: None)
    with pytest.raises(RuntimeError, match=r"disttune\.dist\.init\(\)"):
        step()


@pytest.mark.parametrize("tuner", TUNERS)
def test_check_off_reads_the_same_whether_none_or_false(tuner):
    """Ranks that leave check= at its default and ranks that pass False set the same option."""
    def agreed(**options):
        return TUNERS[tuner](**options).options.agreed()

    assert agreed(check=None) == agreed(check=False) != agreed(check=True)
    assert agreed(check=len) != agreed(check=True)


@pytest.mark.parametrize("tuner", TUNERS)
def test_the_agreed_text_names_every_option_that_changes_the_schedule_or_the_verdict(tuner, monkeypatch):
    monkeypatch.setenv("DISTTUNE_ALWAYS_TUNE", "1")
    texts = TUNERS[tuner](n_repeat=7, reduce="mean").options.agreed()
    names = [n for n in AGREED if tuner == "contextual" or n in FUNCTION_OPTIONS]
    assert [n for n in texts if not n.startswith("DISTTUNE_")] == names
    assert texts["n_repeat"] == "7" and texts["reduce"] == "'mean'"
    assert texts["DISTTUNE_ALWAYS_TUNE"] == "True", "the settings that change a tuning call come with the options"


def test_a_lambda_objective_is_told_apart_by_its_line():
    first = Options(objective=lambda m: m.time_ms)
    second = Options(objective=lambda m: m.time_ms)
    assert first.objective_text() != second.objective_text()
    assert "(line " in first.agreed()["objective"]
