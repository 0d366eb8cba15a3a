"""megaserve package."""
