"""The old spelling of :mod:`rulesets.nn_lm_head`, kept so that ``rulesets.nn_lmhead.offered()`` and
``from rulesets.nn_lmhead import nn_lm_head`` keep working; new code imports :mod:`rulesets.nn_lm_head`."""

from rulesets.nn_lm_head import BLOCKS, nn_lm_head, offered

__all__ = ["nn_lm_head", "BLOCKS", "offered"]
