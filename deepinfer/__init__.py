"""DeepInfer: a DeepSeek-V4 inference engine and the numerics toolkit for porting it.

Importing deepinfer imports torch only: no Triton, TileLang, FlagGems or DeepGEMM (each backend is
imported when chosen).
"""

__version__ = "0.1.0"
