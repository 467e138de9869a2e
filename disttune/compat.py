"""What differs between the Triton versions disttune supports (3.6 to 3.9), handled in one place."""

from __future__ import annotations

from typing import Any


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
