"""The e2e nodes' one container image, made here from Debian's static busybox: nothing is
pulled from a registry (e2e/README.md, "A real container runtime").

``make_image(tar)`` writes a docker-archive tar (what ``docker save`` writes: ``manifest.json``,
the image config, one layer tar) that ``ctr -n k8s.io images import`` reads. The image is
both the pod sandbox (its entrypoint sleeps; containerd's CRI config pins it as the sandbox
image) and the workload of the real-runtime scenarios: ``/report`` prints what the
container's first process really got from the runtime (``report_sections`` parses it):

    == environ       /proc/1/environ, one NAME=VALUE a line
    == mountinfo     /proc/1/mountinfo
    == ld.so.preload /etc/ld.so.preload, or "(absent)"
    == mps           CUDA_MPS_PIPE_DIRECTORY's entries, or "(unset)"
    == cgroup        /proc/1/cgroup
    == end

``/report`` reads PID 1's files, not its own: the container's command is ``/bin/sh /report``,
so PID 1 is that shell, exec'd by runc with exactly the OCI spec's ``process.env``. busybox is
static: the ``LD_PRELOAD`` and ``/etc/ld.so.preload`` a GPU container gets (a stub ELF here) are
never loaded by it.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from pathlib import Path

#: The image's reference in each node's containerd (``k8s.io`` namespace).
IMAGE = "localhost/gpushare-e2e/busybox:1"
BUSYBOX = Path("/bin/busybox")
#: the applets the image links (the report, the sandbox's sleep, tests' shell commands)
APPLETS = ("sh", "cat", "tr", "ls", "sleep", "echo", "true", "env", "id", "stat")
REPORT = """\
#!/bin/sh
# What this container's first process got from the runtime (tests/e2e/local_image.py).
echo "== environ"
tr '\\0' '\\n' < /proc/1/environ
echo "== mountinfo"
cat /proc/1/mountinfo
echo "== ld.so.preload"
cat /etc/ld.so.preload 2>/dev/null || echo "(absent)"
echo "== mps"
if [ -n "${CUDA_MPS_PIPE_DIRECTORY+x}" ]; then
  echo "dir=$CUDA_MPS_PIPE_DIRECTORY"
  ls -1a "$CUDA_MPS_PIPE_DIRECTORY" 2>&1
else
  echo "(unset)"
fi
echo "== cgroup"
cat /proc/1/cgroup
echo "== end"
[ "$1" = once ] && exit 0
exec sleep 2147483647
"""


def _add(tar: tarfile.TarFile, name: str, data: bytes | None = None, *, mode: int = 0o755,
         link: str | None = None, directory: bool = False) -> None:  # fmt: skip
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.mode = mode
    if directory:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif link is not None:
        info.type = tarfile.SYMTYPE
        info.linkname = link
        tar.addfile(info)
    else:
        assert data is not None
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def layer_bytes() -> bytes:
    """The image's one layer: busybox, its applets, /report and the empty directories."""
    if not BUSYBOX.exists():
        raise FileNotFoundError(
            f"{BUSYBOX}: Debian's busybox-static is needed (apt-get install busybox-static)"
        )
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "etc", "proc", "sys", "dev", "tmp", "run", "var"):
            _add(tar, d, directory=True, mode=0o1777 if d == "tmp" else 0o755)
        _add(tar, "bin/busybox", BUSYBOX.read_bytes())
        for applet in APPLETS:
            _add(tar, f"bin/{applet}", link="busybox")
        _add(tar, "report", REPORT.encode())
        _add(tar, "etc/passwd", b"root:x:0:0:root:/:/bin/sh\n", mode=0o644)
    return out.getvalue()


def make_image(path: Path, reference: str = IMAGE) -> Path:
    """A docker-archive tar of the image at ``path`` (replaced), as ``docker save`` writes."""
    layer = layer_bytes()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    config = {
        "architecture": arch,
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin"],
            "Entrypoint": ["/bin/sleep", "2147483647"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "gpushare e2e: Debian busybox-static and /report"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [reference], "Layers": ["layer.tar"]}]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        _add(tar, "layer.tar", layer, mode=0o644)
        _add(tar, config_name, config_bytes, mode=0o644)
        _add(tar, "manifest.json", json.dumps(manifest).encode(), mode=0o644)
    return path


def report_sections(log: str) -> dict[str, list[str]]:
    """The report's sections (name -> lines) from a container's log; raises ValueError if the
    report is not complete (no ``== end`` yet)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in log.splitlines():
        if line.startswith("== "):
            name = line[3:].strip()
            if name == "end":
                return sections
            current = sections.setdefault(name, [])
        elif current is not None:
            current.append(line)
    raise ValueError("the report is incomplete (no '== end' line)")


def env_entries(sections: dict[str, list[str]], name: str) -> list[str]:
    """Every value ``name`` has in the process's environ, in order: a runtime can pass a
    name twice (containerd appends a duplicate the image did not set), and then getenv(3)
    (glibc, musl, HAMi-core's reads) returns the first, Python's os.environ the last."""
    return [
        line.partition("=")[2]
        for line in sections.get("environ", [])
        if line.partition("=")[0] == name
    ]


def environ(sections: dict[str, list[str]]) -> dict[str, str]:
    """The environ section as a dict of what getenv(3) returns: the FIRST entry of a name
    passed twice (``env_entries`` lists them all)."""
    out: dict[str, str] = {}
    for line in sections.get("environ", []):
        name, _, value = line.partition("=")
        out.setdefault(name, value)
    return out


def mounts(sections: dict[str, list[str]]) -> dict[str, str]:
    """Mount point -> the source's root within its file system, from mountinfo."""
    out: dict[str, str] = {}
    for line in sections.get("mountinfo", []):
        fields = line.split()
        if len(fields) >= 5:
            out[fields[4]] = fields[3]
    return out
