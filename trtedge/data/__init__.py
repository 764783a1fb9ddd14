"""Data shipped with trtedge: the default AWQ calibration text and model configs."""
