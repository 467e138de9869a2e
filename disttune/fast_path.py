"""The tuned fast path: every call of a wrapper after tuning launches its winners at close to a plain launch's cost.

Per intercepted launch the plan must still (1) recognise the site (kernel, Triton's cache key,
occurrence within the call) and (2) launch the winner. The general way, a dict keyed on
``(kernel name, key)`` plus a per-call occurrence count, costs about 1 us of Python per launch,
so the plan also learns the *launch sequence* of the first fast call that launched only planned
sites and then checks each launch against its position in it: one tuple index, one identity test
and one key comparison. A call that departs from the sequence (another order, another key, one
launch more) switches to the general way at the point of departure, with the occurrence counts
its earlier launches imply, so it sees exactly what the general way alone would have seen.

:class:`FastKernel` reads a kernel's key with a function generated for the argument types of its
first launch (guarded by exact type checks; anything else takes the general reader), which is
about half the cost of the general reader.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from triton.runtime.autotuner import Autotuner

from . import triton_launch
from .handlers import Fast
from .intercept import triton_run
from .jit_launch import runner
from .sites import SiteId

# (FastKernel, key, run, config kwargs, config pre_hook): one planned launch
_Planned = tuple
# (autotuner, its FastKernel.planned_launch, FastKernel, key): one launch of the learned sequence
_Sequenced = tuple
DEPARTED = object()  # what a planned launch returns, without launching, for a launch with another key

_MISSING = object()
_NO_DTYPE = frozenset({int, float, bool, str, type(None)})
try:
    import torch as _torch

    _Tensor: Any = _torch.Tensor
    _DTYPE_NAMES = {d: str(d) for d in vars(_torch).values() if isinstance(d, _torch.dtype)}
except ImportError:  # pragma: no cover - torch is a dependency
    _Tensor, _DTYPE_NAMES = None, {}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _plain(kind: type) -> bool:
    """Whether arguments of exactly this type have a dtype the generated readers know how to read: none
    (Python scalars, None, strings) or a tensor's own (a subclass that overrides ``dtype`` does not)."""
    return kind in _NO_DTYPE or (issubclass(kind, _Tensor) and kind.dtype is _Tensor.dtype)


class FastKernel:
    """What the fast path needs of one autotuner, computed once: its name, its launcher and a key reader.

    ``key(args, kwargs)`` equals :func:`~disttune.intercept.tuning_key` (Triton's cache key: the
    ``key`` arguments, then every argument's ``str(dtype)``). The first call generates a reader for
    that call's signature: its positional count, its keyword names in order, and the exact types of
    its arguments (tensors and Python scalars, as in ``kernel[grid](a, b, n, ACTIVATION="relu")``);
    a launch with another signature, or with arguments of other types, takes :meth:`general_key`.
    """

    __slots__ = ("autotuner", "name", "run", "positions", "arg_names", "n_names", "needed", "key", "spec",
                 "key_reads", "tensor_reads")

    def __init__(self, autotuner: Autotuner) -> None:
        self.autotuner = autotuner
        self.name = triton_launch.kernel_name(autotuner)
        self.run = runner(autotuner.fn)  # JITFunction.run, cut at a cache hit
        names = list(autotuner.arg_names)
        self.positions = tuple(names.index(k) for k in autotuner.keys if k in names)
        self.arg_names = frozenset(names)
        self.n_names = len(names)
        self.needed = max(self.positions, default=-1) + 1  # general_key: fewer positional arguments, Triton's way
        # The signature the generated reader is for: (positional types, keyword names in order, their
        # value types, where a keyword that is not a kernel argument (``num_warps=``) has None: it is
        # neither in the key nor type-checked); and where the reader finds the key's values and the
        # tensors whose dtypes end the key (``a3``: positional argument 3, ``k1``: keyword value 1).
        self.spec: Optional[tuple] = None
        self.key_reads: list[str] = []
        self.tensor_reads: list[str] = []
        self.key: Callable[[tuple, dict], tuple] = self._first_key

    def _first_key(self, args: tuple, kwargs: dict) -> tuple:
        self.key = self._specialize(args, kwargs) or self.general_key
        return self.key(args, kwargs)

    def _specialize(self, args: tuple, kwargs: dict) -> Optional[Callable[[tuple, dict], tuple]]:
        """A key reader for launches with this launch's signature (see the class doc)."""
        count = len(args)
        if (not count and not kwargs) or count > self.n_names:
            return None
        positional = list(self.autotuner.arg_names)[:count]
        if not set(positional).isdisjoint(kwargs):
            return None  # an argument given twice: Triton's own error, on the general path
        types = tuple(type(arg) for arg in args)
        kw_types = tuple(type(v) if k in self.arg_names else None for k, v in kwargs.items())
        if not all(_plain(kind) for kind in types + kw_types if kind is not None):
            return None  # something with a dtype of its own making: keep the general reader
        reads = {name: f"a{i}" for i, name in enumerate(positional)}
        reads.update({k: f"k{j}" for j, (k, kind) in enumerate(zip(kwargs, kw_types)) if kind is not None})
        self.key_reads = [reads[k] for k in self.autotuner.keys if k in reads]
        # Triton's order: positional arguments, then keywords as given
        self.tensor_reads = ([f"a{i}" for i, kind in enumerate(types) if kind not in _NO_DTYPE]
                             + [f"k{j}" for j, kind in enumerate(kw_types) if kind is not None and kind not in _NO_DTYPE])
        self.spec = (types, tuple(kwargs), kw_types)
        parts = self.key_reads + [f"_dt[{read}.dtype]" for read in self.tensor_reads]
        return self._generate("key", f"return ({''.join(part + ', ' for part in parts)})", "return _general(args, kwargs)")

    def planned_launch(self, key: tuple, run: Callable, config_kwargs: dict,
                       pre_hook: Optional[Callable]) -> Callable[[tuple, dict], Any]:
        """``launch(args, kwargs)``: the winner's launch if this launch has ``key``, else :data:`DEPARTED`.

        Where the launch has the specialized signature the key's values are compared in place (no key
        tuple is built); elsewhere the key is read and compared.
        """
        hook = "_pre({**dict(zip(_arg_list, args)), **kwargs, **_ckw}); " if pre_hook is not None else ""
        launch = f"{hook}return _run(*args, **kwargs, **_ckw)"
        constants = {"_run": run, "_ckw": config_kwargs, "_pre": pre_hook, "_expected": key,
                     "_arg_list": list(self.autotuner.arg_names), "DEPARTED": DEPARTED}
        values = len(self.key_reads)
        dtypes = [_DTYPES_BY_NAME.get(name) for name in key[values:]]
        if (self.spec is None or len(key) != values + len(self.tensor_reads) or None in dtypes
                or any(read in self.tensor_reads for read in self.key_reads)):
            return self._generate("planned", "pass", f"if _key(args, kwargs) != _expected: return DEPARTED\n"
                                  f"    {launch}", **constants)
        tests = ([f"{read} == _k{n}" for n, read in enumerate(self.key_reads)]
                 + [f"{read}.dtype is _d{n}" for n, read in enumerate(self.tensor_reads)])
        constants.update({f"_k{n}": value for n, value in enumerate(key[:values])})
        constants.update({f"_d{n}": dtype for n, dtype in enumerate(dtypes)})
        return self._generate(
            "planned", f"if not ({' and '.join(tests) or 'True'}): return DEPARTED\n            {launch}",
            f"if _key(args, kwargs) != _expected: return DEPARTED\n    {launch}", **constants)

    def _generate(self, name: str, specialized: str, otherwise: str, **constants: Any) -> Callable:
        """Compile ``name(args, kwargs)``: ``specialized`` where the launch has the specialized signature
        and exact types (positional arguments bound as ``a0, a1, ...``, keyword values as ``k0, k1, ...``),
        ``otherwise`` elsewhere."""
        if self.spec is None:
            return self._compile(name, f"def {name}(args, kwargs):\n    {otherwise}\n", constants)
        types, kw_names, kw_types = self.spec
        positional = [f"a{i}" for i in range(len(types))]
        keywords = [f"k{j}" for j in range(len(kw_names))]
        checks = [f"type(a{i}) is _t{i}" for i in range(len(types))]
        checks += [f"type(k{j}) is _u{j}" for j, kind in enumerate(kw_types) if kind is not None]
        lines = [f"def {name}(args, kwargs):",
                 f"    if len(args) == {len(types)} and {'tuple(kwargs) == _kw' if kw_names else 'not kwargs'}:"]
        if positional:
            lines.append(f"        ({', '.join(positional)},) = args")
        if keywords:
            lines.append(f"        ({', '.join(keywords)},) = kwargs.values()")
        lines += [f"        if {' and '.join(checks) or 'True'}:", f"            {specialized}", f"    {otherwise}", ""]
        constants = {"_kw": kw_names, **{f"_t{i}": kind for i, kind in enumerate(types)},
                     **{f"_u{j}": kind for j, kind in enumerate(kw_types) if kind is not None}, **constants}
        return self._compile(name, "\n".join(lines), constants)

    def _compile(self, name: str, source: str, constants: dict) -> Callable:
        scope = {"_dt": _DTYPE_NAMES, "_general": self.general_key, "_key": self.key, **constants}
        exec(compile(source, f"<disttune {name} of {self.name}>", "exec"), scope)  # noqa: S102 - generated above
        return scope[name]

    def general_key(self, args: tuple, kwargs: dict) -> tuple:
        """The key of any launch: by position without building dicts when no argument is a keyword."""
        count = len(args)
        if count > self.n_names or count < self.needed or not self.arg_names.isdisjoint(kwargs):
            return triton_launch.tuning_key(self.autotuner, args, kwargs)
        key = []
        for i in self.positions:
            key.append(args[i])
        for arg in args:
            kind = type(arg)
            if kind is _Tensor:
                key.append(_DTYPE_NAMES[arg.dtype])
            elif kind not in _NO_DTYPE:
                dtype = getattr(arg, "dtype", _MISSING)
                if dtype is not _MISSING:
                    key.append(str(dtype))
        return tuple(key)


class FastPlan:
    """The winners of one tuning, laid out for the fast path: built at commit time, read per launch.

    ``winners`` maps each :class:`~disttune.sites.SiteId` to its config; ``sites`` maps it to its
    :class:`~disttune.sites.Site`. Launches the plan does not cover (another autotuner, a new key,
    an extra occurrence) go to a :class:`~disttune.handlers.Fast` handler that shares the call's
    occurrence counts; ``unseen`` (a :class:`~disttune.unseen.NewKeys`) serves the sites no winner covers.
    ``countdown`` is the wrapper's count of calls to its next agreement on new keys (see :mod:`disttune.unseen`).
    """

    __slots__ = ("kernels", "by_site", "winners", "sequence", "spare", "unseen", "countdown")

    def __init__(self, sites: dict, winners: dict, unseen: Any = None, countdown: int = 1 << 62) -> None:
        self.winners = winners
        self.unseen = unseen
        self.countdown = countdown
        self.kernels: dict[Autotuner, FastKernel] = {}
        self.by_site: dict[tuple, tuple[_Planned, ...]] = {}
        self.sequence: Optional[tuple[_Sequenced, ...]] = None  # learned by the first clean call
        self.spare: list[FastLaunch] = []
        by_occurrence: dict = {}
        for ident, config in winners.items():
            autotuner = sites[ident].autotuner
            if autotuner not in self.kernels:
                self.kernels[autotuner] = FastKernel(autotuner)
            kernel = self.kernels[autotuner]
            by_occurrence.setdefault((ident.kernel, ident.key), {})[ident.occurrence] = (
                kernel, ident.key, kernel.run, config.all_kwargs(), config.pre_hook)
        for counter, planned in by_occurrence.items():
            # occurrences 0..k-1 in order; a gap (never the case for winners of one tuning) ends the list
            run = []
            while len(run) in planned:
                run.append(planned[len(run)])
            self.by_site[counter] = tuple(run)

    @staticmethod
    def _learn(trace: list[_Planned]) -> tuple[_Sequenced, ...]:
        launches: dict = {}
        sequence = []
        for kernel, key, run, config_kwargs, pre_hook in trace:
            # one launcher per winner: occurrences of one key may have different winners
            made = (kernel, key, id(config_kwargs), pre_hook)
            if made not in launches:
                launches[made] = kernel.planned_launch(key, run, config_kwargs, pre_hook)
            sequence.append((kernel.autotuner, launches[made], kernel, key))
        return tuple(sequence)

    def new_handler(self) -> "FastLaunch":
        """A handler for one call when no spare one is left (``spare.pop()`` first: that is the common case)."""
        return FastLaunch(self)

    def finish(self, handler: "FastLaunch") -> Optional[list[str]]:
        """End a call that did not simply follow the learned sequence: learn the sequence if this was the
        first clean call, keep the handler for later calls, and return the untuned sites it launched, if any.

        (A call that followed the sequence needs only ``position = 0`` and goes back on ``spare`` at once.)
        """
        fallback = handler.fallback
        if fallback is not None:
            return fallback.stale or None  # the handler is dropped: its fallback holds this call's state
        if handler.trace is not None and self.sequence is None:
            self.sequence = self._learn(handler.trace)
        handler.reset()
        self.spare.append(handler)
        return None


class FastLaunch:
    """The launch handler of one call after tuning: each site's winner, at close to a plain launch's cost."""

    __slots__ = ("plan", "sequence", "following", "position", "occurrences", "trace", "fallback")

    def __init__(self, plan: FastPlan) -> None:
        self.plan = plan
        self.sequence: tuple = plan.sequence or ()
        self.following = plan.sequence is not None  # every launch so far matched the learned sequence
        self.position = 0
        self.occurrences: dict[tuple, int] = {}
        self.trace: Optional[list[_Planned]] = [] if plan.sequence is None else None
        self.fallback: Any = None

    def reset(self) -> None:
        self.position = 0
        self.occurrences.clear()
        self.sequence = self.plan.sequence or ()
        self.following = self.plan.sequence is not None
        self.trace = [] if self.plan.sequence is None else None

    def launch(self, autotuner: Autotuner, args: tuple, kwargs: dict) -> Any:
        position = self.position
        sequence = self.sequence
        if position < len(sequence):
            expected, planned, _, _ = sequence[position]
            if expected is autotuner:
                self.position = position + 1
                result = planned(args, kwargs)
                if result is not DEPARTED:
                    return result
                self.position = position
        return self._launch_by_site(autotuner, args, kwargs)

    def _launch_by_site(self, autotuner: Autotuner, args: tuple, kwargs: dict) -> Any:
        """The general way: find the site by kernel, key and occurrence; what the plan lacks goes to the fallback."""
        if not triton_launch.has_choice(autotuner):  # never a site: Triton's own launch; the learned sequence goes on
            return triton_run(autotuner, *args, **kwargs)
        if self.following:
            self._leave_sequence()
        plan = self.plan
        kernel = plan.kernels.get(autotuner)
        if kernel is None:
            self.trace = None
            return self._fallback().launch(autotuner, args, kwargs)
        key = kernel.key(args, kwargs)
        counter = (kernel.name, key)
        occurrence = self.occurrences.get(counter, 0)
        self.occurrences[counter] = occurrence + 1
        planned = plan.by_site.get(counter, ())
        if occurrence >= len(planned):
            self.trace = None
            return self._fallback().launch_site(SiteId(counter[0], key, occurrence), autotuner, key, args, kwargs)
        launch = planned[occurrence]
        if self.trace is not None:
            self.trace.append(launch)
        _, _, run, config_kwargs, pre_hook = launch
        if pre_hook is not None:
            pre_hook({**dict(zip(autotuner.arg_names, args)), **kwargs, **config_kwargs})
        return run(*args, **kwargs, **config_kwargs)

    def _leave_sequence(self) -> None:
        """Departing from the learned sequence: count the occurrences its first ``position`` launches made."""
        for _, _, kernel, key in self.sequence[:self.position]:
            counter = (kernel.name, key)
            self.occurrences[counter] = self.occurrences.get(counter, 0) + 1
        self.sequence, self.following = (), False

    def _fallback(self) -> Any:
        if self.fallback is None:
            self.fallback = Fast(self.plan.winners, self.occurrences, self.plan.unseen)
        return self.fallback
