"""Measured costs on one backend, written by ``benchmarks/calibrate.py``; do not edit by hand.

Nanoseconds per element (per byte, per flop, per kernel) on the machine named below, with both
of its cores. Only ratios matter to extraction; rerun the script to calibrate another machine.
"""

CPU = {'platform': 'cpu',
 'device': 'cpu',
 'machine': 'x86_64',
 'date': 'provisional',
 'jax': '0.10.2',
 'elementwise_ns': {'sin': 4.9, 'cos': 4.9, 'sincos': 6.3, 'tan': 10.6, 'exp': 0.1, 'log': 0.1, 'tanh': 0.1,
                    'logistic': 0.1, 'sqrt': 0.1, 'rsqrt': 0.8, 'log1p': 0.7, 'erf': 0.4, 'sinh': 1.4,
                    'pow': 4.7, 'atan2': 19.0, 'div': 0.1, 'mul': 0.02, 'add': 0.02, 'sub': 0.02, 'neg': 0.02},
 'byte': 0.05,
 'copy_per_element': 0.6,
 'reduce_per_element': 0.02,
 'reduce_read_per_element': 0.3,
 'launch': 1000.0,
 'dot_flop': 0.006}
