"""What a rewrite did: :func:`rewrite.explain` and its :class:`rewrite.Report`
(``report``), why a rule's rewrite was not chosen (``why``) and the e-graph drawn
as Graphviz (``dot``).
"""
