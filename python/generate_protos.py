"""Generates the package's gRPC modules (shardtrain/v1/*_pb2.py and
*_pb2_grpc.py) from the repository's proto/ with Debian's protoc and
grpc_python_plugin (packages protobuf-compiler, protobuf-compiler-grpc).

  generate_protos.py --out DIR [--copy-sources]

writes DIR/shardtrain/v1/...; --copy-sources also copies the package's own
modules, so DIR is an importable tree (what the build does in build/python).
setup.py calls generate() when pip builds the package.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(os.path.dirname(HERE), "proto")


def generate(out: str) -> None:
    protos = sorted(glob.glob(os.path.join(PROTO_ROOT, "shardtrain", "v1", "*.proto")))
    if not protos:
        raise SystemExit(f"generate_protos: no .proto files under {PROTO_ROOT}; build the "
                         "package from the repository's python/ folder")
    plugin = shutil.which("grpc_python_plugin")
    if plugin is None or shutil.which("protoc") is None:
        raise SystemExit("generate_protos: needs protoc and grpc_python_plugin "
                         "(apt install protobuf-compiler protobuf-compiler-grpc)")
    os.makedirs(out, exist_ok=True)
    subprocess.run(["protoc", f"--proto_path={PROTO_ROOT}", f"--python_out={out}",
                    f"--grpc_python_out={out}", f"--plugin=protoc-gen-grpc_python={plugin}",
                    *protos], check=True)
    init = os.path.join(out, "shardtrain", "v1", "__init__.py")
    with open(init, "w") as f:
        f.write('"""shardtrain.v1 messages and services, generated from proto/."""\n')


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--copy-sources", action="store_true")
    args = p.parse_args()
    if args.copy_sources:
        package = os.path.join(args.out, "shardtrain")
        os.makedirs(package, exist_ok=True)
        for source in glob.glob(os.path.join(HERE, "shardtrain", "*.py")):
            shutil.copy2(source, package)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
