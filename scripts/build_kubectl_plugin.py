"""Build ``kubectl-gpushare`` as one file: a zipapp of its pure-Python parts.

    python scripts/build_kubectl_plugin.py dist/kubectl-gpushare     (make kubectl-plugin)

The archive holds the gpushare modules the plugin imports (found by importing
``gpushare.ops.kubectl`` in a fresh interpreter), the manifests ``install`` applies, and
the pure-Python part of PyYAML (it falls back to its pure-Python parser without its C
extension), and a stand-in for structlog: modules the plugin shares with the daemon
create a logger at import, and the plugin never logs through it (it prints). Without
the ``kubernetes`` package the plugin talks to the API server through the standard
library (``gpushare.kube.stdlibclient``: tokens and
client certificates). It runs on Python 3.9 and newer with nothing to install:
``chmod +x`` it and put it on the PATH as ``kubectl-gpushare``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import io
import json
import shutil
import string
import subprocess
import sys
import tarfile
import tempfile
import zipapp
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Third-party packages vendored, pure Python only.
VENDORED = ("yaml",)
#: structlog as the plugin needs it: ``get_logger`` of a logger that drops everything.
STRUCTLOG_STAND_IN = '''\
"""A stand-in for structlog in the single-file kubectl plugin: it never logs."""


class _Quiet:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def get_logger(*args, **kwargs):
    return _Quiet()
'''

MAIN = '''\
import sys

if sys.version_info < (3, 9):
    sys.exit("kubectl-gpushare needs Python 3.9 or newer")

from gpushare.ops.kubectl import main

sys.exit(main())
'''


def plugin_modules() -> list[str]:
    """The gpushare module files the plugin imports, relative to src/ (and the
    standard-library API client, imported when the ``kubernetes`` package is absent)."""
    probe = (
        "import json, sys; import gpushare.ops.kubectl, gpushare.kube.stdlibclient; "
        "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() "
        "if n.split('.')[0] == 'gpushare' and getattr(m, '__file__', None))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    src = ROOT / "src"
    return [str(Path(f).resolve().relative_to(src)) for f in json.loads(out.stdout)]


def build(target: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        src = ROOT / "src"
        for relative in plugin_modules():
            (stage / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / relative, stage / relative)
        manifests = stage / "gpushare" / "manifests"
        manifests.mkdir(parents=True, exist_ok=True)
        for manifest in (src / "gpushare" / "manifests").glob("*.yaml"):
            shutil.copy2(manifest, manifests / manifest.name)
        for package in VENDORED:
            spec = importlib.util.find_spec(package)
            assert spec is not None and spec.submodule_search_locations, package
            origin = Path(next(iter(spec.submodule_search_locations)))
            for path in origin.rglob("*.py"):
                if "__pycache__" in path.parts:
                    continue
                dest = stage / package / path.relative_to(origin)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
        (stage / "structlog").mkdir()
        (stage / "structlog" / "__init__.py").write_text(STRUCTLOG_STAND_IN)
        (stage / "__main__.py").write_text(MAIN)
        target.parent.mkdir(parents=True, exist_ok=True)
        zipapp.create_archive(
            stage, target, interpreter="/usr/bin/env python3", compressed=True
        )
    target.chmod(0o755)
    return target


def version() -> str:
    text = (ROOT / "src" / "gpushare" / "__init__.py").read_text()
    return text.split('__version__ = "', 1)[1].split('"', 1)[0]


def krew_release(plugin: Path, url_base: str) -> tuple[Path, Path]:
    """The archive krew downloads (the plugin alone) and
    the manifest naming it with its sha256 (deploy/krew/gpushare.yaml filled in)."""
    ver = version()
    archive = plugin.with_name(f"kubectl-gpushare-v{ver}.tar.gz")
    data = plugin.read_bytes()
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        info = tarfile.TarInfo("kubectl-gpushare")
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as packed:
        packed.write(tar_bytes.getvalue())
    archive.write_bytes(buffer.getvalue())
    template = string.Template((ROOT / "deploy" / "krew" / "gpushare.yaml").read_text())
    manifest = plugin.with_name("gpushare.yaml")
    manifest.write_text(
        template.substitute(
            VERSION=ver,
            URI=f"{url_base.rstrip('/')}/{archive.name}",
            SHA256=hashlib.sha256(archive.read_bytes()).hexdigest(),
        )
    )
    return archive, manifest


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("output", type=Path, help="the plugin file to write")
    parser.add_argument(
        "--krew-url", metavar="URL", help="also write the krew archive and manifest (at URL/)"
    )
    args = parser.parse_args()
    built = build(args.output)
    print(f"{built} ({built.stat().st_size // 1024} KiB)")
    if args.krew_url:
        for path in krew_release(built, args.krew_url):
            print(path)
