"""Choosing the cheapest program in a saturated e-graph under a cost model.
"""
