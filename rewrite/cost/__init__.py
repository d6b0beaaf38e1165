"""What a program costs: the cost-model protocol and the default model (``model``),
its whole-program fusion part (``fusion``), its measured part (``measure``), the
guard that times the original against the rewrite (``guard``) and the measured
tables (``calibration``).
"""
