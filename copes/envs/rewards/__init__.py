"""rewards."""
