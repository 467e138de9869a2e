"""What Triton does with one autotuned launch, reproduced for the tuner: its key, its candidates, its launches.

The tuner replaces ``Autotuner.run`` (see :mod:`disttune.intercept`) and must still behave like it:

* :func:`tuning_key` is the key Triton caches winners under; :func:`candidate_configs` the configs
  it would benchmark (after ``early_config_prune`` and ``perf_model``/``top_k``);
* :func:`launch_config` is one benchmarking launch (``Config.pre_hook``, the tuner's ``pre_hook`` with
  ``reset_to_zero``/``restore_value``, the launch, ``post_hook``); :func:`launch_winner` a cached
  launch; :func:`reset_before_real_launch` what Triton does once after benchmarking.

Each costs what Triton's own step costs: a few dictionary builds around the launch.
"""

from __future__ import annotations

from typing import Any, Callable

from triton.runtime.autotuner import Autotuner

from .jit_launch import runner


def has_choice(autotuner: Autotuner) -> bool:
    """Whether the autotuner has configs to choose between; one with a single config is never a site
    (its launches are Triton's own, in tuning and fast calls alike)."""
    return len(autotuner.configs) > 1


def key_names(autotuner: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """The names of :func:`tuning_key`'s entries, in its order: the ``key`` arguments, then ``<arg>.dtype`` for
    each tensor argument."""
    named = {k: v for k, v in {**dict(zip(autotuner.arg_names, args)), **kwargs}.items() if k in autotuner.arg_names}
    return tuple([k for k in autotuner.keys if k in named] + [f"{k}.dtype" for k, v in named.items()
                                                               if hasattr(v, "dtype")])


NO_GPU = ("disttune: Triton has no GPU driver here and does not run its interpreter: set TRITON_INTERPRET=1 before "
          "Python starts (TRITON_INTERPRET=1 torchrun ..., or scripts/launch.sh, which sets it where no GPU is "
          "visible), or run on a GPU")


def check_driver() -> None:
    """A RuntimeError with one line naming ``TRITON_INTERPRET=1`` where Triton can launch nothing (no GPU driver,
    no interpreter), instead of every config failing with "0 active drivers". Cheap after the first call."""
    from .env import interpreting

    if interpreting():
        return
    try:
        from triton.runtime import driver

        driver.active.get_current_target()
    except RuntimeError as err:
        if "active driver" in str(err):
            raise RuntimeError(NO_GPU) from None
        raise


def empty_config_list(autotuner: Autotuner) -> bool:
    """Whether the autotuner holds only the one empty ``Config`` Triton makes for ``triton.autotune(configs=[])``
    (no meta-parameters at all: a kernel with constexpr arguments cannot launch with it)."""
    return len(autotuner.configs) == 1 and not autotuner.configs[0].kwargs


def tuning_key(autotuner: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's ``Autotuner.run`` caches under: the ``key`` arguments, then every tensor's dtype."""
    nargs = dict(zip(autotuner.arg_names, args))
    all_args = {**nargs, **kwargs}
    named = {k: v for k, v in all_args.items() if k in autotuner.arg_names}
    key = [named[k] for k in autotuner.keys if k in named]
    key.extend(str(v.dtype) for v in named.values() if hasattr(v, "dtype"))
    return tuple(key)


def candidate_configs(autotuner: Autotuner, args: tuple, kwargs: dict) -> list:
    """The configs Triton would benchmark for this launch (``early_config_prune``, ``perf_model``/``top_k``)."""
    autotuner.nargs = dict(zip(autotuner.arg_names, args))
    try:
        return list(autotuner.prune_configs(kwargs))
    finally:
        autotuner.nargs = None


def check_conflicts(autotuner: Autotuner, kwargs: dict, config: Any) -> None:
    """Triton's rule: a meta-parameter set both by the caller and by a config is an error."""
    conflicts = kwargs.keys() & config.kwargs.keys()
    if conflicts:
        raise ValueError(
            f"Conflicting meta-parameters: {', '.join(sorted(conflicts))}."
            " Make sure that you don't re-define auto-tuned symbols."
        )


def launch_config(
    autotuner: Autotuner,
    args: tuple,
    kwargs: dict,
    config: Any,
    wrap: Callable[[Callable[[], Any]], Any] = lambda launch: launch(),
) -> Any:
    """One tuning launch with Triton's hook semantics; ``wrap`` surrounds the bare launch (a timer).

    Raises whatever the hooks or the launch raise (compile errors included), after
    the tuner's ``post_hook`` has run, as Triton does.
    """
    current = dict(kwargs, **config.all_kwargs())
    full_nargs = {**dict(zip(autotuner.arg_names, args)), **current}
    if config.pre_hook:
        config.pre_hook(full_nargs)
    autotuner.pre_hook(full_nargs)
    try:
        result = wrap(lambda: autotuner.fn.run(*args, **current))
    except Exception as err:
        autotuner.post_hook(full_nargs, exception=err)
        raise
    autotuner.post_hook(full_nargs, exception=None)
    return result


def launch_winner(autotuner: Autotuner, args: tuple, kwargs: dict, config: Any) -> Any:
    """A launch with a chosen config, exactly as Triton's cached path does it."""
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **kwargs, **config.all_kwargs()})
    return runner(autotuner.fn)(*args, **kwargs, **config.all_kwargs())


def reset_before_real_launch(autotuner: Autotuner, args: tuple, kwargs: dict, config: Any) -> None:
    """What Triton does once after benchmarking: ``pre_hook(reset_only=True)`` (zeroes ``reset_to_zero``)."""
    full_nargs = {**dict(zip(autotuner.arg_names, args)), **kwargs, **config.all_kwargs()}
    autotuner.pre_hook(full_nargs, reset_only=True)


def kernel_name(autotuner: Autotuner) -> str:
    """``module.qualname`` of the kernel's Python function (remembered on the autotuner)."""
    name = autotuner.__dict__.get("_disttune_name")
    if name is None:
        fn = autotuner.base_fn
        name = autotuner._disttune_name = f"{fn.__module__}.{fn.__qualname__}"
    return name
