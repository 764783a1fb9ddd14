"""graph part of trtedge."""
