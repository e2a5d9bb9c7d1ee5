"""Checkpoint number formats (FP8 e4m3, FP4 e2m1, ue8m0 scales) and quantisation helpers."""
