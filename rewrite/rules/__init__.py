"""Rules and how they run: patterns and their verification (``pattern``), the rule
DSL and what a procedure sees of a match (``rule``), preferred rules (``prefer``)
and the saturation loop (``saturate``).
"""
