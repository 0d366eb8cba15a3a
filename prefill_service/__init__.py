"""prefill_service package."""
