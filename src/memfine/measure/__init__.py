"""memfine.measure."""
