#!/bin/sh
# Regenerate the kubelet device plugin API's Python modules (oci_gpu_hook/node/kubelet_api/) from
# deviceplugin.proto, with a pinned generator in a throwaway venv. The pins decide the runtime floor
# written into pyproject's `kubernetes` extra: grpcio >= GRPCIO, protobuf of the same major as PROTOBUF.
set -eu
GRPCIO_TOOLS=1.76.0  # bundles protoc for protobuf 6.31
here=$(cd "$(dirname "$0")/.." && pwd)
out="$here/oci_gpu_hook/node/kubelet_api"
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q "grpcio-tools==$GRPCIO_TOOLS"
cd "$out"
"$venv/bin/python" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. deviceplugin.proto
# The generated service module imports its messages as a top-level module; make it package-relative.
sed -i 's/^import deviceplugin_pb2 as/from oci_gpu_hook.node.kubelet_api import deviceplugin_pb2 as/' deviceplugin_pb2_grpc.py
echo "regenerated $out/deviceplugin_pb2.py and deviceplugin_pb2_grpc.py"
