#!/usr/bin/env bash
# The one command that regenerates megaserve/rpc/*_pb2*.py from protos/ (pinned grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
.venv/bin/python -m grpc_tools.protoc -I protos --python_out="$out" --grpc_python_out="$out" \
  --pyi_out="$out" $(cd protos && find megaserve -name '*.proto' | sort)
