"""The expert weight formats the EP MoE model builds (no torch: the demo's parser lists them)."""

FORMATS = ("unquantized", "w8a8")
