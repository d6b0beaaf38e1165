"""Rulesets: named collections of rules with a soundness class and a tolerance, composed with ``+``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from .rule import Rule


SOUNDNESS = ("exact", "identity", "fastmath")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far an ``identity`` or ``fastmath`` rule may move a float32 result.

    For other float dtypes both bounds scale with machine epsilon, so a
    bfloat16 program gets a bfloat16-sized tolerance.

    ``terms``, where positive, bounds an element's change instead by that many
    roundings of the terms summed into it: ``terms * (eps * M + tiny)``, where
    ``M`` is their magnitude, the original run on its inputs' magnitudes with
    each sum adding its operands' (``|A| |B|`` for a product ``A B``;
    ``rewrite/testing/_magnitude.py``), and ``tiny`` the smallest normal number,
    for results XLA flushes to zero. That is the bound a reordered sum keeps,
    however small its result: the change of ``A B`` reordered is a few
    roundings of its partial sums, not of ``A B``.

    >>> import numpy as np
    >>> from rewrite import Tolerance
    >>> Tolerance(rtol=1e-6, atol=0.0).for_dtype(np.float64)[0] < 1e-14
    True
    >>> Tolerance(rtol=1e-5, atol=0.0, terms=64).terms_for(np.float32)[0]   # 64 float32 epsilons
    7.62939453125e-06
    """

    rtol: float = 1e-5
    atol: float = 1e-6
    terms: float = 0.0

    def __repr__(self) -> str:
        terms = f", terms={self.terms!r}" if self.terms else ""
        return f"Tolerance(rtol={self.rtol!r}, atol={self.atol!r}{terms})"

    def for_dtype(self, dtype: Any) -> tuple[float, float]:
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.inexact):
            return 0.0, 0.0
        scale = float(jnp.finfo(dtype).eps) / float(jnp.finfo(np.float32).eps)
        return self.rtol * scale, self.atol * scale

    def terms_for(self, dtype: Any) -> tuple[float, float]:
        """The bound by the terms' magnitude for ``dtype``: ``terms`` times its epsilon (relative to the
        magnitude) and ``terms`` times its smallest normal number (absolute)."""
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.inexact):
            return 0.0, 0.0
        info = jnp.finfo(dtype)
        return self.terms * float(info.eps), self.terms * float(info.smallest_normal)


class Ruleset:
    """A named collection of rules with a soundness class. Rulesets compose with ``+``.

    ``soundness`` is ``"exact"`` (bitwise-equal results, NaN equal to NaN),
    ``"identity"`` (true in real arithmetic; within ``tolerance`` on finite
    inputs) or ``"fastmath"`` (may change results; within ``tolerance`` on
    ordinary values). A composite keeps each part's class, and its parts are
    reachable as attributes. ``limits`` (a :class:`rewrite.Limits`) sets the
    back-off of this ruleset's own rules: how many new matches one may act on
    per iteration (``matches``) before it is banned, and for how long (``ban``).

    >>> import jax.numpy as jnp
    >>> from rewrite import rule, Ruleset
    >>> a = Ruleset("a", [rule(lambda x: -(-x), lambda x: x, name="negneg")])
    >>> b = Ruleset("b", [rule(lambda x: x * 1.0, lambda x: x, name="mul1")])
    >>> both = a + b
    >>> [r.name for r in both], both.a is a
    (['negneg', 'mul1'], True)
    """

    def __init__(self, name: str, rules: Iterable[Rule | "Ruleset"] = (), *, soundness: str = "exact",
                 tolerance: Tolerance | None = None, description: str = "", limits: Any = None,
                 min_saving: float = 0.0, recomputes: bool = False, jointly: bool = False) -> None:
        if soundness not in SOUNDNESS:
            raise ValueError(f"ruleset {name!r}: soundness must be one of {SOUNDNESS}, got {soundness!r}")
        self.name = name
        self.soundness = soundness
        self.tolerance = tolerance if tolerance is not None else (
            None if soundness == "exact" else Tolerance() if soundness == "identity" else Tolerance(1e-4, 1e-5))
        self.description = description
        self.limits = limits
        #: The least fraction of the input program's cost that this ruleset's rules must save, beyond what the
        #: program saves without them, for their nodes to be used; below it the program is extracted without
        #: them (rewrite/pipeline.py). For rewrites that change rounding, such as reordering products, a gain
        #: the model barely sees is not worth a different result.
        if not (isinstance(min_saving, (int, float)) and 0.0 <= min_saving < 1.0):
            raise ValueError(f"ruleset {name!r}: min_saving must be a fraction in [0, 1), got {min_saving!r}")
        self.min_saving = float(min_saving)
        #: This ruleset's rules build forms that recompute values to hold fewer (a backward that recomputes its
        #: forward under ``jax.checkpoint``): their nodes are used only where the program that uses them frees
        #: memory at a price no higher (``extract.policy.recomputations``), as the rule that built a node says,
        #: whatever its shape (a loop rule's checkpointed body is not one of them).
        self.recomputes = bool(recomputes)
        #: This ruleset's rules replace a forward computation together with its backward (a loop whose own
        #: backward recomputes what JAX's would read): in a training step, whether one pays depends on that
        #: backward, which a forward's price does not see. So the whole-step search's loss-first program, and
        #: the VJP ``jax.grad`` of a rewritten function runs, are also built without them, and the cheaper of the
        #: two joint programs kept (``rewrite/grad/vjp.py``, ``decided_jointly``).
        self.jointly = bool(jointly)
        self.rules: list[Rule] = []
        self.parts: list[Ruleset] = []
        if isinstance(rules, (Rule, Ruleset)):  # Ruleset("r", rule(...)): one rule is a list of one
            rules = [rules]
        if not isinstance(rules, Iterable) or isinstance(rules, (str, bytes)):
            raise TypeError(f"ruleset {name!r}: rules must be a list of rules or rulesets, got {type(rules).__name__}")
        for r in rules:
            if isinstance(r, Ruleset):
                self.parts.append(r)
            elif isinstance(r, Rule):
                self.rules.append(r)
            else:
                raise TypeError(f"ruleset {name!r}: expected rules or rulesets, got {type(r).__name__}")
        names = [r.name for r, _ in self.entries()]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"ruleset {name!r}: rule name {dups[0]!r} appears twice")
        # help(ruleset) and its __doc__ describe this ruleset, not the class: docs point users at help(pack)
        self.__doc__ = self.describe()

    def describe(self, text: str = "") -> str:
        """What ``help()`` shows for this ruleset: its soundness class and description, ``text`` (a
        built-in pack's module page), its parts and their rules by name, and how rulesets are used.

        >>> from rewrite import rule, Ruleset
        >>> print(Ruleset("a", [rule(lambda x: -(-x), lambda x: x, name="negneg")], description="signs").describe())
        Ruleset 'a' (exact, 1 rule): signs
        <BLANKLINE>
        rules: negneg
        <BLANKLINE>
        Pass it as rewrite(f, rulesets=[...]); see help(rewrite.Ruleset) for what a ruleset is.
        """
        n = len(self.entries())
        head = f"Ruleset {self.name!r} ({self.soundness}, {n} rule{'s' if n != 1 else ''})"
        lines = [f"{head}: {self.description}" if self.description else head]
        if text.strip():
            lines.append(text.strip())
        if self.rules:
            lines.append("rules: " + ", ".join(r.name for r in self.rules))
        for p in self.parts:
            what = f" ({p.description})" if p.description else ""
            lines.append(f"part {p.name!r}{what}: " + ", ".join(r.name for r, _ in p.entries()))
        lines.append("Pass it as rewrite(f, rulesets=[...]); see help(rewrite.Ruleset) for what a ruleset is.")
        return "\n\n".join(lines)

    def entries(self) -> list[tuple[Rule, "Ruleset"]]:
        """Every rule with the ruleset that gives its soundness class, depth first, without duplicates."""
        out: list[tuple[Rule, Ruleset]] = [(r, self) for r in self.rules]
        seen = {id(r) for r in self.rules}
        for p in self.parts:
            for r, owner in p.entries():
                if id(r) not in seen:
                    seen.add(id(r))
                    out.append((r, owner))
        return out

    def __iter__(self) -> Iterator[Rule]:
        return iter([r for r, _ in self.entries()])

    def __len__(self) -> int:
        return len(self.entries())

    def __add__(self, other: "Ruleset") -> "Ruleset":
        if not isinstance(other, Ruleset):
            return NotImplemented
        order = SOUNDNESS.index
        weakest = max(self.soundness, other.soundness, key=order)
        return Ruleset(f"{self.name}+{other.name}", [self, other], soundness=weakest)

    def __getattr__(self, name: str) -> "Ruleset":
        for p in self.__dict__.get("parts", ()):
            if p.name == name:
                return p
            try:
                return getattr(p, name)
            except AttributeError:
                pass
        raise AttributeError(f"ruleset {self.__dict__.get('name')!r} has no part {name!r}")

    def rule(self, name: str) -> Rule:
        for r, _ in self.entries():
            if r.name == name:
                return r
        raise KeyError(f"ruleset {self.name!r} has no rule {name!r}")

    def __repr__(self) -> str:
        return f"<Ruleset {self.name!r}: {len(self)} rules, {self.soundness}>"


def as_ruleset(x: Any, packs: Callable[[], Mapping[str, Ruleset]] | None = None) -> Ruleset:
    """What ``rulesets=`` names, as one :class:`Ruleset`: rulesets, rules, a built-in pack's name
    (``"algebra"``, as ``rulesets.algebra``), or a list of these.

    The packs are built on this package, so names are resolved by the public entry points, which pass
    ``packs`` (``rewrite.api.builtin_packs``): the core never imports them.

    >>> from rewrite.api import builtin_packs
    >>> as_ruleset(["algebra", "nn"], builtin_packs).name
    'algebra+nn'
    >>> as_ruleset("algbra", builtin_packs)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: rulesets=: no built-in pack is named 'algbra'; the packs are algebra, fastmath, ...
    """
    if isinstance(x, Ruleset):
        return x
    if isinstance(x, Rule):
        return Ruleset(x.name, [x], soundness="identity")
    if isinstance(x, str):
        if packs is None:
            raise TypeError(f"rulesets=: a pack's name ({x!r}) is resolved by rewrite(), explain() and "
                            "rewrite.testing; here pass the pack itself (rulesets.{x})")
        known = packs()
        if x not in known:
            raise ValueError(f"rulesets=: no built-in pack is named {x!r}; the packs are {', '.join(known)}")
        return known[x]
    if isinstance(x, Iterable) and not isinstance(x, (bytes, Mapping)):
        parts = [as_ruleset(i, packs) for i in x]
        weakest = max((p.soundness for p in parts), key=SOUNDNESS.index, default="exact")
        return Ruleset("+".join(p.name for p in parts) or "empty", parts, soundness=weakest)
    hint = " (pass [] for no rules)" if x is None else ""
    raise TypeError(f"rulesets= takes Ruleset or Rule objects, built-in pack names, or a list of them; "
                    f"got {type(x).__name__}{hint}")


def named_packs(x: Any, packs: Mapping[str, Ruleset]) -> Any:
    """``rulesets=`` with each built-in pack it holds, alone or in a list, given by its name (``packs``: the packs
    by name): what a pickled rewritten function keeps, so that its packs are found again by name, not
    copied rule by rule (their rules' functions need not pickle).

    >>> import rulesets
    >>> from rewrite.api import builtin_packs
    >>> named_packs([rulesets.algebra, "nn"], builtin_packs())
    ['algebra', 'nn']
    """
    if isinstance(x, Iterable) and not isinstance(x, (Ruleset, Rule, str, bytes, Mapping)):
        return [named_packs(i, packs) for i in x]
    return next((n for n, p in packs.items() if p is x), x)


def entries_of(rulesets: Any, packs: Callable[[], Mapping[str, Ruleset]] | None = None
               ) -> list[tuple[Rule, Ruleset]]:
    """Every (rule, the ruleset that owns it) of ``rulesets=``, each rule once; ``packs`` resolves pack names
    (see :func:`as_ruleset`)."""
    if isinstance(rulesets, (Ruleset, Rule, str)) or not isinstance(rulesets, collections.abc.Iterable):
        rulesets = [rulesets]  # one of them; as_ruleset says what is wrong with anything else
    out: list[tuple[Rule, Ruleset]] = []
    seen: dict[str, int] = {}
    for rs in rulesets:
        for r, owner in as_ruleset(rs, packs).entries():
            if r.name in seen:
                if out[seen[r.name]][0] is r:
                    continue
                raise ValueError(f"two different rules are named {r.name!r}; rule names must be unique")
            seen[r.name] = len(out)
            out.append((r, owner))
    return out
