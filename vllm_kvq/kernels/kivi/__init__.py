"""KIVI-style INT2 cache (per-channel keys, per-token values): a reference point."""
