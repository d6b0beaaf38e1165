"""No built-in pack keeps a rule that is another's mirror image: patterns match ``add`` and ``mul`` in either order.

``rewrite.rules.pattern.commuted`` gives each query its variants with the operands of
commutative operations swapped, so ``log(1 + x)`` also finds ``log(x + 1)``. A second rule
written in the other operand order (the packs once had ``nn_log1p_r``, ``nn_softplus_r``,
``trig_pythagoras_r`` and ``la_factor_in_mul_r``) only adds matches to the e-graph. The first test
compares every pair of rules of each pack as terms, up to the names of their variables; the
second shows each mirrored form the removed rules were written for rewritten by the one rule left.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import explain, rewrite
from rewrite.report.report import primitive_counts
from rewrite.rules.pattern import commuted
from rewrite.rules.rule import _canonical

_ATOM = re.compile(r"^\(= (\S+) \((.*)\)\)$")


def _tree(query):
    """The query as one nested tuple from its root, and its variables numbered in the order the walk meets them.

    Temporaries (``_t1``) become the node that defines them; params and dtypes (``_p2``, ``_d3``) are
    wildcards; pattern variables (``v_x``) become ``v0``, ``v1``, ..., so two queries that differ only in
    their variables' names give the same tuple. ``None`` for a query this reading does not cover.
    """
    defs = {}
    for atom in query.atoms:
        m = _ATOM.match(atom)
        if m is None or "(" in m.group(2):
            return None
        defs[m.group(1)] = m.group(2).split()
    names: dict[str, str] = {}

    def walk(tok):
        if tok in defs:
            ctor, *args = defs[tok]
            return (ctor, *(walk(a) for a in args))
        if tok.startswith("v_"):
            return names.setdefault(tok, f"v{len(names)}")
        return "_" if tok.startswith("_") else tok

    return walk(query.root), names


def _same_function(f, g):
    """Two right sides (or guards) that are the same code over equal captured values."""
    if f is None or g is None:
        return f is g
    if f is g:
        return True
    f, g = getattr(f, "fn", f), getattr(g, "fn", g)  # a procedure: the function it runs
    cf, cg = getattr(f, "__code__", None), getattr(g, "__code__", None)
    if cf is None or cf is not cg:
        return False
    try:
        return [c.cell_contents for c in f.__closure__ or ()] == [c.cell_contents for c in g.__closure__ or ()]
    except ValueError:
        return False


def _same_sides(a, b, perm):
    """Whether rule ``b`` with its variables taken as ``a``'s (``perm[i]``: ``a``'s index of ``b``'s i-th)
    computes what ``a`` computes on both sides, up to the operand order of ``add`` and ``mul``."""
    if perm is None:
        return _same_function(a.rhs, b.rhs) and _same_function(a.when, b.when)
    if (a.when is None) != (b.when is None):
        return False
    for avals in a.probes:
        try:
            sa = a.traced(tuple(avals))
            sb = b.traced(tuple(avals[perm[i]] for i in range(len(perm))))
        except Exception:
            continue
        return all(_canonical(x, range(len(perm))) == _canonical(y, perm) for x, y in zip(sa, sb))
    return False


def _mirror_pairs(pack):
    """The pairs of rules of ``pack`` where one is the other with some ``add`` or ``mul`` operands swapped."""
    forms = {}
    for r, _ in pack.entries():
        if len(r.queries) != 1:
            continue
        variants = [_tree(v) for v in commuted(r.queries[0])]
        if all(v is not None for v in variants):
            forms[r.name] = (r, variants)
    pairs = []
    names = sorted(forms)
    for i, na in enumerate(names):
        a, va = forms[na]
        for nb in names[i + 1:]:
            b, vb = forms[nb]
            if len(a.var_names) != len(b.var_names):
                continue
            tree_b, names_b = vb[0]
            for tree_a, names_a in va[1:]:
                if tree_a != tree_b or set(names_a.values()) != set(names_b.values()):
                    continue
                if a.is_pat or b.is_pat or a.is_procedural or b.is_procedural:  # a right side of named bindings: the same names in the same places
                    same = names_a == names_b and _same_sides(a, b, None)
                else:
                    index_a = {names_a[f"v_{v}"]: k for k, v in enumerate(a.var_names)}
                    perm = [index_a[names_b[f"v_{v}"]] for v in b.var_names]
                    same = _same_sides(a, b, perm)
                if same:
                    pairs.append((na, nb))
                    break
    return pairs


#: Mirror pairs kept on purpose. ``fastmath.reassociate``'s two directions are such a pair up to the
#: operand order of what they build (``a + (b + c) -> (a + b) + c`` is ``(c + b) + a -> c + (b + a)``
#: matched as ``a + (b + c)``), but they run under a match budget and ban (``Limits(matches=200, ban=2)``)
#: per rule, so dropping one changes how far the toggle explores a chain: a change of behaviour, to be
#: measured with ``benchmarks/growth.py``, not a cleanup.
KEPT = {"fastmath": [("add_assoc_left", "add_assoc_right"), ("mul_assoc_left", "mul_assoc_right")]}


@pytest.mark.parametrize("pack", sorted(rulesets.PACKS))
def test_no_builtin_pack_keeps_a_rule_that_is_another_in_the_other_operand_order(pack):
    assert _mirror_pairs(getattr(rulesets, pack)) == KEPT.get(pack, [])


def test_the_mirror_check_finds_a_mirrored_pair():
    from rewrite import Ruleset, rule

    pair = Ruleset("pair", [rule(lambda x: jnp.log(1.0 + x), lambda x: jnp.log1p(x), name="a"),
                            rule(lambda y: jnp.log(y + 1.0), lambda y: jnp.log1p(y), name="b"),
                            rule(lambda x: jnp.log(2.0 + x), lambda x: jnp.log1p(x + 1.0), name="c")],
                   soundness="identity")
    assert _mirror_pairs(pair) == [("a", "b")]


_X = np.linspace(0.1, 2.0, 12, dtype=np.float32).reshape(3, 4)
_R, _A, _B = np.arange(3.0, dtype=np.float32), np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)

#: (pack, the rule left, the mirrored form the removed rule was written for, its arguments,
#:  the rules that fire on it, a primitive the rewritten program has and the written one lacks)
MIRRORED = {
    "nn_log1p_r": ("nn", lambda x: jnp.log(x + 1.0), (_X,), {"nn_log1p"}, "log1p"),
    "nn_softplus_r": ("nn", lambda x: jnp.log(jnp.exp(x) + 1.0), (_X,),
                      {"nn_softplus", "nn_log1p", "nn_softplus_log1p"}, "custom_jvp_call"),
    # trig_sin_stored fires on any sin x beside cos x (derivatives_exact); the sum becomes 1 by trig_pythagoras
    "trig_pythagoras_r": ("derivatives", lambda x: jnp.cos(x) ** 2 + jnp.sin(x) ** 2, (_X,),
                          {"trig_pythagoras", "trig_sin_stored"}, None),
    "la_factor_in_mul_r": ("linalg", lambda r, a, b: (a @ b) * r[:, None], (_R, _A, _B), {"la_factor_in_mul"}, None),
}


@pytest.mark.parametrize("removed", sorted(MIRRORED))
def test_the_mirrored_form_is_rewritten_without_its_mirror_rule(removed):
    pack_name, fn, args, fired, made = MIRRORED[removed]
    pack = getattr(rulesets, pack_name)
    assert removed not in {r.name for r, _ in pack.entries()}
    assert set(explain(fn, *args, rulesets=[pack]).fired) == fired
    new = rewrite(fn, rulesets=[pack])
    np.testing.assert_allclose(np.asarray(new(*args)), np.asarray(fn(*args)), rtol=1e-5, atol=1e-5)
    if made is not None:
        after = primitive_counts(jax.make_jaxpr(new)(*args))
        assert after.get(made) and not primitive_counts(jax.make_jaxpr(fn)(*args)).get(made)
