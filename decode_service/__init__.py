"""decode_service package."""
