"""graph part of lineside."""
