"""build part of lineside."""
