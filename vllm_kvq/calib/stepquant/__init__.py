"""STEPQuant calibration: GDN state statistics → per-head width plan."""
