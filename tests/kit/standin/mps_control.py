"""A stand-in for ``nvidia-cuda-mps-control`` at the edge of the tests (no GPU here).

Behaves as the control daemon does, as far as gpushare uses it:

* ``-h`` prints a usage that lists ``-m`` (unless ``STANDIN_MPS_NO_MULTIUSER`` is set);
  ``-p 3 -h`` lists ``namespace`` commands when ``STANDIN_MPS_V3`` is set, else fails.
* ``-d [-m] [-p 3 -a <file>]`` daemonizes (double fork), serves a control socket in
  ``$CUDA_MPS_PIPE_DIRECTORY`` and writes its pid to ``nvidia-cuda-mps-control.pid`` there;
  ``STANDIN_MPS_FAIL_START`` makes it exit 1 instead. With ``-p 3`` it speaks v3 (only
  where ``STANDIN_MPS_V3`` is set): ``-a`` applies a TOML file's servers and namespaces.
* with no argument it is a legacy client: each stdin line is sent to the daemon, each
  answer printed (``get_server_list``, ``set_default_active_thread_percentage N``,
  ``get_default_active_thread_percentage``, ``quit``); with v3 arguments (``namespace
  create|set|delete --server=S --name=N [--active-thread-percentage=P]
  [--pinned-memory-limit=<MiB>M]``, ``-q``) it sends them as one line.

A v3 namespace gets a listening socket ``<pipe>/<server>/<namespace>/control``, as the
documented routing has it. The stand-in writes as a careless root daemon would: its pid
file, its state file and its namespace directories are opened and made by name,
following whatever link is there, so a test can show that the supervisor leaves it
nothing to follow. It keeps what it was told in ``standin-state.json`` in the pipe
directory, for the tests to read (multi-user, protocol, default percentage, namespaces
with pipe and caps).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tomllib
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
STATE = "standin-state.json"


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def usage() -> int:
    # the option block of r580's own help (read on an H200, docs/gpu-proof.md)
    print("nvidia-cuda-mps-control [options] [command]")
    print("OPTIONS:")
    print("  -h,--help                Print this message")
    print("  -d,--daemon              Setup the daemon in the background")
    if not os.environ.get("STANDIN_MPS_NO_MULTIUSER"):
        print("  -M,--multiuser-server    Enable multi-user mode")
    return 0


def v3_usage() -> int:
    if not os.environ.get("STANDIN_MPS_V3"):
        print("unknown protocol 3", file=sys.stderr)
        return 1
    print("server commands: server create, server list")
    print("namespace commands: namespace create, namespace set, namespace delete")
    return 0


LISTENERS: dict[str, socket.socket] = {}


def make_namespace(state: dict[str, object], server: str, name: str) -> str:
    """The namespace's directory and listening socket, made by name (links followed)."""
    namespaces: dict[str, dict[str, object]] = state["namespaces"]  # type: ignore[assignment]
    where = pipe_dir() / server / name
    os.makedirs(where, exist_ok=True)  # careless: follows a planted link
    path = where / SOCKET
    if os.path.lexists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    LISTENERS[name] = listener
    namespaces.setdefault(name, {"pipe": str(where), "percent": 100, "mib": None})
    return "ok"


def answer_v3(state: dict[str, object], words: list[str]) -> str:
    namespaces: dict[str, dict[str, object]] = state["namespaces"]  # type: ignore[assignment]
    options = dict(w[2:].split("=", 1) for w in words[2:] if w.startswith("--") and "=" in w)
    verb = " ".join(words[:2])
    name = options.get("name", "")
    if verb == "namespace create" and name and options.get("server"):
        return make_namespace(state, options["server"], name)
    if verb == "namespace set" and name:
        if name not in namespaces:
            return "error: no such namespace"
        if "active-thread-percentage" in options:
            namespaces[name]["percent"] = int(options["active-thread-percentage"])
        if "pinned-memory-limit" in options:
            namespaces[name]["mib"] = int(options["pinned-memory-limit"].rstrip("M"))
        return "ok"
    if verb == "namespace delete" and name:
        namespaces.pop(name, None)
        listener = LISTENERS.pop(name, None)
        if listener is not None:
            listener.close()
        return "ok"
    return f"invalid command {verb}"


def answer(state: dict[str, object], line: str) -> str:
    words = line.split()
    if not words:
        return ""
    verb, args = words[0], words[1:]
    if state["protocol"] == 3:
        return answer_v3(state, words)
    if verb == "get_server_list":
        return ""
    if verb == "set_default_active_thread_percentage" and len(args) == 1 and args[0].isdigit():
        state["default_percent"] = int(args[0])
        return args[0]
    if verb == "get_default_active_thread_percentage":
        return str(state["default_percent"])
    return f"invalid command {verb}"


def apply_config(state: dict[str, object], path: str) -> None:
    """A v3 configuration file's servers and their namespaces, with their caps."""
    namespaces: dict[str, dict[str, object]] = state["namespaces"]  # type: ignore[assignment]
    with open(path, "rb") as f:
        config = tomllib.load(f)
    state["config"] = config
    for server, body in config.get("servers", {}).items():
        for name, caps in body.get("namespaces", {}).items():
            make_namespace(state, server, name)
            namespaces[name]["percent"] = int(caps.get("active_thread_percentage", "100"))
            if "pinned_memory_limit" in caps:
                namespaces[name]["mib"] = int(caps["pinned_memory_limit"].rstrip("M"))


def serve(multi_user: bool, protocol: int, config: str | None) -> None:
    where = pipe_dir()
    state: dict[str, object] = {
        "multi_user": multi_user,
        "protocol": protocol,
        "default_percent": 100,
        "namespaces": {},
        "pid": os.getpid(),
    }
    path = where / SOCKET
    if os.path.lexists(path):
        path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    if config is not None:
        apply_config(state, config)

    def save() -> None:
        with open(where / STATE, "w") as f:  # careless: follows a planted link or FIFO
            f.write(json.dumps(state))

    save()
    with open(where / PID_FILE, "w") as f:  # careless, as above
        f.write(str(os.getpid()))
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
                reply = answer(state, line).replace("\n", " ")
                save()  # before the answer: a caller reads the state once it is answered
                stream.write(reply + "\n")
                stream.flush()


def daemonize(args: list[str]) -> int:
    if os.environ.get("STANDIN_MPS_FAIL_START"):
        print("cannot start: the stand-in was told to fail", file=sys.stderr)
        return 1
    multi_user = "-M" in args
    protocol = int(args[args.index("-p") + 1]) if "-p" in args else 2
    if protocol == 3 and not os.environ.get("STANDIN_MPS_V3"):
        print("unknown protocol 3", file=sys.stderr)
        return 1
    config = args[args.index("-a") + 1] if "-a" in args else None
    if os.fork() > 0:
        return 0  # like the real one: the caller returns at once, the daemon runs on
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        serve(multi_user, protocol, config)
    finally:
        os._exit(1)


def client(argv: list[str]) -> int:
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(pipe_dir() / SOCKET))
    except OSError as exc:
        print(f"cannot reach the control daemon: {exc}", file=sys.stderr)
        return 1
    lines = [" ".join(argv)] if argv else sys.stdin
    with conn, conn.makefile("rw") as stream:
        for line in lines:
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
        return daemonize(argv[1:])
    if argv == ["-q"]:
        return client(["quit"])
    if not argv or argv[0] in ("namespace", "server", "client"):
        return client(argv)
    print(f"unknown arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
