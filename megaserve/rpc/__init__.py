"""Generated gRPC code (scripts/gen_protos.sh); do not edit."""
