"""jetson part of lineside."""
