"""server part of lineside."""
