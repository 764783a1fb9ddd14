"""runtime part of trtedge."""
