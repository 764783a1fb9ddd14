"""models part of trtedge."""
