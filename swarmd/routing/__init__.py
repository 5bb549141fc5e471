"""Network coordinates, path choice and relaying (sans-IO cores and their drivers)."""
