"""TileLang backend: importable only where TileLang is installed. No op has a TileLang kernel yet, so
choosing it runs every op on the reference (each fallback announced; `--strict` refuses)."""

import tilelang  # noqa: F401  (an ImportError here marks the backend unavailable, with the reason)
