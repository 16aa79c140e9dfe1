"""cupy_fa benchmark: `python -m bench --help`. See bench/NOTES.md for the method."""
