"""The data the rewriter works on: the table of primitives (``primitives``), the term
language derived from it (``terms``), the tables that map e-graph integers back to
params, types and literals (``intern``), the runtime around one egglog e-graph
(``egraph``) and the one walk over a chosen program (``walk``). Nothing here imports
the rest of the package.
"""
