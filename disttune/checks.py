"""Output checks (``check=``): a config whose result differs from the first working config's scores ``inf``.

A fast config that computes the wrong thing (a communication kernel that skips a wait and reads a
peer's rows before they arrive, a tile size that breaks an assumption) must never win. With
``check=True`` or ``check=callable`` each tuning run's result is compared with a *reference*: for
:func:`~disttune.contextual_autotune` the result of the discovery run (which launches, at each
site, the first config that works on the rank), for :func:`~disttune.autotune` the first
successful call's. A run whose result does not match marks, at every site, the config that run
tried as failed on this rank ("output differs from the reference"); the agreement then scores it
``inf`` on every rank (a config that fails on any rank fails everywhere), and the rank log and the
report name it with that reason.

* ``check=True`` compares with :func:`outputs_match`: the same structure (tuples, lists, dicts
  walked), tensors of the same shape and dtype, finite where the reference is, and within a
  relative error ``||out - ref|| / ||ref||`` of ``1e-2`` for 16-bit floats and ``1e-4`` for wider
  ones (configs may sum in another order); integers, booleans and other values exactly.
* ``check=callable(reference, output) -> bool`` decides itself, e.g. on the tensors it picks.

Cost: the reference is copied once (tensors cloned); each tuning run pays one comparison (a host
sync on GPUs). When runs try several sites at once (their config lists run in lockstep), a
mismatch marks the config every site tried in that run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Union

import torch

from .sites import Schedule, Site, SiteId

CheckSpec = Union[bool, None, Callable[[Any, Any], bool]]


class OutputMismatch(RuntimeError):
    """A config's result differed from the reference config's (``check=``)."""


def check_spec(check: Any) -> CheckSpec:
    """``check=`` checked and made canonical: True, False (also for None) or a callable
    ``(reference, output) -> bool``, so that ranks passing None and False agree on it."""
    if not (check is None or isinstance(check, bool) or callable(check)):
        raise TypeError(f"disttune: check must be True, False or a callable (reference, output) -> bool, "
                        f"got {type(check).__name__}")
    return check if callable(check) else bool(check)


def snapshot(value: Any) -> Any:
    """A copy of ``value`` that later runs cannot overwrite (tensors cloned, containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(snapshot(v) for v in value) if type(value) in (tuple, list) else value
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


def _tolerance(tensor: torch.Tensor) -> float:
    return 1e-2 if tensor.element_size() <= 2 else 1e-4


def outputs_match(reference: Any, output: Any) -> bool:
    """``check=True``'s comparison (see the module doc)."""
    if isinstance(reference, torch.Tensor):
        if not isinstance(output, torch.Tensor) or output.shape != reference.shape or output.dtype != reference.dtype:
            return False
        if not reference.is_floating_point() and not reference.is_complex():
            return bool(torch.equal(reference, output))
        ref, out = reference.double(), output.double()
        finite = torch.isfinite(ref)
        if not bool(torch.equal(finite, torch.isfinite(out))) or not bool(torch.equal(ref[~finite], out[~finite])):
            return False
        scale = float(ref[finite].norm()) if ref.numel() else 0.0
        difference = float((out[finite] - ref[finite]).norm()) if ref.numel() else 0.0
        return difference <= _tolerance(reference) * scale if scale else difference == 0.0
    if isinstance(reference, (tuple, list)):
        return (isinstance(output, (tuple, list)) and len(output) == len(reference)
                and all(outputs_match(r, o) for r, o in zip(reference, output)))
    if isinstance(reference, dict):
        return (isinstance(output, dict) and output.keys() == reference.keys()
                and all(outputs_match(reference[k], output[k]) for k in reference))
    if isinstance(reference, float) and isinstance(output, float) and math.isnan(reference):
        return math.isnan(output)
    try:
        return bool(reference == output)
    except Exception:  # a value without a truth value for ==: not comparable, not a match
        return False


class OutputCheck:
    """One tuning's check: the reference result and how to compare a run's result with it."""

    def __init__(self, spec: CheckSpec, reference: Any) -> None:
        self.compare: Callable[[Any, Any], bool] = outputs_match if spec is True else spec  # type: ignore[assignment]
        self.reference = snapshot(reference)

    def matches(self, output: Any) -> bool:
        return bool(self.compare(self.reference, output))


def make_check(spec: CheckSpec, reference: Any) -> Optional[OutputCheck]:
    """The check of one tuning (None when ``check`` is off)."""
    return None if spec is None or spec is False else OutputCheck(spec, reference)


def scheduled_configs(sites: Iterable[Site], schedule: Schedule, run: int) -> dict[SiteId, int]:
    """The config index each site tried in tuning run ``run`` (sites on their stand-in are left out)."""
    tried = {}
    for site in sites:
        if site.preset is not None or site.decided is not None:
            continue
        position, _ = schedule.slot(run, len(site.active), site.share)
        if position is not None and site.active[position] not in site.failures:
            tried[site.id] = site.active[position]
    return tried


def blame(sites: dict[SiteId, Site], tried: dict[SiteId, int]) -> None:
    """Mark each config in ``tried`` as failed on this rank: its run's output did not match the reference."""
    for ident, index in tried.items():
        sites[ident].record_failure(index, OutputMismatch("output differs from the reference config's (check=)"))
