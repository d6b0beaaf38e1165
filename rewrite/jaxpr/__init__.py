"""Between JAX and the e-graph: tracing a function to a jaxpr (``trace``), loading a
jaxpr into the e-graph (``load``) and emitting a chosen program back as a jaxpr
(``emit``).
"""
