"""Rules and how they run: patterns and their verification (``pattern``), the rule
DSL and what a procedure sees of a match (``rule``), preferred rules (``prefer``),
the saturation loop (``saturate``), a matched term read a block at a time (``sliced``) and rules
that act on loops (``loops``, public as :mod:`rewrite.loops`).
"""
