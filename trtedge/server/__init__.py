"""server part of trtedge."""
