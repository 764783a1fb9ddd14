"""build part of trtedge."""
