"""jetson part of trtedge."""
