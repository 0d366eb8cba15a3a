"""Generated code of the public API (megaserve.v1); regenerate with `make protos`."""
