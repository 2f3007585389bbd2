"""Regenerate api_pb2.py and api_pb2_grpc.py from api.proto (needs grpcio-tools, the `test` extra).

    python -m gpuledger.agents.podresources.generate [OUT_DIR]

The proto is compiled under the import path gpuledger/agents/podresources/ so that the gRPC stub
imports its messages as `gpuledger.agents.podresources.api_pb2` (protoc names imports after the
path it was given)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATED = ("api_pb2.py", "api_pb2_grpc.py")


def generate(out_dir: Path = HERE) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="podresources-") as tmp:
        package = Path(tmp, "gpuledger", "agents", "podresources")
        package.mkdir(parents=True)
        shutil.copy(HERE / "api.proto", package / "api.proto")
        rc = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                          "gpuledger/agents/podresources/api.proto"])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(package / name, out_dir / name)) for name in GENERATED]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
