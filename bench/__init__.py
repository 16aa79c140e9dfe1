"""cupy_fa benchmark: `python -m bench --help`. docs/performance.md says how each figure is taken."""
