"""Data shipped with lineside: the default AWQ calibration text and model configs."""
