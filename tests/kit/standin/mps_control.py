"""A stand-in for ``nvidia-cuda-mps-control`` at the edge of the tests (no GPU here).

Behaves as the control daemon does, as far as gpushare uses it:

* ``-h`` prints a usage that lists ``-m`` (unless ``STANDIN_MPS_NO_MULTIUSER`` is set);
  ``-p 3 -h`` lists ``namespace`` commands when ``STANDIN_MPS_V3`` is set, else fails.
* ``-d [-m]`` daemonizes (double fork), serves a control socket in
  ``$CUDA_MPS_PIPE_DIRECTORY`` and writes its pid to ``nvidia-cuda-mps-control.pid`` there;
  ``STANDIN_MPS_FAIL_START`` makes it exit 1 instead.
* with no argument it is a client: each stdin line is sent to the daemon, each answer
  printed. Commands: ``get_server_list``, ``set_default_active_thread_percentage N``,
  ``get_default_active_thread_percentage``, the v3 namespace commands, ``quit``.

The daemon keeps what it was told in ``standin-state.json`` in the pipe directory, for the
tests to read (multi-user, default percentage, namespaces with pipe and caps).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
STATE = "standin-state.json"


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def usage() -> int:
    print("Usage: nvidia-cuda-mps-control [-d | -f] [-p <protocol>]")
    if not os.environ.get("STANDIN_MPS_NO_MULTIUSER"):
        print("  -m    multi-user: servers run as root")
    return 0


def v3_usage() -> int:
    if not os.environ.get("STANDIN_MPS_V3"):
        print("unknown protocol 3", file=sys.stderr)
        return 1
    print("server commands: get_server_list quit")
    print("namespace commands: create_namespace remove_namespace")
    return 0


def answer(state: dict[str, object], line: str) -> str:
    words = line.split()
    if not words:
        return ""
    namespaces: dict[str, dict[str, object]] = state["namespaces"]  # type: ignore[assignment]
    verb, args = words[0], words[1:]
    if verb == "get_server_list":
        return ""
    if verb == "set_default_active_thread_percentage" and len(args) == 1 and args[0].isdigit():
        state["default_percent"] = int(args[0])
        return args[0]
    if verb == "get_default_active_thread_percentage":
        return str(state["default_percent"])
    if state["v3"]:
        if verb == "create_namespace" and len(args) == 2:
            namespaces[args[0]] = {"pipe": args[1], "percent": 100, "mib": None}
            return "ok"
        if verb == "set_namespace_active_thread_percentage" and len(args) == 2:
            if args[0] not in namespaces or not args[1].isdigit():
                return "error: no such namespace"
            namespaces[args[0]]["percent"] = int(args[1])
            return "ok"
        if verb == "set_namespace_device_pinned_mem_limit" and len(args) == 3:
            if args[0] not in namespaces:
                return "error: no such namespace"
            namespaces[args[0]]["mib"] = int(args[2].rstrip("M"))
            return "ok"
        if verb == "remove_namespace" and len(args) == 1:
            namespaces.pop(args[0], None)
            return "ok"
    return f"invalid command {verb}"


def serve(multi_user: bool) -> None:
    where = pipe_dir()
    state: dict[str, object] = {
        "multi_user": multi_user,
        "default_percent": 100,
        "namespaces": {},
        "v3": bool(os.environ.get("STANDIN_MPS_V3")),
        "pid": os.getpid(),
    }
    path = where / SOCKET
    if path.exists():
        path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)

    def save() -> None:
        tmp = where / (STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(where / STATE)

    save()
    (where / (PID_FILE + ".tmp")).write_text(str(os.getpid()))
    (where / (PID_FILE + ".tmp")).replace(where / PID_FILE)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as stream:
            for line in stream:
                line = line.strip()
                if line == "quit":
                    stream.write("\n")
                    stream.flush()
                    (where / PID_FILE).unlink(missing_ok=True)
                    path.unlink(missing_ok=True)
                    os._exit(0)
                stream.write(answer(state, line).replace("\n", " ") + "\n")
                stream.flush()
                save()


def daemonize(multi_user: bool) -> int:
    if os.environ.get("STANDIN_MPS_FAIL_START"):
        print("cannot start: the stand-in was told to fail", file=sys.stderr)
        return 1
    if os.fork() > 0:
        return 0  # like the real one: the caller returns at once, the daemon runs on
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        serve(multi_user)
    finally:
        os._exit(1)


def client() -> int:
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(pipe_dir() / SOCKET))
    except OSError as exc:
        print(f"cannot reach the control daemon: {exc}", file=sys.stderr)
        return 1
    with conn, conn.makefile("rw") as stream:
        for line in sys.stdin:
            stream.write(line.strip() + "\n")
            stream.flush()
            print(stream.readline().rstrip("\n"))
    return 0


def main(argv: list[str]) -> int:
    if argv == ["-h"]:
        return usage()
    if argv == ["-p", "3", "-h"]:
        return v3_usage()
    if argv and argv[0] == "-d":
        return daemonize("-m" in argv[1:])
    if not argv:
        return client()
    print(f"unknown arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
