"""The HTTP API: thin. It validates input, records work in Temporal and reads it back."""
