"""Command-line helpers (notebook runner)."""
