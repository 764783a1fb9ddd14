"""bench part of trtedge."""
