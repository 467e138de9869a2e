"""A config's identity and its text, for every Triton version disttune supports (3.6 to 3.9).

* :func:`config_text`: the canonical text of a ``triton.Config`` (what digests, stored winners, pinned
  tables and logs use to name a config, the same under every Triton version);
* :func:`kwargs_text`: the canonical text of a function tuner's config (a dict of keyword arguments);
* :func:`describe_config`: the one short label people read (``BLOCK_M=128 BLOCK_N=256 w8 s3``).

Each costs a string format (microseconds).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Optional


def config_text(config: Any) -> str:
    """A ``triton.Config`` as text that names a config the same way under every Triton version.

    ``"BLOCK: 32, num_warps: 4, num_ctas: 1, num_stages: 3, maxnreg: None"``: the form of
    Triton 3.6's ``str(config)``. Newer Triton also prints fields at their defaults
    (``ir_override: None``); here such a field appears only when it is set. Stored winners, pinned
    tables, cross-rank digests and logs use this text, so a table written under one Triton
    version matches the same configs under another. Anything that is not a ``triton.Config`` (the
    function tuner's dict configs) is ``str(config)``. Costs a string format.
    """
    if not hasattr(config, "kwargs"):
        return str(config)
    parts = [f"{k}: {v}" for k, v in config.kwargs.items()]
    parts += [f"{name}: {getattr(config, name, None)}" for name in ("num_warps", "num_ctas", "num_stages", "maxnreg")]
    if getattr(config, "ir_override", None) is not None:
        parts.append(f"ir_override: {config.ir_override}")
    return ", ".join(parts)


def kwargs_text(config: dict) -> str:
    """A function tuner's config as its store and its consensus name it: ``{chunks=4, algo=ring}``."""
    return "{" + ", ".join(f"{k}={v}" for k, v in config.items()) + "}"


# How a Config option reads in a label; options not listed read ``name=value``.
_OPTION_LABELS = {"num_warps": "w{}", "num_stages": "s{}", "num_ctas": "ctas{}", "maxnreg": "maxnreg{}"}
_ALWAYS_SHOWN = ("num_warps", "num_stages")  # tuned in most config lists, so shown even at Triton's default
_NOT_SHOWN = ("pre_hook",)  # a callable: no readable value
_CONFIG_TEXT = re.compile(r"(\w+): ((?:[^,(\[{]|\([^)]*\)|\[[^\]]*\]|\{[^}]*\})+)(?:, |$)")


def describe_config(config: Any) -> str:
    """The one short label of a config, used by the demo, the tuner's summary, the report and ``show``.

    ``BLOCK_M=128 BLOCK_N=256 w8 s3``: the meta-parameters, then warps and stages, then any other
    option that differs from Triton's default (``ctas2``, ``maxnreg128``, ``name=value`` for options
    newer Triton versions add); options at their default (``maxnreg=None``, ``ir_override=None``,
    ``num_ctas=1``) are left out. Takes a ``triton.Config`` (any version), a plain dict of
    keyword arguments (function-level configs), or ``str(triton.Config)`` as the logs and the store
    hold it; anything else comes back as ``str(config)``. Cost: a few microseconds.
    """
    if isinstance(config, str):
        parsed = _parse_config_text(config)
        return config if parsed is None else _label(*parsed)
    if isinstance(config, dict):
        return _label(config, {}, {})
    if not isinstance(getattr(config, "kwargs", None), dict):
        return str(config)
    options = {name: value for name, value in vars(config).items() if name != "kwargs"}
    return _label(dict(config.kwargs), options, _option_defaults(type(config)))


def _label(kwargs: dict, options: dict, defaults: dict) -> str:
    parts = [f"{name}={value}" for name, value in kwargs.items()]
    ordered = sorted(options.items(), key=lambda item: item[0] not in _ALWAYS_SHOWN)  # w and s first
    for name, value in ordered:
        at_default = value is None or value == "None" or name in defaults and _same(value, defaults[name])
        if name in _NOT_SHOWN or (at_default and name not in _ALWAYS_SHOWN):
            continue
        parts.append(_OPTION_LABELS.get(name, f"{name}={{}}").format(value))
    return " ".join(parts)


def _same(value: Any, default: Any) -> bool:
    """A value equals its default; text read back from a log compares by its printed form."""
    return value == default or isinstance(value, str) and value == str(default)


@functools.lru_cache(maxsize=None)
def _option_defaults(config_type: type) -> dict:
    """``{option: default}`` from the Config constructor, so options of any Triton version are known."""
    try:
        parameters = inspect.signature(config_type.__init__).parameters.values()
    except (TypeError, ValueError):
        parameters = ()
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return {**{"num_ctas": 1, "maxnreg": None}, **defaults}


def _parse_config_text(text: str) -> Optional[tuple[dict, dict, dict]]:
    """``str(triton.Config)`` split into (kwargs, options, defaults); None when the text is not one.

    Triton prints the meta-parameters first, then the options from ``num_warps`` on.
    """
    pairs = _CONFIG_TEXT.findall(text)
    if not pairs or ", ".join(f"{k}: {v}" for k, v in pairs) != text:
        return None
    names = [name for name, _ in pairs]
    split = names.index("num_warps") if "num_warps" in names else len(pairs)
    return dict(pairs[:split]), dict(pairs[split:]), {"num_ctas": 1, "maxnreg": None}
