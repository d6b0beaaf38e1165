"""The kernels the built-in packs build: ordinary JAX functions, each usable and tested alone.

* :mod:`rulesets.kernels.attention`: softmax attention over blocks of keys (and of queries), with an
  online softmax and a backward that recomputes each block (``rulesets.attention`` builds it).
* :mod:`rulesets.kernels.sin_squared`: ``sin(b x)**2 / b`` whose backward computes both gradients from one ``sin``
  and one ``cos`` an element, over blocks of the leading axis (``rulesets.derivatives`` builds it).
"""
