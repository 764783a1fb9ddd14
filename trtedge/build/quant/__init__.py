"""quant part of trtedge."""
