"""Outside the library (not in the wheel): how the shipped demo model was made."""
