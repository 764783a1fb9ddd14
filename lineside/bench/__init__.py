"""bench part of lineside."""
