"""Generate the Python stubs of ``specserve.proto`` (committed beside it).

protoc names imports after the proto's path, so the proto is compiled from a staging tree that
mirrors the installed package (``specserve/ingress/specserve.proto``): the stubs then import
``specserve.ingress.specserve_pb2``, which resolves on every node that has specserve installed,
Ray Serve's gRPC proxy included.

    python -m specserve.ingress.grpc_stubs            # rewrite the committed stubs
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "specserve.proto"
STUBS = ("specserve_pb2.py", "specserve_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as staging:
        package = Path(staging) / "specserve" / "ingress"
        package.mkdir(parents=True)
        shutil.copy(PROTO, package / PROTO.name)
        include = str(Path(protoc.__file__).parent / "_proto")
        code = protoc.main(["protoc", f"-I{staging}", f"-I{include}", f"--python_out={staging}",
                            f"--grpc_python_out={staging}", str(package / PROTO.name)])
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(package / name, out_dir / name)) for name in STUBS]


if __name__ == "__main__":
    for path in generate(HERE):
        print(f"wrote {path}", file=sys.stderr)
