"""Derivatives of rewritten functions: the primitive that runs rewritten derivative
programs under ``jax.grad``/``jax.jvp`` (``primitive``) and the rewritten VJP,
split into forward and backward programs (``vjp``).
"""
