"""runtime part of lineside."""
